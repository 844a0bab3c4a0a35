//! The engine: what one forward step takes (`step`) and the loaded model with its tokenizer and
//! KV cache (`Engine`). The scheduler and the batcher actor (gateway work) drive it; `generate`
//! drives it for one prompt.

pub mod batcher;
pub mod loaded;
pub mod scheduler;
pub mod step;

pub use loaded::{Engine, EngineOptions};
pub use step::{SeqChunk, StepBatch};
