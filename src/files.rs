//! Reading model files: JSON with errors that name the file, GGUF metadata by key. Shared by the
//! weight loader (`model::loader`) and the tokenizer, which read the same files.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde_json::Value;

use crate::error::{EngineError, Result};

/// The parsed JSON of a file, with errors naming it.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| EngineError::bad_file(path, format!("invalid JSON: {e}")))
}

/// A GGUF metadata value as an integer.
pub fn md_u(c: &gguf_file::Content, key: &str) -> Option<usize> {
    c.metadata
        .get(key)
        .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
        .map(|v| v as usize)
}

/// A GGUF metadata value as a float.
pub fn md_f(c: &gguf_file::Content, key: &str) -> Option<f64> {
    c.metadata
        .get(key)
        .and_then(|v| v.to_f32().map(f64::from).ok().or_else(|| v.to_f64().ok()))
}

/// A GGUF metadata value as a string.
pub fn md_str<'a>(c: &'a gguf_file::Content, key: &str) -> Option<&'a str> {
    c.metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
}
