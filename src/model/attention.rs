//! Attention over the paged KV cache for a flat step batch: causal within a sequence, never across
//! sequences, each sequence reading its history through its block table.
//!
//! Two implementations of the same function:
//! - `fast_cpu`: reads the cache tensors as slices and runs one task per (sequence, KV head, tile of
//!   up to `TILE_ROWS` query rows) on the rayon pool, each through `kernels::attn` (the query heads
//!   of a GQA group, and of several tokens of a prefill chunk, share each load of K and V). Written
//!   by hand because candle has no paged attention on CPU and gathering blocks into a fresh tensor
//!   per sequence per layer costs more than the attention itself at decode time.
//! - `generic`: gathers each sequence's slots with `index_select` and runs standard masked
//!   attention with candle ops, so it runs on any device (CUDA): the cache stays where it is and
//!   only the gather indices and masks (`GenericPlan`, once a step) travel to it. Tests compare
//!   the two on CPU.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::kv_cache::slot_of;
use crate::model::batch::SeqMeta;
use crate::model::kernels::attn::{attend, merge_parts, KvElem, Tile};
use crate::model::kernels::cpu::Isa;
use crate::model::kernels::{with_cpu_slice, with_cpu_slice_of};

/// Which attention implementation a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionImpl {
    /// Hand-written CPU kernel (CPU only).
    FastCpu,
    /// candle ops, any device.
    Generic,
}

/// Shapes that attention needs.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// `q`: `[tokens, heads*head_dim]` (RoPE applied); `k_cache`/`v_cache`: `[slots, kv_heads*head_dim]`
/// already holding this step's keys and values. Returns `[tokens, heads*head_dim]`.
pub fn paged_attention(
    imp: AttentionImpl,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    dims: AttnDims,
) -> Result<Tensor> {
    match imp {
        AttentionImpl::FastCpu => {
            fast_cpu(q, k_cache, v_cache, seqs, &FastCpuPlan::new(seqs, dims))
        }
        AttentionImpl::Generic => {
            let plan = GenericPlan::new(seqs, dims.block_size, q.device())?;
            generic(q, k_cache, v_cache, seqs, dims, &plan)
        }
    }
}

/// One task of a `fast_cpu` call: a tile of consecutive tokens' GQA rows of one sequence and KV
/// head, over positions `from..` the rows' own ends, cut at `to`.
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    t0: usize,
    tokens: usize,
    from: usize,
    to: usize,
}

/// What the CPU fast path derives from a step's sequences, the same for every layer: each
/// sequence's cache row offsets and the task list. The model builds it once per step.
pub(crate) struct FastCpuPlan {
    dims: AttnDims,
    n_tokens: usize,
    /// Each sequence's cache row offsets by position: looking the slot up per position and head (a
    /// division by the block size each time) cost more than the arithmetic it fed.
    seq_rows: Vec<Vec<usize>>,
    tasks: Vec<Task>,
}

impl FastCpuPlan {
    pub(crate) fn new(seqs: &[SeqMeta], d: AttnDims) -> Self {
        let kv_dim = d.num_kv_heads * d.head_dim;
        FastCpuPlan {
            dims: d,
            n_tokens: seqs.iter().map(|s| s.q_len).sum(),
            seq_rows: seqs
                .iter()
                .map(|s| {
                    (0..s.start_pos + s.q_len)
                        .map(|p| slot_of(&s.block_table, p, d.block_size) * kv_dim)
                        .collect()
                })
                .collect(),
            tasks: plan_tasks(
                seqs,
                d.num_kv_heads,
                d.num_heads / d.num_kv_heads,
                rayon::current_num_threads(),
            ),
        }
    }
}

/// What every task of one `fast_cpu` call shares.
struct Job<'a> {
    seqs: &'a [SeqMeta],
    plan: &'a FastCpuPlan,
    /// Distance between query rows in `qs` (Q may sit inside wider rows, as in a stacked QKV output).
    q_stride: usize,
    isa: Isa,
}

/// A task's output rows and each row's softmax statistics.
type TaskOut = (Vec<f32>, Vec<(f32, f32)>);

