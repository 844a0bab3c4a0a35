//! Q4_1 weights repacked eight rows at a time, times Q8_0 activations (`q8_0x8`'s layout idea for
//! 4-bit weights; the default model is Q4_1).
//!
//! A Q4_1 value is `d * q + m` with `q` in 0..16, so a block's dot product with an activation block
//! (scale `da`, quants `qa`, `sa = da * sum(qa)`) is `d * da * sum(q * qa) + m * sa`. Per group of
//! 8 rows and 32-value block: 8 f16 scales `d`, 8 f16 minimums `m` (as the file stores them; the
//! kernel widens them with F16C), then 4 x 32 bytes of nibbles: 20 bytes a row and block, as in
//! the file (single-stream decode reads every weight byte once a token, so the layout keeps the
//! file's size). Byte `r * 4 + i` of the `s`-th 32 bytes holds row `r`'s value `8s + i` in its low
//! nibble and value `8s + 4 + i` in its high nibble, so one load and two masks give two 4-value
//! steps of `q8_0x8`'s kernel for 8 rows. The nibbles are unsigned, so `maddubs` takes them as
//! they are, and its 16-bit sums (at most 2 * 15 * 127 per lane and step) stay exact over a whole
//! block's 8 steps: one `madd` per block instead of one per step. Q4_0 (`d * (q - 8)`) is repacked
//! into the same layout with minimum `-8 d` (exact in f16) and runs on the same kernel. Q4_K has
//! its own layout (`q4_kx8`). Every tile prefetches the weights it reads next
//! (`kernels::prefetch_ahead`): at the few rows of a decode step it waits on them.

use half::f16;
use rayon::prelude::*;

use super::cpu::Isa;
use super::{lines, prefetch_ahead, Lines};

use super::q8_0::{QuantizedRows, QK};
use super::q8_0x8::{matmul_grouped, pair_by_halves, RowGroups, GROUP, PAIR_TILE_ROWS, TILE_ROWS};

/// Rows from which the 16-column pair kernel runs: with fewer, each weight is used by one tile
/// only, and read from memory the pair kernel ran 1.5-2.5x slower than the one-group one (the
/// output projection at 1-4 rows); from 8 rows, where the tiles reuse a pair from L1, it was as
/// fast or faster (`docs/performance.md`, "Two groups a tile").
pub(crate) const PAIR_MIN_ROWS: usize = 8;
/// Bytes per GGUF Q4_1 block: f16 scale, f16 minimum, 16 bytes of nibbles.
pub const BLOCK_BYTES: usize = 20;
/// Bytes per GGUF Q4_0 block: f16 scale, 16 bytes of nibbles.
pub const Q4_0_BLOCK_BYTES: usize = 18;
/// Bytes per (group, block): 8 f16 scales, 8 f16 minimums, 8 x 16 bytes of nibbles.
pub const GROUP_BLOCK_BYTES: usize = GROUP * 4 + GROUP * QK / 2;
/// Offset of the minimums in a group block.
const MINS: usize = GROUP * 2;
/// Offset of the nibbles in a group block.
const QS: usize = GROUP * 4;

/// A `[n, k]` Q4_1 matrix in the 8-row layout.
#[derive(Debug, Clone)]
pub struct Repacked {
    pub n: usize,
    pub k: usize,
    data: Lines<u8>,
}

/// Where row `r`'s value `i` (0..32) of a block sits: (byte offset from `QS`, high nibble?).
#[inline]
pub(crate) fn nibble_at(r: usize, i: usize) -> (usize, bool) {
    let (s, j) = (i / 8, i % 8);
    (s * 32 + r * 4 + j % 4, j >= 4)
}

