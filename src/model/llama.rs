//! A Llama decoder whose forward pass takes a flat step batch and reads and writes the paged KV
//! cache, instead of candle-transformers' per-model cache of one sequence.
//!
//! Laid out as candle's model files are: config (in `config.rs`), small blocks each with `load` and
//! `forward`, weight names as in Hugging Face, then the public model. The matmuls run once over
//! every token of the step; attention (see `attention.rs`) is the only per-sequence part; logits are
//! computed only for the rows the caller will sample.
//!
//! On CPU, when every projection runs on a repacked kernel (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K),
//! the layers
//! run on plain row buffers instead (`forward_cpu`): the same arithmetic without a tensor, an
//! allocation and a parallel region per small op (norms, residual adds, SiLU, the QKV split, the
//! cache-write copies): each candle op wakes the thread pool, which at one decoding sequence
//! costs a large share of a step.

use candle_core::{DType, Device, Tensor};

use crate::model::team;

use super::attention::{
    fast_cpu, fast_cpu_rows, generic, AttentionImpl, AttnDims, FastCpuPlan, GenericPlan,
};
use super::config::{inv_freqs, ModelConfig};
use super::kernels::amx::ActTiles;
use super::kernels::cpu::{Amx, Isa};
use super::kernels::f16::round_to_f16;
use super::kernels::norm::{rms_norm_row, rms_norm_rows};
use super::kernels::rope::{rope_half, rope_half_in_place};
use super::kernels::silu::{silu_mul_quantized, silu_mul_rows};
use super::kernels::with_cpu_slice;
use super::linear::{mlp_on_tiles, Linear, Packed, PackedGroup, ProjectionGroup};
use super::loader::{Embedding, WeightSource};
use super::profile::{time, Part};
use super::tile_packs::PackStore;
use crate::error::{EngineError, Result};
use crate::kv_cache::storage::KeyRotation;
use crate::kv_cache::{KvCache, SlotIndex};
use crate::model::batch::{StepBatch, StepPlan};

/// cos/sin tables for every position up to the context limit, `[positions, head_dim/2]`.
#[derive(Debug, Clone)]
struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
}

