//! RMS norm over rows on the CPU: `out = x / sqrt(mean(x^2) + eps) * weight`.
//!
//! The arithmetic is fixed to the bit, since both layer paths (`llama.rs`: plain rows, and candle
//! ops on CPU) call this one function and a quantized model's logits move by up to ~1 with any
//! change of rounding (activations are rounded to 8 bits before each matmul): the squares summed
//! in eight lanes (lane `l` takes values `l, l + 8, ...` one after another), the lanes added in
//! order, then each value divided by the root and multiplied by its weight. The SIMD kernels do
//! exactly those operations a lane (IEEE division and square root are correctly rounded at any
//! width), so every level gives the scalar reference's bits; they only run them 8 (AVX2) or 16
//! (AVX-512, the division) at a time. Outputs are written into fresh capacity, never zeroed
//! first: at a prompt's 512 rows the zeroing cost as much as the norm.

use std::mem::MaybeUninit;

use crate::model::team;

use super::cpu::Isa;

/// Rows from which a call spreads over the threads: below it a call is shorter than handing half
/// to the other worker (576-wide rows, called from a pool thread as a step does: 32 rows 7.4 µs
/// on one thread and 8.1 µs on two, 64 rows 14.1 and 11.8 µs).
const PAR_ROWS: usize = 48;

/// The eight lanes' sum of squares of `x`, in the reference order.
#[inline]
fn lanes_scalar(x: &[f32]) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for c in x.chunks(8) {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    lanes
}

/// `sqrt(sum of the lanes in order / width + eps)`.
#[inline]
fn root(lanes: [f32; 8], width: usize, eps: f32) -> f32 {
    (lanes.iter().sum::<f32>() / width as f32 + eps).sqrt()
}

/// `out = x / m * w`, value by value (the reference, and the SIMD levels' tails).
#[inline]
fn divide_scalar(x: &[f32], w: &[f32], m: f32, out: &mut [MaybeUninit<f32>]) {
    for ((o, &v), &a) in out.iter_mut().zip(x).zip(w) {
        o.write(v / m * a);
    }
}

