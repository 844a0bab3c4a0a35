//! Attention over the paged KV cache for a flat step batch: causal within a sequence, never across
//! sequences, each sequence reading its history through its block table.
//!
//! Two implementations of the same function:
//! - `fast_cpu`: reads the cache tensors as slices and runs one task per (sequence, KV head, tile of
//!   up to `TILE_ROWS` query rows) on the rayon pool, each through `kernels::attn` (the query heads
//!   of a GQA group, and of several tokens of a prefill chunk, share each load of K and V); on CPUs
//!   with AMX and an F16 or Q8 cache, a sequence with many query rows (a prefill chunk) runs on
//!   the tile units instead
//!   (`kernels::attn_amx`: each of its KV heads packed once a layer, tiles of `TASK_ROWS`), and on
//!   other CPUs with AVX2 on F32 register tiles over blocks of positions (`kernels::attn_flash`,
//!   the same tiles, each converting its blocks itself; bf16 dot products with AVX-512 BF16 and an
//!   F16 or Q8 cache, rounded as the tile units round). Written
//!   by hand because candle has no paged attention on CPU and gathering blocks into a fresh tensor
//!   per sequence per layer costs more than the attention itself at decode time.
//! - `generic`: gathers the sequences' slots with `index_select` and runs standard masked
//!   attention with candle ops, so it runs on any device (CUDA): the cache stays where it is and
//!   only the gather indices and masks (`GenericPlan`, once a step) travel to it. A step's decodes
//!   are one padded group, so a layer's attention is a few batched ops however many sequences
//!   decode. Tests compare the two on CPU.

use candle_core::{DType, Device, Tensor};

use crate::model::team::{self, SharedMut};

use crate::error::{EngineError, Result};
use crate::kv_cache::{slot_of, LayerKv, Written};
use crate::model::batch::SeqMeta;
use crate::model::kernels::attn::{
    attend, attend_heads, heads_kernel, merge_parts, Heads, KvElem, Tile,
};
use crate::model::kernels::attn_amx::{self, Packed};
use crate::model::kernels::attn_flash;
use crate::model::kernels::cpu::{Amx, Isa};
use crate::model::kernels::{with_cpu_slice, with_cpu_slice_of};
use crate::model::tile_packs::{self, PackStore, SeqPacks};

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

/// `q`: `[tokens, heads*head_dim]` (RoPE applied); `kv`: a layer's cache (`[slots,
/// kv_heads*head_dim]`) already holding this step's keys and values. Returns
/// `[tokens, heads*head_dim]`.
pub fn paged_attention(
    imp: AttentionImpl,
    q: &Tensor,
    kv: &LayerKv,
    seqs: &[SeqMeta],
    dims: AttnDims,
) -> Result<Tensor> {
    match imp {
        AttentionImpl::FastCpu => {
            fast_cpu(q, kv, seqs, &FastCpuPlan::new(seqs, dims, kv.k.dtype()))
        }
        AttentionImpl::Generic => {
            let plan = GenericPlan::new(seqs, dims, q.device())?;
            generic(q, kv, dims, &plan)
        }
    }
}

/// One task of a `fast_cpu` call: a tile of consecutive tokens' GQA rows of one sequence and
/// `heads` KV heads from `kv_head` (several only for a decode row, `plan_tasks`' `heads_together`),
/// over positions `from..` the rows' own ends, cut at `to`.
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    heads: usize,
    /// One token's rows over all KV heads, on `attn::attend_heads`.
    together: bool,
    t0: usize,
    tokens: usize,
    from: usize,
    to: usize,
}

/// What the CPU fast path derives from a step's sequences, the same for every layer: each
/// sequence's cache row offsets and the task list. The model builds it once per step.
pub(crate) struct FastCpuPlan {
    /// The kernels' level (`Isa::best()` but in tests).
    isa: Isa,
    dims: AttnDims,
    n_tokens: usize,
    /// Each sequence's cache row offsets by position: looking the slot up per position and head (a
    /// division by the block size each time) cost more than the arithmetic it fed.
    seq_rows: Vec<Vec<usize>>,
    tasks: Vec<Task>,
    /// The tile units, when this CPU has them and they take this head size.
    amx: Option<Amx>,
    /// Per sequence, which of `packs` is its when its rows run on the tile units (`attn_amx`: a
    /// prompt's run, never a reply's decode, of at least `MIN_TOKENS` tokens and `MIN_ROWS`
    /// query rows a KV head).
    tiled: Vec<Option<usize>>,
    /// Whose each of `packs` is (a sequence).
    pack_owners: Vec<usize>,
    /// Without tile units, the kernel for a prompt's runs (`attn_flash`, on AVX2 or AVX-512), and per
    /// sequence whether its rows take it (as `tiled` would: a prompt's run of `MIN_TOKENS` tokens
    /// and `MIN_ROWS` rows a KV head at least).
    flash: Option<attn_flash::Width>,
    blocked: Vec<bool>,
    /// The packed positions of each tiled sequence's KV heads (`tile_packs`: kept per layer and
    /// across steps for a prompt that goes on, else one layer's, packed again by every layer).
    packs: std::sync::Mutex<Vec<SeqPacks>>,
}

impl FastCpuPlan {
    /// `cache`: the type the cache stores K and V in. Prompt runs may run on the tile units (bf16)
    /// where the CPU has them, except over an F32 cache: the exact setting, whose attention stays
    /// in F32.
    pub(crate) fn new(seqs: &[SeqMeta], d: AttnDims, cache: DType) -> Self {
        Self::at_level(seqs, d, cache, Isa::best())
    }

    /// `new` with the kernels of level `isa` (tests run each level this CPU has).
    fn at_level(seqs: &[SeqMeta], d: AttnDims, cache: DType, isa: Isa) -> Self {
        let tiles = cache != DType::F32;
        let kv_dim = d.num_kv_heads * d.head_dim;
        let group = d.num_heads / d.num_kv_heads;
        let amx = (isa.amx()).filter(|_| tiles && attn_amx::supports(d.head_dim));
        // Asked only where the tile units do not take prompts: `Width::of` may time the bf16 form.
        let flash = (isa.amx().is_none() && attn_flash::supports(d.head_dim))
            .then(|| attn_flash::Width::of(isa, !tiles))
            .flatten();
        let per_seq: Vec<bool> = seqs
            .iter()
            .map(|s| {
                let rows = s.q_len * group;
                (amx.is_some() || flash.is_some())
                    && !s.exact
                    && s.q_len >= attn_amx::MIN_TOKENS
                    && rows >= attn_amx::MIN_ROWS
            })
            .collect();
        let pack_owners: Vec<usize> = (0..seqs.len())
            .filter(|&i| per_seq[i] && amx.is_some())
            .collect();
        // A one-token row runs as one task over all its KV heads (`attn::attend_heads`, which
        // reads each cache row's heads side by side) where the kernel for it pays here
        // (`attn::heads_kernel`: an F32 or F16 cache on AVX2 or AVX-512).
        let heads_together = match cache {
            DType::F16 => heads_kernel::<half::f16>(isa, d.head_dim),
            DType::F32 => heads_kernel::<f32>(isa, d.head_dim),
            _ => false,
        };
        let mut tiled = vec![None; seqs.len()];
        for (at, &si) in pack_owners.iter().enumerate() {
            tiled[si] = Some(at);
        }
        FastCpuPlan {
            isa,
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
            tasks: plan_tasks_cut(
                seqs,
                d.num_kv_heads,
                group,
                team::size(),
                &per_seq,
                heads_together,
                flash.is_some(),
            ),
            amx,
            tiled,
            flash,
            blocked: per_seq,
            packs: std::sync::Mutex::new(
                (0..pack_owners.len())
                    .map(|_| SeqPacks::for_the_step())
                    .collect(),
            ),
            pack_owners,
        }
    }

