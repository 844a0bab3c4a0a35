//! Q4_K weights repacked eight rows at a time, keeping its compact scales: 4.75 bits a value
//! against 6 for Q4_K stored as Q4_1 blocks (`q4_1x8::Repacked::from_q4_k`), for the decode steps
//! of large Llama 3 models, which are bound by the bytes of weights they read.
//!
//! A Q4_K super-block (256 values) holds f16 `d` and `dmin` and, per 32-value sub-block `j`, a
//! 6-bit scale `sc_j` and minimum `m_j`: value `d * sc_j * q - dmin * m_j`. Per group of 8 rows
//! and super-block: 8 f32 `d`, 8 f32 `dmin`, the 8 x 8 scales and 8 x 8 minimums as bytes
//! (sub-block-major, so one 8-byte load gives a sub-block's 8 columns), then each sub-block's
//! nibbles in `q4_1x8`'s interleaving. The kernel is `q4_1x8`'s with the sub-block's scale and
//! minimum vectors made on the fly (`d * sc_j`, `dmin * m_j`: exact in f32, as in the Q4_1 form),
//! once per group and sub-block for all the tile's rows.

use half::f16;
use rayon::prelude::*;

use super::cpu::Isa;

use super::q4_1x8::nibble_at;
use super::q8_0::{QuantizedRows, QK, QK_K};
use super::q8_0x8::{RowGroups, GROUP, TILE_ROWS};

/// Bytes per GGUF Q4_K super-block: f16 `d`, f16 `dmin`, 12 bytes of scales, 128 of nibbles.
pub const Q4_K_BLOCK_BYTES: usize = 144;
/// 32-value sub-blocks per super-block.
const SUBS: usize = QK_K / QK;
/// Offsets in a (group, super-block): `d`, `dmin`, scales, minimums, nibbles.
const D: usize = 0;
const DMIN: usize = GROUP * 4;
const SC: usize = 2 * GROUP * 4;
const MN: usize = SC + SUBS * GROUP;
const QS: usize = MN + SUBS * GROUP;
/// Nibble bytes per (group, sub-block).
const SUB_BYTES: usize = GROUP * QK / 2;
/// Bytes per (group, super-block).
pub const GROUP_SUPER_BYTES: usize = QS + SUBS * SUB_BYTES;

/// A `[n, k]` Q4_K matrix in the 8-row layout.
#[derive(Debug, Clone)]
pub struct Repacked {
    pub n: usize,
    pub k: usize,
    data: Vec<u8>,
}

impl Repacked {
    /// Repacks GGUF Q4_K bytes (`n` rows of `k / 256` super-blocks of 144 bytes).
    pub fn from_q4_k(bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(
            k.is_multiple_of(QK_K),
            "k = {k} is not a multiple of {QK_K}"
        );
        let supers = k / QK_K;
        let row_bytes = supers * Q4_K_BLOCK_BYTES;
        assert_eq!(bytes.len(), n * row_bytes, "Q4_K bytes for [{n}, {k}]");
        let mut data = vec![0u8; n.div_ceil(GROUP) * supers * GROUP_SUPER_BYTES];
        data.par_chunks_mut(supers * GROUP_SUPER_BYTES)
            .enumerate()
            .for_each(|(g, dst)| {
                for sb in 0..supers {
                    let gs = &mut dst[sb * GROUP_SUPER_BYTES..(sb + 1) * GROUP_SUPER_BYTES];
                    for r in 0..GROUP {
                        let row = g * GROUP + r;
                        if row >= n {
                            continue;
                        }
                        let src =
                            &bytes[row * row_bytes + sb * Q4_K_BLOCK_BYTES..][..Q4_K_BLOCK_BYTES];
                        let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
                        let dmin = f16::from_le_bytes([src[2], src[3]]).to_f32();
                        gs[D + r * 4..D + r * 4 + 4].copy_from_slice(&d.to_le_bytes());
                        gs[DMIN + r * 4..DMIN + r * 4 + 4].copy_from_slice(&dmin.to_le_bytes());
                        for j in 0..SUBS {
                            let (sc, m) = q4_k_scale_min(j, src[4..16].try_into().unwrap());
                            gs[SC + j * GROUP + r] = sc;
                            gs[MN + j * GROUP + r] = m;
                            // Sub-blocks 2c and 2c + 1: low and high nibbles of bytes 32c..32c + 32.
                            let q = &src[16 + 32 * (j / 2)..][..32];
                            for (i, &byte) in q.iter().enumerate() {
                                let v = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                                let (at, high) = nibble_at(r, i);
                                gs[QS + j * SUB_BYTES + at] |= if high { v << 4 } else { v };
                            }
                        }
                    }
                }
            });
        Repacked { n, k, data }
    }

    fn supers(&self) -> usize {
        self.k / QK_K
    }
}

