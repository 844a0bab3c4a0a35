//! The Llama-family decoder on candle: the step batch it takes (`batch`), its configuration, its
//! weight loading and its attention.

pub mod attention;
pub mod batch;
pub mod config;
pub mod kernels;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod profile;
pub mod team;
pub(crate) mod tile_packs;

pub use attention::AttentionImpl;
pub use config::ModelConfig;
pub use llama::Llama;