impl Repacked {
    /// Repacks `n` rows of `k / 32` blocks given block by block: `block(row, b)` is block `b` of
    /// `row` as (scale, minimum, the 32 values' quants 0..16 in order).
    fn from_blocks(
        n: usize,
        k: usize,
        block: impl Fn(usize, usize) -> (f16, f16, [u8; QK]) + Sync,
    ) -> Self {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        let blocks = k / QK;
        let mut data = lines(0u8, n.div_ceil(GROUP) * blocks * GROUP_BLOCK_BYTES);
        data.par_chunks_mut(blocks * GROUP_BLOCK_BYTES)
            .enumerate()
            .for_each(|(g, dst)| {
                for b in 0..blocks {
                    let gb = &mut dst[b * GROUP_BLOCK_BYTES..(b + 1) * GROUP_BLOCK_BYTES];
                    for r in 0..GROUP {
                        let row = g * GROUP + r;
                        if row >= n {
                            continue;
                        }
                        let (d, m, qs) = block(row, b);
                        gb[r * 2..r * 2 + 2].copy_from_slice(&d.to_le_bytes());
                        gb[MINS + r * 2..MINS + r * 2 + 2].copy_from_slice(&m.to_le_bytes());
                        for (i, &q) in qs.iter().enumerate() {
                            debug_assert!(q < 16);
                            let (at, high) = nibble_at(r, i);
                            gb[QS + at] |= if high { q << 4 } else { q };
                        }
                    }
                }
            });
        Repacked { n, k, data }
    }

    /// Repacks GGUF Q4_1 bytes (`n` rows of `k / 32` blocks).
    pub fn from_q4_1(bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        let row_bytes = k / QK * BLOCK_BYTES;
        assert_eq!(bytes.len(), n * row_bytes, "Q4_1 bytes for [{n}, {k}]");
        Self::from_blocks(n, k, |row, b| {
            let src = &bytes[row * row_bytes + b * BLOCK_BYTES..][..BLOCK_BYTES];
            let d = f16::from_le_bytes([src[0], src[1]]);
            let m = f16::from_le_bytes([src[2], src[3]]);
            // GGUF: value j is the low nibble of byte j, value j + 16 its high one.
            let qs = std::array::from_fn(|i| {
                if i < 16 {
                    src[4 + i] & 0x0F
                } else {
                    src[4 + i - 16] >> 4
                }
            });
            (d, m, qs)
        })
    }

    /// Repacks GGUF Q4_0 bytes (`n` rows of `k / 32` blocks of f16 scale + 16 bytes of nibbles,
    /// value `d * (q - 8)`): the same layout with minimum `-8 d`, so Q4_0 runs on this kernel too.
    pub fn from_q4_0(bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        assert_eq!(
            bytes.len(),
            n * k / QK * Q4_0_BLOCK_BYTES,
            "Q4_0 bytes for [{n}, {k}]"
        );
        // As Q4_1 blocks: the scale, a minimum of -8 * scale, the same nibbles.
        let mut q4_1 = Vec::with_capacity(n * k / QK * BLOCK_BYTES);
        for b in bytes.chunks_exact(Q4_0_BLOCK_BYTES) {
            let d = f16::from_le_bytes([b[0], b[1]]);
            q4_1.extend_from_slice(&d.to_le_bytes());
            q4_1.extend_from_slice(&f16::from_f32(-8.0 * d.to_f32()).to_le_bytes());
            q4_1.extend_from_slice(&b[2..]);
        }
        Self::from_q4_1(&q4_1, n, k)
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }
}

impl RowGroups for Repacked {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn groups(&self, g: usize, count: usize) -> &[u8] {
        let len = self.blocks() * GROUP_BLOCK_BYTES;
        &self.data[g * len..(g + count) * len]
    }

