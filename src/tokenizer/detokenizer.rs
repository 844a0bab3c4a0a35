//! Incremental detokenization for streaming: emits only complete UTF-8 text, and the pieces
//! concatenate to exactly what decoding all ids at once gives.
//!
//! The method is TGI's and vLLM's: decode a short window of ids before and after the new ones
//! and emit the difference once it no longer ends in an incomplete character (U+FFFD). A
//! byte-level BPE token can hold half of a Korean syllable or an emoji, so token-by-token decoding
//! would emit replacement characters.

use crate::error::Result;
use crate::tokenizer::TextTokenizer;

/// Streaming decoder state for one generation.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// Ids before this have been emitted.
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special: bool) -> Self {
        IncrementalDecoder {
            skip_special,
            ..Default::default()
        }
    }

    /// Adds one id; returns the new complete text, if any.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(Some(delta));
        }
        Ok(None)
    }

    /// Whatever is left at the end (a dangling partial character decodes as U+FFFD, as a full decode would).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<Option<String>> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.starts_with(&prefix) {
            Ok(Some(full[prefix.len()..].to_string()))
        } else {
            Ok(None)
        }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