    /// Takes from `store` the packs kept for the tiled sequences, and packs to keep for those
    /// whose prompt goes on in a later step (`SeqMeta::more`; at most `tile_packs::KEEP`, the
    /// longest contexts): their layers keep their packs, and `put_packs` hands those that go
    /// on back after the step. A prompt's last chunk uses its kept packs, if any, and drops them.
    pub(crate) fn take_packs(&self, seqs: &[SeqMeta], store: &mut PackStore) {
        let owner = |at: usize| &seqs[self.pack_owners[at]];
        let mut going_on: Vec<usize> = (0..self.pack_owners.len())
            .filter(|&at| owner(at).more)
            .collect();
        going_on.sort_by_key(|&at| std::cmp::Reverse(owner(at).context_len()));
        going_on.truncate(tile_packs::KEEP);
        let mut wanted: Vec<usize> = going_on.clone();
        wanted.extend((0..self.pack_owners.len()).filter(|&at| !owner(at).more));
        let tables: Vec<(&[u32], bool)> = (wanted.iter())
            .map(|&at| (&owner(at).block_table[..], owner(at).more))
            .collect();
        let mut packs = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        for (at, p) in wanted.into_iter().zip(store.take(&tables)) {
            packs[at] = p;
        }
    }

    /// Hands the packs kept per layer back to `store` for the next step.
    pub(crate) fn put_packs(&self, store: &mut PackStore) {
        let mut packs = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        store.put(std::mem::take(&mut *packs));
    }
}

/// What every task of one `fast_cpu` call shares.
struct Job<'a> {
    seqs: &'a [SeqMeta],
    plan: &'a FastCpuPlan,
    /// Distance between query rows in `qs` (Q may sit inside wider rows, as in a stacked QKV output).
    q_stride: usize,
    isa: Isa,
    /// The layer's write stamps (which of the kept packs still hold).
    written: Option<&'a Written>,
    /// Per task, whether it is its tile's only part (`alone`).
    alone: &'a [bool],
}

/// A task's output rows and each row's softmax statistics: empty for a task that is its tile's
/// only part, which writes its rows into the step's output itself.
type TaskOut = (Vec<f32>, Vec<(f32, f32)>);

/// Whether each task is its tile's only part (the parts of one tile are consecutive tasks).
fn alone(tasks: &[Task]) -> Vec<bool> {
    let key = |t: &Task| (t.seq, t.kv_head, t.t0);
    (0..tasks.len())
        .map(|i| {
            let same = |j: Option<usize>| {
                j.and_then(|j| tasks.get(j))
                    .is_some_and(|u| key(u) == key(&tasks[i]))
            };
            !same(i.checked_sub(1)) && !same(Some(i + 1))
        })
        .collect()
}

/// A Q8 cache layer's K and V scales, `[slots, kv_heads]`.
type Scales<'a> = Option<(&'a [half::f16], &'a [half::f16])>;

impl Job<'_> {
    /// Runs every task: a tile's only part writes its rows into `out` (`[tokens, heads * d]`);
    /// returns each task's output, in task order (empty for those).
    fn run<T: KvElem>(
        &self,
        qs: &[f32],
        ks: &[T],
        vs: &[T],
        scales: Scales,
        out: &mut [f32],
    ) -> Vec<TaskOut> {
        let d = self.plan.dims;
        let (hd, group) = (d.head_dim, d.num_heads / d.num_kv_heads);
        let mut packs = self.plan.packs.lock().unwrap_or_else(|e| e.into_inner());
        let layer = self.written.map_or(0, |w| w.layer);
        if let Some(amx) = self.plan.amx {
            // Each tiled sequence's KV heads packed once for all of its tasks: the positions
            // its kept packs do not hold.
            let mut work = Vec::new();
            for (p, &si) in packs.iter_mut().zip(&self.plan.pack_owners) {
                let s = &self.seqs[si];
                let n = s.start_pos + s.q_len;
                let l = p.layer(layer, d.num_kv_heads);
                let keep = l.kept(&s.block_table, self.written);
                l.record(&s.block_table, n, self.written);
                for (h, pack) in l.heads.iter_mut().enumerate() {
                    work.push((pack, si, h, keep, n));
                }
            }
            team::chunks_mut(&mut work, 1, 1, |_, w| {
                let (p, si, h, keep, n) = &mut w[0];
                let (si, h, keep, n) = (*si, *h, *keep, *n);
                p.pack_from(
                    amx,
                    keep,
                    n,
                    &self.plan.seq_rows[si],
                    &ks[h * hd..],
                    &vs[h * hd..],
                    hd,
                    scales.map(|(k, v)| (&k[h..], &v[h..])),
                );
            });
        }
        let packs: Vec<&[Packed]> = packs.iter().map(|p| p.heads(layer)).collect();
        // The step's output, written by the tasks in parallel: each task that is its tile's
        // only part writes its own (token, KV head) rows, which no other task writes.
        let (dst, len) = (SharedMut(out.as_mut_ptr()), out.len());
        let width = d.num_heads * hd;
        // Each task its own job, so an idle thread takes the next task rather than waiting on a
        // half of the list: a step's prompt tasks come first and are each many decode tasks'
        // work (2 turns of 27 tokens beside 8 decodes at the AVX2 level: 71 against 59 ms a step
        // with rayon's default split).
        team::map(self.plan.tasks.len(), |i| {
            let (t, alone) = (&self.plan.tasks[i], self.alone[i]);
            let (o, stats) = self.task(t, qs, ks, vs, scales, &packs);
            if !alone {
                return (o, stats);
            }
            let (dst, s) = (&dst, &self.seqs[t.seq]);
            let n = group * t.heads * hd;
            for (k, tok) in (t.t0..t.t0 + t.tokens).enumerate() {
                let at = (s.q_start + tok) * width + t.kv_head * group * hd;
                assert!(at + n <= len, "a task's rows lie inside the output");
                // SAFETY: inside `out` (checked); no other task writes these rows (above).
                unsafe { std::ptr::copy_nonoverlapping(o[k * n..].as_ptr(), dst.0.add(at), n) };
            }
            (Vec::new(), Vec::new())
        })
    }

    /// One task's output rows and their softmax statistics.
    fn task<T: KvElem>(
        &self,
        t: &Task,
        qs: &[f32],
        ks: &[T],
        vs: &[T],
        scales: Scales,
        packs: &[&[Packed]],
    ) -> TaskOut {
        let d = self.plan.dims;
        let (hd, group) = (d.head_dim, d.num_heads / d.num_kv_heads);
        let scale = 1.0 / (hd as f32).sqrt();
        let s = &self.seqs[t.seq];
        let rows = group * t.heads;
        let mut qt = Vec::with_capacity(t.tokens * rows * hd);
        let mut ctx = Vec::with_capacity(t.tokens * rows);
        for i in t.t0..t.t0 + t.tokens {
            let row = (s.q_start + i) * self.q_stride + t.kv_head * group * hd;
            qt.extend(qs[row..row + rows * hd].iter().map(|x| x * scale));
            ctx.extend(std::iter::repeat_n((s.start_pos + i + 1).min(t.to), rows));
        }
        let mut o = vec![0f32; qt.len()];
        if t.together {
            let heads = Heads {
                q: &qt,
                group,
                heads: t.heads,
                from: t.from,
                ctx: ctx[0],
                rows: &self.plan.seq_rows[t.seq],
                k: &ks[t.kv_head * hd..],
                v: &vs[t.kv_head * hd..],
                d: hd,
                scales: scales.map(|(k, v)| (&k[t.kv_head..], &v[t.kv_head..])),
            };
            let stats = attend_heads(self.isa, &heads, &mut o);
            return (o, stats);
        }
        let whole = t.from == 0 && t.to == usize::MAX;
        if let (Some(amx), Some(at), true) = (self.plan.amx, self.plan.tiled[t.seq], whole) {
            let stats = attn_amx::tile(amx, &qt, &ctx, &packs[at][t.kv_head], &mut o);
            return (o, stats);
        }
        let tile = Tile {
            q: &qt,
            from: t.from,
            ctx: &ctx,
            rows: &self.plan.seq_rows[t.seq],
            k: &ks[t.kv_head * hd..],
            v: &vs[t.kv_head * hd..],
            d: hd,
            scales: scales.map(|(k, v)| (&k[t.kv_head..], &v[t.kv_head..])),
        };
        // All of a run's positions, or a part of them (`tiled_cut`).
        if let (Some(width), true) = (self.plan.flash, self.plan.blocked[t.seq]) {
            let stats = attn_flash::tile(width, &tile, &mut o);
            return (o, stats);
        }
        let stats = attend(self.isa, &tile, &mut o);
        (o, stats)
    }
}

