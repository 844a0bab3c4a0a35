//! `silu(gate) * up`, the MLP's activation, for rows on the CPU.
//!
//! candle's `silu` calls libm's `expf` once per value, on one thread. Here `exp` is the attention
//! softmax's polynomial (`attn::exp8_minus`, within 2 ulp of libm), eight values at a time on
//! AVX2 and sixteen on AVX-512 (`exp16_minus`, the same bits), and rows are spread over the
//! threads. Both layer paths (`llama.rs`: plain rows and candle ops on CPU)
//! call this one function, so they stay equal to the bit.

use std::mem::MaybeUninit;

use crate::model::team;

use super::cpu::Isa;
use super::q8_0::{quantize_rows_of, QuantizedRows};

/// Values from which a call spreads over the threads: below it the work is shorter than handing
/// half to the other worker (called from a pool thread as a step does, a 16-row decode step's
/// 24,576 values took 13.1 µs on one thread and 10.7 µs on two).
const PAR_VALUES: usize = 8192;

/// The scalar formula, candle's: `g / (exp(-g) + 1) * u`.
#[inline]
fn silu_mul_scalar(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        o.write(g / ((-g).exp() + 1.0) * u);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::attn::exp8_minus;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// # Safety
    /// The CPU must support AVX2 and FMA; the slices must have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
        let n8 = out.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        // exp(-g) overflows f32 past 88.7: clamp there (silu is then -0.0 to within 1e-36).
        let top = _mm256_set1_ps(88.0);
        for i in (0..n8).step_by(8) {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let e = exp8_minus(
                _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), top),
                0.0,
            );
            let s = _mm256_div_ps(gv, _mm256_add_ps(e, one));
            _mm256_storeu_ps((out.as_mut_ptr() as *mut f32).add(i), _mm256_mul_ps(s, uv));
        }
        super::silu_mul_scalar(&g[n8..], &u[n8..], &mut out[n8..]);
    }
}

/// `avx2::silu_mul` on 512-bit vectors: the same operations on each lane (`attn::exp16_minus` is
/// `exp8_minus` at twice the width), so the same bits, in half the instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::super::attn::exp16_minus;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// # Safety
    /// The CPU must support AVX-512 F, AVX2 and FMA; the slices must have equal lengths.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
        let n16 = out.len() / 16 * 16;
        for i in (0..n16).step_by(16) {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let uv = _mm512_loadu_ps(u.as_ptr().add(i));
            _mm512_storeu_ps((out.as_mut_ptr() as *mut f32).add(i), silu_mul16(gv, uv));
        }
        super::avx2::silu_mul(&g[n16..], &u[n16..], &mut out[n16..]);
    }

    /// Sixteen lanes of `silu(g) * u` (the tile units' fused MLP epilogue calls it too, so both
    /// paths give these bits).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(crate) unsafe fn silu_mul16(gv: __m512, uv: __m512) -> __m512 {
        let zero = _mm512_setzero_ps();
        // exp(-g) overflows f32 past 88.7: clamp there, as the 256-bit kernel does.
        let e = exp16_minus(
            _mm512_min_ps(_mm512_sub_ps(zero, gv), _mm512_set1_ps(88.0)),
            zero,
        );
        let s = _mm512_div_ps(gv, _mm512_add_ps(e, _mm512_set1_ps(1.0)));
        _mm512_mul_ps(s, uv)
    }
}