/// ggml's unpacking of Q4_K's 6-bit (scale, minimum) pair `j` (0..8) from its 12 bytes.
fn q4_k_scale_min(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Row `r`'s (scale, minimum) of sub-block `j` in a group super-block: `(d * sc_j, dmin * m_j)`.
#[inline]
fn scale_min(gs: &[u8], r: usize, j: usize) -> (f32, f32) {
    let f = |at: usize| f32::from_le_bytes(gs[at..at + 4].try_into().unwrap());
    (
        f(D + r * 4) * gs[SC + j * GROUP + r] as f32,
        f(DMIN + r * 4) * gs[MN + j * GROUP + r] as f32,
    )
}

#[inline]
fn quant(gs: &[u8], r: usize, j: usize, i: usize) -> u8 {
    let (at, high) = nibble_at(r, i);
    let b = gs[QS + j * SUB_BYTES + at];
    if high {
        b >> 4
    } else {
        b & 0x0F
    }
}

impl RowGroups for Repacked {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn groups(&self, g: usize, count: usize) -> &[u8] {
        let len = self.supers() * GROUP_SUPER_BYTES;
        &self.data[g * len..(g + count) * len]
    }

    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.n && out.len() == self.k);
        let (g, r) = (row / GROUP, row % GROUP);
        let data = self.group(g);
        for (b, ob) in out.chunks_exact_mut(QK).enumerate() {
            let (gs, j) = (&data[(b / SUBS) * GROUP_SUPER_BYTES..], b % SUBS);
            let (d, m) = scale_min(gs, r, j);
            for (i, o) in ob.iter_mut().enumerate() {
                *o = d * quant(gs, r, j, i) as f32 - m;
            }
        }
    }

    fn tile(&self, w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa) {
        tile(w, a, r0, nr, out, isa)
    }
}

/// Scalar reference: one group against rows `r0..r0+nr`; `out` is `nr x 8`.
pub fn tile_scalar(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32]) {
    for r in 0..nr {
        let row = r0 + r;
        for c in 0..GROUP {
            let mut sum = 0f32;
            for b in 0..a.blocks {
                let (gs, j) = (&w[(b / SUBS) * GROUP_SUPER_BYTES..], b % SUBS);
                let (d, m) = scale_min(gs, c, j);
                let aq = &a.qs[(row * a.blocks + b) * QK..][..QK];
                let isum: i32 = (0..QK)
                    .map(|i| quant(gs, c, j, i) as i32 * aq[i] as i32)
                    .sum();
                let ai = row * a.blocks + b;
                sum += d * a.scales[ai] * isum as f32 - m * a.sums[ai];
            }
            out[r * GROUP + c] = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::q4_1x8::avx2::nibble_sums;
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` must hold `a.blocks / 8` group super-blocks; rows
    /// `r0..r0+NR` must exist in `a`; `out` must hold `NR * 8` values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const NR: usize>(w: &[u8], a: &QuantizedRows, r0: usize, out: &mut [f32]) {
        debug_assert!(w.len() >= a.blocks / SUBS * GROUP_SUPER_BYTES && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * GROUP);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        for sb in 0..a.blocks / SUBS {
            let gs = wp.add(sb * GROUP_SUPER_BYTES);
            let dv = _mm256_loadu_ps(gs.add(D) as *const f32);
            let mv = _mm256_loadu_ps(gs.add(DMIN) as *const f32);
            for j in 0..SUBS {
                let b = sb * SUBS + j;
                let s16 = nibble_sums::<NR>(gs.add(QS + j * SUB_BYTES), a, r0, b);
                let bytes8 = |at: usize| {
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        gs.add(at + j * GROUP) as *const __m128i,
                    )))
                };
                let dw = _mm256_mul_ps(dv, bytes8(SC));
                let mw = _mm256_mul_ps(mv, bytes8(MN));
                for r in 0..NR {
                    let ai = (r0 + r) * a.blocks + b;
                    let isum = _mm256_madd_epi16(s16[r], ones);
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(*a.scales.get_unchecked(ai)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[r]);
                    acc[r] =
                        _mm256_fnmadd_ps(mw, _mm256_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP), *v);
        }
    }
}

/// One group against rows `r0..r0+nr` (`nr <= 4`) into `out` (`nr x 8`).
fn tile(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa) {
    assert!(
        a.blocks.is_multiple_of(SUBS),
        "{} blocks are not whole super-blocks",
        a.blocks
    );
    assert!(nr <= TILE_ROWS && r0 + nr <= a.rows);
    assert!(w.len() >= a.blocks / SUBS * GROUP_SUPER_BYTES && out.len() >= nr * GROUP);
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2 and FMA; bounds asserted above.
        unsafe { dispatch_rows!(nr, avx2::tile(w, a, r0, out)) }
        return;
    }
    tile_scalar(w, a, r0, nr, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::q8_0::quantize_rows;
    use crate::model::kernels::test_data::{assert_matches_reference, candle_quantized, lcg};
    use candle_core::quantized::GgmlDType;
    use proptest::prelude::*;

    #[test]
    fn rows_read_back_exactly_as_candle_dequantizes_them() {
        let (k, n) = (768, 11);
        let (bytes, deq) = candle_quantized(31, n, k, GgmlDType::Q4K);
        let rp = Repacked::from_q4_k(&bytes, n, k);
        let mut got = vec![0f32; k];
        for j in 0..n {
            rp.dequantize_row(j, &mut got);
            assert_eq!(got, deq[j * k..(j + 1) * k], "row {j}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The SIMD and scalar kernels both match an f64 reference on candle's dequantized
        /// weights and the quantized activations, on odd shapes.
        #[test]
        fn products_match_a_reference(m in 1usize..11, kb in 1usize..4, n in 1usize..30, seed in any::<u64>()) {
            let k = kb * QK_K;
            let (bytes, deq) = candle_quantized(seed, n, k, GgmlDType::Q4K);
            let rp = Repacked::from_q4_k(&bytes, n, k);
            let x = lcg(seed ^ 0x55, m * k);
            let a = quantize_rows(&x, m, k);
            for isa in Isa::available() {
                assert_matches_reference(&rp.matmul_with(&x, m, isa), &a, &deq, n);
            }
        }
    }
}
