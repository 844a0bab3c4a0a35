//! Reads model weights from a GGUF file or a Hugging Face folder into the shapes `llama.rs` wants.
//!
//! Both sources answer the same questions by Hugging Face weight name (`model.layers.3.mlp.up_proj`),
//! so the model code has one spelling; the GGUF source maps names to llama.cpp's (`blk.3.ffn_up`).
//! Two things happen at load and are logged once per tensor type:
//! - GGUF stores Q/K projection rows permuted for llama.cpp's interleaved RoPE; we move the rows
//!   back to the Hugging Face order (the rows of a quantized tensor are whole blocks, so this is a
//!   byte copy) and use one RoPE for every model, as transformers does.
//! - On CPU, Q8_0, Q4_1, Q4_0, Q4_K and Q6_K run on our 8-row kernels (`kernels::q8_0x8`,
//!   `kernels::q4_1x8`, `kernels::q4_kx8`; the matrices are repacked by `linear.rs`, Q4_0 as Q4_1
//!   blocks).
//!   candle has only scalar loops for Q5_0 and Q5_1: those are requantized to Q8_0 at load (not to
//!   a K-quant, whose rows must be multiples of 256, which SmolLM2's 576 is not). F16/BF16 become
//!   F32. `weights = "keep"` keeps every type as stored.
//!   Q4_1 stays as stored: on its own kernel it reads fewer bytes a token than Q8_0 and decodes
//!   faster (`cargo bench --bench engine -- --weights keep|auto` compares).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::config::{parse_id_list, ModelConfig, RopeScaling};
use super::linear::{Linear, Packed};
use crate::error::{EngineError, Result};
use crate::files::{md_f, md_str, md_u, read_json};

/// How weights are stored after load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub weights: WeightMode,
}

/// What quantized weights become at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMode {
    /// The fastest layout on this device: on CPU, types without a fast kernel (Q5_0, Q5_1) become
    /// Q8_0; Q8_0, Q4_1, Q4_0, Q4_K and Q6_K run on our 8-row kernels.
    Auto,
    /// As stored in the file.
    Keep,
    /// Everything dequantized to F32: reference precision, for checking a model against transformers.
    F32,
}

/// A token embedding table: quantized rows looked up without dequantizing the whole table, or dense.
#[derive(Debug, Clone)]
pub enum Embedding {
    Quantized(Arc<QTensor>),
    /// A CPU table in an 8-row layout (`Packed`), shared with a tied output projection.
    Packed(Arc<Packed>),
    Dense(Tensor),
}

impl Embedding {
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(ids)?,
            Embedding::Dense(t) => t.index_select(ids, 0)?,
            Embedding::Packed(p) => {
                let (n, k) = p.dims();
                let ids = ids.to_vec1::<u32>()?;
                let mut out = vec![0f32; ids.len() * k];
                for (o, &id) in out.chunks_exact_mut(k).zip(&ids) {
                    if id as usize >= n {
                        return Err(EngineError::InvalidBatch(format!(
                            "token id {id} is outside the vocabulary of {n}"
                        )));
                    }
                    p.dequantize_row(id as usize, o);
                }
                Tensor::from_vec(out, (ids.len(), k), &candle_core::Device::Cpu)?
            }
        })
    }

    /// A CPU table of a type with an 8-row layout (Q8_0, Q4_1, Q4_0, Q4_K, Q6_K) moves to it
    /// (the table and a tied output projection then share it); anything else stays as it is.
    pub fn repack(self) -> Result<Self> {
        if let Embedding::Quantized(q) = &self {
            if let Some(p) = Packed::from_qtensor(q)? {
                return Ok(Embedding::Packed(Arc::new(p)));
            }
        }
        Ok(self)
    }

    /// The same table as an output projection (tied embeddings).
    pub fn as_linear(&self) -> Result<Linear> {
        match self {
            Embedding::Quantized(q) => Linear::new(QMatMul::from_arc(q.clone())?),
            Embedding::Packed(p) => Ok(Linear::packed(p.clone())),
            Embedding::Dense(t) => Linear::new(QMatMul::Tensor(t.clone())),
        }
    }
}

