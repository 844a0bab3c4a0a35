//! Attention over the paged KV cache for a flat step batch: causal within a sequence, never across
//! sequences, each sequence reading its history through its block table.
//!
//! Two implementations of the same function:
//! - `fast_cpu`: reads the cache tensors as slices and runs one task per (token, KV head) on the
//!   rayon pool; the query heads of a GQA group share one pass over K and V. Written by hand
//!   because candle has no paged attention on CPU and gathering blocks into a fresh tensor per
//!   sequence per layer costs more than the attention itself at decode time.
//! - `generic`: gathers each sequence's slots with `index_select` and runs standard masked
//!   attention with candle ops, so it runs on any device (CUDA). Tests compare the two on CPU.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::engine::step::SeqMeta;
use crate::error::{EngineError, Result};
use crate::kv_cache::slot_of;
use crate::model::kernels::with_cpu_slice;

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
        AttentionImpl::FastCpu => fast_cpu(q, k_cache, v_cache, seqs, dims),
        AttentionImpl::Generic => generic(q, k_cache, v_cache, seqs, dims),
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes so the compiler keeps one vector accumulator (AVX2: one ymm).
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Dot products of one query head with four key rows at once: four independent accumulators hide
/// the latency of the adds that a single dot product waits on (measured: attention was ~20% of a
/// 16-sequence decode step with one accumulator). AVX2+FMA when the CPU has them.
#[inline]
fn dot4<const D: usize>(q: &[f32; D], k: [&[f32; D]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if crate::model::kernels::q8_0::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; every row is D wide and D is a multiple of 8.
        return unsafe { dot4_avx2(q, k) };
    }
    let mut out = [0f32; 4];
    for (o, kj) in out.iter_mut().zip(k) {
        *o = dot(q, kj);
    }
    out
}

/// # Safety
/// The CPU must support AVX2 and FMA; `D` must be a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2<const D: usize>(q: &[f32; D], k: [&[f32; D]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    for c in (0..D).step_by(8) {
        let qv = _mm256_loadu_ps(q.as_ptr().add(c));
        for j in 0..4 {
            acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j].as_ptr().add(c)), acc[j]);
        }
    }
    let mut out = [0f32; 4];
    for j in 0..4 {
        out[j] = crate::model::kernels::q8_0::avx2::hsum(acc[j]);
    }
    out
}

/// Scores of the `group` query heads in `q` against positions `0..ctx` (`krow(p)` is position
/// `p`'s key row for this KV head), scaled, into `scores[qh * ctx + p]`.
fn scores_for<'a, const D: usize>(
    q: &[f32],
    krow: &impl Fn(usize) -> &'a [f32],
    ctx: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let group = q.len() / D;
    let heads: Vec<&[f32; D]> = q
        .chunks_exact(D)
        .map(|c| c.try_into().expect("D wide"))
        .collect();
    let key = |p: usize| -> &[f32; D] { krow(p).try_into().expect("a key row is D wide") };
    let mut p = 0;
    while p + 4 <= ctx {
        let k = [key(p), key(p + 1), key(p + 2), key(p + 3)];
        for (qh, qv) in heads.iter().enumerate() {
            let d = dot4(qv, k);
            for j in 0..4 {
                scores[qh * ctx + p + j] = d[j] * scale;
            }
        }
        p += 4;
    }
    for p in p..ctx {
        for qh in 0..group {
            scores[qh * ctx + p] = dot(heads[qh], key(p)) * scale;
        }
    }
}