/// The scalar reference for one row.
fn row_scalar(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    divide_scalar(x, w, root(lanes_scalar(x), x.len(), eps), out);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// The squares' lanes: whole chunks of 8 in one register (`acc += v * v`, unfused as the
    /// reference), the partial last chunk by the scalar loop.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn lanes(x: &[f32]) -> [f32; 8] {
        let n8 = x.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for (l, v) in lanes.iter_mut().zip(&x[n8..]) {
            *l += v * v;
        }
        lanes
    }

    /// `divide_scalar` 8 values at a time, the rest by it.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` and `out` at least as long as `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn divide(x: &[f32], w: &[f32], m: f32, out: &mut [MaybeUninit<f32>]) {
        let n = x.len();
        assert!(w.len() >= n && out.len() >= n);
        let mv = _mm256_set1_ps(m);
        let n8 = n / 8 * 8;
        let o = out.as_mut_ptr() as *mut f32;
        for i in (0..n8).step_by(8) {
            let v = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(i)), mv);
            _mm256_storeu_ps(
                o.add(i),
                _mm256_mul_ps(v, _mm256_loadu_ps(w.as_ptr().add(i))),
            );
        }
        divide_scalar(&x[n8..], &w[n8..n], m, &mut out[n8..n]);
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` and `out` at least as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
        divide(x, w, root(lanes(x), x.len(), eps), out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// `avx2::row` with the division and the weights 16 values at a time (the rest by
    /// `avx2::divide`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, AVX2 and FMA; `w` and `out` at least as long as `x`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn row(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
        let n = x.len();
        assert!(w.len() >= n && out.len() >= n);
        let m = root(super::avx2::lanes(x), n, eps);
        let mv = _mm512_set1_ps(m);
        let n16 = n / 16 * 16;
        let o = out.as_mut_ptr() as *mut f32;
        for i in (0..n16).step_by(16) {
            let v = _mm512_div_ps(_mm512_loadu_ps(x.as_ptr().add(i)), mv);
            _mm512_storeu_ps(
                o.add(i),
                _mm512_mul_ps(v, _mm512_loadu_ps(w.as_ptr().add(i))),
            );
        }
        super::avx2::divide(&x[n16..], &w[n16..n], m, &mut out[n16..n]);
    }
}

/// One row at level `isa`.
fn row_with(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(_avx512) = isa.avx512_vnni() {
            // SAFETY: the token proves AVX-512 F (with VNNI), AVX2 and FMA; lengths checked inside.
            return unsafe { avx512::row(x, w, eps, out) };
        }
        if let Some(_avx2) = isa.avx2() {
            // SAFETY: the token proves AVX2 and FMA; lengths checked inside.
            return unsafe { avx2::row(x, w, eps, out) };
        }
    }
    row_scalar(x, w, eps, out);
}

/// RMS norm of one row `x` with `weight` into `out` (every value written), at level `isa`: the
/// bits `rms_norm_rows` gives that row (the tile units' input tiles are filled row by row).
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [MaybeUninit<f32>], isa: Isa) {
    assert!(weight.len() == x.len() && out.len() == x.len());
    row_with(x, weight, eps, out, isa);
}

/// RMS norm of each `width`-wide row of `x` with `weight` (`width` values), at the best level.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, width: usize) -> Vec<f32> {
    rms_norm_rows_with(x, weight, eps, width, Isa::best())
}

/// As `rms_norm_rows`, at level `isa` (tests run each).
pub fn rms_norm_rows_with(x: &[f32], weight: &[f32], eps: f32, width: usize, isa: Isa) -> Vec<f32> {
    assert!(width > 0 && x.len().is_multiple_of(width) && weight.len() == width);
    let mut out = Vec::with_capacity(x.len());
    let spare = &mut out.spare_capacity_mut()[..x.len()];
    let norm = |(o, xr): (&mut [MaybeUninit<f32>], &[f32])| row_with(xr, weight, eps, o, isa);
    let rows = x.len() / width;
    if rows >= PAR_ROWS {
        team::chunks_mut(spare, width, team::per_task(rows), |r, o| {
            norm((o, &x[r * width..][..width]))
        });
    } else {
        spare.chunks_mut(width).zip(x.chunks(width)).for_each(norm);
    }
    // SAFETY: every row's `width` values were written above (each level writes its whole row).
    unsafe { out.set_len(x.len()) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::test_data::lcg;
    use proptest::prelude::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Every level gives the scalar reference's bits, on widths with and without a partial chunk of
        /// 8 or 16, one row and enough rows to go parallel, small and large values.
        #[test]
        fn every_level_gives_the_scalar_bits(width in 1usize..80, rows in prop_oneof![1usize..4, 32usize..40], scale in prop_oneof![Just(1e-3f32), Just(1.0f32), Just(300.0f32)], seed in any::<u64>()) {
            let x: Vec<f32> = lcg(seed, rows * width).iter().map(|v| v * scale).collect();
            let w: Vec<f32> = lcg(seed ^ 7, width).iter().map(|v| v + 1.5).collect();
            let want = bits(&rms_norm_rows_with(&x, &w, 1e-5, width, Isa::Scalar));
            for isa in Isa::simd_levels_for_test("every_level_gives_the_scalar_bits") {
                prop_assert_eq!(&bits(&rms_norm_rows_with(&x, &w, 1e-5, width, isa)), &want, "{}", isa.name());
            }
        }
    }

    #[test]
    fn zero_rows_give_zeros_from_eps() {
        let out = rms_norm_rows(&[0.0; 32], &[2.0; 16], 1e-5, 16);
        assert!(out.iter().all(|v| *v == 0.0));
    }
}
