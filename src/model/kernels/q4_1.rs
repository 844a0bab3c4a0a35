//! Q4_1 weights x Q8 activations for a batch of rows: `out[m, n] = x[m, k] . w[n, k]`.
//!
//! Decode is bound by how many weight bytes each step reads: Q4_1 is 20 bytes per 32 values where
//! the Q8_0 that candle needs for SIMD is 34, so keeping the file's Q4_1 reads 41% less. Weights
//! stay in GGUF's layout (per 32 values: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles: value
//! j is the low nibble of byte j, value j+16 its high nibble). With activations quantized per
//! block (scale `da`, quants `qa`, and `sa = da * sum(qa)`), a block's dot product is
//! `d * da * sum(q * qa) + m * sa`. The nibbles are unsigned, so AVX2's `maddubs` takes them as they
//! are (15 * 127 * 2 cannot saturate). Same tiling as `q8_0`: a weight row against up to 4
//! activation rows, columns split across threads.

use half::f16;

use super::q8_0::{has_avx2, tiled_matmul, QuantizedRows, QK, TILE_ROWS};

/// Bytes per weight block: f16 scale, f16 minimum, 16 bytes of nibbles.
pub const BLOCK_BYTES: usize = 20;

#[inline]
fn scale_min(block: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([block[0], block[1]]).to_f32(),
        f16::from_le_bytes([block[2], block[3]]).to_f32(),
    )
}

/// Scalar reference: weight row `w` against activation rows `r0..r0+nr`.
pub fn tile_scalar(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32; TILE_ROWS]) {
    for (r, o) in out.iter_mut().enumerate().take(nr) {
        let row = r0 + r;
        let mut sum = 0f32;
        for b in 0..a.blocks {
            let wb = &w[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            let (d, m) = scale_min(wb);
            let aq = &a.qs[(row * a.blocks + b) * QK..(row * a.blocks + b + 1) * QK];
            let mut isum = 0i32;
            for j in 0..16 {
                isum += (wb[4 + j] & 0x0F) as i32 * aq[j] as i32;
                isum += (wb[4 + j] >> 4) as i32 * aq[j + 16] as i32;
            }
            let i = row * a.blocks + b;
            sum += d * a.scales[i] * isum as f32 + m * a.sums[i];
        }
        *o = sum;
    }
}

/// Dequantizes rows of Q4_1 bytes into `out` (`rows * blocks * 32` values).
pub fn dequantize_row(w: &[u8], out: &mut [f32]) {
    for (ob, b) in out.chunks_exact_mut(QK).zip(w.chunks_exact(BLOCK_BYTES)) {
        let (d, m) = scale_min(b);
        for j in 0..16 {
            ob[j] = (b[4 + j] & 0x0F) as f32 * d + m;
            ob[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::q8_0::avx2::hsum;
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA must be available; `w` holds `a.blocks` blocks; rows `r0..r0+NR` exist.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32; TILE_ROWS],
    ) {
        debug_assert!(w.len() >= a.blocks * BLOCK_BYTES && r0 + NR <= a.rows);
        let ones = _mm256_set1_epi16(1);
        let low = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); NR];
        let mut mins = [0f32; NR];
        let wp = w.as_ptr();
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let wb = wp.add(b * BLOCK_BYTES);
            let d = f16::from_bits(u16::from_le_bytes([*wb, *wb.add(1)])).to_f32();
            let m = f16::from_bits(u16::from_le_bytes([*wb.add(2), *wb.add(3)])).to_f32();
            let bytes = _mm_loadu_si128(wb.add(4) as *const __m128i);
            let lo = _mm_and_si128(bytes, low);
            let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
            let q = _mm256_set_m128i(hi, lo);
            for r in 0..NR {
                let i = (r0 + r) * a.blocks + b;
                let av = _mm256_loadu_si256(ap.add(i * QK) as *const __m256i);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), ones);
                let s = _mm256_set1_ps(d * *a.scales.get_unchecked(i));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r]);
                mins[r] += m * *a.sums.get_unchecked(i);
            }
        }
        for r in 0..NR {
            out[r] = hsum(acc[r]) + mins[r];
        }
    }
}

fn tile(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32; TILE_ROWS], simd: bool) {
    assert!(nr <= TILE_ROWS && r0 + nr <= a.rows && w.len() >= a.blocks * BLOCK_BYTES);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA were detected; bounds asserted above.
        unsafe {
            match nr {
                4 => avx2::tile::<4>(w, a, r0, out),
                3 => avx2::tile::<3>(w, a, r0, out),
                2 => avx2::tile::<2>(w, a, r0, out),
                _ => avx2::tile::<1>(w, a, r0, out),
            }
        }
        return;
    }
    let _ = simd;
    tile_scalar(w, a, r0, nr, out);
}

/// `out[m, n] = x[m, k] . w[n, k]` for Q4_1 weights `w`.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    matmul_with(x, m, k, w, n, has_avx2())
}

pub fn matmul_with(x: &[f32], m: usize, k: usize, w: &[u8], n: usize, simd: bool) -> Vec<f32> {
    tiled_matmul(x, m, k, w, n, BLOCK_BYTES, |wrow, a, r0, nr, res| {
        tile(wrow, a, r0, nr, res, simd)
    })
}

#[cfg(test)]
mod tests {
    use super::super::q8_0::quantize_rows;
    use super::*;
    use proptest::prelude::*;

    fn lcg(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect()
    }

    /// Random but valid Q4_1 blocks (finite f16 scales and minimums).
    fn weights(seed: u64, n: usize, k: usize) -> Vec<u8> {
        let mut w = lcg(seed, n * k / QK * BLOCK_BYTES);
        for b in w.chunks_exact_mut(BLOCK_BYTES) {
            let d = f16::from_f32((b[0] as f32 + 1.0) / 2000.0);
            let m = f16::from_f32((b[2] as f32 - 128.0) / 1000.0);
            b[..2].copy_from_slice(&d.to_le_bytes());
            b[2..4].copy_from_slice(&m.to_le_bytes());
        }
        w
    }

    fn acts(seed: u64, n: usize) -> Vec<f32> {
        lcg(seed, n)
            .iter()
            .map(|&v| v as f32 / 128.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_the_dequantized_product() {
        let (m, k, n) = (3, 64, 5);
        let w = weights(7, n, k);
        let x = acts(9, m * k);
        let got = matmul(&x, m, k, &w, n);
        let a = quantize_rows(&x, m, k);
        for r in 0..m {
            for j in 0..n {
                let mut wf = vec![0f32; k];
                dequantize_row(
                    &w[j * k / QK * BLOCK_BYTES..(j + 1) * k / QK * BLOCK_BYTES],
                    &mut wf,
                );
                let mut s = 0f64;
                for (i, wv) in wf.iter().enumerate() {
                    let av = a.scales[r * k / QK + i / QK] as f64 * a.qs[r * k + i] as f64;
                    s += *wv as f64 * av;
                }
                assert!(
                    (got[r * n + j] as f64 - s).abs() < 1e-3,
                    "({r},{j}) {} vs {s}",
                    got[r * n + j]
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        #[test]
        fn simd_equals_scalar(m in 1usize..11, kb in 1usize..7, n in 1usize..40, seed in any::<u64>()) {
            let k = kb * QK;
            let w = weights(seed, n, k);
            let x = acts(seed ^ 0x55, m * k);
            let s = matmul_with(&x, m, k, &w, n, false);
            let v = matmul_with(&x, m, k, &w, n, true);
            for (a, b) in s.iter().zip(&v) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
    }
}