    /// Row `row` as f32 values.
    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.n && out.len() == self.k);
        let (g, r) = (row / GROUP, row % GROUP);
        let data = self.group(g);
        for (b, ob) in out.chunks_exact_mut(QK).enumerate() {
            let gb = &data[b * GROUP_BLOCK_BYTES..];
            let (d, m) = scale_min(gb, r);
            for (i, o) in ob.iter_mut().enumerate() {
                *o = quant(gb, r, i) as f32 * d + m;
            }
        }
    }

    fn tile(&self, w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa) {
        tile(w, a, r0, nr, out, isa)
    }

    /// On the tile units from `amx_int8::MIN_ROWS` rows where the CPU has AMX (the same values
    /// as the VNNI kernels), else the 8-row kernels.
    fn matmul_quantized_with(&self, a: &QuantizedRows, isa: Isa) -> Vec<f32> {
        if let Some(amx) = isa.amx().filter(|_| a.rows >= super::amx_int8::MIN_ROWS) {
            return super::amx_int8::matmul_q4_1(amx, self, a);
        }
        matmul_grouped(self, a, isa)
    }

    /// From `PAIR_MIN_ROWS` rows with AVX-512 VNNI (see `vnni_pair`): in tiles of
    /// `PAIR_TILE_ROWS` rows on the 512-bit kernel, of `TILE_ROWS` on the 256-bit one (its 16
    /// columns take two registers a row).
    fn pairs(&self, rows: usize, isa: Isa) -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        if let (true, Some(vnni)) = (rows >= PAIR_MIN_ROWS, isa.avx512_vnni()) {
            return Some(if vnni_pair::wide(vnni) {
                PAIR_TILE_ROWS
            } else {
                TILE_ROWS
            });
        }
        let _ = (rows, isa);
        None
    }

    fn tile_pair(
        &self,
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        nr: usize,
        out: &mut [f32],
        isa: Isa,
    ) {
        assert!(r0 + nr <= a.rows);
        assert!(w.len() >= 2 * a.blocks * GROUP_BLOCK_BYTES && out.len() >= nr * 2 * GROUP);
        #[cfg(target_arch = "x86_64")]
        if let Some(vnni) = isa.avx512_vnni() {
            // SAFETY: the token proves AVX2, FMA, F16C, AVX512F/BW/VL and AVX512VNNI; bounds
            // asserted above and here (the rows each form takes).
            unsafe {
                if vnni_pair::wide(vnni) {
                    assert!(nr <= PAIR_TILE_ROWS);
                    dispatch_pair_rows!(nr, vnni_pair::tile512(w, a, r0, out))
                } else {
                    assert!(nr <= TILE_ROWS);
                    dispatch_rows!(nr, vnni_pair::tile256(w, a, r0, out))
                }
            }
            return;
        }
        assert!(nr <= TILE_ROWS);
        let w = &w[..2 * a.blocks * GROUP_BLOCK_BYTES];
        pair_by_halves(w, nr, out, |wh, one| tile(wh, a, r0, nr, one, isa));
    }
}

#[inline]
fn scale_min(gb: &[u8], r: usize) -> (f32, f32) {
    let f = |at: usize| f16::from_le_bytes([gb[at], gb[at + 1]]).to_f32();
    (f(r * 2), f(MINS + r * 2))
}

#[inline]
fn quant(gb: &[u8], r: usize, i: usize) -> u8 {
    let (at, high) = nibble_at(r, i);
    let b = gb[QS + at];
    if high {
        b >> 4
    } else {
        b & 0x0F
    }
}