/// Query rows a `fast_cpu` task aims for: with a GQA group of 3, 8 tokens of a prefill chunk, so
/// each block of keys and values is loaded once for 24 rows; a decode step's task is one token.
const TILE_ROWS: usize = 24;

/// The fewest positions a part of a decode row's history gets. A decode row is cut into up to
/// two parts a thread, so that one sequence keeps every thread busy (one task a decode row left
/// one of two threads idle: 5.9 against 3.8 ms a step at context 1,500), whatever else the step
/// holds: the cut must not depend on the other rows (`plan_tasks`). Each part costs a task and a
/// merge: with 64-position parts, 16 decodes at context 138 took 71 us a layer against 55 in
/// one part each, and a lone decode there 8.2 against 5.9 us (`docs/performance.md`).
const MIN_PART: usize = 256;

/// Tasks for a step: tiles of up to `TILE_ROWS` rows (for a sequence whose rows run on the tile
/// units or on `attn_flash`, `tiled`, up to `attn_amx::TASK_ROWS` spread by `tiled_tokens`), one
/// KV head each, except with `heads_together` a
/// one-token sequence's row and each token of a reply's decode with drafts (`SeqMeta::exact`):
/// one task for all its KV heads; a decode with drafts, a token a task either way. Each decode
/// row's positions are cut into parts (merged after with `merge_parts`) by its history's length
/// alone.
#[cfg(test)]
fn plan_tasks(
    seqs: &[SeqMeta],
    kvh: usize,
    group: usize,
    threads: usize,
    tiled: &[bool],
    heads_together: bool,
) -> Vec<Task> {
    plan_tasks_cut(seqs, kvh, group, threads, tiled, heads_together, false)
}

