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
        AttentionImpl::FastCpu => fast_cpu(q, k_cache, v_cache, seqs, dims),
        AttentionImpl::Generic => generic(q, k_cache, v_cache, seqs, dims),
    }
}

/// An element of the KV cache: F32, or F16 read into F32 lanes as it is loaded.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight values from `p` as F32 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must point to 8 readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl KvElem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// Whether the AVX2 + FMA + F16C paths may run.
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            crate::model::kernels::q8_0::has_avx2() && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[inline]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight independent lanes so the compiler keeps one vector accumulator (AVX2: one ymm).
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i].to_f32();
    }
    s
}

/// Dot products of one query head with four key rows at once: four independent accumulators hide
/// the latency of the adds that a single dot product waits on (measured: attention was ~20% of a
/// 16-sequence decode step with one accumulator). AVX2 when the CPU has it.
#[inline]
fn dot4<T: KvElem, const D: usize>(q: &[f32; D], k: [&[T; D]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2, FMA and F16C were detected; every row is D wide, D a multiple of 8.
        return unsafe { dot4_avx2(q, k) };
    }
    let mut out = [0f32; 4];
    for (o, kj) in out.iter_mut().zip(k) {
        *o = dot(q, kj);
    }
    out
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `D` must be a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_avx2<T: KvElem, const D: usize>(q: &[f32; D], k: [&[T; D]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    for c in (0..D).step_by(8) {
        let qv = _mm256_loadu_ps(q.as_ptr().add(c));
        for j in 0..4 {
            acc[j] = _mm256_fmadd_ps(qv, T::load8(k[j].as_ptr().add(c)), acc[j]);
        }
    }
    let mut out = [0f32; 4];
    for j in 0..4 {
        out[j] = crate::model::kernels::q8_0::avx2::hsum(acc[j]);
    }
    out
}

/// In-place softmax of one row of scores. With AVX2 the exponentials are computed eight at a time
/// (`exp8`); libm's scalar `expf` was a large share of a prefill chunk's attention at long context
/// (one call per head, position and layer).
fn softmax(s: &mut [f32]) {
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::model::kernels::q8_0::has_avx2() {
        while i + 8 <= s.len() {
            // SAFETY: AVX2 and FMA were detected; the 8 values are in bounds.
            unsafe { exp8_minus(&mut s[i..i + 8], m) };
            i += 8;
        }
    }
    for x in &mut s[i..] {
        *x = (*x - m).exp();
    }
    let inv = 1.0 / s.iter().sum::<f32>();
    for x in s.iter_mut() {
        *x *= inv;
    }
}

/// `x[i] = exp(x[i] - m)` for 8 values, `x[i] - m <= 0`: Cephes' `expf` (range reduction by
/// `ln 2` in two parts, degree-5 polynomial, 2^n by the exponent bits), within 2 ulp of libm;
/// results below `exp(-87)` flush to 0, as softmax weights that small do not count.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x` must hold 8 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_minus(x: &mut [f32], m: f32) {
    use std::arch::x86_64::*;
    let v = _mm256_sub_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_set1_ps(m));
    let tiny = _mm256_cmp_ps(v, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    let v = _mm256_max_ps(v, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(
        _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), v);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    ));
    let e = _mm256_andnot_ps(tiny, _mm256_mul_ps(e, pow2));
    _mm256_storeu_ps(x.as_mut_ptr(), e);
}

/// Scores of the `group` query heads in `q` against positions `0..ctx` (`krow(p)` is position
/// `p`'s key row for this KV head), scaled, into `scores[qh * ctx + p]`.
fn scores_for<'a, T: KvElem, const D: usize>(
    q: &[f32],
    krow: &impl Fn(usize) -> &'a [T],
    ctx: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let group = q.len() / D;
    let heads: Vec<&[f32; D]> = q
        .chunks_exact(D)
        .map(|c| c.try_into().expect("D wide"))
        .collect();
    let key = |p: usize| -> &[T; D] { krow(p).try_into().expect("a key row is D wide") };
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
fn weighted_sum<'a, T: KvElem, const D: usize>(
    w: &[f32],
    v: &impl Fn(usize) -> &'a [T],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd() && D == 64 {
        // SAFETY: AVX2, FMA and F16C were detected; every value row is D = 64 wide.
        unsafe { weighted_sum64_avx2(w, v, out) };
        return;
    }
    let mut acc = [0f32; D];
    for (p, &wp) in w.iter().enumerate() {
        let row: &[T; D] = v(p).try_into().expect("a value row is D wide");
        for i in 0..D {
            acc[i] = wp.mul_add(row[i].to_f32(), acc[i]);
        }
    }
    out.copy_from_slice(&acc);
}