impl RotaryEmbedding {
    fn load(cfg: &ModelConfig, max_positions: usize, device: &Device) -> Result<Self> {
        let freqs = inv_freqs(cfg);
        let half = freqs.len();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &freqs {
                // Angles in f64: at position 100k an f32 angle is off by ~1e-2 rad.
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(RotaryEmbedding {
            cos: Tensor::from_vec(cos, (max_positions, half), device)?,
            sin: Tensor::from_vec(sin, (max_positions, half), device)?,
        })
    }

    /// The rows for this step's positions.
    fn select(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Applies the half-split (Hugging Face) rotation to `[tokens, heads*head_dim]`.
    fn forward(x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (t, width) = x.dims2()?;
        if x.device().is_cpu() && x.dtype() == DType::F32 {
            let x = x.contiguous()?;
            let out = with_cpu_slice(&x, |xs| {
                with_cpu_slice(cos, |c| {
                    with_cpu_slice(sin, |s| rope_half(xs, heads, width / heads, c, s))
                })
            })???;
            return Ok(Tensor::from_vec(out, (t, width), x.device())?);
        }
        let x = x.reshape((1, t, heads, width / heads))?;
        let y = candle_nn::rotary_emb::rope_thd(&x, cos, sin)?;
        Ok(y.reshape((t, width))?)
    }
}

#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(src: &mut dyn WeightSource, name: &str, cfg: &ModelConfig) -> Result<Self> {
        Ok(RmsNorm {
            weight: src.vector(name, cfg.hidden_size)?,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.on_cpu_f32() && x.dtype() == DType::F32 {
            // The same arithmetic as the CPU layer path, so the two agree to the bit.
            let (rows, width) = x.dims2()?;
            let x = x.contiguous()?;
            let out = with_cpu_slice(&x, |xs| self.forward_rows(xs, width))??;
            return Ok(Tensor::from_vec(out, (rows, width), x.device())?);
        }
        Ok(candle_nn::ops::rms_norm(x, &self.weight, self.eps)?)
    }

    /// `forward` on rows `width` wide: `kernels::norm` (candle's formula with the sum of squares
    /// in eight lanes; both layer paths use it, so they agree to the bit).
    fn forward_rows(&self, x: &[f32], width: usize) -> Result<Vec<f32>> {
        with_cpu_slice(&self.weight, |w| rms_norm_rows(x, w, self.eps, width))
    }

    /// The norm of `x`'s rows rounded to the tile units' input (`amx::ActTiles::from_rows`):
    /// `ActTiles::from_f32(forward_rows(x))` without the F32 rows in memory.
    fn tiles(&self, amx: Amx, x: &[f32], width: usize) -> Result<ActTiles> {
        let isa = Isa::best();
        with_cpu_slice(&self.weight, |w| {
            // SAFETY: `rms_norm_row` writes every value of its `out` (each level writes the
            // whole row).
            unsafe {
                ActTiles::from_rows(amx, x.len() / width, width, |r, out| {
                    rms_norm_row(&x[r * width..][..width], w, self.eps, out, isa)
                })
            }
        })
    }

    fn on_cpu_f32(&self) -> bool {
        self.weight.device().is_cpu() && self.weight.dtype() == DType::F32
    }
}

/// `silu(gate) * up` for rows holding `[gate | up]`, each `inter` wide.
fn silu_mul(gu: &[f32], inter: usize) -> Vec<f32> {
    let rows = gu.len() / (2 * inter);
    silu_mul_rows(gu, 2 * inter, &gu[inter..], 2 * inter, inter, rows)
}

/// `silu(gate) * up` on tensors: on CPU in F32 the same kernel as the plain-row path (so both
/// paths stay equal to the bit), elsewhere candle's ops.
fn silu_mul_tensors(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let on_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
    if !(on_cpu(gate) && on_cpu(up)) || gate.dims() != up.dims() {
        return Ok((gate.silu()? * up)?);
    }
    let width = *gate.dims().last().expect("a matrix");
    let rows = gate.elem_count() / width;
    let out = with_cpu_slice(gate, |g| {
        with_cpu_slice(up, |u| silu_mul_rows(g, width, u, width, width, rows))
    })??;
    Ok(Tensor::from_vec(out, gate.dims(), &Device::Cpu)?)
}

/// `x += y`, a residual connection: split across the pool when a prefill makes it big (a
/// 512-token step's 295k values; a decode step's few thousand stay on this thread).
fn add_assign(x: &mut [f32], y: &[f32]) {
    const PART: usize = 1 << 14;
    let add = |x: &mut [f32], y: &[f32]| x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    if x.len() < 4 * PART {
        return add(x, y);
    }
    team::chunks_mut(x, PART, 1, |i, x| add(x, &y[i * PART..][..x.len()]));
}

#[derive(Debug, Clone)]
struct Mlp {
    /// gate_proj and up_proj, stacked when stored alike.
    gate_up: ProjectionGroup,
    down_proj: Linear,
}

impl Mlp {
    fn load(src: &mut dyn WeightSource, p: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = src.linear(&format!("{p}.gate_proj"), i, h)?;
        let up = src.linear(&format!("{p}.up_proj"), i, h)?;
        Ok(Mlp {
            gate_up: ProjectionGroup::new(vec![gate, up], vec![i, i])?,
            down_proj: Linear::new(src.linear(&format!("{p}.down_proj"), h, i)?)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gu = self.gate_up.forward(x)?;
        self.down_proj.forward(&silu_mul_tensors(&gu[0], &gu[1])?)
    }
}

#[derive(Debug, Clone)]
struct SelfAttention {
    /// q_proj, k_proj and v_proj, stacked when stored alike.
    qkv: ProjectionGroup,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
}

/// What every layer's attention shares in one step.
struct StepContext<'a> {
    cos: Tensor,
    sin: Tensor,
    /// Where the step's K/V rows go in the cache.
    slot_index: SlotIndex,
    plan: &'a StepPlan,
    cache: &'a KvCache,
    dims: AttnDims,
    /// The attention's per-step plan: every layer shares it.
    attn: AttnPlan,
}

/// The per-step part of whichever attention the model runs.
enum AttnPlan {
    /// Row offsets and tasks.
    Fast(FastCpuPlan),
    /// Gather indices and masks on the device.
    Generic(GenericPlan),
}

impl SelfAttention {
    fn load(src: &mut dyn WeightSource, p: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, qd, kvd) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.kv_dim());
        let q = src.linear(&format!("{p}.q_proj"), qd, h)?;
        let k = src.linear(&format!("{p}.k_proj"), kvd, h)?;
        let v = src.linear(&format!("{p}.v_proj"), kvd, h)?;
        Ok(SelfAttention {
            qkv: ProjectionGroup::new(vec![q, k, v], vec![qd, kvd, kvd])?,
            o_proj: Linear::new(src.linear(&format!("{p}.o_proj"), h, qd)?)?,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
        })
    }

    fn forward(&self, x: &Tensor, layer: usize, ctx: &StepContext) -> Result<Tensor> {
        let qkv = self.qkv.forward(x)?;
        let q = RotaryEmbedding::forward(&qkv[0], self.num_heads, &ctx.cos, &ctx.sin)?;
        let k = RotaryEmbedding::forward(&qkv[1], self.num_kv_heads, &ctx.cos, &ctx.sin)?;
        ctx.cache.write(layer, &ctx.slot_index, &k, &qkv[2])?;
        let kv = ctx.cache.layer(layer)?;
        let o = match &ctx.attn {
            AttnPlan::Fast(plan) => fast_cpu(&q, &kv, &ctx.plan.seqs, plan)?,
            AttnPlan::Generic(plan) => generic(&q, &kv, ctx.dims, plan)?,
        };
        self.o_proj.forward(&o)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(src: &mut dyn WeightSource, i: usize, cfg: &ModelConfig) -> Result<Self> {
        let p = format!("model.layers.{i}");
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(src, &format!("{p}.input_layernorm"), cfg)?,
            self_attn: SelfAttention::load(src, &format!("{p}.self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(
                src,
                &format!("{p}.post_attention_layernorm"),
                cfg,
            )?,
            mlp: Mlp::load(src, &format!("{p}.mlp"), cfg)?,
        })
    }

    /// The repacked weights the CPU layer path needs, when the layer has them all.
    fn cpu_parts(&self) -> Option<CpuParts<'_>> {
        let (qkv, qkv_outs) = self.self_attn.qkv.as_packed()?;
        let (gate_up, gu_outs) = self.mlp.gate_up.as_packed()?;
        if qkv_outs.len() != 3 || gu_outs.len() != 2 || gu_outs[0] != gu_outs[1] {
            return None;
        }
        if !self.input_layernorm.on_cpu_f32() || !self.post_attention_layernorm.on_cpu_f32() {
            return None;
        }
        Some(CpuParts {
            qkv,
            q_width: qkv_outs[0],
            kv_width: qkv_outs[1],
            o_proj: self.self_attn.o_proj.as_packed()?,
            gate_up,
            inter: gu_outs[0],
            down: self.mlp.down_proj.as_packed()?,
        })
    }

