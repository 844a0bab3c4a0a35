//! Q8_0 weights x Q8_0 activations for a batch of rows: `out[m, n] = x[m, k] . w[n, k]`.
//!
//! Weights stay in GGUF's Q8_0 layout (per 32 values: an f16 scale, then 32 i8). Activations are
//! quantized once per call the same way (ggml's `quantize_row_q8_0`). The AVX2 micro-kernel takes
//! one weight row and a tile of up to 4 activation rows: each weight block is loaded once and its
//! absolute value computed once, then used for all rows of the tile (the `maddubs` sign trick,
//! as in llama.cpp). Work is split over output columns in chunks small enough that a chunk's
//! weight rows stay in L1 while every row tile passes over them.

use half::f16;

use crate::model::team::{self, SharedMut};

use super::cpu::Isa;

/// Values per block.
pub const QK: usize = 32;
/// Values per K-quant super-block (Q4_K, Q6_K).
pub const QK_K: usize = 256;
/// Bytes per weight block: f16 scale + 32 i8.
pub const BLOCK_BYTES: usize = 34;
/// Activation rows per micro-kernel call (4 f32 accumulators plus weights fit AVX2's 16 registers).
pub(crate) const TILE_ROWS: usize = 4;
/// Output columns per parallel task: 16 weight rows of 1536 values are 26 KiB, inside L1.
const COLS_PER_TASK: usize = 16;

/// Activations quantized per 32-value block.
#[derive(Debug, Clone)]
pub struct QuantizedRows {
    pub rows: usize,
    pub blocks: usize,
    /// `rows * blocks` scales.
    pub scales: Vec<f32>,
    /// `rows * blocks * 32` quants.
    pub qs: Vec<i8>,
    /// `rows * blocks` values of scale * sum of the block's quants (Q8_1's `s`, for Q4_1's minimum).
    pub sums: Vec<f32>,
}

impl QuantizedRows {
    /// `rows` rows of `k` values (whole blocks), every quant, scale and sum zero, to be filled.
    fn zeroed(rows: usize, k: usize) -> QuantizedRows {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        let blocks = k / QK;
        QuantizedRows {
            rows,
            blocks,
            scales: vec![0f32; rows * blocks],
            qs: vec![0i8; rows * k],
            sums: vec![0f32; rows * blocks],
        }
    }
}

/// Rows per parallel task when quantizing: below two tasks' worth a call stays on the caller's
/// thread (a decode step's 16 x 1536 values take a few microseconds, less than waking the pool).
const QUANTIZE_ROWS_PER_TASK: usize = 32;

/// ggml's `quantize_row_q8_0` (scale = amax / 127, round half away from zero) for every row:
/// AVX-512 or AVX2 where the CPU has them (bit-identical to the scalar loop, tested), over all
/// threads for calls of more than `QUANTIZE_ROWS_PER_TASK` rows.
pub fn quantize_rows(x: &[f32], rows: usize, k: usize) -> QuantizedRows {
    quantize_rows_with(x, rows, k, Isa::best())
}

