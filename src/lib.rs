//! llama-relay: streams Llama-3-family chat completions, batched on one machine.
//!
//! Modules, in layers (each uses only those above it in this list; `tests/integration/layers.rs`
//! checks it):
//! - `error`: the engine's error enum with stable `error_type()` strings. `huge_pages`: which
//!   memory sits on 2 MiB pages.
//! - `files` (reading JSON and GGUF metadata), `default_model` (fetching and verifying the
//!   embedded default model), `sampler` (logits to a token), `kv_cache` (paged K/V tensors, the
//!   block pool, the KV manager: all block bookkeeping).
//! - `model`: the Llama decoder on candle, the step batch it takes, GGUF and Hugging Face loading,
//!   paged attention, the CPU kernels. `tokenizer`: tokenizers, chat templates, detokenizer.
//! - `engine`: a loaded engine, the scheduler (policy) and the core that steps them.
//!   `metrics`: the Prometheus registry.
//! - `generate`: one prompt through an engine core. `settings`: the config file's values.
//! - `server`: actix-web routes, the session actors, the batcher actor, tenants and access.
//! - `fuzz_harness`: what the fuzz targets (`fuzz/`) run on an input.
//!
//! The load generator and the soak client are the `llama-relay-bench` package (`bench/`).

pub mod default_model;
pub mod engine;
pub mod error;
pub mod files;
pub mod fuzz_harness;
pub mod generate;
pub mod huge_pages;
pub mod kv_cache;
pub mod metrics;
pub mod model;
pub mod perplexity;
pub mod sampler;
pub mod server;
pub mod settings;
pub mod tokenizer;

pub use error::{EngineError, Result};