    /// `forward` on CPU over plain rows: `x` (`[n, hidden]`) is updated in place; `cos`/`sin` are
    /// the step's RoPE rows.
    fn forward_cpu(
        &self,
        x: &mut [f32],
        n: usize,
        layer: usize,
        ctx: &StepContext,
        rope: (&[f32], &[f32]),
    ) -> Result<()> {
        let p = self.cpu_parts().ok_or_else(|| {
            EngineError::InvalidBatch("the CPU layer path needs repacked weights".into())
        })?;
        let width = x.len() / n;
        let (qd, kvd, hd) = (p.q_width, p.kv_width, ctx.dims.head_dim);
        let stride = qd + 2 * kvd;
        let mut qkv = if let Some((tiles, t)) = p.qkv.stacked_tiles_at(n) {
            let xa = time(Part::Norm, || self.input_layernorm.tiles(t, x, width))?;
            time(Part::Qkv, || tiles.matmul_tiles(t, &xa))
        } else {
            let h = time(Part::Norm, || self.input_layernorm.forward_rows(x, width))?;
            time(Part::Qkv, || p.qkv.forward_rows(&h, n))?
        };
        let (cos, sin) = rope;
        let (heads, kv_heads) = (self.self_attn.num_heads, self.self_attn.num_kv_heads);
        time(Part::Rope, || {
            if qd == heads * hd {
                // K's heads follow Q's in each row (`[q | k | v]`): one pass rotates both.
                rope_half_in_place(&mut qkv, stride, 0, heads + kv_heads, hd, cos, sin);
            } else {
                rope_half_in_place(&mut qkv, stride, 0, heads, hd, cos, sin);
                rope_half_in_place(&mut qkv, stride, qd, kv_heads, hd, cos, sin);
            }
        });
        time(Part::KvWrite, || {
            let isa = Isa::best();
            let round = |s: &[f32], d: &mut [half::f16]| round_to_f16(isa, s, d);
            (ctx.cache).write_rows(layer, &ctx.slot_index, &qkv, stride, (qd, qd + kvd), &round)
        })?;
        let kv = ctx.cache.layer(layer)?;
        let AttnPlan::Fast(fast) = &ctx.attn else {
            return Err(EngineError::InvalidBatch(
                "the CPU layer path needs the fast attention".into(),
            ));
        };
        let o = time(Part::Attention, || {
            fast_cpu_rows(&qkv, stride, &kv, &ctx.plan.seqs, fast)
        })?;
        if let Some((tiles, t)) = p.o_proj.tiles_at(n) {
            // The residual add runs in the kernel's epilogue (its time is counted there).
            time(Part::O, || {
                let xa = ActTiles::from_f32(t, &o, n, tiles.dims().1);
                tiles.matmul_tiles_add(t, &xa, x)
            });
        } else {
            let o = time(Part::O, || p.o_proj.forward_rows(&o, n))?;
            time(Part::Residual, || add_assign(x, &o));
        }
        if let Some(t) = mlp_on_tiles(&p.gate_up, p.down, n) {
            // SiLU and the residual add run in the kernels' epilogues (their time is counted
            // there).
            let xa = time(Part::Norm, || {
                self.post_attention_layernorm.tiles(t.amx, x, width)
            })?;
            let act = time(Part::GateUp, || t.gate_up.matmul_silu_mul(t.amx, &xa));
            time(Part::Down, || t.down.matmul_tiles_add(t.amx, &act, x));
        } else {
            let h = time(Part::Norm, || {
                self.post_attention_layernorm.forward_rows(x, width)
            })?;
            let gu = time(Part::GateUp, || p.gate_up.forward_rows(&h, n))?;
            let d = if p.down.quantized_rows_at(n) {
                // The activation goes straight to `down`'s 8-bit input, row by row (the same
                // bits as quantizing it whole; its time is counted as SiLU's).
                let (i, gu) = (p.inter, &gu);
                let a = time(Part::Silu, || {
                    silu_mul_quantized(gu, 2 * i, &gu[i..], 2 * i, i, n)
                });
                time(Part::Down, || p.down.matmul_quantized(&a))
            } else {
                let act = time(Part::Silu, || silu_mul(&gu, p.inter));
                time(Part::Down, || p.down.forward_rows(&act, n))?
            };
            time(Part::Residual, || add_assign(x, &d));
        }
        Ok(())
    }