/// `rows` rows of `k` values, each made by `row(r, out)` into a scratch row of the task that
/// quantizes it (cache-hot, never written out as F32), quantized as `quantize_rows_with` quantizes
/// them: the same bits as making all rows, then `quantize_rows_with`. Over the threads where the
/// rows hold `par_values` values or more.
pub fn quantize_rows_of(
    rows: usize,
    k: usize,
    isa: Isa,
    par_values: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> QuantizedRows {
    let mut out = QuantizedRows::zeroed(rows, k);
    let blocks = out.blocks;
    let per = if rows * k >= par_values {
        team::per_task(rows)
    } else {
        rows.max(1)
    };
    let (q, sc, su) = (
        SharedMut(out.qs.as_mut_ptr()),
        SharedMut(out.scales.as_mut_ptr()),
        SharedMut(out.sums.as_mut_ptr()),
    );
    team::run(rows.div_ceil(per), |t| {
        let (r0, nr) = (t * per, per.min(rows - t * per));
        let mut x = vec![0f32; k];
        for r in r0..r0 + nr {
            row(r, &mut x);
            // SAFETY: task t alone owns rows r0..r0 + nr of each buffer, all inside them.
            let (q, sc, su) = unsafe {
                (
                    q.slice(r * k, k),
                    sc.slice(r * blocks, blocks),
                    su.slice(r * blocks, blocks),
                )
            };
            quantize_into(&x, q, sc, su, isa);
        }
    });
    out
}

/// Whole blocks of `x` into their quants, scales and scaled sums, with the best kernel `isa`
/// allows.
fn quantize_into(x: &[f32], qs: &mut [i8], scales: &mut [f32], sums: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx512) = isa.avx512_vnni() {
        // SAFETY: the token proves AVX-512 F/BW/VL, AVX2, FMA and F16C; the slices hold whole
        // blocks alike.
        unsafe { avx512::quantize_blocks(x, qs, scales, sums) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2, FMA and F16C; the slices hold whole blocks alike.
        unsafe { avx2::quantize_blocks(x, qs, scales, sums) };
        return;
    }
    for (i, (xb, q)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        let (d, isum) = quantize_block(xb.try_into().unwrap(), q.try_into().unwrap());
        // As ggml: quantize with the f32 scale, store it as f16 (the kernels multiply by that).
        scales[i] = f16::from_f32(d).to_f32();
        sums[i] = scales[i] * isum as f32;
    }
}

/// As `quantize_rows`, at level `isa` (tests run each).
pub fn quantize_rows_with(x: &[f32], rows: usize, k: usize, isa: Isa) -> QuantizedRows {
    assert_eq!(x.len(), rows * k);
    let mut out = QuantizedRows::zeroed(rows, k);
    let blocks = out.blocks;
    if rows >= 2 * QUANTIZE_ROWS_PER_TASK {
        let per = QUANTIZE_ROWS_PER_TASK;
        let (q, s, u) = (
            SharedMut(out.qs.as_mut_ptr()),
            SharedMut(out.scales.as_mut_ptr()),
            SharedMut(out.sums.as_mut_ptr()),
        );
        team::run(rows.div_ceil(per), |t| {
            let (r0, nr) = (t * per, per.min(rows - t * per));
            // SAFETY: task t alone owns rows r0..r0 + nr of each buffer, all inside them.
            let (q, s, u) = unsafe {
                (
                    q.slice(r0 * k, nr * k),
                    s.slice(r0 * blocks, nr * blocks),
                    u.slice(r0 * blocks, nr * blocks),
                )
            };
            quantize_into(&x[r0 * k..][..nr * k], q, s, u, isa)
        });
    } else {
        quantize_into(x, &mut out.qs, &mut out.scales, &mut out.sums, isa);
    }
    out
}

/// One 32-value block: quants into `q`; returns (the f32 scale `amax / 127`, the quants' sum).
#[inline]
fn quantize_block(xb: &[f32; QK], q: &mut [i8; QK]) -> (f32, i32) {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut isum = 0i32;
    for (qv, v) in q.iter_mut().zip(xb) {
        *qv = (v * id).round().clamp(-127.0, 127.0) as i8;
        isum += *qv as i32;
    }
    (d, isum)
}

#[inline]
fn weight_scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// Scalar reference: dot products of weight row `w` with activation rows `r0..r0+nr`.
pub fn tile_scalar(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32; TILE_ROWS]) {
    for (r, o) in out.iter_mut().enumerate().take(nr) {
        let row = r0 + r;
        let mut sum = 0f32;
        for b in 0..a.blocks {
            let wb = &w[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            let aq = &a.qs[(row * a.blocks + b) * QK..(row * a.blocks + b + 1) * QK];
            let mut isum = 0i32;
            for i in 0..QK {
                isum += (wb[2 + i] as i8) as i32 * aq[i] as i32;
            }
            sum += isum as f32 * weight_scale(wb) * a.scales[row * a.blocks + b];
        }
        *o = sum;
    }
}

/// `avx2::quantize_blocks` with a block in two 512-bit registers and sixteen blocks a group
/// (`quantize_group`): the same operations a value (the product with `1 / d`, truncation, the step
/// away from zero where the dropped fraction is at least one half, the clamp), so the same quants,
/// scales and sums in fewer instructions.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; `x` and `qs` hold
    /// `scales.len()` blocks, `sums` as many values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn quantize_blocks(x: &[f32], qs: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
        let blocks = scales.len();
        assert!(x.len() == blocks * QK && qs.len() == blocks * QK && sums.len() == blocks);
        let abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fff_ffff));
        let groups = blocks / GROUP;
        for g in 0..groups {
            quantize_group(x, qs, scales, sums, g * GROUP);
        }
        for i in groups * GROUP..blocks {
            let xp = x.as_ptr().add(i * QK);
            let v = [_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16))];
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_and_ps(v[0], abs),
                _mm512_and_ps(v[1], abs),
            ));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            let isum = _mm512_reduce_add_epi32(quantize_with(v, id, qs.as_mut_ptr().add(i * QK)));
            super::avx2::store_scale(d, isum, i, scales, sums);
        }
    }

    /// A block's 32 values `v` times `id`, rounded half away from zero as `f32::round` does,
    /// clamped to +-127 and stored at `q`; returns the quants' sums in sixteen lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL; `q` points to 32 writable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quantize_with(v: [__m512; 2], id: __m512, q: *mut i8) -> __m512i {
        let abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fff_ffff));
        let sign = _mm512_castsi512_ps(_mm512_set1_epi32(i32::MIN));
        let (half, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0));
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let ints = v.map(|v| {
            let x = _mm512_mul_ps(v, id);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
            let frac = _mm512_and_ps(_mm512_sub_ps(x, t), abs);
            let away = _mm512_or_ps(_mm512_and_ps(x, sign), one);
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
            let r = _mm512_mask_add_ps(t, up, t, away);
            _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi))
        });
        _mm_storeu_si128(q as *mut __m128i, _mm512_cvtepi32_epi8(ints[0]));
        _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(ints[1]));
        _mm512_add_epi32(ints[0], ints[1])
    }

    /// Blocks quantized together by `quantize_group`.
    const GROUP: usize = 16;

    /// Blocks `first..first + GROUP` as `quantize_blocks` does them one by one, to the bit, with
    /// the per-block scalar work done once for the group: the sixteen maxima and integer sums
    /// reduced across registers together (`transpose_reduce`), the scales and their reciprocals
    /// divided in one register, rounded through F16 and stored sixteen at a time. One block at a
    /// time, those reductions and divisions were most of a block's ~15 ns.
    ///
    /// # Safety
    /// As `quantize_blocks`; blocks `first..first + GROUP` exist.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn quantize_group(
        x: &[f32],
        qs: &mut [i8],
        scales: &mut [f32],
        sums: &mut [f32],
        first: usize,
    ) {
        debug_assert!((first + GROUP) * QK <= x.len() && first + GROUP <= scales.len());
        let abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fff_ffff));
        let one = _mm512_set1_ps(1.0);
        let xp = x.as_ptr().add(first * QK);
        let maxima: [__m512; GROUP] = std::array::from_fn(|b| {
            let p = xp.add(b * QK);
            _mm512_max_ps(
                _mm512_and_ps(_mm512_loadu_ps(p), abs),
                _mm512_and_ps(_mm512_loadu_ps(p.add(16)), abs),
            )
        });
        let amax = transpose_reduce(maxima, |a, b| _mm512_max_ps(a, b));
        let d = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
        let mut ids = [0f32; GROUP];
        _mm512_storeu_ps(ids.as_mut_ptr(), _mm512_maskz_div_ps(nonzero, one, d));
        let sums_i: [__m512; GROUP] = std::array::from_fn(|b| {
            let p = xp.add(b * QK);
            let v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
            let ints = quantize_with(
                v,
                _mm512_set1_ps(ids[b]),
                qs.as_mut_ptr().add((first + b) * QK),
            );
            _mm512_castsi512_ps(ints)
        });
        let isum = _mm512_castps_si512(transpose_reduce(sums_i, |a, b| {
            _mm512_castsi512_ps(_mm512_add_epi32(
                _mm512_castps_si512(a),
                _mm512_castps_si512(b),
            ))
        }));
        // The scales rounded to F16 and back (to nearest even, as `store_scale`), then the sums.
        let s = _mm512_cvtph_ps(_mm512_cvtps_ph::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(d));
        _mm512_storeu_ps(scales.as_mut_ptr().add(first), s);
        _mm512_storeu_ps(
            sums.as_mut_ptr().add(first),
            _mm512_mul_ps(s, _mm512_cvtepi32_ps(isum)),
        );
    }

    /// Lane `b` of the result is `v[b]`'s sixteen lanes combined by `op` (associative and
    /// commutative: max, integer add), for all sixteen registers at once: halves, then quarters,
    /// then pairs and single lanes are combined across registers, 15 shuffles and ops a step
    /// instead of 16 separate horizontal reductions.
    #[inline(always)]
    unsafe fn transpose_reduce(v: [__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
        // 256-bit halves: register j holds v[2j] in lanes 0-7 and v[2j+1] in lanes 8-15.
        let h: [__m512; 8] = std::array::from_fn(|j| {
            let (a, b) = (v[2 * j], v[2 * j + 1]);
            op(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        // 128-bit quarters: register j holds v[4j + q] in quarter q.
        let q: [__m512; 4] = std::array::from_fn(|j| {
            let (a, b) = (h[2 * j], h[2 * j + 1]);
            op(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        // Within quarters: register j's quarter q holds two partials of v[4 * 2j + q] and two
        // of v[4 * (2j + 1) + q].
        let p: [__m512; 2] = std::array::from_fn(|j| {
            let (a, b) = (q[2 * j], q[2 * j + 1]);
            op(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        // Quarter q now holds v[q], v[4 + q], v[8 + q], v[12 + q]: lane 4q + j is v[4j + q].
        let r = op(
            _mm512_shuffle_ps::<0b10_00_10_00>(p[0], p[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(p[0], p[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, r)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Horizontal sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// `quantize_block`'s loop in AVX2, to the bit: the same product `v * id`, then round half
    /// away from zero as `f32::round` does (truncate, then step away from zero where the dropped
    /// fraction is at least one half: exact, unlike adding 0.5), the same clamp.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_block(xb: &[f32; QK], q: &mut [i8; QK]) -> (f32, i32) {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let sum = quantize_with(v, id, q);
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        (d, _mm_cvtsi128_si32(s))
    }

    /// A block's 32 values `v` times `id`, rounded half away from zero as `f32::round` does
    /// (truncate, then step away from zero where the dropped fraction is at least one half:
    /// exact, unlike adding 0.5), clamped to +-127 and stored into `q`; returns the quants' sums
    /// in eight lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_with(v: [__m256; 4], id: __m256, q: &mut [i8; QK]) -> __m256i {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let mut sum = _mm256_setzero_si256();
        let ints: [__m256i; 4] = std::array::from_fn(|i| {
            let x = _mm256_mul_ps(v[i], id);
            let t = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let frac = _mm256_and_ps(_mm256_sub_ps(x, t), abs);
            let away = _mm256_or_ps(_mm256_and_ps(x, sign), one);
            let step = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), away);
            let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, step), lo), hi);
            let r = _mm256_cvttps_epi32(r);
            sum = _mm256_add_epi32(sum, r);
            r
        });
        // Pack 4 x 8 i32 into 32 i8; the packs interleave 128-bit lanes, the permute undoes it.
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, p);
        sum
    }

    /// Blocks quantized together by `quantize_group`.
    const GROUP: usize = 8;

    /// Blocks `first..first + GROUP` as `quantize_block` and `store_scale` do them one by one,
    /// to the bit, with the per-block scalar work done once for the group (as the AVX-512
    /// path's `quantize_group`): the eight maxima and integer sums reduced across registers
    /// together, the scales and reciprocals divided in one register, rounded through F16 and
    /// stored eight at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; blocks `first..first + GROUP` exist in `x`,
    /// `qs`, `scales` and `sums`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quantize_group(
        x: &[f32],
        qs: &mut [i8],
        scales: &mut [f32],
        sums: &mut [f32],
        first: usize,
    ) {
        debug_assert!((first + GROUP) * QK <= x.len() && first + GROUP <= scales.len());
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let xp = x.as_ptr().add(first * QK);
        let load = |b: usize| -> [__m256; 4] {
            std::array::from_fn(|i| _mm256_loadu_ps(xp.add(b * QK + 8 * i)))
        };
        let maxima: [__m256; GROUP] = std::array::from_fn(|b| {
            let v = load(b);
            _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            )
        });
        let amax = transpose_reduce(maxima, |a, b| _mm256_max_ps(a, b));
        let d = _mm256_div_ps(amax, _mm256_set1_ps(127.0));
        let nonzero = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ);
        let mut ids = [0f32; GROUP];
        _mm256_storeu_ps(
            ids.as_mut_ptr(),
            _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), d), nonzero),
        );
        let sums_i: [__m256; GROUP] = std::array::from_fn(|b| {
            let q = &mut *(qs.as_mut_ptr().add((first + b) * QK) as *mut [i8; QK]);
            _mm256_castsi256_ps(quantize_with(load(b), _mm256_set1_ps(ids[b]), q))
        });
        let isum = _mm256_castps_si256(transpose_reduce(sums_i, |a, b| {
            _mm256_castsi256_ps(_mm256_add_epi32(
                _mm256_castps_si256(a),
                _mm256_castps_si256(b),
            ))
        }));
        // The scales rounded to F16 and back (to nearest even, as `store_scale`), then the sums.
        let s = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(d));
        _mm256_storeu_ps(scales.as_mut_ptr().add(first), s);
        _mm256_storeu_ps(
            sums.as_mut_ptr().add(first),
            _mm256_mul_ps(s, _mm256_cvtepi32_ps(isum)),
        );
    }

    /// Lane `b` of the result is `v[b]`'s eight lanes combined by `op` (associative and
    /// commutative: max, integer add), for all eight registers at once: halves, then pairs,
    /// then single lanes combined across registers.
    #[inline(always)]
    unsafe fn transpose_reduce(v: [__m256; 8], op: impl Fn(__m256, __m256) -> __m256) -> __m256 {
        // 128-bit halves: register j holds v[2j] in lanes 0-3 and v[2j+1] in lanes 4-7.
        let h: [__m256; 4] = std::array::from_fn(|j| {
            let (a, b) = (v[2 * j], v[2 * j + 1]);
            op(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        });
        // Within halves: register j's half k holds two partials of v[4j + k] and two of
        // v[4j + 2 + k].
        let p: [__m256; 2] = std::array::from_fn(|j| {
            let (a, b) = (h[2 * j], h[2 * j + 1]);
            op(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        // Half k now holds v[k], v[2 + k], v[4 + k], v[6 + k]: lane 4k + j is v[2j + k].
        let r = op(
            _mm256_shuffle_ps::<0b10_00_10_00>(p[0], p[1]),
            _mm256_shuffle_ps::<0b11_01_11_01>(p[0], p[1]),
        );
        _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// `quantize_rows`' loop over consecutive blocks, to the bit: each block as `quantize_block`,
    /// its scale as `store_scale`, all inlined into one loop (a call a block, and `half`'s
    /// run-time dispatch a scale, cost more than the block's arithmetic).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `x` and `qs` hold `scales.len()` blocks, `sums`
    /// as many values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_blocks(x: &[f32], qs: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
        let blocks = scales.len();
        assert!(x.len() == blocks * QK && qs.len() == blocks * QK && sums.len() == blocks);
        let groups = blocks / GROUP;
        for g in 0..groups {
            quantize_group(x, qs, scales, sums, g * GROUP);
        }
        for i in groups * GROUP..blocks {
            let xb = &*(x.as_ptr().add(i * QK) as *const [f32; QK]);
            let q = &mut *(qs.as_mut_ptr().add(i * QK) as *mut [i8; QK]);
            let (d, isum) = quantize_block(xb, q);
            store_scale(d, isum, i, scales, sums);
        }
    }

    /// Block `i`'s scale `d` rounded to f16 and back with F16C (to nearest even, as `half` does,
    /// without its run-time dispatch), and its sum `scale * isum`.
    ///
    /// # Safety
    /// The CPU must support F16C; `i` is inside `scales` and `sums`.
    #[inline]
    #[target_feature(enable = "f16c")]
    pub(super) unsafe fn store_scale(
        d: f32,
        isum: i32,
        i: usize,
        scales: &mut [f32],
        sums: &mut [f32],
    ) {
        let s = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
            _mm_set_ss(d),
        )));
        *scales.get_unchecked_mut(i) = s;
        *sums.get_unchecked_mut(i) = s * isum as f32;
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` must hold `a.blocks` blocks; rows `r0..r0+NR` must
    /// exist in `a`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32; TILE_ROWS],
    ) {
        debug_assert!(w.len() >= a.blocks * BLOCK_BYTES && r0 + NR <= a.rows);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let wb = wp.add(b * BLOCK_BYTES);
            let dw = f16::from_bits(u16::from_le_bytes([*wb, *wb.add(1)])).to_f32();
            let wv = _mm256_loadu_si256(wb.add(2) as *const __m256i);
            let aw = _mm256_sign_epi8(wv, wv);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let av = _mm256_loadu_si256(ap.add((row * a.blocks + b) * QK) as *const __m256i);
                let sa = _mm256_sign_epi8(av, wv);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones);
                let d = _mm256_set1_ps(dw * *a.scales.get_unchecked(row * a.blocks + b));
                *acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, *acc_r);
            }
        }
        for r in 0..NR {
            out[r] = hsum(acc[r]);
        }
    }
}

/// GGUF Q8_0 bytes (per 32 values: f16 scale, 32 i8) for `[n, k]` values, quantized as
/// `quantize_rows` does (tests and the kernel benchmark build weights with it).
pub fn to_gguf_bytes(w: &[f32], n: usize, k: usize) -> Vec<u8> {
    let q = quantize_rows(w, n, k);
    let mut bytes = Vec::with_capacity(n * k / QK * BLOCK_BYTES);
    for (s, qs) in q.scales.iter().zip(q.qs.chunks_exact(QK)) {
        bytes.extend_from_slice(&f16::from_f32(*s).to_le_bytes());
        bytes.extend(qs.iter().map(|&v| v as u8));
    }
    bytes
}

/// One weight row against rows `r0..r0+nr` (`nr <= 4`), with the best kernel this CPU has.
fn tile(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32; TILE_ROWS], isa: Isa) {
    assert!(nr <= TILE_ROWS && r0 + nr <= a.rows && w.len() >= a.blocks * BLOCK_BYTES);
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2 and FMA; bounds asserted above.
        unsafe { dispatch_rows!(nr, avx2::tile(w, a, r0, out)) }
        return;
    }
    tile_scalar(w, a, r0, nr, out);
}

/// `out[m, n] = x[m, k] . w[n, k]` for Q8_0 weights `w` (`n * k / 32` blocks).
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    matmul_with(x, m, k, w, n, Isa::best())
}

/// As `matmul`, at level `isa` (tests run each).
pub fn matmul_with(x: &[f32], m: usize, k: usize, w: &[u8], n: usize, isa: Isa) -> Vec<f32> {
    tiled_matmul(x, m, k, w, n, BLOCK_BYTES, |wrow, a, r0, nr, res| {
        tile(wrow, a, r0, nr, res, isa)
    })
}

/// The driver every quantized kernel shares: quantizes the activations once, splits output columns
/// into tasks of `COLS_PER_TASK` (each task's weight rows stay in L1 while every tile of up to
/// `TILE_ROWS` activation rows passes over them), and calls `tile` for one weight row and one row
/// tile. `block_bytes` is the weight type's bytes per 32 values.
pub(crate) fn tiled_matmul(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    n: usize,
    block_bytes: usize,
    tile: impl Fn(&[u8], &QuantizedRows, usize, usize, &mut [f32; TILE_ROWS]) + Sync,
) -> Vec<f32> {
    assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
    let row_bytes = k / QK * block_bytes;
    assert_eq!(w.len(), n * row_bytes, "weight bytes for [{n}, {k}]");
    let a = quantize_rows(x, m, k);
    // Transposed result: each task owns a contiguous run of output columns.
    let mut out_t = vec![0f32; n * m];
    team::chunks_mut(&mut out_t, COLS_PER_TASK * m, 1, |ci, chunk| {
        let c0 = ci * COLS_PER_TASK;
        let mut res = [0f32; TILE_ROWS];
        for (j, col) in chunk.chunks_mut(m).enumerate() {
            let wrow = &w[(c0 + j) * row_bytes..(c0 + j + 1) * row_bytes];
            let mut r0 = 0;
            while r0 < m {
                let nr = (m - r0).min(TILE_ROWS);
                tile(wrow, &a, r0, nr, &mut res);
                col[r0..r0 + nr].copy_from_slice(&res[..nr]);
                r0 += nr;
            }
        }
    });
    let mut out = vec![0f32; m * n];
    for (j, col) in out_t.chunks_exact(m).enumerate() {
        for (r, v) in col.iter().enumerate() {
            out[r * n + j] = *v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::model::kernels::test_data::lcg;

    #[test]
    fn matches_dequantized_reference() {
        let (m, k, n) = (5, 96, 7);
        let x = lcg(1, m * k);
        let wf = lcg(2, n * k);
        let w = to_gguf_bytes(&wf, n, k);
        let got = matmul(&x, m, k, &w, n);
        // Reference in f64 on dequantized weights and dequantized activations.
        let a = quantize_rows(&x, m, k);
        for r in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for b in 0..k / QK {
                    let wb = &w[(j * k / QK + b) * BLOCK_BYTES..];
                    for i in 0..QK {
                        let wv = weight_scale(wb) as f64 * (wb[2 + i] as i8) as f64;
                        let av = a.scales[r * k / QK + b] as f64 * a.qs[r * k + b * QK + i] as f64;
                        s += wv * av;
                    }
                }
                assert!(
                    (got[r * n + j] as f64 - s).abs() < 1e-3,
                    "({r},{j}): {} vs {s}",
                    got[r * n + j]
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The AVX2 quantizer equals the scalar one to the bit, ties included: with `ties`, some
        /// blocks have amax 127 (so `v * id` is `v`) and their other values on halves (-15.5 to
        /// 14.5), and some blocks are all zero.
        #[test]
        fn simd_quantizer_equals_scalar(rows in 1usize..80, kb in 1usize..5, seed in any::<u64>(), ties in any::<bool>()) {
            let k = kb * QK;
            let mut x = crate::model::kernels::test_data::lcg(seed, rows * k);
            for (b, xb) in x.chunks_exact_mut(QK).enumerate() {
                match (b % 3, ties) {
                    (0, true) => xb.iter_mut().enumerate().for_each(|(i, v)| {
                        *v = if i == 31 { 127.0 } else { i as f32 - 15.5 }
                    }),
                    (1, true) => xb.fill(0.0),
                    _ => {}
                }
            }
            let s = quantize_rows_with(&x, rows, k, Isa::Scalar);
            for isa in Isa::simd_levels_for_test("simd_quantizer_equals_scalar") {
                let v = quantize_rows_with(&x, rows, k, isa);
                prop_assert_eq!(&s.qs, &v.qs);
                prop_assert_eq!(&s.scales, &v.scales);
                prop_assert_eq!(&s.sums, &v.sums);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// SIMD and scalar kernels agree on odd shapes (rows not a multiple of the tile, columns not
        /// a multiple of the task chunk).
        #[test]
        fn simd_equals_scalar(m in 1usize..11, kb in 1usize..7, n in 1usize..40, seed in any::<u64>()) {
            let k = kb * QK;
            let x = lcg(seed, m * k);
            let w = to_gguf_bytes(&lcg(seed ^ 0xabc, n * k), n, k);
            let s = matmul_with(&x, m, k, &w, n, Isa::Scalar);
            for isa in Isa::simd_levels_for_test("q8_0 simd_equals_scalar") {
                let v = matmul_with(&x, m, k, &w, n, isa);
                for (a, b) in s.iter().zip(&v) {
                    prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{isa:?}: {a} vs {b}");
                }
            }
        }
    }
}