/// A source of weights addressed by Hugging Face names.
pub trait WeightSource {
    /// A `[out, in]` projection (name without `.weight`).
    fn linear(&mut self, name: &str, out_dim: usize, in_dim: usize) -> Result<QMatMul>;
    /// A 1-D F32 vector such as a norm weight (name without `.weight`).
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor>;
    /// The token embedding table `[vocab, hidden]`.
    fn embedding(&mut self, vocab: usize, hidden: usize) -> Result<Embedding>;
    /// What was done to each tensor type, for the start-up log: "Q4_1 -> Q8_0 (210 tensors)".
    fn load_summary(&self) -> Vec<String>;
}

/// Which projections carry RoPE'd heads, and how many heads each has.
fn rope_heads(name: &str, cfg: &ModelConfig) -> Option<usize> {
    if name.ends_with("self_attn.q_proj") {
        Some(cfg.num_heads)
    } else if name.ends_with("self_attn.k_proj") {
        Some(cfg.num_kv_heads)
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF
// ---------------------------------------------------------------------------------------------

/// Weights from a GGUF file (`general.architecture = llama`).
pub struct GgufSource {
    path: PathBuf,
    file: BufReader<File>,
    content: gguf_file::Content,
    cfg: ModelConfig,
    opts: LoadOptions,
    /// (stored type -> used type) -> count, for the log.
    conversions: BTreeMap<(String, String), usize>,
}

/// Reads the GGUF header (metadata and tensor index) without touching tensor data.
pub fn read_gguf(path: &Path) -> Result<(gguf_file::Content, BufReader<File>)> {
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| EngineError::bad_file(path, format!("not a readable GGUF file: {e}")))?;
    Ok((content, reader))
}

/// Builds the model config from `llama.*` metadata (and the tensor index, for what metadata omits).
pub fn gguf_config(
    path: &Path,
    c: &gguf_file::Content,
    reader: &mut BufReader<File>,
) -> Result<ModelConfig> {
    let arch = md_str(c, "general.architecture").unwrap_or("");
    if arch != "llama" {
        return Err(EngineError::UnsupportedArchitecture {
            path: path.into(),
            arch: arch.to_string(),
        });
    }
    let req = |k: &str| {
        md_u(c, k).ok_or_else(|| EngineError::bad_file(path, format!("missing metadata `{k}`")))
    };
    let hidden = req("llama.embedding_length")?;
    let heads = req("llama.attention.head_count")?;
    let kv_heads = md_u(c, "llama.attention.head_count_kv").unwrap_or(heads);
    let head_dim = md_u(c, "llama.attention.key_length")
        .or_else(|| md_u(c, "llama.rope.dimension_count"))
        .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    let vocab = md_u(c, "llama.vocab_size")
        .or_else(|| {
            c.metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(Vec::len)
        })
        .or_else(|| {
            c.tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
        })
        .ok_or_else(|| EngineError::bad_file(path, "cannot tell the vocabulary size"))?;
    let rope_scaling = if c.tensor_infos.contains_key("rope_freqs.weight") {
        let t = c
            .tensor(reader, "rope_freqs.weight", &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(|e| bad_tensor(path, "rope_freqs.weight", e.to_string()))?;
        RopeScaling::FreqFactors(t)
    } else {
        match md_str(c, "llama.rope.scaling.type") {
            Some("linear") => RopeScaling::Linear {
                factor: md_f(c, "llama.rope.scaling.factor").unwrap_or(1.0),
            },
            Some("none") | None => RopeScaling::None,
            Some(other) => {
                return Err(EngineError::bad_file(
                    path,
                    format!(
                        "unsupported llama.rope.scaling.type `{other}` (supported: none, linear)"
                    ),
                ))
            }
        }
    };
    let mut eos = Vec::new();
    for k in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = md_u(c, k) {
            if !eos.contains(&(id as u32)) {
                eos.push(id as u32);
            }
        }
    }
    let cfg = ModelConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: req("llama.feed_forward_length")?,
        num_layers: req("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: md_f(c, "llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope_theta: md_f(c, "llama.rope.freq_base").unwrap_or(10_000.0),
        rope_scaling,
        max_position_embeddings: md_u(c, "llama.context_length").unwrap_or(2048),
        tie_word_embeddings: !c.tensor_infos.contains_key("output.weight"),
        bos_token_id: md_u(c, "tokenizer.ggml.bos_token_id").map(|v| v as u32),
        eos_token_ids: eos,
    };
    cfg.validate(path)?;
    Ok(cfg)
}

fn bad_tensor(path: &Path, tensor: &str, message: String) -> EngineError {
    EngineError::BadTensor {
        path: path.into(),
        tensor: tensor.into(),
        message,
    }
}

/// llama.cpp's name for a Hugging Face weight name (both without `.weight`).
fn gguf_name(hf: &str) -> String {
    if hf == "model.embed_tokens" {
        return "token_embd".into();
    }
    if hf == "model.norm" {
        return "output_norm".into();
    }
    if hf == "lm_head" {
        return "output".into();
    }
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (idx, leaf) = rest.split_once('.').unwrap_or((rest, ""));
        let leaf = match leaf {
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.o_proj" => "attn_output",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            "input_layernorm" => "attn_norm",
            "post_attention_layernorm" => "ffn_norm",
            other => other,
        };
        return format!("blk.{idx}.{leaf}");
    }
    hf.to_string()
}