/// `out = sum_p w[p] * v(p)` with the accumulator in registers (a const width lets the compiler
/// keep all of it in vector registers across the loop instead of storing it every position).
#[inline]
fn weighted_sum<'a, const D: usize>(w: &[f32], v: &impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    let mut acc = [0f32; D];
    for (p, &wp) in w.iter().enumerate() {
        let row: &[f32; D] = v(p).try_into().expect("a value row is D wide");
        for i in 0..D {
            acc[i] = wp.mul_add(row[i], acc[i]);
        }
    }
    out.copy_from_slice(&acc);
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn fast_cpu(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    d: AttnDims,
) -> Result<Tensor> {
    let n_tokens = q.dim(0)?;
    let (h, kvh, hd, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
    let group = h / kvh;
    let kv_dim = kvh * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // Which sequence and position each flat row belongs to.
    let mut row_seq = vec![(0usize, 0usize); n_tokens];
    for (si, s) in seqs.iter().enumerate() {
        for j in 0..s.q_len {
            row_seq[s.q_start + j] = (si, s.start_pos + j);
        }
    }
    let q = q.contiguous()?;
    let mut out = vec![0f32; n_tokens * h * hd];
    with_cpu_slice(&q, |qs| {
        with_cpu_slice(k_cache, |ks| {
            with_cpu_slice(v_cache, |vs| {
                // One task per (token, kv head): its `group` query heads are contiguous in `out`.
                out.par_chunks_mut(group * hd)
                    .enumerate()
                    .for_each(|(i, o)| {
                        let (t, g) = (i / kvh, i % kvh);
                        let (si, pos) = row_seq[t];
                        let table = &seqs[si].block_table;
                        let ctx = pos + 1;
                        let qrow =
                            &qs[t * h * hd + g * group * hd..t * h * hd + (g + 1) * group * hd];
                        let mut scores = vec![0f32; group * ctx];
                        let krow = |p: usize| {
                            let slot = slot_of(table, p, bs);
                            &ks[slot * kv_dim + g * hd..slot * kv_dim + (g + 1) * hd]
                        };
                        match hd {
                            64 => scores_for::<64>(qrow, &krow, ctx, scale, &mut scores),
                            128 => scores_for::<128>(qrow, &krow, ctx, scale, &mut scores),
                            _ => {
                                for p in 0..ctx {
                                    for qh in 0..group {
                                        scores[qh * ctx + p] =
                                            dot(&qrow[qh * hd..(qh + 1) * hd], krow(p)) * scale;
                                    }
                                }
                            }
                        }
                        for qh in 0..group {
                            let s = &mut scores[qh * ctx..(qh + 1) * ctx];
                            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            let mut sum = 0f32;
                            for x in s.iter_mut() {
                                *x = (*x - m).exp();
                                sum += *x;
                            }
                            let inv = 1.0 / sum;
                            for x in s.iter_mut() {
                                *x *= inv;
                            }
                        }
                        let vrow = |p: usize| {
                            let slot = slot_of(table, p, bs);
                            &vs[slot * kv_dim + g * hd..slot * kv_dim + (g + 1) * hd]
                        };
                        for qh in 0..group {
                            let w = &scores[qh * ctx..(qh + 1) * ctx];
                            let out = &mut o[qh * hd..(qh + 1) * hd];
                            match hd {
                                64 => weighted_sum::<64>(w, &vrow, out),
                                128 => weighted_sum::<128>(w, &vrow, out),
                                _ => {
                                    for (p, &wp) in w.iter().enumerate() {
                                        axpy(out, wp, vrow(p));
                                    }
                                }
                            }
                        }
                    });
            })
        })
    })???;
    Ok(Tensor::from_vec(out, (n_tokens, h * hd), q.device())?)
}

fn generic(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[SeqMeta],
    d: AttnDims,
) -> Result<Tensor> {
    let (h, kvh, hd, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
    let group = h / kvh;
    let device = q.device();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut outs = Vec::with_capacity(seqs.len());
    for s in seqs {
        let ctx = s.context_len();
        let slots: Vec<u32> = (0..ctx)
            .map(|p| slot_of(&s.block_table, p, bs) as u32)
            .collect();
        let idx = Tensor::from_vec(slots, ctx, device)?;
        // [ctx, kvh, hd] -> [kvh, ctx, hd] -> [kvh, group, ctx, hd] -> [h, ctx, hd]
        let expand = |cache: &Tensor| -> candle_core::Result<Tensor> {
            cache
                .index_select(&idx, 0)?
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
        let scores = (qs.matmul(&k.t()?)? * scale)?; // [h, q_len, ctx]
                                                     // Causal: row j (position start_pos + j) sees positions 0..=start_pos + j.
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
        let mask = Tensor::from_vec(mask, (1, s.q_len, ctx), device)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
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