/// `weighted_sum` for 64-wide rows: eight ymm accumulators.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every `v(p)` must hold 64 values, `out` too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_sum64_avx2<'a, T: KvElem>(
    w: &[f32],
    v: &impl Fn(usize) -> &'a [T],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    for (p, &wp) in w.iter().enumerate() {
        let row = v(p);
        assert!(row.len() >= 64);
        let wv = _mm256_set1_ps(wp);
        for (c, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(wv, T::load8(row.as_ptr().add(c * 8)), *a);
        }
    }
    assert!(out.len() >= 64);
    for (c, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(c * 8), *a);
    }
}

#[inline]
fn axpy<T: KvElem>(y: &mut [f32], a: f32, x: &[T]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x.to_f32();
    }
}

/// What every task of one `fast_cpu` call shares.
struct Attend<'a> {
    h: usize,
    hd: usize,
    group: usize,
    scale: f32,
    /// (sequence, position) of each flat row.
    row_seq: &'a [(usize, usize)],
    /// Each sequence's cache row offsets by position.
    seq_rows: &'a [Vec<usize>],
}

impl Attend<'_> {
    fn run<T: KvElem>(&self, qs: &[f32], ks: &[T], vs: &[T], out: &mut [f32]) {
        let (h, hd, group, scale) = (self.h, self.hd, self.group, self.scale);
        let kvh = h / group;
        // One task per (token, kv head): its `group` query heads are contiguous in `out`.
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(i, o)| {
                let (t, g) = (i / kvh, i % kvh);
                let (si, pos) = self.row_seq[t];
                let rows = &self.seq_rows[si];
                let ctx = pos + 1;
                let qrow = &qs[t * h * hd + g * group * hd..t * h * hd + (g + 1) * group * hd];
                let mut scores = vec![0f32; group * ctx];
                let krow = |p: usize| &ks[rows[p] + g * hd..rows[p] + (g + 1) * hd];
                match hd {
                    64 => scores_for::<T, 64>(qrow, &krow, ctx, scale, &mut scores),
                    128 => scores_for::<T, 128>(qrow, &krow, ctx, scale, &mut scores),
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
                    softmax(&mut scores[qh * ctx..(qh + 1) * ctx]);
                }
                let vrow = |p: usize| &vs[rows[p] + g * hd..rows[p] + (g + 1) * hd];
                for qh in 0..group {
                    let w = &scores[qh * ctx..(qh + 1) * ctx];
                    let out = &mut o[qh * hd..(qh + 1) * hd];
                    match hd {
                        64 => weighted_sum::<T, 64>(w, &vrow, out),
                        128 => weighted_sum::<T, 128>(w, &vrow, out),
                        _ => {
                            for (p, &wp) in w.iter().enumerate() {
                                axpy(out, wp, vrow(p));
                            }
                        }
                    }
                }
            });
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
    // Each sequence's cache row offsets by position, computed once per call: looking the slot up
    // per position and head (a division by the block size each time) cost more than the
    // arithmetic it fed.
    let seq_rows: Vec<Vec<usize>> = seqs
        .iter()
        .map(|s| {
            (0..s.start_pos + s.q_len)
                .map(|p| slot_of(&s.block_table, p, bs) * kv_dim)
                .collect()
        })
        .collect();
    let q = q.contiguous()?;
    let mut out = vec![0f32; n_tokens * h * hd];
    let a = Attend {
        h,
        hd,
        group,
        scale,
        row_seq: &row_seq,
        seq_rows: &seq_rows,
    };
    with_cpu_slice(&q, |qs| match k_cache.dtype() {
        DType::F16 => with_cpu_slice_of::<half::f16, _>(k_cache, |ks| {
            with_cpu_slice_of::<half::f16, _>(v_cache, |vs| a.run(qs, ks, vs, &mut out))
        }),
        _ => with_cpu_slice_of::<f32, _>(k_cache, |ks| {
            with_cpu_slice_of::<f32, _>(v_cache, |vs| a.run(qs, ks, vs, &mut out))
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_libm_exp() {
        // Scores spread over the range softmax sees, with a row length that leaves a scalar tail.
        let row: Vec<f32> = (0..1003)
            .map(|i| ((i * 37 % 1000) as f32 - 900.0) * 0.11)
            .collect();
        let mut got = row.clone();
        softmax(&mut got);
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = row.iter().map(|&x| ((x - m) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (g, w) in got.iter().zip(&e) {
            let w = w / sum;
            assert!((*g as f64 - w).abs() <= 1e-6 * w + 1e-30, "{g} vs {w}");
        }
    }
}
