//! A loaded engine: the model, its tokenizer, the paged KV cache and the pool of its blocks.
//! `Engine::load` turns validated options into that, logging what it chose (weight types,
//! attention implementation, cache bytes per token).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;

use crate::default_model;
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockPool, KvCache, KvCacheSpec};
use crate::model::attention::{self, AttentionImpl};
use crate::model::kernels::amx;
use crate::model::kernels::cpu::Isa;
use crate::model::loader::{GgufSource, HfSource, LoadOptions, WeightMode, WeightSource};
use crate::model::Llama;
use crate::tokenizer::TextTokenizer;

/// How much memory the KV cache gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSize {
    Mib(usize),
    Tokens(usize),
}

/// Everything needed to load an engine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// A `.gguf` file or a Hugging Face folder; `None` = the embedded default model.
    pub model: Option<PathBuf>,
    /// A `tokenizer.json` to use instead of the model's own.
    pub tokenizer: Option<PathBuf>,
    pub device: Device,
    pub block_size: usize,
    pub cache: CacheSize,
    /// Longest sequence served; `None` = the model's own limit.
    pub max_context: Option<usize>,
    /// `None` = the fastest for the device.
    pub attention: Option<AttentionImpl>,
    pub weights: WeightMode,
    /// What the KV cache stores: F32, F16 or Q8.
    pub kv_dtype: crate::kv_cache::KvDtype,
    /// MiB of bf16 weight copies for the tile units on CPUs with AMX (`kernels::amx`); 0 = none.
    pub amx_weights_mib: usize,
}

impl EngineOptions {
    /// Options for tests and tools: CPU, given model, small cache.
    pub fn for_model(model: impl Into<PathBuf>) -> Self {
        EngineOptions {
            model: Some(model.into()),
            tokenizer: None,
            device: Device::Cpu,
            block_size: 16,
            cache: CacheSize::Tokens(4096),
            max_context: None,
            attention: None,
            weights: WeightMode::Auto,
            kv_dtype: crate::kv_cache::KvDtype::F32,
            amx_weights_mib: 1024,
        }
    }
}

/// The CPU-only paths a GPU engine goes without, named in its start-up log: on a GPU the step's
/// weights, KV cache and attention stay on the device and run through candle's CUDA ops.
pub const CPU_ONLY: [&str; 5] = [
    "the paged attention kernel (candle ops over the block tables instead, decodes in padded groups)",
    "the repacked 8-row quantized matmul kernels and the dense F32 path for big steps (candle's CUDA quantized matmul on the stored types instead)",
    "the layer path over plain row buffers (norms, RoPE, SiLU, cache writes without a tensor op each)",
    "requantizing Q5_0/Q5_1 to Q8_0 and F16/BF16 to F32 at load (kept as stored)",
    "CPU feature detection (AVX2/AVX-512 kernels)",
];

/// What was loaded, for logs and the `ready` frame.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub path: PathBuf,
    pub format: &'static str,
    pub weight_types: Vec<String>,
}

pub struct Engine {
    pub model: Llama,
    pub tokenizer: Arc<TextTokenizer>,
    pub cache: KvCache,
    pub pool: BlockPool,
    pub info: ModelInfo,
}