    fn forward(&self, x: &Tensor, layer: usize, ctx: &StepContext) -> Result<Tensor> {
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, layer, ctx)?;
        let x = (x + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((x + h)?)
    }
}

/// A layer's repacked weights, for the CPU layer path.
struct CpuParts<'a> {
    /// q_proj, k_proj and v_proj: rows `[q | k | v]`, `q_width` + 2 `kv_width` wide.
    qkv: PackedGroup<'a>,
    q_width: usize,
    kv_width: usize,
    o_proj: &'a Packed,
    /// gate_proj and up_proj: rows `[gate | up]`, each `inter` wide.
    gate_up: PackedGroup<'a>,
    inter: usize,
    down: &'a Packed,
}

/// Whether the CPU layer path can run: on CPU, every layer's projections repacked.
fn cpu_path_possible(device: &Device, layers: &[DecoderLayer]) -> bool {
    device.is_cpu() && layers.iter().all(|l| l.cpu_parts().is_some())
}

/// The public model: one forward over a flat step batch.
pub struct Llama {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: RotaryEmbedding,
    max_positions: usize,
    attention: AttentionImpl,
    /// Whether the layers run on the CPU layer path (see the module doc).
    cpu_layers: bool,
    device: Device,
    /// The tile packs kept between steps for long prompts (`tile_packs`).
    tile_packs: std::sync::Mutex<PackStore>,
}