impl Job<'_> {
    /// Runs every task; returns each task's output, in task order.
    fn run<T: KvElem>(&self, qs: &[f32], ks: &[T], vs: &[T]) -> Vec<TaskOut> {
        let d = self.plan.dims;
        let (hd, group) = (d.head_dim, d.num_heads / d.num_kv_heads);
        let scale = 1.0 / (hd as f32).sqrt();
        self.plan
            .tasks
            .par_iter()
            .map(|t| {
                let s = &self.seqs[t.seq];
                let mut qt = Vec::with_capacity(t.tokens * group * hd);
                let mut ctx = Vec::with_capacity(t.tokens * group);
                for i in t.t0..t.t0 + t.tokens {
                    let row = (s.q_start + i) * self.q_stride + t.kv_head * group * hd;
                    qt.extend(qs[row..row + group * hd].iter().map(|x| x * scale));
                    ctx.extend(std::iter::repeat_n((s.start_pos + i + 1).min(t.to), group));
                }
                let mut o = vec![0f32; qt.len()];
                let tile = Tile {
                    q: &qt,
                    from: t.from,
                    ctx: &ctx,
                    rows: &self.plan.seq_rows[t.seq],
                    k: &ks[t.kv_head * hd..],
                    v: &vs[t.kv_head * hd..],
                    d: hd,
                };
                let stats = attend(self.isa, &tile, &mut o);
                (o, stats)
            })
            .collect()
    }
}

/// Query rows a `fast_cpu` task aims for: with a GQA group of 3, 8 tokens of a prefill chunk, so
/// each block of keys and values is loaded once for 24 rows; a decode step's task is one token.
const TILE_ROWS: usize = 24;

/// The fewest positions a part of a decode row's history gets when a step has too few tasks to
/// keep every thread busy (one sequence: three KV heads on two threads left one idle a third of
/// the time, while each task waited on DRAM).
const MIN_PART: usize = 64;

/// Tasks for a step: tiles of up to `TILE_ROWS` rows; when there are fewer than two per thread,
/// each decode row's positions are cut into parts (merged after with `merge_parts`).
fn plan_tasks(seqs: &[SeqMeta], kvh: usize, group: usize, threads: usize) -> Vec<Task> {
    let per_task = (TILE_ROWS / group).max(1);
    let base: Vec<Task> = seqs
        .iter()
        .enumerate()
        .flat_map(|(si, s)| {
            (0..kvh).flat_map(move |g| {
                (0..s.q_len).step_by(per_task).map(move |t0| Task {
                    seq: si,
                    kv_head: g,
                    t0,
                    tokens: per_task.min(s.q_len - t0),
                    from: 0,
                    to: usize::MAX,
                })
            })
        })
        .collect();
    if base.len() >= 2 * threads {
        return base;
    }
    let want = (2 * threads).div_ceil(base.len());
    base.into_iter()
        .flat_map(|t| {
            // Only one-token tiles (decode rows) are cut: a chunk's rows end at different positions.
            let ctx = seqs[t.seq].start_pos + t.t0 + 1;
            let parts = if t.tokens == 1 {
                want.min(ctx / MIN_PART).max(1)
            } else {
                1
            };
            (0..parts).map(move |p| {
                if parts == 1 {
                    return t;
                }
                Task {
                    from: ctx * p / parts,
                    to: ctx * (p + 1) / parts,
                    ..t
                }
            })
        })
        .collect()
}

/// `q`: `[tokens, heads * head_dim]`; `plan` made from the same `seqs`.
pub(crate) fn fast_cpu(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    plan: &FastCpuPlan,
) -> Result<Tensor> {
    let (n_tokens, width) = q.dims2()?;
    let q = q.contiguous()?;
    let out = with_cpu_slice(&q, |qs| {
        fast_cpu_rows(qs, width, k_cache, v_cache, seqs, plan)
    })??;
    Ok(Tensor::from_vec(out, (n_tokens, width), q.device())?)
}