fn is_gguf(path: &Path) -> bool {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// What a model path must be, for errors that name it.
const EXPECTED_MODEL: &str = "expected a GGUF file (llama architecture) or a Hugging Face folder \
     (config.json, *.safetensors, tokenizer.json)";

impl Engine {
    /// Checks in milliseconds, without reading weights, that `path` is a model `load` can take:
    /// it exists and can be read, and it is a GGUF file whose header names the llama
    /// architecture, or a Hugging Face folder whose config.json names a Llama model and whose
    /// weight files and tokenizer are there. The server runs this before it binds, so a wrong
    /// path ends the process at once instead of a background load failing later.
    pub fn check_model(path: &Path, tokenizer: Option<&Path>) -> Result<()> {
        let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
        if meta.is_dir() {
            let cpu = LoadOptions {
                device: Device::Cpu,
                weights: WeightMode::Keep,
            };
            if !path.join("config.json").exists() {
                return Err(EngineError::bad_file(
                    path,
                    format!("a folder without config.json: {EXPECTED_MODEL}"),
                ));
            }
            HfSource::open(path, cpu)?;
            let tok = tokenizer.map_or_else(|| path.join("tokenizer.json"), Path::to_path_buf);
            if !tok.exists() {
                return Err(EngineError::ModelNotFound { path: tok });
            }
            return Ok(());
        }
        let mut magic = [0u8; 4];
        std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => EngineError::bad_file(
                    path,
                    format!("too short to be a model: {EXPECTED_MODEL}"),
                ),
                _ => EngineError::io(path, e),
            })?;
        if &magic != b"GGUF" {
            return Err(EngineError::bad_file(
                path,
                format!("not a model (it does not start with `GGUF`): {EXPECTED_MODEL}"),
            ));
        }
        let (content, mut reader) = crate::model::loader::read_gguf(path)?;
        crate::model::loader::gguf_config(path, &content, &mut reader)?;
        if let Some(t) = tokenizer {
            if !t.exists() {
                return Err(EngineError::ModelNotFound { path: t.into() });
            }
        }
        Ok(())
    }

    pub fn load(opts: &EngineOptions) -> Result<Self> {
        let path = match &opts.model {
            Some(p) => p.clone(),
            None => default_model::ensure_default_model()?,
        };
        if !path.exists() {
            return Err(EngineError::ModelNotFound { path });
        }
        let load_opts = LoadOptions {
            device: opts.device.clone(),
            weights: opts.weights,
        };
        let (mut src, cfg, tokenizer, format): (Box<dyn WeightSource>, _, _, _) = if path.is_dir() {
            let (src, cfg) = HfSource::open(&path, load_opts)?;
            let tok = match &opts.tokenizer {
                Some(t) => TextTokenizer::from_hf_files(&path, t, &cfg.eos_token_ids)?,
                None => TextTokenizer::from_hf_dir(&path, &cfg.eos_token_ids)?,
            };
            (Box::new(src), cfg, tok, "safetensors")
        } else if is_gguf(&path) {
            let (src, cfg) = GgufSource::open(&path, load_opts)?;
            let tok = match &opts.tokenizer {
                Some(t) => {
                    TextTokenizer::from_file_with_gguf(t, src.content(), &cfg.eos_token_ids)?
                }
                None => TextTokenizer::from_gguf(src.content(), &cfg.eos_token_ids)?,
            };
            (Box::new(src), cfg, tok, "gguf")
        } else {
            return Err(EngineError::bad_file(
                &path,
                format!("not a model (it does not start with `GGUF`): {EXPECTED_MODEL}"),
            ));
        };
        let max_positions = match opts.max_context {
            Some(m) => m.min(cfg.max_position_embeddings),
            None => cfg.max_position_embeddings,
        };
        let imp = attention::choose(&opts.device, opts.attention)?;
        amx::set_budget_mib(opts.amx_weights_mib);
        let model = Llama::load(src.as_mut(), &cfg, max_positions, imp, &opts.device)?;
        let weight_types = src.load_summary();
        // The repacked weights onto 2 MiB pages (`huge_pages`).
        let started = std::time::Instant::now();
        let spans = model.weight_spans();
        let pages = crate::huge_pages::collapse(&spans);
        if pages.regions > 0 {
            tracing::info!(
                mib = spans.iter().map(|s| s.1).sum::<usize>() >> 20,
                regions = pages.regions,
                collapsed = pages.collapsed,
                ms = started.elapsed().as_millis() as u64,
                "weights on 2 MiB pages (regions collapsed of those the weights touch)"
            );
        }
        let spec = match opts.cache {
            CacheSize::Mib(m) => {
                KvCacheSpec::from_bytes(cfg.kv_shape(), opts.kv_dtype, opts.block_size, m << 20)
            }
            CacheSize::Tokens(t) => KvCacheSpec::from_tokens(opts.block_size, t),
        };
        let cache = KvCache::new(cfg.kv_shape(), spec, opts.kv_dtype, &opts.device)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        tracing::info!(
            model = %name, format, layers = cfg.num_layers, hidden = cfg.hidden_size,
            heads = cfg.num_heads, kv_heads = cfg.num_kv_heads, vocab = cfg.vocab_size,
            context = max_positions, attention = ?imp, weights = %weight_types.join(", "),
            cpu_kernels = crate::model::kernels::cpu::Isa::best().name(),
            "model loaded"
        );
        if Isa::best().amx().is_some() && opts.device.is_cpu() {
            tracing::info!(
                mib = (opts.amx_weights_mib << 20).saturating_sub(amx::budget_left()) >> 20,
                budget_mib = opts.amx_weights_mib,
                min_rows = amx::AMX_MIN_ROWS,
                "AMX: bf16 weight copies for steps of many tokens (engine.amx_weights_mib)"
            );
        }
        if !opts.device.is_cpu() {
            tracing::info!(
                device = ?opts.device,
                cpu_only = %CPU_ONLY.join("; "),
                "not on this device: these paths run on the CPU only; the step uses candle's device ops instead"
            );
        }
        tracing::info!(
            bytes_per_token = KvCacheSpec::bytes_per_token(cfg.kv_shape(), opts.kv_dtype),
            dtype = opts.kv_dtype.name(),
            block_size = spec.block_size,
            blocks = spec.num_blocks,
            tokens = spec.num_slots(),
            mib = cache.bytes() >> 20,
            "KV cache allocated"
        );
        Ok(Engine {
            pool: BlockPool::new(spec.num_blocks),
            model,
            tokenizer: Arc::new(tokenizer),
            cache,
            info: ModelInfo {
                name,
                path,
                format,
                weight_types,
            },
        })
    }
}