/// Scalar reference: one group against rows `r0..r0+nr`; `out` is `nr x 8`.
pub fn tile_scalar(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32]) {
    for r in 0..nr {
        let row = r0 + r;
        for c in 0..GROUP {
            let mut sum = 0f32;
            for b in 0..a.blocks {
                let gb = &w[b * GROUP_BLOCK_BYTES..];
                let (d, m) = scale_min(gb, c);
                let aq = &a.qs[(row * a.blocks + b) * QK..][..QK];
                let mut isum = 0i32;
                for (i, &av) in aq.iter().enumerate() {
                    isum += quant(gb, c, i) as i32 * av as i32;
                }
                let ai = row * a.blocks + b;
                sum += d * a.scales[ai] * isum as f32 + m * a.sums[ai];
            }
            out[r * GROUP + c] = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// The 16-bit dot products of one group's block of interleaved nibbles (`nib`, 128 bytes in
    /// this module's order) with block `b` of activation rows `r0..r0+NR`: per row, each column's
    /// sum in a pair of lanes, exact (see the module doc). Shared with `q4_kx8`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `nib` must point at 128 readable bytes; rows `r0..r0+NR` and
    /// block `b` must exist in `a`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn nibble_sums<const NR: usize>(
        nib: *const u8,
        a: &QuantizedRows,
        r0: usize,
        b: usize,
    ) -> [__m256i; NR] {
        let low = _mm256_set1_epi8(0x0F);
        let ap = a.qs.as_ptr();
        let mut s16 = [_mm256_setzero_si256(); NR];
        for s in 0..4 {
            let v = _mm256_loadu_si256(nib.add(s * 32) as *const __m256i);
            let lo = _mm256_and_si256(v, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (r, acc16) in s16.iter_mut().enumerate() {
                let at = ap.add((r0 + r) * a.blocks * QK + b * QK + s * 8) as *const i32;
                let a_lo = _mm256_set1_epi32(at.read_unaligned());
                let a_hi = _mm256_set1_epi32(at.add(1).read_unaligned());
                *acc16 = _mm256_add_epi16(*acc16, _mm256_maddubs_epi16(lo, a_lo));
                *acc16 = _mm256_add_epi16(*acc16, _mm256_maddubs_epi16(hi, a_hi));
            }
        }
        s16
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must hold `a.blocks` group blocks; rows
    /// `r0..r0+NR` must exist in `a`; `out` must hold `NR * 8` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const NR: usize>(w: &[u8], a: &QuantizedRows, r0: usize, out: &mut [f32]) {
        debug_assert!(w.len() >= a.blocks * GROUP_BLOCK_BYTES && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * GROUP);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        for b in 0..a.blocks {
            let gb = wp.add(b * GROUP_BLOCK_BYTES);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(gb);
            let s16 = nibble_sums::<NR>(gb.add(QS), a, r0, b);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(MINS) as *const __m128i));
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let isum = _mm256_madd_epi16(s16[r], ones);
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*a.scales.get_unchecked(ai)));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[r]);
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP), *v);
        }
    }
}

/// The AVX-512 VNNI kernel: `vpdpbusd` on 256-bit vectors sums each step's four nibble-activation
/// products straight into a column's 32-bit lane, where AVX2 needs `maddubs`, a 16-bit add and a
/// final `madd` (~1.15x on a prefill step of the default model).
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX512VL and AVX512VNNI; `w` must hold `a.blocks`
    /// group blocks; rows `r0..r0+NR` must exist in `a`; `out` must hold `NR * 8` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn tile<const NR: usize>(w: &[u8], a: &QuantizedRows, r0: usize, out: &mut [f32]) {
        debug_assert!(w.len() >= a.blocks * GROUP_BLOCK_BYTES && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * GROUP);
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let gb = wp.add(b * GROUP_BLOCK_BYTES);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(gb);
            let nib = gb.add(QS);
            let mut s32 = [_mm256_setzero_si256(); NR];
            for s in 0..4 {
                let v = _mm256_loadu_si256(nib.add(s * 32) as *const __m256i);
                let lo = _mm256_and_si256(v, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (r, acc32) in s32.iter_mut().enumerate() {
                    let at = ap.add((r0 + r) * a.blocks * QK + b * QK + s * 8) as *const i32;
                    let a_lo = _mm256_set1_epi32(at.read_unaligned());
                    let a_hi = _mm256_set1_epi32(at.add(1).read_unaligned());
                    *acc32 = _mm256_dpbusd_epi32(*acc32, lo, a_lo);
                    *acc32 = _mm256_dpbusd_epi32(*acc32, hi, a_hi);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(MINS) as *const __m128i));
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*a.scales.get_unchecked(ai)));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), d, acc[r]);
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP), *v);
        }
    }
}

