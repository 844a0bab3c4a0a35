//! Errors of the engine layer: loading a model, building a tokenizer, running a step.
//!
//! One enum per layer (TGI's habit): each variant names the file, tensor or field at fault, and
//! `error_type()` gives the stable string that a wire protocol or a log line can match on.

use std::path::PathBuf;

/// Everything that can go wrong below the server: model files, tokenizer, KV cache, forward step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model file not found: {path}")]
    ModelNotFound { path: PathBuf },

    /// The `--config` file: missing, unreadable or not valid TOML.
    #[error("config file {path}: {message}")]
    Config { path: PathBuf, message: String },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: {message}")]
    BadModelFile { path: PathBuf, message: String },

    #[error("{path}: unsupported architecture `{arch}` (supported: llama / LlamaForCausalLM)")]
    UnsupportedArchitecture { path: PathBuf, arch: String },

    #[error("{path}: tensor `{tensor}`: {message}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    #[error("default model: {0}")]
    DefaultModel(String),

    #[error("KV cache: {0}")]
    KvCache(String),

    #[error("invalid step batch: {0}")]
    InvalidBatch(String),

    #[error("invalid setting `{key}` = {value}: {allowed}")]
    InvalidSetting {
        key: String,
        value: String,
        allowed: String,
    },

    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

impl EngineError {
    /// Stable machine-readable category, one per variant family.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::ModelNotFound { .. }
            | EngineError::Io { .. }
            | EngineError::BadModelFile { .. }
            | EngineError::UnsupportedArchitecture { .. }
            | EngineError::BadTensor { .. }
            | EngineError::DefaultModel(_) => "model_load",
            EngineError::Tokenizer(_) | EngineError::ChatTemplate(_) => "tokenizer",
            EngineError::KvCache(_) => "kv_cache",
            EngineError::InvalidBatch(_) => "invalid_batch",
            EngineError::InvalidSetting { .. } | EngineError::Config { .. } => "invalid_setting",
            EngineError::Candle(_) => "internal",
        }
    }

    /// Whether what the operator gave cannot work (a config file, a setting, a model path that
    /// does not exist or is not a model, model files that do not fit together), as opposed to the machine failing (a read error, a port
    /// in use, a folder not writable, a fetch). The command line exits 2 for the first, 1 for the
    /// second.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            EngineError::Config { .. }
                | EngineError::InvalidSetting { .. }
                | EngineError::ModelNotFound { .. }
                | EngineError::BadModelFile { .. }
                | EngineError::UnsupportedArchitecture { .. }
                | EngineError::BadTensor { .. }
                | EngineError::Tokenizer(_)
                | EngineError::ChatTemplate(_)
        )
    }

    pub(crate) fn bad_file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::BadModelFile {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            EngineError::ModelNotFound { path }
        } else {
            EngineError::Io { path, source }
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