/// The type a stored quantized type is kept in for matmuls on this device.
fn target_type(stored: GgmlDType, in_dim: usize, opts: &LoadOptions) -> GgmlDType {
    match opts.weights {
        WeightMode::F32 => return GgmlDType::F32,
        WeightMode::Keep => return stored,
        WeightMode::Auto if !opts.device.is_cpu() => return stored,
        WeightMode::Auto => {}
    }
    match stored {
        // Scalar-only in candle's CPU backend and no kernel of ours: requantize to Q8_0.
        GgmlDType::Q5_0 | GgmlDType::Q5_1 if in_dim.is_multiple_of(32) => GgmlDType::Q8_0,
        // Half precision weights: candle's CPU matmul for them goes through F32 anyway.
        GgmlDType::F16 | GgmlDType::BF16 => GgmlDType::F32,
        other => other,
    }
}

/// Moves the rows of a `[heads*head_dim, in]` tensor from llama.cpp's interleaved-pair order to
/// Hugging Face's half-split order. Row `h*D + 2j + s` (GGUF) becomes row `h*D + s*D/2 + j`.
pub fn unpermute_rows(data: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let d = rows / heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for j in 0..d / 2 {
            for s in 0..2 {
                let src = h * d + 2 * j + s;
                let dst = h * d + s * (d / 2) + j;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

impl GgufSource {
    pub fn open(path: &Path, opts: LoadOptions) -> Result<(Self, ModelConfig)> {
        let (content, mut file) = read_gguf(path)?;
        let cfg = gguf_config(path, &content, &mut file)?;
        let src = GgufSource {
            path: path.into(),
            file,
            content,
            cfg: cfg.clone(),
            opts,
            conversions: BTreeMap::new(),
        };
        Ok((src, cfg))
    }

    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    /// Reads a tensor (GGUF name with `.weight`), checks its `[rows, cols]` shape.
    fn read(&mut self, name: &str, shape: &[usize]) -> Result<QTensor> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(bad_tensor(&self.path, name, "missing from the file".into()));
        };
        if info.shape.dims() != shape {
            return Err(bad_tensor(
                &self.path,
                name,
                format!("shape {:?}, expected {:?}", info.shape.dims(), shape),
            ));
        }
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| bad_tensor(&self.path, name, e.to_string()))
    }

    fn note(&mut self, from: GgmlDType, to: GgmlDType) {
        *self
            .conversions
            .entry((format!("{from:?}"), format!("{to:?}")))
            .or_default() += 1;
    }

    /// Puts a CPU-read tensor in its final type and on the target device.
    fn finish(&mut self, name: &str, q: QTensor, rope_heads: Option<usize>) -> Result<QTensor> {
        let stored = q.dtype();
        let dims = q.shape().dims().to_vec();
        let in_dim = *dims.last().unwrap_or(&0);
        let target = target_type(stored, in_dim, &self.opts);
        let path = self.path.clone();
        let e = |e: candle_core::Error| bad_tensor(&path, name, e.to_string());
        let mut q = q;
        if let Some(heads) = rope_heads {
            let data = q.data().map_err(e)?;
            let rows = dims[0];
            let permuted = unpermute_rows(&data, rows, heads);
            let storage =
                QStorage::from_data(std::borrow::Cow::Owned(permuted), &Device::Cpu, stored)
                    .map_err(e)?;
            q = QTensor::new(storage, dims.as_slice()).map_err(e)?;
        }
        if target != stored && target != GgmlDType::F32 {
            let f = q.dequantize(&Device::Cpu).map_err(e)?;
            q = QTensor::quantize(&f, target).map_err(e)?;
        }
        self.note(stored, target);
        if !self.opts.device.is_cpu() {
            let f = q.dequantize(&Device::Cpu).map_err(e)?;
            q = QTensor::quantize_onto(&f, target, &self.opts.device).map_err(e)?;
        }
        Ok(q)
    }
}

