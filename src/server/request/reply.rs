//! A reply's text as its tokens arrive: incremental detokenizing (complete UTF-8 only) and stop
//! strings (text that could still become one is held back until it cannot; a match ends the
//! reply before it), and how a reply ended (`FinishReason`, `Usage`, `Timings`). One per reply: the WebSocket session and the OpenAI API stream through the
//! same code, so both send exactly the same text for the same tokens.

use serde::{Deserialize, Serialize};

use crate::server::request::stop::scan;
use crate::tokenizer::{IncrementalDecoder, TextTokenizer};

/// Why a reply ended.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
    Shutdown,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Speculative drafts run for the reply, and those kept (part of `completion_tokens`).
    #[serde(default)]
    pub drafted_tokens: usize,
    #[serde(default)]
    pub accepted_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct Timings {
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub decode_tokens_per_s: f64,
}

pub struct ReplyText {
    detok: IncrementalDecoder,
    stop: Vec<String>,
    /// Decoded and not yet sent.
    tail: String,
    /// Sent so far.
    sent: String,
    /// A stop string matched: nothing more is sent.
    stopped: bool,
}

impl ReplyText {
    pub fn new(stop: Vec<String>) -> Self {
        ReplyText {
            detok: IncrementalDecoder::new(true),
            stop,
            tail: String::new(),
            sent: String::new(),
            stopped: false,
        }
    }

    /// Adds a generated token; returns the text that may be sent now (often empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> String {
        if self.stopped {
            return String::new();
        }
        match self.detok.push(tok, id) {
            Ok(Some(text)) => self.tail.push_str(&text),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "detokenizer"),
        }
        self.release(false)
    }

    /// The generation ended: the rest of the text (held-back text included, unless a stop string
    /// matched).
    pub fn finish(&mut self, tok: &TextTokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        if let Ok(Some(rest)) = self.detok.finish(tok) {
            self.tail.push_str(&rest);
        }
        self.release(true)
    }

    fn release(&mut self, at_end: bool) -> String {
        let s = scan(&self.tail, &self.stop);
        let send = if at_end && !s.stopped {
            self.tail.len()
        } else {
            s.send
        };
        let text: String = self.tail.drain(..send).collect();
        if s.stopped {
            self.stopped = true;
            self.tail.clear();
        }
        self.sent.push_str(&text);
        text
    }

    /// A stop string matched: the reply is over.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The reply's stop strings.
    pub fn stop_strings(&self) -> &[String] {
        &self.stop
    }

    /// The text sent so far.
    pub fn sent(&self) -> &str {
        &self.sent
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> usize {
        self.detok.ids().len()
    }
}