/// `fast_cpu` on query rows `q_stride` apart in `qs` (the heads first in each row); returns
/// `[tokens, heads * head_dim]`.
pub(crate) fn fast_cpu_rows(
    qs: &[f32],
    q_stride: usize,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    plan: &FastCpuPlan,
) -> Result<Vec<f32>> {
    let (n_tokens, d) = (plan.n_tokens, plan.dims);
    let (h, hd) = (d.num_heads, d.head_dim);
    let group = h / d.num_kv_heads;
    if q_stride < h * hd || qs.len() < n_tokens * q_stride {
        return Err(EngineError::InvalidBatch(format!(
            "attention needs {n_tokens} query rows of {} values, {q_stride} apart",
            h * hd
        )));
    }
    let job = Job {
        seqs,
        plan,
        q_stride,
        isa: Isa::best(),
    };
    let outs = match k_cache.dtype() {
        DType::F16 => with_cpu_slice_of::<half::f16, _>(k_cache, |ks| {
            with_cpu_slice_of::<half::f16, _>(v_cache, |vs| job.run(qs, ks, vs))
        })??,
        _ => with_cpu_slice_of::<f32, _>(k_cache, |ks| {
            with_cpu_slice_of::<f32, _>(v_cache, |vs| job.run(qs, ks, vs))
        })??,
    };
    let tasks = &plan.tasks;
    let mut out = vec![0f32; n_tokens * h * hd];
    let mut i = 0;
    while i < tasks.len() {
        let t = tasks[i];
        // The parts of one tile are consecutive tasks.
        let mut j = i + 1;
        while j < tasks.len()
            && (tasks[j].seq, tasks[j].kv_head, tasks[j].t0) == (t.seq, t.kv_head, t.t0)
        {
            j += 1;
        }
        for (k, tok) in (t.t0..t.t0 + t.tokens).enumerate() {
            let at = (seqs[t.seq].q_start + tok) * h * hd + t.kv_head * group * hd;
            for r in 0..group {
                let row = k * group + r;
                let dst = &mut out[at + r * hd..at + (r + 1) * hd];
                if j == i + 1 {
                    dst.copy_from_slice(&outs[i].0[row * hd..(row + 1) * hd]);
                } else {
                    let parts: Vec<(&[f32], (f32, f32))> = outs[i..j]
                        .iter()
                        .map(|(o, st)| (&o[row * hd..(row + 1) * hd], st[row]))
                        .collect();
                    merge_parts(&parts, dst);
                }
            }
        }
        i = j;
    }
    Ok(out)
}

/// What the generic path derives from a step's sequences, the same for every layer: each
/// sequence's slot ids (the gather index into the cache) and, for a chunk of several tokens, its
/// causal mask, on the device once a step instead of once a layer.
pub(crate) struct GenericPlan {
    /// Per sequence: `[ctx]` u32 slots, and `[1, q_len, ctx]` additive mask (`None` for one
    /// token, which sees every position).
    seqs: Vec<(Tensor, Option<Tensor>)>,
}

impl GenericPlan {
    pub(crate) fn new(seqs: &[SeqMeta], block_size: usize, device: &Device) -> Result<Self> {
        let mut out = Vec::with_capacity(seqs.len());
        for s in seqs {
            let ctx = s.context_len();
            let slots: Vec<u32> = (0..ctx)
                .map(|p| slot_of(&s.block_table, p, block_size) as u32)
                .collect();
            let idx = Tensor::from_vec(slots, ctx, device)?;
            // Causal: row j (position start_pos + j) sees positions 0..=start_pos + j.
            let mask = (s.q_len > 1)
                .then(|| {
                    let mask: Vec<f32> = (0..s.q_len)
                        .flat_map(|j| {
                            (0..ctx).map(move |p| {
                                if p <= s.start_pos + j {
                                    0.0
                                } else {
                                    f32::NEG_INFINITY
                                }
                            })
                        })
                        .collect();
                    Tensor::from_vec(mask, (1, s.q_len, ctx), device)
                })
                .transpose()?;
            out.push((idx, mask));
        }
        Ok(GenericPlan { seqs: out })
    }
}