/// Two groups (16 output columns) a call with AVX-512 VNNI: each activation broadcast feeds both
/// groups' products, so a column costs half the broadcasts, scale conversions and loop overhead of
/// the one-group kernel, whose issue slots, not its `vpdpbusd`s, bound it (48-56% of one core's
/// 8-bit peak at 4-16 rows, 66-73% for the 512-bit pair; `docs/performance.md`, "The roof
/// report"). Two forms: both groups in one 512-bit register (`tile512`), or each in a 256-bit one
/// (`tile256`). Which runs is measured once on this CPU (`wide`), not assumed: a 512-bit
/// `vpdpbusd` has the 256-bit one's peak on Zen 4 but takes one issue slot for two, and on other
/// cores 512-bit code may lower the clock.
#[cfg(target_arch = "x86_64")]
pub(crate) use vnni_pair::wide as wide_vnni_pays;

#[cfg(target_arch = "x86_64")]
mod vnni_pair {
    use super::*;
    use crate::model::kernels::cpu::{wide_pays, Avx512Vnni};
    use crate::model::kernels::q8_0::quantize_rows;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Whether `tile512` runs faster than `tile256` here: `cpu::wide_pays` with
    /// `LLAMA_RELAY_VNNI_WIDTH`, timed once (a few milliseconds) over 16 cache-resident group
    /// pairs and 4 rows. The Q8_0 pair kernel (`q8_0x8`) follows the same answer: the question is
    /// this core's 512-bit `vpdpbusd` rate and clock, which both kernels are bound by.
    pub fn wide(_vnni: Avx512Vnni) -> bool {
        static WIDE: OnceLock<bool> = OnceLock::new();
        *WIDE.get_or_init(|| {
            let (n, k) = (256, 512);
            let bytes: Vec<u8> = (0..n * k / QK * BLOCK_BYTES)
                .map(|i| (i * 131 % 251) as u8 & 0x3b)
                .collect();
            let rp = Repacked::from_q4_1(&bytes, n, k);
            let x: Vec<f32> = (0..4 * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
            let a = quantize_rows(&x, 4, k);
            let pass = |kernel: unsafe fn(&[u8], &QuantizedRows, usize, &mut [f32])| {
                let mut out = [0f32; TILE_ROWS * 2 * GROUP];
                for p in 0..n / (2 * GROUP) {
                    // SAFETY: the token proves the features; each pair of groups and the 4
                    // rows exist.
                    unsafe { kernel(rp.groups(2 * p, 2), &a, 0, &mut out) };
                    std::hint::black_box(&out);
                }
            };
            wide_pays(
                "Q4_1 pair kernel",
                "LLAMA_RELAY_VNNI_WIDTH",
                20,
                || pass(tile256::<4>),
                || pass(tile512::<4>),
            )
        })
    }

    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX512F/BW/VL and AVX512VNNI; `w` must hold two
    /// groups of `a.blocks` group blocks; rows `r0..r0+NR` must exist in `a`; `out` must hold
    /// `NR * 16` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile512<const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32],
    ) {
        let gbytes = a.blocks * GROUP_BLOCK_BYTES;
        debug_assert!(w.len() >= 2 * gbytes && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * 2 * GROUP);
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); NR];
        let (w0, w1) = (w.as_ptr(), w.as_ptr().add(gbytes));
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let (g0, g1) = (w0.add(b * GROUP_BLOCK_BYTES), w1.add(b * GROUP_BLOCK_BYTES));
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g0);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g1);
            let mut s32 = [_mm512_setzero_si512(); NR];
            for s in 0..4 {
                let v = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(
                        g0.add(QS + s * 32) as *const __m256i
                    )),
                    _mm256_loadu_si256(g1.add(QS + s * 32) as *const __m256i),
                );
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                for (r, acc32) in s32.iter_mut().enumerate() {
                    let at = ap.add((r0 + r) * a.blocks * QK + b * QK + s * 8) as *const i32;
                    let a_lo = _mm512_set1_epi32(at.read_unaligned());
                    let a_hi = _mm512_set1_epi32(at.add(1).read_unaligned());
                    *acc32 = _mm512_dpbusd_epi32(*acc32, lo, a_lo);
                    *acc32 = _mm512_dpbusd_epi32(*acc32, hi, a_hi);
                }
            }
            let halves = |at: usize| {
                _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(_mm_loadu_si128(g0.add(at) as *const __m128i)),
                    _mm_loadu_si128(g1.add(at) as *const __m128i),
                ))
            };
            let (dw, mw) = (halves(0), halves(MINS));
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*a.scales.get_unchecked(ai)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), d, acc[r]);
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * 2 * GROUP), *v);
        }
    }

    /// # Safety
    /// As `tile512`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile256<const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32],
    ) {
        let gbytes = a.blocks * GROUP_BLOCK_BYTES;
        debug_assert!(w.len() >= 2 * gbytes && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * 2 * GROUP);
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); 2]; NR];
        let (w0, w1) = (w.as_ptr(), w.as_ptr().add(gbytes));
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let (g0, g1) = (w0.add(b * GROUP_BLOCK_BYTES), w1.add(b * GROUP_BLOCK_BYTES));
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g0);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g1);
            let mut s32 = [[_mm256_setzero_si256(); 2]; NR];
            for s in 0..4 {
                let v0 = _mm256_loadu_si256(g0.add(QS + s * 32) as *const __m256i);
                let v1 = _mm256_loadu_si256(g1.add(QS + s * 32) as *const __m256i);
                let lo0 = _mm256_and_si256(v0, low);
                let hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
                let lo1 = _mm256_and_si256(v1, low);
                let hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
                for (r, acc32) in s32.iter_mut().enumerate() {
                    let at = ap.add((r0 + r) * a.blocks * QK + b * QK + s * 8) as *const i32;
                    let a_lo = _mm256_set1_epi32(at.read_unaligned());
                    let a_hi = _mm256_set1_epi32(at.add(1).read_unaligned());
                    acc32[0] = _mm256_dpbusd_epi32(acc32[0], lo0, a_lo);
                    acc32[1] = _mm256_dpbusd_epi32(acc32[1], lo1, a_lo);
                    acc32[0] = _mm256_dpbusd_epi32(acc32[0], hi0, a_hi);
                    acc32[1] = _mm256_dpbusd_epi32(acc32[1], hi1, a_hi);
                }
            }
            let dw = [g0, g1].map(|g| _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i)));
            let mw =
                [g0, g1].map(|g| _mm256_cvtph_ps(_mm_loadu_si128(g.add(MINS) as *const __m128i)));
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let sa = _mm256_set1_ps(*a.scales.get_unchecked(ai));
                let ma = _mm256_set1_ps(*a.sums.get_unchecked(ai));
                for h in 0..2 {
                    let d = _mm256_mul_ps(dw[h], sa);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r][h]), d, acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(mw[h], ma, acc[r][h]);
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * 2 * GROUP), v[0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(r * 2 * GROUP + GROUP), v[1]);
        }
    }
}

