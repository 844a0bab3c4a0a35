//! llama-relay: streams Llama-3-family chat completions, batched on one machine.
//!
//! Module map:
//! - `settings`: config file / environment / defaults, validated into engine options.
//! - `error`: the engine's error enum with stable `error_type()` strings.
//! - `model`: the Llama decoder on candle (`llama`), its config (`config`), GGUF and Hugging Face
//!   loading (`loader`), and paged attention with a CPU fast path and a generic path (`attention`).
//! - `kv_cache`: paged K/V tensors (`storage`) and the pure block pool (`block_pool`).
//! - `engine`: the flat step batch (`step`) and a loaded engine (`loaded`).
//! - `tokenizer`: tokenizer from tokenizer.json or GGUF metadata, chat templates (minijinja),
//!   incremental detokenizer.
//! - `generate`: one sequence through the engine (the `generate` command, model tests).
//! - `default_model`: fetching and verifying the embedded default model.

pub mod bench;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod metrics;
pub mod model;
pub mod protocol;
pub mod sampler;
pub mod server;
pub mod settings;
pub mod tokenizer;

pub use error::{EngineError, Result};