/// `plan_tasks`; with `history_parts` (where `attn_flash` runs the tiled runs) a tiled run after a
/// long history may also be cut into parts of its positions (`tiled_cut`).
fn plan_tasks_cut(
    seqs: &[SeqMeta],
    kvh: usize,
    group: usize,
    threads: usize,
    tiled: &[bool],
    heads_together: bool,
    history_parts: bool,
) -> Vec<Task> {
    let base: Vec<Task> = seqs
        .iter()
        .enumerate()
        .flat_map(|(si, s)| {
            let rows = if tiled[si] {
                attn_amx::TASK_ROWS
            } else {
                TILE_ROWS
            };
            // A reply's decode with drafts runs token by token, each as its plain decode runs:
            // speculation must not change a reply.
            let together = heads_together && !tiled[si] && (s.q_len == 1 || s.exact);
            let (per_task, step, heads, parts) = match (together, s.exact) {
                (true, _) => (1, kvh, kvh, 1),
                (false, true) => (1, 1, 1, 1),
                (false, false) if tiled[si] => {
                    let (tokens, parts) = tiled_cut(s, rows / group, kvh, threads, history_parts);
                    (tokens, 1, 1, parts)
                }
                (false, false) => ((rows / group).max(1), 1, 1, 1),
            };
            let h = s.start_pos;
            (0..kvh).step_by(step).flat_map(move |g| {
                (0..s.q_len).step_by(per_task).flat_map(move |t0| {
                    (0..parts).map(move |p| Task {
                        seq: si,
                        kv_head: g,
                        heads,
                        together,
                        t0,
                        tokens: per_task.min(s.q_len - t0),
                        // A part of the history; the last part the rest and the run's own.
                        from: if parts == 1 { 0 } else { h * p / parts },
                        to: if p + 1 == parts {
                            usize::MAX
                        } else {
                            h * (p + 1) / parts
                        },
                    })
                })
            })
        })
        .collect();
    if threads < 2 {
        return base;
    }
    base.into_iter()
        .flat_map(|t| {
            // Only one-token tiles (decode rows) are cut: a chunk's rows end at different
            // positions. The cut depends on the row's history alone, never on the rest of the
            // step: a row rounds the same beside any other rows, and with drafts or without.
            // A power of two, so the parts spread evenly over two threads (three parts of a
            // lone decode at context 1,000 took 1.3x four).
            let ctx = seqs[t.seq].start_pos + t.t0 + 1;
            let parts = if t.tokens == 1 {
                prev_power_of_two((ctx / MIN_PART).clamp(1, 2 * threads))
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

/// How a tiled prompt run is cut into tasks: (tokens a task, parts of the positions a task of
/// them covers). With `history_parts` (`attn_flash`), after a history of at least `MIN_PART`
/// positions a part, a run whose tiles of up to `most` tokens are not a multiple of the threads'
/// tasks keeps them whole and cuts its positions into as many parts as make them one: each task
/// converts only its part's keys and values, for all its rows. Else its tokens are spread
/// (`tiled_tokens`). A 10-token chunk after 5,500 positions: 3 KV heads x 2 parts of 30 rows
/// instead of 6 tasks of 15 rows each converting the whole history (docs/performance.md, "A
/// short chunk's attention on every thread"). A function of the run alone.
fn tiled_cut(
    s: &SeqMeta,
    most: usize,
    kvh: usize,
    threads: usize,
    history_parts: bool,
) -> (usize, usize) {
    let tiles = s.q_len.div_ceil(most.max(1)).max(1);
    if history_parts && threads > 1 {
        let mut parts = 1;
        while !(kvh * tiles * parts).is_multiple_of(threads) && parts < threads {
            parts += 1;
        }
        if parts > 1 && s.start_pos >= parts * MIN_PART {
            return (s.q_len.div_ceil(tiles), parts);
        }
    }
    (tiled_tokens(s.q_len, most, kvh, threads), 1)
}

/// Tokens a task of a tiled prompt run (`attn_amx`, `attn_flash`) takes: at most `most`, spread
/// evenly over as many tasks a KV head as make the run's tasks a multiple of the threads where
/// the run has the tokens (two a task at least). With 32 a task, a long prompt's chunk of 30 tokens beside streams was
/// one task a KV head, 3 tasks on 2 threads: one idle for a third of the run's attention
/// (docs/performance.md, "A short chunk's attention on every thread"). A function of the run's
/// length alone, so a run's rows are cut the same beside any other rows; the kernels compute
/// each row the same whichever rows share its task.
fn tiled_tokens(q_len: usize, most: usize, kvh: usize, threads: usize) -> usize {
    let mut tiles = q_len.div_ceil(most.max(1)).max(1);
    // Two tokens a task at least: a one-token task is a decode row's, cut into parts elsewhere.
    while threads > 1 && !(kvh * tiles).is_multiple_of(threads) && tiles < q_len / 2 {
        tiles += 1;
    }
    q_len.div_ceil(tiles).max(1)
}

/// The largest power of two at most `n` (`n >= 1`).
fn prev_power_of_two(n: usize) -> usize {
    1 << n.ilog2()
}

/// `q`: `[tokens, heads * head_dim]`; `plan` made from the same `seqs`.
pub(crate) fn fast_cpu(
    q: &Tensor,
    kv: &LayerKv,
    seqs: &[SeqMeta],
    plan: &FastCpuPlan,
) -> Result<Tensor> {
    let (n_tokens, width) = q.dims2()?;
    let q = q.contiguous()?;
    let out = with_cpu_slice(&q, |qs| fast_cpu_rows(qs, width, kv, seqs, plan))??;
    Ok(Tensor::from_vec(out, (n_tokens, width), q.device())?)
}

/// `fast_cpu` on query rows `q_stride` apart in `qs` (the heads first in each row); returns
/// `[tokens, heads * head_dim]`.
pub(crate) fn fast_cpu_rows(
    qs: &[f32],
    q_stride: usize,
    kv: &LayerKv,
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
    let alone = alone(&plan.tasks);
    let job = Job {
        seqs,
        plan,
        q_stride,
        isa: plan.isa,
        written: kv.written.as_ref(),
        alone: &alone,
    };
    let (kc, vc) = (&kv.k, &kv.v);
    // A prompt's rows (a 512-token prompt's are over a megabyte) zeroed by the pool, not by one
    // thread; a few decode rows by the caller (waking the pool for them cost more than zeroing).
    const POOL_ZEROES: usize = 1 << 16;
    let len = n_tokens * h * hd;
    let mut out = Vec::with_capacity(len);
    if len >= POOL_ZEROES {
        let spare = &mut out.spare_capacity_mut()[..len];
        team::chunks_mut(spare, POOL_ZEROES / 4, 1, |_, c| {
            c.fill(std::mem::MaybeUninit::new(0.0))
        });
        // SAFETY: the tasks above wrote all `len` values.
        unsafe { out.set_len(len) };
    } else {
        out.resize(len, 0f32);
    }
    let o = &mut out;
    let outs = match (kc.dtype(), &kv.scales) {
        (DType::F16, None) => with_cpu_slice_of::<half::f16, _>(kc, |ks| {
            with_cpu_slice_of::<half::f16, _>(vc, |vs| job.run(qs, ks, vs, None, o))
        })??,
        (DType::F32, None) => with_cpu_slice_of::<f32, _>(kc, |ks| {
            with_cpu_slice_of::<f32, _>(vc, |vs| job.run(qs, ks, vs, None, o))
        })??,
        (DType::U8, Some((kss, vss))) => with_cpu_slice_of::<u8, _>(kc, |ks| {
            with_cpu_slice_of::<u8, _>(vc, |vs| {
                with_cpu_slice_of::<half::f16, _>(kss, |ksc| {
                    with_cpu_slice_of::<half::f16, _>(vss, |vsc| {
                        job.run(qs, ks, vs, Some((ksc, vsc)), o)
                    })
                })
            })
        })????,
        (dtype, _) => {
            return Err(EngineError::KvCache(format!(
                "the CPU attention reads F32, F16 or Q8 caches, not {dtype:?}"
            )))
        }
    };
    let tasks = &plan.tasks;
    let mut i = 0;
    while i < tasks.len() {
        let t = tasks[i];
        // A tile's only part wrote its rows itself; the parts of one tile (consecutive tasks)
        // are merged here.
        if alone[i] {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < tasks.len()
            && (tasks[j].seq, tasks[j].kv_head, tasks[j].t0) == (t.seq, t.kv_head, t.t0)
        {
            j += 1;
        }
        for (k, tok) in (t.t0..t.t0 + t.tokens).enumerate() {
            let rows = group * t.heads;
            let at = (seqs[t.seq].q_start + tok) * h * hd + t.kv_head * group * hd;
            for r in 0..rows {
                let row = k * rows + r;
                let dst = &mut out[at + r * hd..at + (r + 1) * hd];
                let parts: Vec<(&[f32], (f32, f32))> = outs[i..j]
                    .iter()
                    .map(|(o, st)| (&o[row * hd..(row + 1) * hd], st[row]))
                    .collect();
                merge_parts(&parts, dst);
            }
        }
        i = j;
    }
    Ok(out)
}

/// What the generic path derives from a step's sequences, the same for every layer, on the device
/// once a step instead of once a layer: the step's one-token rows (decodes) in groups, each padded
/// to the longest of its histories, so that a layer's attention over many decodes is a handful of
/// batched ops (on a GPU each op is a kernel launch, and one group per sequence made the launches
/// grow with the batch); each chunk of several tokens as a group of its own.
pub(crate) struct GenericPlan {
    groups: Vec<Group>,
    /// Where each of the step's rows sits in the groups' outputs, concatenated (`None`: in order
    /// already, as when decodes come first).
    order: Option<Tensor>,
}

/// Where a group's query rows sit in the step.
enum Rows {
    /// Consecutive, from this row.
    From(usize),
    /// Anywhere: `[n * q_len]` u32 row ids.
    At(Tensor),
}

/// Sequences attended together: `n` of them, `q_len` rows each, histories padded to `ctx`.
struct Group {
    n: usize,
    q_len: usize,
    ctx: usize,
    rows: Rows,
    /// `[n * ctx]` u32 cache slots; a sequence's padding repeats its position 0's slot (written,
    /// so finite) and the mask hides it.
    slots: Tensor,
    /// `[n, 1, q_len, 1, ctx]` additive: causal within a chunk, and the padding (`None`: nothing
    /// to hide, one row each over equal histories).
    mask: Option<Tensor>,
}

impl Group {
    fn new(seqs: &[&SeqMeta], block_size: usize, device: &Device) -> Result<Self> {
        let (n, q_len) = (seqs.len(), seqs[0].q_len);
        debug_assert!(seqs.iter().all(|s| s.q_len == q_len));
        let ctx = seqs.iter().map(|s| s.context_len()).max().unwrap_or(0);
        let mut slots = Vec::with_capacity(n * ctx);
        for s in seqs {
            let (own, first) = (
                s.context_len(),
                slot_of(&s.block_table, 0, block_size) as u32,
            );
            slots.extend((0..ctx).map(|p| {
                if p < own {
                    slot_of(&s.block_table, p, block_size) as u32
                } else {
                    first
                }
            }));
        }
        // Nothing to hide when every row sees its group's whole padded history: one row each
        // over equal histories.
        let masked = q_len > 1 || seqs.iter().any(|s| s.context_len() < ctx);
        let mask = masked.then(|| {
            // Row j (position start_pos + j) sees positions 0..=start_pos + j.
            let mut mask = Vec::with_capacity(n * q_len * ctx);
            for s in seqs {
                for j in 0..q_len {
                    mask.extend((0..ctx).map(|p| {
                        if p <= s.start_pos + j {
                            0.0f32
                        } else {
                            f32::NEG_INFINITY
                        }
                    }));
                }
            }
            mask
        });
        let starts: Vec<u32> = seqs
            .iter()
            .flat_map(|s| (s.q_start..s.q_start + q_len).map(|r| r as u32))
            .collect();
        let consecutive = starts.windows(2).all(|w| w[1] == w[0] + 1);
        Ok(Group {
            n,
            q_len,
            ctx,
            rows: if consecutive {
                Rows::From(starts[0] as usize)
            } else {
                Rows::At(Tensor::from_vec(starts, n * q_len, device)?)
            },
            slots: Tensor::from_vec(slots, n * ctx, device)?,
            mask: mask
                .map(|m| Tensor::from_vec(m, (n, 1, q_len, 1, ctx), device))
                .transpose()?,
        })
    }

    /// The group's attention: `[n * q_len, heads * head_dim]`.
    fn attend(&self, q: &Tensor, kv: &LayerKv, d: AttnDims) -> Result<Tensor> {
        let (n, ql, c) = (self.n, self.q_len, self.ctx);
        let (h, kvh, hd) = (d.num_heads, d.num_kv_heads, d.head_dim);
        let group = h / kvh;
        let q = match &self.rows {
            Rows::From(first) => q.narrow(0, *first, n * ql)?,
            Rows::At(rows) => q.index_select(rows, 0)?,
        };
        // Query head i reads KV head i / group: [n, ql, kvh, group, hd] -> [n * kvh, ql * group, hd],
        // so the heads of a GQA group share their K and V without copies.
        let q = (q.reshape((n, ql, kvh, group, hd))?.transpose(1, 2)?
            * (1.0 / (hd as f64).sqrt()))?
        .reshape((n * kvh, ql * group, hd))?;
        // [n * ctx, kvh * hd] -> [n, kvh, ctx, hd] -> [n * kvh, ctx, hd]
        let heads_first = |rows: Tensor| -> Result<Tensor> {
            Ok(rows
                .reshape((n, c, kvh, hd))?
                .transpose(1, 2)?
                .reshape((n * kvh, c, hd))?)
        };
        let k = heads_first(kv.keys(&self.slots)?)?;
        let v = heads_first(kv.values(&self.slots)?)?;
        let mut scores = q.matmul(&k.t()?)?; // [n * kvh, ql * group, ctx]
        if let Some(mask) = &self.mask {
            scores = scores
                .reshape((n, kvh, ql, group, c))?
                .broadcast_add(mask)?
                .reshape((n * kvh, ql * group, c))?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = probs.matmul(&v)?; // [n * kvh, ql * group, hd]
        Ok(o.reshape((n, kvh, ql, group, hd))?
            .transpose(1, 2)?
            .reshape((n * ql, h * hd))?)
    }
}

/// On a CPU, the most K and V (as F32) one group of decodes gathers: past a cache's worth, the
/// batched copies cost more than the calls they save (64 decodes over 1,000 positions each took
/// 3-5x as long in one group as in groups of 1-4).
const CPU_GROUP_BYTES: usize = 8 << 20;

/// A group of decodes pads each history to the longest: at most this many times the positions
/// they hold.
const MAX_PADDING: usize = 2;

impl GenericPlan {
    pub(crate) fn new(seqs: &[SeqMeta], d: AttnDims, device: &Device) -> Result<Self> {
        // Decodes, longest history first, into groups that bound the padding (and, on a CPU, the
        // bytes gathered); each chunk of several tokens alone.
        let mut decodes: Vec<&SeqMeta> = seqs.iter().filter(|s| s.q_len == 1).collect();
        decodes.sort_by_key(|s| std::cmp::Reverse(s.context_len()));
        let row_bytes = 2 * d.num_kv_heads * d.head_dim * 4;
        let mut members: Vec<Vec<&SeqMeta>> = Vec::new();
        let mut held = 0;
        for s in decodes {
            let fits = members.last().is_some_and(|g: &Vec<&SeqMeta>| {
                let padded = (g.len() + 1) * g[0].context_len();
                padded <= MAX_PADDING * (held + s.context_len())
                    && (!device.is_cpu() || padded * row_bytes <= CPU_GROUP_BYTES)
            });
            if fits {
                members.last_mut().expect("a group").push(s);
                held += s.context_len();
            } else {
                members.push(vec![s]);
                held = s.context_len();
            }
        }
        members.extend(seqs.iter().filter(|s| s.q_len > 1).map(|s| vec![s]));
        let groups = members
            .iter()
            .map(|m| Group::new(m, d.block_size, device))
            .collect::<Result<Vec<_>>>()?;
        // Row r of the step is row at[r] of the groups' outputs, concatenated.
        let n_rows: usize = seqs.iter().map(|s| s.q_len).sum();
        let mut at = vec![0u32; n_rows];
        let mut next = 0u32;
        for s in members.iter().flatten() {
            for a in &mut at[s.q_start..s.q_start + s.q_len] {
                *a = next;
                next += 1;
            }
        }
        let in_order = at.iter().enumerate().all(|(i, &a)| a as usize == i);
        Ok(GenericPlan {
            groups,
            order: (!in_order)
                .then(|| Tensor::from_vec(at, n_rows, device))
                .transpose()?,
        })
    }
}

pub(crate) fn generic(q: &Tensor, kv: &LayerKv, d: AttnDims, plan: &GenericPlan) -> Result<Tensor> {
    let outs = plan
        .groups
        .iter()
        .map(|g| g.attend(q, kv, d))
        .collect::<Result<Vec<_>>>()?;
    let mut out = Tensor::cat(&outs, 0)?;
    if let Some(order) = &plan.order {
        out = out.index_select(order, 0)?;
    }
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
    use crate::kv_cache::q8;
    use proptest::prelude::*;

    /// A task writes its own rows unless a neighbour is a part of its tile (the same sequence,
    /// KV head and first token), whose rows are merged after.
    #[test]
    fn a_task_is_alone_unless_a_neighbour_is_a_part_of_its_tile() {
        let t = |seq, kv_head, t0| Task {
            seq,
            kv_head,
            heads: 1,
            together: false,
            t0,
            tokens: 1,
            from: 0,
            to: usize::MAX,
        };
        let tasks = [
            t(0, 0, 0),
            t(0, 1, 0),
            t(0, 1, 0),
            t(0, 1, 0),
            t(0, 1, 1),
            t(1, 1, 1),
            t(1, 1, 1),
        ];
        let want = [true, false, false, false, true, false, false];
        assert_eq!(alone(&tasks), want);
        assert_eq!(alone(&tasks[..1]), [true]);
        assert!(alone(&[]).is_empty());
    }

    /// A step of `shapes` (q_len, start_pos) over a shuffled cache of random K and V (`kv`: 0 F32,
    /// 1 F16, 2 Q8), attended by both implementations.
    fn both_paths(shapes: &[(usize, usize)], order_seed: u64, kv: u8) -> (Vec<f32>, Vec<f32>) {
        let (fast, generic, _) = both_paths_of(8, shapes, &[], order_seed, kv);
        (fast, generic)
    }

    /// `both_paths` with heads of `head_dim` values, the runs at `decodes` a reply's decodes
    /// (`SeqMeta::exact`); third, the CPU kernel's result with the tile units left out.
    fn both_paths_of(
        head_dim: usize,
        shapes: &[(usize, usize)],
        decodes: &[usize],
        order_seed: u64,
        kv: u8,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (seqs, q, layer, dims) = step(head_dim, shapes, decodes, order_seed, kv);
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let run = |imp| flat(paged_attention(imp, &q, &layer, &seqs, dims).unwrap());
        // As over an F32 cache: no run on the tiles.
        let untiled = FastCpuPlan::new(&seqs, dims, DType::F32);
        (
            run(AttentionImpl::FastCpu),
            run(AttentionImpl::Generic),
            flat(fast_cpu(&q, &layer, &seqs, &untiled).unwrap()),
        )
    }

    /// A step of `shapes` as `both_paths_of` makes it: its sequences, query rows, one layer's
    /// cache and the shapes.
    fn step(
        head_dim: usize,
        shapes: &[(usize, usize)],
        decodes: &[usize],
        order_seed: u64,
        kv: u8,
    ) -> (Vec<SeqMeta>, Tensor, LayerKv, AttnDims) {
        let dims = AttnDims {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim,
            block_size: 4,
        };
        let (h, kvd, bs) = (
            dims.num_heads * dims.head_dim,
            2 * dims.head_dim,
            dims.block_size,
        );
        let per_seq: Vec<usize> = shapes.iter().map(|&(q, p)| (p + q).div_ceil(bs)).collect();
        let blocks: usize = per_seq.iter().sum::<usize>() + 3;
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        let mut r = order_seed | 1;
        for i in (1..order.len()).rev() {
            r = r
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (r >> 33) as usize % (i + 1));
        }
        let (mut seqs, mut q_start, mut next) = (Vec::new(), 0, 0);
        for (i, (&(q_len, start_pos), &n)) in shapes.iter().zip(&per_seq).enumerate() {
            seqs.push(SeqMeta {
                q_start,
                q_len,
                start_pos,
                block_table: order[next..next + n].to_vec(),
                exact: decodes.contains(&i),
                more: false,
            });
            q_start += q_len;
            next += n;
        }
        let dev = Device::Cpu;
        let cache = || Tensor::rand(-1f32, 1.0, (blocks * bs, kvd), &dev).unwrap();
        let (kc, vc) = (cache(), cache());
        let layer = match kv {
            0 | 1 => {
                let dt = if kv == 1 { DType::F16 } else { DType::F32 };
                LayerKv {
                    k: kc.to_dtype(dt).unwrap(),
                    v: vc.to_dtype(dt).unwrap(),
                    scales: None,
                    written: None,
                }
            }
            _ => {
                let (k, ks) = q8::quantize(&kc, dims.num_kv_heads).unwrap();
                let (v, vs) = q8::quantize(&vc, dims.num_kv_heads).unwrap();
                LayerKv {
                    k,
                    v,
                    scales: Some((ks, vs)),
                    written: None,
                }
            }
        };
        let q = Tensor::rand(-1f32, 1.0, (q_start, h), &dev).unwrap();
        (seqs, q, layer, dims)
    }

    /// Decode rows as one task over all their KV heads (`heads_together`, forced on, whatever
    /// this CPU measured) or a task per head give the generic path's rows: many decodes, one
    /// decode cut into parts for idle threads, decodes beside a chunk, both head sizes the
    /// kernel takes, F32 and F16 caches; over a Q8 cache (whose scores on a CPU with VNNI come
    /// from quantized queries, so not the generic path's), one task or one a head alike.
    #[test]
    fn decode_rows_over_all_kv_heads_attend_as_the_generic_path() {
        let steps: [&[(usize, usize)]; 3] = [
            &[(1, 70), (1, 3), (1, 130), (1, 0), (1, 64)],
            &[(1, 1100)],
            &[(1, 40), (6, 20), (1, 9)],
        ];
        for head_dim in [64, 128] {
            for shapes in steps {
                for kv in 0..3 {
                    let decodes: Vec<usize> = (0..shapes.len()).collect();
                    let (seqs, q, layer, dims) = step(head_dim, shapes, &decodes, 5, kv);
                    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let generic = flat(
                        paged_attention(AttentionImpl::Generic, &q, &layer, &seqs, dims).unwrap(),
                    );
                    let mut runs = Vec::new();
                    for together in [true, false] {
                        let mut plan = FastCpuPlan::new(&seqs, dims, layer.k.dtype());
                        let tiled: Vec<bool> = plan.tiled.iter().map(|t| t.is_some()).collect();
                        plan.tasks = plan_tasks(&seqs, 2, 3, 2, &tiled, together);
                        runs.push(flat(fast_cpu(&q, &layer, &seqs, &plan).unwrap()));
                    }
                    let want = if kv == 2 { &runs[1] } else { &generic };
                    for (fast, together) in runs.iter().zip([true, false]) {
                        let d = fast
                            .iter()
                            .zip(want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max);
                        assert!(
                            d <= 1e-5,
                            "head_dim {head_dim}, {shapes:?}, kv {kv}, together {together}: {d}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_seed: proptest::test_runner::RngSeed::Fixed(18), ..ProptestConfig::default() })]
        /// The generic path (decodes padded into one group, chunks alone, rows put back in step
        /// order) equals the CPU kernel on steps of decodes and chunks in any order, with
        /// histories of different lengths, over a shuffled F32, F16 or Q8 cache.
        #[test]
        fn generic_equals_fast_cpu_on_mixed_steps(
            shapes in prop::collection::vec((prop_oneof![Just(1usize), 1usize..9], 0usize..40), 1..7),
            order_seed in any::<u64>(),
            kv in 0u8..3,
        ) {
            let (fast, generic) = both_paths(&shapes, order_seed, kv);
            prop_assert_eq!(fast.len(), generic.len());
            for (i, (a, b)) in fast.iter().zip(&generic).enumerate() {
                prop_assert!((a - b).abs() <= 1e-5, "row value {}: {} vs {}", i, a, b);
            }
        }
    }

    /// The output values of run `i` of a step of `shapes` (q_len, start_pos), rows `width` wide.
    fn run_rows(shapes: &[(usize, usize)], width: usize, i: usize) -> std::ops::Range<usize> {
        let start: usize = shapes[..i].iter().map(|s| s.0).sum();
        start * width..(start + shapes[i].0) * width
    }

    /// The largest absolute difference between `a` and `b`.
    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    }

    /// Steps whose prompt runs have enough rows for the tile units (`attn_amx`, on CPUs with AMX:
    /// several of them, each KV head packed once for its tasks) beside decodes that stay on the
    /// F32 kernel, drafts and all: the generic path's result within bf16's rounding, and (where
    /// the tiles ran) not bit for bit, which shows they did; the decodes' rows as the kernel
    /// gives them with no run on the tiles; over an F32 cache, F32 throughout.
    #[test]
    fn chunks_on_the_tile_units_attend_as_the_generic_path() {
        // Prompt runs of 4+ tokens on the tiles; decodes, one with 6 drafts (7 tokens), and a
        // 3-token run on the F32 kernel.
        let shapes = [
            (40, 0),
            (1, 50),
            (7, 100),
            (1, 3),
            (70, 30),
            (11, 0),
            (3, 9),
            (4, 7),
        ];
        let decodes = [1, 2, 3];
        let rows_of = |i: usize| run_rows(&shapes, 6 * 64, i);
        for kv in 0..3 {
            let (fast, generic, exact) = both_paths_of(64, &shapes, &decodes, 11, kv);
            let d = max_diff(&fast, &generic);
            assert!(d <= 1e-2, "kv {kv}: max-abs-diff {d}");
            for i in decodes.into_iter().chain([6]) {
                let r = rows_of(i);
                let d = max_diff(&fast[r.clone()], &exact[r]);
                assert!(d <= 1e-6, "kv {kv}, run {i} (F32): max-abs-diff {d}");
            }
            // An F32 cache asks for exact attention: F32 all the way.
            if kv == 0 {
                assert!(d <= 1e-5, "kv {kv}: max-abs-diff {d}");
            } else if Amx::detect().is_some() && Isa::best().amx().is_some() {
                for i in [0, 4, 5, 7] {
                    let r = rows_of(i);
                    let d = max_diff(&fast[r.clone()], &generic[r]);
                    assert!(d > 0.0, "kv {kv}: run {i} ran on the tile units");
                }
            }
        }
    }

    /// At every kernel level this CPU has, a step of prompt runs beside decodes attends as the
    /// generic path does (within bf16's rounding where runs go to the tile units, F32's
    /// elsewhere), and at the levels without the tile units the prompt runs take the blocked
    /// kernel (`attn_flash`): their rows differ bit for bit from the same level's without it,
    /// which shows it ran, while the decodes' and the short run's rows do not differ at all.
    #[test]
    fn prompt_runs_attend_as_the_generic_path_at_every_level() {
        let shapes = [(40, 0), (1, 50), (7, 100), (1, 3), (70, 30), (3, 9), (4, 7)];
        let decodes = [1, 2, 3];
        let rows_of = |i: usize| run_rows(&shapes, 6 * 64, i);
        let test = "prompt_runs_attend_as_the_generic_path_at_every_level";
        for kv in 0..3 {
            let (seqs, q, layer, dims) = step(64, &shapes, &decodes, 5, kv);
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let generic =
                flat(paged_attention(AttentionImpl::Generic, &q, &layer, &seqs, dims).unwrap());
            for isa in Isa::simd_levels_for_test(test) {
                let mut plan = FastCpuPlan::at_level(&seqs, dims, layer.k.dtype(), isa);
                let fast = flat(fast_cpu(&q, &layer, &seqs, &plan).unwrap());
                // bf16 on the tile units or AVX-512 BF16 (an F16 or Q8 cache); a Q8 cache's decode
                // scores from 8-bit queries (VNNI).
                let bf16 = isa.avx512_bf16().is_some() && kv > 0;
                let bound = if bf16 || (isa.avx512_vnni().is_some() && kv == 2) {
                    1e-2
                } else {
                    1e-5
                };
                let d = max_diff(&fast, &generic);
                assert!(d <= bound, "{isa:?}, kv {kv}: max-abs-diff {d}");
                if plan.flash.is_none() {
                    continue;
                }
                plan.flash = None;
                let plain = flat(fast_cpu(&q, &layer, &seqs, &plan).unwrap());
                for i in [0, 4, 6] {
                    let r = rows_of(i);
                    assert!(
                        fast[r.clone()] != plain[r],
                        "{isa:?}, kv {kv}: run {i} blocked"
                    );
                }
                for i in decodes.into_iter().chain([5]) {
                    let r = rows_of(i);
                    assert_eq!(
                        fast[r.clone()],
                        plain[r],
                        "{isa:?}, kv {kv}: run {i} on attn"
                    );
                }
            }
        }
    }

    /// A tiled prompt run's tokens are spread evenly over a multiple of the threads' tasks (a
    /// short chunk on two threads: 3 KV heads x 2 tasks of 15 tokens, not 3 of 30), and its rows
    /// come out the same bits however they are cut into tasks, at every level this CPU has.
    #[test]
    fn a_tiled_run_is_spread_over_the_threads_and_its_rows_do_not_depend_on_the_cut() {
        let cut = |q_len: usize, threads: usize| {
            let seq = SeqMeta {
                q_start: 0,
                q_len,
                start_pos: 6000,
                block_table: Vec::new(),
                exact: false,
                more: false,
            };
            plan_tasks(&[seq], 3, 3, threads, &[true], false)
                .iter()
                .map(|t| (t.kv_head, t.t0, t.tokens))
                .collect::<Vec<_>>()
        };
        let halves = |h| [(h, 0, 15), (h, 15, 15)];
        assert_eq!(cut(30, 2), [halves(0), halves(1), halves(2)].concat());
        assert_eq!(cut(30, 1), [(0, 0, 30), (1, 0, 30), (2, 0, 30)]);
        assert_eq!(cut(64, 2).len(), 6);
        assert_eq!(cut(96, 2).len(), 12);
        assert_eq!(
            cut(5, 16),
            [
                (0, 0, 3),
                (0, 3, 2),
                (1, 0, 3),
                (1, 3, 2),
                (2, 0, 3),
                (2, 3, 2)
            ]
        );
        assert_eq!(tiled_tokens(1, 32, 3, 2), 1);

        let shapes = [(40, 0), (1, 50), (70, 30), (4, 7), (33, 200)];
        let tiled_runs = [0, 2, 3, 4];
        let test = "a_tiled_run_is_spread_over_the_threads_and_its_rows_do_not_depend_on_the_cut";
        for kv in 0..3 {
            let (seqs, q, layer, dims) = step(64, &shapes, &[1], 9, kv);
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for isa in Isa::simd_levels_for_test(test) {
                let mut plan = FastCpuPlan::at_level(&seqs, dims, layer.k.dtype(), isa);
                if plan.flash.is_none() && plan.amx.is_none() {
                    continue;
                }
                let blocked = plan.blocked.clone();
                assert_eq!(
                    tiled_runs.map(|i| blocked[i]),
                    [true; 4],
                    "{isa:?}, kv {kv}: the runs are tiled"
                );
                let mut outs = Vec::new();
                for threads in [1, 2, 3, 8] {
                    plan.tasks = plan_tasks(&seqs, 2, 3, threads, &blocked, false);
                    outs.push(flat(fast_cpu(&q, &layer, &seqs, &plan).unwrap()));
                }
                for i in tiled_runs {
                    let r = run_rows(&shapes, 6 * 64, i);
                    for (o, threads) in outs[1..].iter().zip([2, 3, 8]) {
                        assert_eq!(
                            o[r.clone()],
                            outs[0][r.clone()],
                            "{isa:?}, kv {kv}: run {i} cut for {threads} threads"
                        );
                    }
                }
            }
        }
    }

    /// A short tiled run after a long history, its positions cut into parts (`tiled_cut`, where
    /// `attn_flash` runs) and merged, attends as the generic path; a short history, or a run
    /// whose tiles already fill the threads, is not cut.
    #[test]
    fn a_short_run_after_a_long_history_is_cut_into_parts_that_attend_as_the_generic_path() {
        let run = |q_len, start_pos| SeqMeta {
            q_start: 0,
            q_len,
            start_pos,
            block_table: Vec::new(),
            exact: false,
            more: false,
        };
        assert_eq!(tiled_cut(&run(10, 5500), 32, 3, 2, true), (10, 2));
        assert_eq!(tiled_cut(&run(10, 5500), 32, 3, 2, false), (5, 1));
        assert_eq!(tiled_cut(&run(10, 400), 32, 3, 2, true), (5, 1));
        assert_eq!(tiled_cut(&run(64, 5500), 32, 3, 2, true), (32, 1));
        assert_eq!(tiled_cut(&run(10, 5500), 32, 3, 3, true), (10, 1));

        let shapes = [(10, 800), (1, 50), (6, 900)];
        let test = "a_short_run_after_a_long_history_is_cut_into_parts";
        for kv in 0..3 {
            let (seqs, q, layer, dims) = step(64, &shapes, &[1], 3, kv);
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let generic =
                flat(paged_attention(AttentionImpl::Generic, &q, &layer, &seqs, dims).unwrap());
            for isa in Isa::simd_levels_for_test(test) {
                let mut plan = FastCpuPlan::at_level(&seqs, dims, layer.k.dtype(), isa);
                if plan.flash.is_none() {
                    continue;
                }
                let blocked = plan.blocked.clone();
                plan.tasks = plan_tasks_cut(&seqs, 2, 3, 3, &blocked, false, true);
                let cut: Vec<_> = plan.tasks.iter().filter(|t| t.seq == 0).collect();
                assert_eq!(cut.len(), 2 * 3, "{isa:?}: 2 KV heads x 3 parts");
                assert_eq!(
                    cut.iter().map(|t| (t.from, t.to)).collect::<Vec<_>>()[..3],
                    [(0, 266), (266, 533), (533, usize::MAX)]
                );
                let fast = flat(fast_cpu(&q, &layer, &seqs, &plan).unwrap());
                // A Q8 cache's decode scores from 8-bit queries (VNNI); bf16 on AVX-512 BF16 (an
                // F16 or Q8 cache).
                let bf16 = isa.avx512_bf16().is_some() && kv > 0;
                let bound = if bf16 || (kv == 2 && isa.avx512_vnni().is_some()) {
                    1e-2
                } else {
                    1e-5
                };
                let d = max_diff(&fast, &generic);
                assert!(d <= bound, "{isa:?}, kv {kv}: max-abs-diff {d}");
            }
        }
    }

    #[test]
    fn decodes_after_a_chunk_are_put_back_in_step_order() {
        // A chunk first, then decodes with different histories, then another chunk.
        for kv in 0..3 {
            let (fast, generic) = both_paths(&[(5, 3), (1, 17), (1, 0), (3, 9), (1, 30)], 7, kv);
            let d = fast
                .iter()
                .zip(&generic)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= 1e-5, "kv {kv}: max-abs-diff {d}");
        }
    }

    /// A reply's decode rounds the same however the step around it is made: a row of a decode
    /// with drafts (`SeqMeta::exact`) equals, bit for bit, the same token's plain decode alone
    /// in its step and beside other decodes, over a long history that is cut into parts for
    /// idle threads; one task for all KV heads or one a head; F32, F16 and Q8 caches. Speculation
    /// must not change a reply, and another visitor's presence must not either.
    #[test]
    fn a_decode_row_rounds_the_same_whatever_the_step_around_it() {
        for kv in 0..3 {
            for together in [true, false] {
                let start = 1100;
                let (seqs, q, layer, dims) = step(64, &[(3, start)], &[0], 9, kv);
                let table = seqs[0].block_table.clone();
                let width = dims.num_heads * dims.head_dim;
                let run = |seqs: &[SeqMeta], q: &Tensor| {
                    let mut plan = FastCpuPlan::new(seqs, dims, layer.k.dtype());
                    let tiled: Vec<bool> = plan.tiled.iter().map(|t| t.is_some()).collect();
                    plan.tasks = plan_tasks(seqs, 2, 3, 2, &tiled, together);
                    let out = fast_cpu(q, &layer, seqs, &plan).unwrap();
                    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                let drafts = run(&seqs, &q);
                for i in 0..3 {
                    let row = q.narrow(0, i, 1).unwrap();
                    let decode = |q_start: usize| SeqMeta {
                        q_start,
                        q_len: 1,
                        start_pos: start + i,
                        block_table: table.clone(),
                        exact: true,
                        more: false,
                    };
                    let alone = run(&[decode(0)], &row);
                    // Four other decodes over the same cache, this one third.
                    let mut crowd: Vec<SeqMeta> = (0..5)
                        .map(|j| SeqMeta {
                            start_pos: 40 * j,
                            ..decode(j)
                        })
                        .collect();
                    crowd[2] = decode(2);
                    let others = Tensor::rand(-1f32, 1.0, (5, width), &Device::Cpu).unwrap();
                    let rows = Tensor::cat(
                        &[
                            others.narrow(0, 0, 2).unwrap(),
                            row,
                            others.narrow(0, 3, 2).unwrap(),
                        ],
                        0,
                    )
                    .unwrap();
                    let beside = run(&crowd, &rows);
                    let want = &drafts[i * width..(i + 1) * width];
                    assert_eq!(
                        &alone[..],
                        want,
                        "kv {kv}, together {together}, token {i} alone"
                    );
                    assert_eq!(
                        &beside[2 * width..3 * width],
                        want,
                        "kv {kv}, together {together}, token {i} beside others"
                    );
                }
            }
        }
    }

    fn seq(q_len: usize, start_pos: usize) -> SeqMeta {
        SeqMeta {
            q_start: 0,
            q_len,
            start_pos,
            block_table: Vec::new(),
            exact: false,
            more: false,
        }
    }

    /// Positions `from..to` of each tile's parts, in task order.
    fn spans(tasks: &[Task]) -> Vec<(usize, usize, usize)> {
        tasks.iter().map(|t| (t.kv_head, t.from, t.to)).collect()
    }

    #[test]
    fn a_decode_row_is_one_task_for_all_its_kv_heads_where_that_pays() {
        // Four decodes and a chunk: each decode one task over the 3 heads, the chunk one a head.
        let mut shapes = vec![seq(1, 40); 4];
        shapes.push(seq(5, 10));
        let t = plan_tasks(&shapes, 3, 3, 2, &[false; 5], true);
        assert_eq!(
            t.iter()
                .map(|t| (t.seq, t.kv_head, t.heads))
                .collect::<Vec<_>>(),
            vec![
                (0, 0, 3),
                (1, 0, 3),
                (2, 0, 3),
                (3, 0, 3),
                (4, 0, 1),
                (4, 1, 1),
                (4, 2, 1)
            ]
        );
        // A decode with 2 drafts: a task a token, as its plain decode would run.
        let mut drafts = seq(3, 40);
        drafts.exact = true;
        let t = plan_tasks(&[drafts], 3, 3, 2, &[false], true);
        assert_eq!(
            t.iter()
                .map(|t| (t.t0, t.tokens, t.heads))
                .collect::<Vec<_>>(),
            vec![(0, 1, 3), (1, 1, 3), (2, 1, 3)]
        );
        // One decode on two threads: its 1,200 positions in four parts.
        let t = plan_tasks(&[seq(1, 1199)], 3, 3, 2, &[false], true);
        assert_eq!(
            spans(&t),
            vec![(0, 0, 300), (0, 300, 600), (0, 600, 900), (0, 900, 1200)]
        );
        assert!(t.iter().all(|t| t.heads == 3));
    }

    #[test]
    fn one_decoding_sequence_is_cut_into_parts_for_idle_threads() {
        // A task a KV head, on two threads: each head's 1,200 positions in four parts.
        let t = plan_tasks(&[seq(1, 1199)], 3, 3, 2, &[false], false);
        let quarters = [(0, 300), (300, 600), (600, 900), (900, 1200)];
        let want: Vec<_> = (0..3)
            .flat_map(|h| quarters.map(|(a, b)| (h, a, b)))
            .collect();
        assert_eq!(spans(&t), want);
        // Too short to cut: MIN_PART positions a part at least.
        let t = plan_tasks(&[seq(1, 500)], 3, 3, 2, &[false], false);
        assert!(t.iter().all(|t| t.from == 0 && t.to == usize::MAX));
        // Four sequences: each row cut as it would be alone (the cut depends on the row's
        // history, not on the step); 1,000 positions hold three parts' worth, cut in two halves
        // (a power of two).
        let t = plan_tasks(
            &[seq(1, 999), seq(1, 999), seq(1, 99), seq(1, 1999)],
            3,
            3,
            2,
            &[false; 4],
            false,
        );
        assert_eq!(t.len(), 3 * (2 + 2 + 1 + 4));
        let first: Vec<_> = t.iter().filter(|t| t.seq == 0 && t.kv_head == 0).collect();
        assert_eq!(
            first.iter().map(|t| (t.from, t.to)).collect::<Vec<_>>(),
            vec![(0, 500), (500, 1000)]
        );
        let last: Vec<_> = t.iter().filter(|t| t.seq == 3 && t.kv_head == 0).collect();
        assert_eq!(
            last.iter().map(|t| (t.from, t.to)).collect::<Vec<_>>(),
            vec![(0, 500), (500, 1000), (1000, 1500), (1500, 2000)]
        );
        // A decode with 2 drafts on the per-head kernel: a task a token and head, each token's
        // positions cut as its plain decode's would be.
        let mut drafts = seq(3, 1199);
        drafts.exact = true;
        let t = plan_tasks(&[drafts], 3, 3, 2, &[false], false);
        assert_eq!(t.len(), 3 * 3 * 4);
        assert!(t.iter().all(|t| t.tokens == 1));
        assert_eq!(
            t[..4]
                .iter()
                .map(|t| (t.t0, t.from, t.to))
                .collect::<Vec<_>>(),
            vec![(0, 0, 300), (0, 300, 600), (0, 600, 900), (0, 900, 1200)]
        );
        // A prefill chunk's tiles are never cut.
        let t = plan_tasks(&[seq(5, 900)], 1, 3, 2, &[false], false);
        assert!(t.iter().all(|t| t.from == 0 && t.to == usize::MAX));
    }
}
