//! F32 rows rounded to F16: the step's keys and values on their way into an F16 cache.
//!
//! Why by hand: `half`'s slice conversion goes through F16C eight values at a time via a copy to
//! a buffer and a call per chunk, about a cycle a value, which made the conversion the larger
//! part of a prefill step's cache write (docs/performance.md). Here AVX2's F16C (`vcvtps2ph`)
//! runs inline over the slice. The rounding is the same: to nearest, ties to even, as
//! `half::f16::from_f32` (the scalar path, and the reference the test compares against).

use super::cpu::Isa;

/// `dst[i] = f16(src[i])` for every value, F16C eight at a time where the CPU has AVX2 (whose
/// token implies F16C), else one at a time.
pub fn round_to_f16(isa: Isa, src: &[f32], dst: &mut [half::f16]) {
    assert_eq!(src.len(), dst.len(), "one F16 for each F32");
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves F16C; the lengths are equal (checked).
        unsafe { x86::round(src, dst) };
        return;
    }
    let _ = isa;
    scalar(src, dst);
}

/// The reference: `half`'s rounding, one value at a time.
fn scalar(src: &[f32], dst: &mut [half::f16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// F16C and AVX; `dst.len() == src.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn round(src: &[f32], dst: &mut [half::f16]) {
        let n = src.len();
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr() as *mut __m128i);
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(sp.add(i)));
            _mm_storeu_si128(dp.cast::<u16>().add(i).cast(), h);
            i += 8;
        }
        super::scalar(&src[i..], &mut dst[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(0x16), ..ProptestConfig::default() })]
        /// Every level rounds as `half::f16::from_f32`, bit for bit: ordinary values, values
        /// beyond F16's range, subnormal results, ties, infinities and zeros of both signs (a
        /// cache's values are never NaN, whose payloads are not compared).
        #[test]
        fn every_level_rounds_as_half_does(
            bits in prop::collection::vec(any::<u32>(), 0..70),
            scale in prop::sample::select(vec![1e-6f32, 1e-3, 1.0, 300.0, 7e4]),
        ) {
            let mut src: Vec<f32> = bits
                .iter()
                .map(|&b| (b as i32 as f32 / i32::MAX as f32) * scale)
                .collect();
            src.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 65520.0, 1.0 + 1.0 / 2048.0, 5.96e-8]);
            let want: Vec<u16> = src.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
            for isa in Isa::available() {
                let mut got = vec![half::f16::ZERO; src.len()];
                round_to_f16(isa, &src, &mut got);
                let got: Vec<u16> = got.iter().map(|h| h.to_bits()).collect();
                prop_assert_eq!(&got, &want, "{:?}", isa);
            }
        }
    }
}