impl Llama {
    /// Loads every weight from `src`. `max_positions` bounds the RoPE tables (the served context).
    pub fn load(
        src: &mut dyn WeightSource,
        cfg: &ModelConfig,
        max_positions: usize,
        attention: AttentionImpl,
        device: &Device,
    ) -> Result<Self> {
        let embed_tokens = src.embedding(cfg.vocab_size, cfg.hidden_size)?.repack()?;
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(src, i, cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(src, "model.norm", cfg)?;
        // Tied embeddings: configs say so, and GGUF files say so by having no `output.weight`.
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.as_linear()?
        } else {
            Linear::new(src.linear("lm_head", cfg.vocab_size, cfg.hidden_size)?)?
        };
        let cpu_layers = cpu_path_possible(device, &layers);
        Ok(Llama {
            cpu_layers,
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary: RotaryEmbedding::load(cfg, max_positions, device)?,
            max_positions,
            attention,
            device: device.clone(),
            tile_packs: Default::default(),
        })
    }

    fn pack_store(&self) -> std::sync::MutexGuard<'_, PackStore> {
        self.tile_packs.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The memory of every repacked matrix the steps stream (the layers' projections and the LM
    /// head), as (address, bytes).
    pub fn weight_spans(&self) -> Vec<(usize, usize)> {
        let mut spans = self.lm_head.spans();
        for l in &self.layers {
            spans.extend(l.self_attn.qkv.spans());
            spans.extend(l.self_attn.o_proj.spans());
            spans.extend(l.mlp.gate_up.spans());
            spans.extend(l.mlp.down_proj.spans());
        }
        spans
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The rotation that moves cached K from position p to p - `delta` (the context shift,
    /// `kv_cache::manager`): RoPE by -`delta`, from the model's own tables (so rope scaling
    /// applies). Exact up to rounding: RoPE turns each pair of dimensions by an angle
    /// proportional to the position.
    pub fn key_rotation(&self, delta: usize) -> Result<KeyRotation> {
        let row = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.get(delta)?.to_vec1::<f32>()?) };
        Ok(KeyRotation {
            heads: self.cfg.num_kv_heads,
            cos: row(&self.rotary.cos)?,
            sin: row(&self.rotary.sin)?,
        })
    }

    pub fn attention(&self) -> AttentionImpl {
        self.attention
    }

    /// Whether the layers run on the CPU layer path over plain rows.
    pub fn cpu_layers(&self) -> bool {
        self.cpu_layers && self.attention == AttentionImpl::FastCpu
    }

    /// Turns the CPU layer path off (every op through candle, as on other devices) or back on where
    /// the weights allow it; returns whether it is now on. Tests compare the two.
    pub fn set_cpu_layers(&mut self, on: bool) -> bool {
        self.cpu_layers = on && cpu_path_possible(&self.device, &self.layers);
        self.cpu_layers()
    }

    pub fn set_attention(&mut self, imp: AttentionImpl) -> Result<()> {
        self.attention = super::attention::choose(&self.device, Some(imp))?;
        Ok(())
    }

    /// Runs one step. Returns `[rows, vocab]` F32 logits for the rows the sequences' `logits` name, in
    /// batch order, or `None` when no sequence wants them (a step of prefill chunks only).
    pub fn forward(&self, batch: &StepBatch, cache: &KvCache) -> Result<Option<Tensor>> {
        // The CPU layer path runs its parallel loops on the thread team (`model::team`), with
        // this thread as one of its members. Other paths call candle, whose loops use rayon: they
        // run on a rayon worker, so each loop starts from inside the pool instead of waking it
        // from outside and sleeping on a latch (that cost ~20% of a decode step on 2 cores).
        if !self.cpu_layers() && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_in_pool(batch, cache));
        }
        self.forward_in_pool(batch, cache)
    }

    fn forward_in_pool(&self, batch: &StepBatch, cache: &KvCache) -> Result<Option<Tensor>> {
        let plan = batch.plan(
            self.cfg.vocab_size,
            self.max_positions,
            cache.block_size(),
            cache.num_blocks(),
        )?;
        if cache.kv_dim() != self.cfg.kv_dim() {
            return Err(EngineError::KvCache(format!(
                "cache rows are {} wide, the model needs {}",
                cache.kv_dim(),
                self.cfg.kv_dim()
            )));
        }
        let n = plan.token_ids.len();
        let dev = &self.device;
        let ids = Tensor::from_slice(&plan.token_ids, n, dev)?;
        let positions = Tensor::from_slice(&plan.positions, n, dev)?;
        let (cos, sin) = self.rotary.select(&positions)?;
        let slot_index = cache.slot_index(&plan.slots)?;
        let dims = AttnDims {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: cache.block_size(),
        };
        let ctx = StepContext {
            cos,
            sin,
            slot_index,
            attn: match self.attention {
                AttentionImpl::FastCpu => {
                    let fast = FastCpuPlan::new(&plan.seqs, dims, cache.dtype().storage());
                    fast.take_packs(&plan.seqs, &mut self.pack_store());
                    AttnPlan::Fast(fast)
                }
                AttentionImpl::Generic => {
                    AttnPlan::Generic(GenericPlan::new(&plan.seqs, dims, dev)?)
                }
            },
            plan: &plan,
            cache,
            dims,
        };
        let mut x = time(Part::Embed, || self.embed_tokens.forward(&ids))?;
        if x.dtype() != DType::F32 {
            x = x.to_dtype(DType::F32)?;
        }
        if self.cpu_layers() {
            let width = self.cfg.hidden_size;
            let mut xs = x.flatten_all()?.to_vec1::<f32>()?;
            let cos = ctx.cos.flatten_all()?.to_vec1::<f32>()?;
            let sin = ctx.sin.flatten_all()?.to_vec1::<f32>()?;
            for (i, layer) in self.layers.iter().enumerate() {
                layer.forward_cpu(&mut xs, n, i, &ctx, (&cos, &sin))?;
            }
            x = Tensor::from_vec(xs, (n, width), dev)?;
        } else {
            for (i, layer) in self.layers.iter().enumerate() {
                x = layer.forward(&x, i, &ctx)?;
            }
        }
        if let AttnPlan::Fast(fast) = &ctx.attn {
            fast.put_packs(&mut self.pack_store());
        }
        if plan.logit_rows.is_empty() {
            return Ok(None);
        }
        let rows = Tensor::from_slice(&plan.logit_rows, plan.logit_rows.len(), dev)?;
        let x = time(Part::Norm, || self.norm.forward(&x.index_select(&rows, 0)?))?;
        Ok(Some(time(Part::LmHead, || self.lm_head.forward(&x))?))
    }
}
