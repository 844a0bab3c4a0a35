//! The engine: the loaded model with its tokenizer and KV cache (`Engine`), the scheduler
//! (`scheduler`, policy) and the core that runs them step by step with each request's sampler
//! (`core`). No actors and no wire types: the server's batcher actor drives a core and maps its
//! events to frames; `generate` drives one for a single prompt.

pub mod constraint;
pub mod core;
pub mod cost;
pub mod draft;
pub mod loaded;
pub mod scheduler;
pub mod speculate;

pub use crate::model::batch::{Logits, SeqChunk, StepBatch};
pub use loaded::{Engine, EngineOptions};
pub use scheduler::{Priority, Quota, RequestId};
