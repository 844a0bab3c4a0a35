//! The engine: what one forward step takes (`step`) and the loaded model with its tokenizer and
//! KV cache (`Engine`), the scheduler (`scheduler`, policy) and the core that runs them step by
//! step with each request's sampler (`core`). The batcher actor drives the core for the server;
//! `generate` drives one for a single prompt.

pub mod batcher;
pub mod core;
pub mod loaded;
pub mod scheduler;
pub mod step;

pub use loaded::{Engine, EngineOptions};
pub use step::{SeqChunk, StepBatch};