pub(crate) fn generic(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    d: AttnDims,
    plan: &GenericPlan,
) -> Result<Tensor> {
    let (h, kvh, hd) = (d.num_heads, d.num_kv_heads, d.head_dim);
    let group = h / kvh;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut outs = Vec::with_capacity(seqs.len());
    for (s, (idx, mask)) in seqs.iter().zip(&plan.seqs) {
        let ctx = s.context_len();
        // [ctx, kvh, hd] -> [kvh, ctx, hd] -> [kvh, group, ctx, hd] -> [h, ctx, hd]
        let expand = |cache: &Tensor| -> candle_core::Result<Tensor> {
            cache
                .index_select(idx, 0)?
                .to_dtype(DType::F32)?
                .reshape((ctx, kvh, hd))?
                .transpose(0, 1)?
                .unsqueeze(1)?
                .expand((kvh, group, ctx, hd))?
                .reshape((h, ctx, hd))
        };
        let k = expand(k_cache)?;
        let v = expand(v_cache)?;
        let qs = q
            .narrow(0, s.q_start, s.q_len)?
            .reshape((s.q_len, h, hd))?
            .transpose(0, 1)?
            .contiguous()?; // [h, q_len, hd]
        let mut scores = (qs.matmul(&k.t()?)? * scale)?; // [h, q_len, ctx]
        if let Some(mask) = mask {
            scores = scores.broadcast_add(mask)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = probs.matmul(&v)?; // [h, q_len, hd]
        outs.push(o.transpose(0, 1)?.reshape((s.q_len, h * hd))?);
    }
    let out = Tensor::cat(&outs, 0)?;
    debug_assert_eq!(out.dtype(), DType::F32);
    Ok(out)
}

/// Picks the implementation for a device and a request (`auto` = fast on CPU).
pub fn choose(device: &Device, requested: Option<AttentionImpl>) -> Result<AttentionImpl> {
    match (requested, device.is_cpu()) {
        (Some(AttentionImpl::FastCpu), false) => Err(EngineError::InvalidSetting {
            key: "engine.attention".into(),
            value: "\"fast\"".into(),
            allowed: "the fast attention kernel runs on CPU only; use \"auto\" or \"generic\""
                .into(),
        }),
        (Some(imp), _) => Ok(imp),
        (None, true) => Ok(AttentionImpl::FastCpu),
        (None, false) => Ok(AttentionImpl::Generic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(q_len: usize, start_pos: usize) -> SeqMeta {
        SeqMeta {
            q_start: 0,
            q_len,
            start_pos,
            block_table: Vec::new(),
        }
    }

    /// Positions `from..to` of each tile's parts, in task order.
    fn spans(tasks: &[Task]) -> Vec<(usize, usize, usize)> {
        tasks.iter().map(|t| (t.kv_head, t.from, t.to)).collect()
    }

    #[test]
    fn one_decoding_sequence_is_cut_into_parts_for_idle_threads() {
        // Three KV heads on two threads: each head's 300 positions in two parts.
        let t = plan_tasks(&[seq(1, 299)], 3, 3, 2);
        assert_eq!(
            spans(&t),
            vec![
                (0, 0, 150),
                (0, 150, 300),
                (1, 0, 150),
                (1, 150, 300),
                (2, 0, 150),
                (2, 150, 300)
            ]
        );
        // Too short to cut: MIN_PART positions a part at least.
        let t = plan_tasks(&[seq(1, 100)], 3, 3, 2);
        assert!(t.iter().all(|t| t.from == 0 && t.to == usize::MAX));
        // Enough tasks already (four sequences): nothing is cut.
        let t = plan_tasks(
            &[seq(1, 999), seq(1, 999), seq(1, 999), seq(1, 999)],
            3,
            3,
            2,
        );
        assert_eq!(t.len(), 12);
        assert!(t.iter().all(|t| t.from == 0 && t.to == usize::MAX));
        // A prefill chunk's tiles are never cut.
        let t = plan_tasks(&[seq(5, 900)], 1, 3, 2);
        assert!(t.iter().all(|t| t.from == 0 && t.to == usize::MAX));
    }
}