/// One group against rows `r0..r0+nr` (`nr <= 4`) into `out` (`nr x 8`).
fn tile(w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa) {
    assert!(nr <= TILE_ROWS && r0 + nr <= a.rows && w.len() >= a.blocks * GROUP_BLOCK_BYTES);
    assert!(out.len() >= nr * GROUP);
    #[cfg(target_arch = "x86_64")]
    if let Some(_vnni) = isa.avx512_vnni() {
        // SAFETY: the token proves AVX2, FMA, F16C, AVX512VL and AVX512VNNI; bounds asserted above.
        unsafe { dispatch_rows!(nr, vnni::tile(w, a, r0, out)) }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2, FMA and F16C; bounds asserted above.
        unsafe { dispatch_rows!(nr, avx2::tile(w, a, r0, out)) }
        return;
    }
    tile_scalar(w, a, r0, nr, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::q8_0::quantize_rows;
    use crate::model::kernels::test_data::assert_matches_reference;
    use proptest::prelude::*;

    fn lcg(seed: u64, n: usize) -> Vec<u64> {
        crate::model::kernels::test_data::lcg_states(seed, n)
            .into_iter()
            .map(|x| x >> 33)
            .collect()
    }

    /// Random GGUF Q4_1 bytes for `[n, k]` (scales 0.001..0.05, minimums -0.4..0).
    fn q4_1_bytes(seed: u64, n: usize, k: usize) -> Vec<u8> {
        let r = lcg(seed, n * k / QK * BLOCK_BYTES);
        let mut bytes = Vec::with_capacity(r.len());
        for blk in r.chunks_exact(BLOCK_BYTES) {
            let d = 0.001 + (blk[0] % 1000) as f32 * 0.00005;
            let m = -((blk[1] % 1000) as f32) * 0.0004;
            bytes.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            bytes.extend_from_slice(&f16::from_f32(m).to_le_bytes());
            bytes.extend(blk[4..].iter().map(|&v| v as u8));
        }
        bytes
    }

    fn xs(seed: u64, n: usize) -> Vec<f32> {
        lcg(seed, n)
            .iter()
            .map(|&v| (v % 20001) as f32 / 10000.0 - 1.0)
            .collect()
    }

    #[test]
    fn rows_read_back_as_gguf_and_products_match_a_reference() {
        // 70 rows: the driver's blocks of rows (`q8_0x8::ROW_BLOCK`) and a part block.
        let (m, k, n) = (70, 128, 21);
        let bytes = q4_1_bytes(5, n, k);
        let rp = Repacked::from_q4_1(&bytes, n, k);
        let row_bytes = k / QK * BLOCK_BYTES;
        // Rows read back as GGUF defines Q4_1: value j is the low nibble of byte j, j + 16 its
        // high one; `d * q + m`.
        let mut deq = vec![0f32; n * k];
        for j in 0..n {
            for b in 0..k / QK {
                let src = &bytes[j * row_bytes + b * BLOCK_BYTES..][..BLOCK_BYTES];
                let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
                let mm = f16::from_le_bytes([src[2], src[3]]).to_f32();
                for i in 0..16 {
                    deq[j * k + b * QK + i] = (src[4 + i] & 0x0F) as f32 * d + mm;
                    deq[j * k + b * QK + i + 16] = (src[4 + i] >> 4) as f32 * d + mm;
                }
            }
            let mut got = vec![0f32; k];
            rp.dequantize_row(j, &mut got);
            assert_eq!(got, deq[j * k..(j + 1) * k], "row {j}");
        }
        // Products against an f64 reference on those weights and the quantized activations.
        let x = xs(6, m * k);
        let a = quantize_rows(&x, m, k);
        assert_matches_reference(&rp.matmul(&x, m), &a, &deq, n);
    }

    #[test]
    fn q4_0_rows_read_back_as_gguf() {
        let (k, n) = (64, 9);
        let r = lcg(11, n * k / QK * Q4_0_BLOCK_BYTES);
        let mut bytes = Vec::new();
        for blk in r.chunks_exact(Q4_0_BLOCK_BYTES) {
            bytes.extend_from_slice(&f16::from_f32(0.001 * (1 + blk[0] % 50) as f32).to_le_bytes());
            bytes.extend(blk[2..].iter().map(|&v| v as u8));
        }
        let rp = Repacked::from_q4_0(&bytes, n, k);
        let mut got = vec![0f32; k];
        for j in 0..n {
            rp.dequantize_row(j, &mut got);
            for b in 0..k / QK {
                let src = &bytes[(j * k / QK + b) * Q4_0_BLOCK_BYTES..][..Q4_0_BLOCK_BYTES];
                let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
                for i in 0..16 {
                    let lo = ((src[2 + i] & 0x0F) as i32 - 8) as f32 * d;
                    let hi = ((src[2 + i] >> 4) as i32 - 8) as f32 * d;
                    // -8 d is exact in f16, and d * q - 8 d = d * (q - 8) exactly in f32.
                    assert_eq!(got[b * QK + i], lo);
                    assert_eq!(got[b * QK + i + 16], hi);
                }
            }
        }
    }

    /// Both forms of the VNNI pair kernel against the scalar reference, at the rows each takes
    /// (the 512-bit one up to `PAIR_TILE_ROWS`), on a CPU that has them (the matmul tests run
    /// whichever `wide` picked).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn both_pair_kernels_equal_scalar() {
        let Some(_vnni) = crate::model::kernels::cpu::Avx512Vnni::detect() else {
            eprintln!("both_pair_kernels_equal_scalar: no AVX-512 VNNI here; skipped");
            return;
        };
        let (n, k) = (16, 5 * QK);
        let rp = Repacked::from_q4_1(&q4_1_bytes(3, n, k), n, k);
        let m = PAIR_TILE_ROWS + 2;
        let x = xs(4, m * k);
        let a = quantize_rows(&x, m, k);
        type Kernel = unsafe fn(&[u8], &QuantizedRows, usize, &mut [f32]);
        let kernels: [(&str, usize, Kernel); 7] = [
            ("tile256::<4>", 4, vnni_pair::tile256::<4>),
            ("tile256::<1>", 1, vnni_pair::tile256::<1>),
            ("tile512::<16>", 16, vnni_pair::tile512::<16>),
            ("tile512::<13>", 13, vnni_pair::tile512::<13>),
            ("tile512::<8>", 8, vnni_pair::tile512::<8>),
            ("tile512::<4>", 4, vnni_pair::tile512::<4>),
            ("tile512::<1>", 1, vnni_pair::tile512::<1>),
        ];
        for (name, nr, kernel) in kernels {
            for r0 in 0..=m - nr {
                let mut got = [0f32; PAIR_TILE_ROWS * 16];
                // SAFETY: the CPU has AVX-512 VNNI (detected above); both groups and rows
                // r0..r0 + nr exist.
                unsafe { kernel(rp.groups(0, 2), &a, r0, &mut got) };
                let mut want = [0f32; PAIR_TILE_ROWS * 16];
                for (r, want) in want.chunks_exact_mut(16).take(nr).enumerate() {
                    pair_by_halves(rp.groups(0, 2), 1, want, |wh, one| {
                        tile_scalar(wh, &a, r0 + r, 1, one)
                    });
                }
                for (i, (g, w)) in got[..nr * 16].iter().zip(&want[..nr * 16]).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{name} r0 {r0} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// SIMD and scalar kernels agree on odd shapes.
        #[test]
        fn simd_equals_scalar(m in 1usize..72, kb in 1usize..7, n in 1usize..70, seed in any::<u64>()) {
            let k = kb * QK;
            let rp = Repacked::from_q4_1(&q4_1_bytes(seed, n, k), n, k);
            let x = xs(seed ^ 0x5a5a, m * k);
            let s = rp.matmul_with(&x, m, Isa::Scalar);
            for isa in Isa::simd_levels_for_test("simd_equals_scalar") {
                let v = rp.matmul_with(&x, m, isa);
                for (a, b) in s.iter().zip(&v) {
                    prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{isa:?}: {a} vs {b}");
                }
            }
        }
    }
}