fn qtensor_to_matmul(q: QTensor, name: &str, path: &Path) -> Result<QMatMul> {
    // Dense types become a plain tensor so candle's F32 gemm runs them.
    match q.dtype() {
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
            let t = q
                .dequantize(&q.device())
                .map_err(|e| bad_tensor(path, name, e.to_string()))?;
            Ok(QMatMul::Tensor(t))
        }
        _ => QMatMul::from_qtensor(q).map_err(|e| bad_tensor(path, name, e.to_string())),
    }
}

impl WeightSource for GgufSource {
    fn linear(&mut self, name: &str, out_dim: usize, in_dim: usize) -> Result<QMatMul> {
        let g = format!("{}.weight", gguf_name(name));
        let q = self.read(&g, &[out_dim, in_dim])?;
        let heads = rope_heads(name, &self.cfg);
        let q = self.finish(&g, q, heads)?;
        if self.opts.weights == WeightMode::F32 {
            let t = q
                .dequantize(&self.opts.device)
                .map_err(|e| bad_tensor(&self.path, &g, e.to_string()))?;
            return Ok(QMatMul::Tensor(t));
        }
        qtensor_to_matmul(q, &g, &self.path.clone())
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let g = format!("{}.weight", gguf_name(name));
        let q = self.read(&g, &[len])?;
        q.dequantize(&self.opts.device)
            .map_err(|e| bad_tensor(&self.path, &g, e.to_string()))
    }

    fn embedding(&mut self, vocab: usize, hidden: usize) -> Result<Embedding> {
        let g = "token_embd.weight";
        let q = self.read(g, &[vocab, hidden])?;
        let q = self.finish(g, q, None)?;
        match q.dtype() {
            _ if self.opts.weights == WeightMode::F32 => Ok(Embedding::Dense(
                q.dequantize(&self.opts.device)
                    .map_err(|e| bad_tensor(&self.path, g, e.to_string()))?,
            )),
            GgmlDType::F32 => Ok(Embedding::Dense(
                q.dequantize(&self.opts.device)
                    .map_err(|e| bad_tensor(&self.path, g, e.to_string()))?,
            )),
            _ => Ok(Embedding::Quantized(Arc::new(q))),
        }
    }

    fn load_summary(&self) -> Vec<String> {
        summary(&self.conversions)
    }
}