/// `out = silu(g) * u` element by element, with the best kernel `isa` allows.
fn silu_mul_with(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>], isa: Isa) {
    assert!(g.len() == out.len() && u.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx512) = isa.avx512_vnni() {
        // SAFETY: the token proves AVX-512 F (with VNNI), AVX2 and FMA; lengths asserted above.
        unsafe { avx512::silu_mul(g, u, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2 and FMA; lengths asserted above.
        unsafe { avx2::silu_mul(g, u, out) };
        return;
    }
    silu_mul_scalar(g, u, out);
}

/// `silu(gate) * up` for `rows` rows of `width` values each: `gate` and `up` are read at row
/// strides `g_stride` / `u_stride` (so one `[gate | up]` matrix serves); the result is
/// `rows x width`, written into fresh capacity (never zeroed first: at a prompt's 512 rows the
/// zeroing cost as much as the activation).
pub fn silu_mul_rows(
    gate: &[f32],
    g_stride: usize,
    up: &[f32],
    u_stride: usize,
    width: usize,
    rows: usize,
) -> Vec<f32> {
    let isa = Isa::best();
    let mut out = Vec::with_capacity(rows * width);
    let row = |(r, o): (usize, &mut [MaybeUninit<f32>])| {
        let g = &gate[r * g_stride..][..width];
        let u = &up[r * u_stride..][..width];
        silu_mul_with(g, u, o, isa);
    };
    let spare = &mut out.spare_capacity_mut()[..rows * width];
    if rows * width >= PAR_VALUES {
        team::chunks_mut(spare, width, team::per_task(rows), |r, o| row((r, o)));
    } else {
        spare.chunks_mut(width).enumerate().for_each(row);
    }
    // SAFETY: every row's `width` values were written above (each level writes its whole slice).
    unsafe { out.set_len(rows * width) };
    out
}

/// `silu_mul_rows` quantized for the next projection (`q8_0::quantize_rows_of`): each row's
/// activation made in a scratch row and quantized at once, so the `rows x width` F32 result is
/// never written out and read back. The same bits as `quantize_rows(silu_mul_rows(..))` (test).
pub fn silu_mul_quantized(
    gate: &[f32],
    g_stride: usize,
    up: &[f32],
    u_stride: usize,
    width: usize,
    rows: usize,
) -> QuantizedRows {
    silu_mul_quantized_with(gate, g_stride, up, u_stride, width, rows, Isa::best())
}

fn silu_mul_quantized_with(
    gate: &[f32],
    g_stride: usize,
    up: &[f32],
    u_stride: usize,
    width: usize,
    rows: usize,
    isa: Isa,
) -> QuantizedRows {
    quantize_rows_of(rows, width, isa, PAR_VALUES, |r, out| {
        let g = &gate[r * g_stride..][..width];
        let u = &up[r * u_stride..][..width];
        // SAFETY: `f32` and `MaybeUninit<f32>` have the same layout, and every value written
        // through the view is a valid `f32`.
        let out = unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) };
        silu_mul_with(g, u, out, isa);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::test_data::lcg;
    use proptest::prelude::*;

    /// `silu_mul_with` into a new vector.
    fn run(g: &[f32], u: &[f32], isa: Isa) -> Vec<f32> {
        let mut out = Vec::with_capacity(g.len());
        silu_mul_with(g, u, &mut out.spare_capacity_mut()[..g.len()], isa);
        // SAFETY: every level writes the whole slice.
        unsafe { out.set_len(g.len()) };
        out
    }

    /// Within 4 ulp of the scalar formula (`exp` within 2 ulp of libm's, then a division).
    fn assert_close(g: &[f32], u: &[f32]) {
        let n = g.len();
        let s = run(g, u, Isa::Scalar);
        for isa in Isa::simd_levels_for_test("silu simd_matches_the_scalar_formula") {
            let v = run(g, u, isa);
            for i in 0..n {
                let tol = 4.0 * f32::EPSILON * s[i].abs() + 1e-30;
                assert!(
                    (s[i] - v[i]).abs() <= tol,
                    "g={} u={}: {} vs {}",
                    g[i],
                    u[i],
                    s[i],
                    v[i]
                );
            }
        }
    }

    #[test]
    fn simd_matches_the_scalar_formula_in_the_tails() {
        let g = [
            0.0, -0.0, 87.0, -87.0, 90.0, -90.0, 200.0, -200.0, 1e-30, -1e-30,
        ];
        assert_close(&g, &[1.5; 10]);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The AVX2 kernel against the scalar formula on odd lengths (the tail past the last
        /// 8 values goes through the scalar loop) over activation-sized and larger values.
        #[test]
        fn simd_matches_the_scalar_formula(n in 1usize..300, scale in 0.1f32..40.0, seed in any::<u64>()) {
            let g: Vec<f32> = lcg(seed, n).iter().map(|v| v * scale).collect();
            assert_close(&g, &lcg(seed ^ 1, n));
        }

        /// Every SIMD level gives the AVX2 kernel's bits (the 512-bit one runs the same
        /// operations a lane; its tail past the last 16 values goes through the AVX2 one), so
        /// the level a CPU picks changes no reply; the tails of `exp` included.
        #[test]
        fn simd_levels_agree_to_the_bit(n in 1usize..300, scale in 0.1f32..120.0, seed in any::<u64>()) {
            let Some(avx2) = crate::model::kernels::cpu::Avx2::detect() else {
                return Ok(());
            };
            let g: Vec<f32> = lcg(seed, n).iter().map(|v| v * scale).collect();
            let u = lcg(seed ^ 1, n);
            let want = run(&g, &u, Isa::Avx2(avx2));
            for isa in Isa::simd_levels_for_test("silu simd_levels_agree_to_the_bit") {
                let got = run(&g, &u, isa);
                let (w, o): (Vec<u32>, Vec<u32>) =
                    (want.iter().map(|v| v.to_bits()).collect(), got.iter().map(|v| v.to_bits()).collect());
                prop_assert_eq!(w, o, "{}", isa.name());
            }
        }
    }

    /// The fused activation and quantization gives the bits of the two steps apart, at every
    /// level, from one row (on the caller's thread) to a prompt's (over the threads).
    #[test]
    fn quantized_activations_equal_the_two_steps_apart() {
        use crate::model::kernels::q8_0::quantize_rows_with;
        for (rows, width) in [(1, 64), (3, 1536), (16, 1536), (70, 96)] {
            let gu: Vec<f32> = lcg(rows as u64, rows * 2 * width)
                .iter()
                .map(|v| v * 6.0)
                .collect();
            for isa in Isa::available() {
                let fused = silu_mul_quantized_with(
                    &gu,
                    2 * width,
                    &gu[width..],
                    2 * width,
                    width,
                    rows,
                    isa,
                );
                let act: Vec<f32> = (0..rows)
                    .flat_map(|r| {
                        let row = &gu[r * 2 * width..][..2 * width];
                        run(&row[..width], &row[width..], isa)
                    })
                    .collect();
                let apart = quantize_rows_with(&act, rows, width, isa);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(fused.qs, apart.qs, "{rows} x {width}, {}", isa.name());
                assert_eq!(bits(&fused.scales), bits(&apart.scales), "{}", isa.name());
                assert_eq!(bits(&fused.sums), bits(&apart.sums), "{}", isa.name());
            }
        }
    }

    #[test]
    fn rows_read_at_their_strides() {
        let (rows, width) = (5, 40);
        let gu = lcg(3, rows * 2 * width);
        let out = silu_mul_rows(&gu, 2 * width, &gu[width..], 2 * width, width, rows);
        for r in 0..rows {
            let row = &gu[r * 2 * width..][..2 * width];
            let want = run(&row[..width], &row[width..], Isa::best());
            assert_eq!(&out[r * width..][..width], &want[..]);
        }
    }
}