fn summary(conv: &BTreeMap<(String, String), usize>) -> Vec<String> {
    conv.iter()
        .map(|((a, b), n)| {
            if a == b {
                format!("{a} kept ({n} tensors)")
            } else {
                format!("{a} -> {b} ({n} tensors)")
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Hugging Face folder
// ---------------------------------------------------------------------------------------------

/// Weights from a Hugging Face folder: `model.safetensors` or shards listed in
/// `model.safetensors.index.json`. BF16/F16/F32 weights are computed in F32.
pub struct HfSource {
    dir: PathBuf,
    tensors: candle_core::safetensors::MmapedSafetensors,
    /// Which shard holds each tensor, for error messages.
    files: Vec<PathBuf>,
    device: Device,
    conversions: BTreeMap<(String, String), usize>,
}

impl HfSource {
    pub fn open(dir: &Path, opts: LoadOptions) -> Result<(Self, ModelConfig)> {
        let cfg_path = dir.join("config.json");
        let mut cfg = ModelConfig::from_hf_json(&cfg_path, &read_json(&cfg_path)?)?;
        // generation_config.json holds the full list of end-of-turn ids (Llama 3: eot, eom, eos).
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            for id in parse_id_list(read_json(&gen_path)?.get("eos_token_id")) {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
        }
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let json = read_json(&index)?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| EngineError::bad_file(&index, "no `weight_map` object"))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect();
            names.sort();
            names.dedup();
            names.iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        for f in &files {
            if !f.exists() {
                return Err(EngineError::ModelNotFound { path: f.clone() });
            }
        }
        // SAFETY: the files are mapped read-only and must not be modified while the server runs,
        // as with every mmap-based loader (candle, transformers, llama.cpp).
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| {
                EngineError::bad_file(&files[0], format!("not a readable safetensors file: {e}"))
            })?;
        let src = HfSource {
            dir: dir.into(),
            tensors,
            files,
            device: opts.device.clone(),
            conversions: BTreeMap::new(),
        };
        Ok((src, cfg))
    }

    fn load(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let full = format!("{name}.weight");
        let where_ = || {
            if self.files.len() == 1 {
                self.files[0].clone()
            } else {
                self.dir.join("model.safetensors.index.json")
            }
        };
        let view = self
            .tensors
            .get(&full)
            .map_err(|_| bad_tensor(&where_(), &full, "missing from the model files".into()))?;
        if view.shape() != shape {
            return Err(bad_tensor(
                &where_(),
                &full,
                format!("shape {:?}, expected {:?}", view.shape(), shape),
            ));
        }
        let t = self
            .tensors
            .load(&full, &Device::Cpu)
            .map_err(|e| bad_tensor(&where_(), &full, e.to_string()))?;
        let from = format!("{:?}", t.dtype());
        let t = t.to_dtype(DType::F32)?.to_device(&self.device)?;
        *self.conversions.entry((from, "F32".into())).or_default() += 1;
        Ok(t)
    }
}

impl WeightSource for HfSource {
    fn linear(&mut self, name: &str, out_dim: usize, in_dim: usize) -> Result<QMatMul> {
        Ok(QMatMul::Tensor(self.load(name, &[out_dim, in_dim])?))
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        self.load(name, &[len])
    }

    fn embedding(&mut self, vocab: usize, hidden: usize) -> Result<Embedding> {
        Ok(Embedding::Dense(
            self.load("model.embed_tokens", &[vocab, hidden])?,
        ))
    }

    fn load_summary(&self) -> Vec<String> {
        summary(&self.conversions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.o_proj"),
            "blk.12.attn_output"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm"),
            "blk.0.ffn_norm"
        );
        assert_eq!(gguf_name("lm_head"), "output");
        assert_eq!(gguf_name("model.embed_tokens"), "token_embd");
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp's convert: w.reshape(heads, 2, D/2, ...).swapaxes(1, 2): gguf row (h, j, s) = hf row (h, s, j).
        let (heads, d) = (3usize, 8usize);
        let rows = heads * d;
        let hf: Vec<u8> = (0..rows as u8)
            .flat_map(|r| [r, r.wrapping_mul(7)])
            .collect();
        let mut gguf = vec![0u8; hf.len()];
        for h in 0..heads {
            for j in 0..d / 2 {
                for s in 0..2 {
                    let g = h * d + 2 * j + s;
                    let f = h * d + s * d / 2 + j;
                    gguf[2 * g..2 * g + 2].copy_from_slice(&hf[2 * f..2 * f + 2]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gguf, rows, heads), hf);
    }
}
