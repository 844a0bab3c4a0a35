//! Q8_0 weights repacked eight rows at a time, times Q8_0 activations: `out[m, n] = x[m, k] . w[n, k]`.
//!
//! The layout (llama.cpp's "repacked" CPU kernels follow the same idea, `ggml_gemm_q4_0_8x8_q8_0`):
//! for each group of 8 weight rows and each 32-value block, the 8 rows' f32 scales, then their
//! quants interleaved 4 bytes at a time (`[k0..4 of rows 0..8][k4..8 of rows 0..8]...`). One 32-byte
//! load then holds 4 consecutive values of 8 output columns, and one broadcast of 4 activation
//! bytes multiplies all of them: after `maddubs` + `madd` each 32-bit lane is a partial dot product
//! of one output column. A block's 8 loads leave 8 columns' integer dot products in one register,
//! scaled by a vector of 8 weight scales: no horizontal sums, no per-pair scale broadcasts. The
//! micro-kernel keeps up to 4 activation rows in registers against each weight load. With AVX-512
//! VNNI, Q8_0 (`S = 1`) runs `vpdpbusd` on the weights flipped to unsigned bytes instead (`vnni`):
//! one instruction a step and row where AVX2 needs four.
//!
//! Weights are repacked once at load; the GGUF bytes are dropped (no second copy), and the tiles
//! prefetch them ahead of use (`kernels::prefetch_ahead`). Rows past `n` in the last group are
//! zero. `dequantize_row` reads a row back (embedding lookups, dense path).
//!
//! The layout is generic over `S`, the scales per row and block: Q8_0 has one (`Repacked`); Q6_K
//! (`Q6kRepacked`) has one per 16 values, so two, and its 6-bit values are stored as i8 `q - 32`
//! (10 bits a value against Q6_K's 6.6, as in candle's repacked Q6_K tiles; exact). The kernel
//! sums each 16-value half on its own and scales it with its own vector of 8 scales.

use half::f16;
use rayon::prelude::*;

use crate::model::team::{self, SharedMut};

use super::cpu::Isa;
use super::{lines, prefetch_ahead, Lines};
use crate::model::profile::{time, Part};

#[cfg(target_arch = "x86_64")]
use super::q4_1x8::wide_vnni_pays;
use super::q4_1x8::PAIR_MIN_ROWS;
use super::q8_0::{quantize_rows, QuantizedRows, BLOCK_BYTES, QK, QK_K};

/// Weight rows per group (one AVX2 register of 32-bit lanes).
pub const GROUP: usize = 8;
/// Bytes per (group, block) with `s` scales per row and block: `s x 8` f32 scales + 8 x 32 quants.
pub const fn group_block_bytes(s: usize) -> usize {
    GROUP * 4 * s + GROUP * QK
}
/// Bytes per (group, block) of Q8_0: 8 f32 scales + 8 x 32 quants.
pub const GROUP_BLOCK_BYTES: usize = group_block_bytes(1);
/// Bytes per GGUF Q6_K super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 i8
/// scales, f16 `d`.
pub const Q6_K_BLOCK_BYTES: usize = 210;
/// Activation rows per micro-kernel call: 4 integer and 4 float accumulators, the weight vector,
/// its absolute value and a constant fit AVX2's 16 registers.
pub(crate) const TILE_ROWS: usize = 4;
/// Activation rows per call of a 512-bit pair kernel (`RowGroups::pairs`): its float
/// accumulators take 16 of the 32 registers, and the weights' decode (load, insert, mask or flip)
/// and the per-block scale loads are shared by all rows of the tile.
pub(crate) const PAIR_TILE_ROWS: usize = 16;

/// A `[n, k]` matrix of 8-bit weights in the 8-row layout, `S` scales per row and 32-value block.
#[derive(Debug, Clone)]
pub struct Rows8<const S: usize> {
    pub n: usize,
    pub k: usize,
    data: Lines<u8>,
}

/// Q8_0 in the 8-row layout.
pub type Repacked = Rows8<1>;
/// Q6_K in the 8-row layout: a scale per 16 values.
pub type Q6kRepacked = Rows8<2>;

impl<const S: usize> Rows8<S> {
    /// Values per scale.
    const SUB: usize = QK / S;
    /// Bytes per (group, block).
    const GBB: usize = group_block_bytes(S);

    /// Repacks `n` rows of `k / 32` blocks given block by block: `block(row, b)` is block `b` of
    /// `row` as (its `S` scales, its 32 quants in order).
    fn from_blocks(
        n: usize,
        k: usize,
        block: impl Fn(usize, usize) -> ([f32; S], [i8; QK]) + Sync,
    ) -> Self {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        let blocks = k / QK;
        let groups = n.div_ceil(GROUP);
        let mut data = lines(0u8, groups * blocks * Self::GBB);
        data.par_chunks_mut(blocks * Self::GBB)
            .enumerate()
            .for_each(|(g, dst)| {
                for b in 0..blocks {
                    let gb = &mut dst[b * Self::GBB..(b + 1) * Self::GBB];
                    for r in 0..GROUP {
                        let row = g * GROUP + r;
                        if row >= n {
                            continue;
                        }
                        let (d, qs) = block(row, b);
                        for (h, d) in d.iter().enumerate() {
                            let at = h * GROUP * 4 + r * 4;
                            gb[at..at + 4].copy_from_slice(&d.to_le_bytes());
                        }
                        for (i, &q) in qs.iter().enumerate() {
                            gb[Self::quant_at(r, i)] = q as u8;
                        }
                    }
                }
            });
        Rows8 { n, k, data }
    }

    /// Byte offset of row `r`'s value `i` (0..32) in a group block.
    #[inline]
    fn quant_at(r: usize, i: usize) -> usize {
        GROUP * 4 * S + (i / 4) * GROUP * 4 + r * 4 + i % 4
    }

    #[inline]
    fn scale(gb: &[u8], r: usize, h: usize) -> f32 {
        let at = h * GROUP * 4 + r * 4;
        f32::from_le_bytes(gb[at..at + 4].try_into().unwrap())
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }
}

impl Repacked {
    /// Repacks GGUF Q8_0 bytes (`n` rows of `k / 32` blocks of f16 scale + 32 i8).
    pub fn from_q8_0(bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(QK), "k = {k} is not a multiple of {QK}");
        let row_bytes = k / QK * BLOCK_BYTES;
        assert_eq!(bytes.len(), n * row_bytes, "Q8_0 bytes for [{n}, {k}]");
        Self::from_blocks(n, k, |row, b| {
            let src = &bytes[row * row_bytes + b * BLOCK_BYTES..][..BLOCK_BYTES];
            let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
            ([d], std::array::from_fn(|i| src[2 + i] as i8))
        })
    }
}

impl Q6kRepacked {
    /// Repacks GGUF Q6_K bytes (`n` rows of `k / 256` super-blocks; value
    /// `d * sc[v / 16] * (q - 32)` with `q` 6 bits: low nibble from `ql`, two high bits from
    /// `qh`). Each 32-value block keeps its two 16-value scales `d * sc`, exact in f32.
    pub fn from_q6_k(bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(
            k.is_multiple_of(QK_K),
            "k = {k} is not a multiple of {QK_K}"
        );
        let row_bytes = k / QK_K * Q6_K_BLOCK_BYTES;
        assert_eq!(bytes.len(), n * row_bytes, "Q6_K bytes for [{n}, {k}]");
        Self::from_blocks(n, k, |row, b| {
            let src = &bytes[row * row_bytes + (b / 8) * Q6_K_BLOCK_BYTES..][..Q6_K_BLOCK_BYTES];
            let (ql, qh, sc) = (&src[..128], &src[128..192], &src[192..208]);
            let d = f16::from_le_bytes([src[208], src[209]]).to_f32();
            // Values 32j..32j + 32 of the super-block: half `hf` (128 values), quarter `qq`.
            let j = b % 8;
            let (hf, qq) = (j / 4, j % 4);
            let qs = std::array::from_fn(|l| {
                let lo = ql[64 * hf + l + 32 * (qq % 2)];
                let lo = if qq < 2 { lo & 0x0F } else { lo >> 4 };
                let hi = (qh[32 * hf + l] >> (2 * qq)) & 3;
                (lo | (hi << 4)) as i8 - 32
            });
            let scale = |h: usize| d * sc[8 * hf + 2 * qq + h] as i8 as f32;
            ([scale(0), scale(1)], qs)
        })
    }
}

impl<const S: usize> RowGroups for Rows8<S> {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn groups(&self, g: usize, count: usize) -> &[u8] {
        let len = self.blocks() * Self::GBB;
        &self.data[g * len..(g + count) * len]
    }

    /// Row `row` as f32 values.
    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.n && out.len() == self.k);
        let (g, r) = (row / GROUP, row % GROUP);
        let data = self.group(g);
        for (b, ob) in out.chunks_exact_mut(QK).enumerate() {
            let gb = &data[b * Self::GBB..];
            for (i, o) in ob.iter_mut().enumerate() {
                *o = Self::scale(gb, r, i / Self::SUB) * (gb[Self::quant_at(r, i)] as i8) as f32;
            }
        }
    }

    fn tile(&self, w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa) {
        tile::<S>(w, a, r0, nr, out, isa)
    }

    /// Q8_0 from `q4_1x8::PAIR_MIN_ROWS` rows where 512-bit VNNI pays (see `vnni_pair`), in
    /// tiles of `PAIR_TILE_ROWS`.
    fn pairs(&self, rows: usize, isa: Isa) -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        if let (1, true, Some(vnni)) = (S, rows >= PAIR_MIN_ROWS, isa.avx512_vnni()) {
            return wide_vnni_pays(vnni).then_some(PAIR_TILE_ROWS);
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
        let gbytes = a.blocks * Self::GBB;
        assert!(nr <= PAIR_TILE_ROWS && r0 + nr <= a.rows);
        assert!(w.len() >= 2 * gbytes && out.len() >= nr * 2 * GROUP);
        #[cfg(target_arch = "x86_64")]
        if let (1, Some(_vnni)) = (S, isa.avx512_vnni()) {
            // SAFETY: the token proves AVX2, FMA, AVX512F/BW/VL and AVX512VNNI; S = 1, bounds
            // asserted above.
            unsafe { dispatch_pair_rows!(nr, vnni_pair::tile512(w, a, r0, out)) }
            return;
        }
        pair_by_halves(&w[..2 * gbytes], nr, out, |wh, one| {
            self.tile(wh, a, r0, nr, one, isa)
        });
    }

    /// Q8_0 on the tile units from `amx_int8::Q8_0_MIN_ROWS` rows where the CPU has AMX (the
    /// same values as the VNNI kernels), else the 8-row kernels.
    fn matmul_quantized_with(&self, a: &QuantizedRows, isa: Isa) -> Vec<f32> {
        let amx = isa
            .amx()
            .filter(|_| a.rows >= super::amx_int8::Q8_0_MIN_ROWS);
        if let (1, Some(amx)) = (S, amx) {
            return super::amx_int8::matmul_q8_0(amx, self, a);
        }
        matmul_grouped(self, a, isa)
    }
}

/// Activation rows a task takes through all its groups before the next rows: 32 rows of a
/// 576-wide input are 18 KiB of 8-bit values, which stay in L1 while the task's weights (in L2)
/// pass by them. Without blocks each pair of groups passed over all of a prompt's rows, from L2.
/// A 500-token prompt ran 1.1x faster with 32 than without, and 64 or 128 gained less (Emerald
/// Rapids; docs/performance.md, "Row blocks in the 8-row driver"). At 32 rows or fewer (decode
/// steps) the order is the same as without.
const ROW_BLOCK: usize = 32;

/// The driver the 8-row kernels share: output columns in about four tasks a thread
/// (`team::per_task`, an even count of groups where they go in pairs), each group (or pair) held in
/// L1 while the row tiles of a block of `ROW_BLOCK` rows pass over it, each tile's results copied
/// straight into the row-major `[m, n]` result (no per-task buffers to gather, and the result is
/// not zeroed first: every element is written once, which matters for the 49152-column output
/// projection). `groups(g, count)` is the bytes of groups
/// `g..g + count` (adjacent in memory); `tile(w, count, a, r0, nr, out)` writes rows
/// `r0..r0+nr` x `8 * count` columns of the `count` groups in `w` into `out`. With
/// `pairs = Some(rows)`, a task's groups go two at a time (a lone last one alone), in tiles of up
/// to `rows` activation rows; single groups in tiles of up to `TILE_ROWS`.
pub(crate) fn grouped_matmul<'w>(
    n: usize,
    a: &QuantizedRows,
    groups: impl Fn(usize, usize) -> &'w [u8] + Sync,
    pairs: Option<usize>,
    tile: impl Fn(&[u8], usize, &QuantizedRows, usize, usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let pair_rows = pairs.map_or(0, |rows| rows.clamp(1, PAIR_TILE_ROWS));
    let m = a.rows;
    let total = n.div_ceil(GROUP);
    // Long runs of groups: at a few rows, where the weights stream from memory, tasks of 4
    // groups ran a one-row step 1.4-1.8x slower on Zen 4 (docs/performance.md, "Longer tasks for
    // the 8-row kernels"); four a thread still let a thread that falls behind be helped.
    let mut per_task = team::per_task(total);
    if pair_rows > 0 {
        per_task += per_task % 2;
    }
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let base = SharedMut(out.as_mut_ptr());
    team::run(total.div_ceil(per_task), |t| {
        let base = &base;
        let mut buf = [0f32; PAIR_TILE_ROWS * 2 * GROUP];
        let (first, end) = (t * per_task, ((t + 1) * per_task).min(total));
        for rb in (0..m).step_by(ROW_BLOCK) {
            let rend = (rb + ROW_BLOCK).min(m);
            let mut g = first;
            while g < end {
                let count = if pair_rows > 0 && g + 2 <= end { 2 } else { 1 };
                let rows = if count == 2 { pair_rows } else { TILE_ROWS };
                let w = groups(g, count);
                let c0 = g * GROUP;
                let width = count * GROUP;
                let cols = width.min(n - c0);
                let mut r0 = rb;
                while r0 < rend {
                    let nr = (rend - r0).min(rows);
                    tile(w, count, a, r0, nr, &mut buf[..nr * width]);
                    for r in 0..nr {
                        // SAFETY: row r0 + r < m and columns c0..c0 + cols <= n lie inside the
                        // m * n allocation; only this task writes columns of these groups.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr().add(r * width),
                                base.0.add((r0 + r) * n + c0),
                                cols,
                            )
                        }
                    }
                    r0 += nr;
                }
                g += count;
            }
        }
    });
    // SAFETY: the groups cover columns 0..n and each group's tiles rows 0..m, so all m * n
    // elements were written above.
    unsafe { out.set_len(m * n) };
    out
}

/// A pair of adjacent groups (`w`, two groups' bytes) into `out` (`nr x 16`) by a one-group
/// `tile(group's bytes, out nr x 8)` on each half.
pub(crate) fn pair_by_halves(
    w: &[u8],
    nr: usize,
    out: &mut [f32],
    mut tile: impl FnMut(&[u8], &mut [f32]),
) {
    let half = w.len() / 2;
    let mut one = [0f32; TILE_ROWS * GROUP];
    for (h, wh) in [&w[..half], &w[half..2 * half]].into_iter().enumerate() {
        tile(wh, &mut one[..nr * GROUP]);
        for r in 0..nr {
            out[r * 2 * GROUP + h * GROUP..][..GROUP]
                .copy_from_slice(&one[r * GROUP..(r + 1) * GROUP]);
        }
    }
}

/// A weight matrix stored in groups of `GROUP` rows for `grouped_matmul`: the 8-row Q8_0 and Q4_1
/// layouts share the driver, the whole-matrix dequantization and the matmul entry points.
pub trait RowGroups: Sync {
    /// `(n, k)`: output columns, inner dimension.
    fn dims(&self) -> (usize, usize);
    /// The bytes of groups `g..g + count`, adjacent in memory.
    fn groups(&self, g: usize, count: usize) -> &[u8];
    /// Group `g`'s bytes.
    fn group(&self, g: usize) -> &[u8] {
        self.groups(g, 1)
    }
    /// Row `row` as f32 values.
    fn dequantize_row(&self, row: usize, out: &mut [f32]);
    /// One group against activation rows `r0..r0+nr` into `out` (`nr x GROUP`), with the
    /// best kernel `isa` allows.
    fn tile(&self, w: &[u8], a: &QuantizedRows, r0: usize, nr: usize, out: &mut [f32], isa: Isa);
    /// Whether the driver takes groups two at a time (`tile_pair`) for `rows` activation rows at
    /// `isa`, and in tiles of how many rows (at most `PAIR_TILE_ROWS`): where this layout has a
    /// 16-column kernel that pays there.
    fn pairs(&self, _rows: usize, _isa: Isa) -> Option<usize> {
        None
    }
    /// Two adjacent groups (`w` holds both) against rows `r0..r0+nr` into `out` (`nr x 16`;
    /// `nr` at most what `pairs` answered).
    /// This default runs `tile` on each; a layout with a 16-column kernel overrides it.
    fn tile_pair(
        &self,
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        nr: usize,
        out: &mut [f32],
        isa: Isa,
    ) {
        pair_by_halves(w, nr, out, |wh, one| self.tile(wh, a, r0, nr, one, isa));
    }

    /// The whole matrix as f32, `[n, k]` row-major, all threads.
    fn dequantize(&self) -> Vec<f32> {
        let (n, k) = self.dims();
        let mut out = vec![0f32; n * k];
        out.par_chunks_mut(k)
            .enumerate()
            .for_each(|(row, o)| self.dequantize_row(row, o));
        out
    }

    /// `out[m, n] = x[m, k] . w[n, k]` with the best kernel this CPU has.
    fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(x, m, Isa::best())
    }

    /// As `matmul`, at level `isa` (tests run each).
    fn matmul_with(&self, x: &[f32], m: usize, isa: Isa) -> Vec<f32> {
        let (_, k) = self.dims();
        assert_eq!(x.len(), m * k);
        let a = time(Part::Quantize, || quantize_rows(x, m, k));
        self.matmul_quantized_with(&a, isa)
    }

    /// `out[m, n]` for activations already quantized (projections that share an input share
    /// one quantization).
    fn matmul_quantized(&self, a: &QuantizedRows) -> Vec<f32> {
        self.matmul_quantized_with(a, Isa::best())
    }

    /// As `matmul_quantized`, at level `isa`.
    fn matmul_quantized_with(&self, a: &QuantizedRows, isa: Isa) -> Vec<f32> {
        matmul_grouped(self, a, isa)
    }
}

/// `RowGroups::matmul_quantized_with` on the 8-row kernels (`grouped_matmul`): the default, and
/// what a layout with kernels of its own runs where those do not.
pub(crate) fn matmul_grouped<R: RowGroups + ?Sized>(
    w: &R,
    a: &QuantizedRows,
    isa: Isa,
) -> Vec<f32> {
    let (n, k) = w.dims();
    assert_eq!(
        a.blocks * QK,
        k,
        "activations {} wide for a matrix {k} wide",
        a.blocks * QK
    );
    grouped_matmul(
        n,
        a,
        |g, count| w.groups(g, count),
        w.pairs(a.rows, isa),
        |wb, count, a, r0, nr, out| match count {
            2 => w.tile_pair(wb, a, r0, nr, out, isa),
            _ => w.tile(wb, a, r0, nr, out, isa),
        },
    )
}

/// Scalar reference: one group of `Rows8<S>` against rows `r0..r0+nr`; `out` is `nr x 8`.
pub fn tile_scalar<const S: usize>(
    w: &[u8],
    a: &QuantizedRows,
    r0: usize,
    nr: usize,
    out: &mut [f32],
) {
    for r in 0..nr {
        let row = r0 + r;
        for c in 0..GROUP {
            let mut sum = 0f32;
            for b in 0..a.blocks {
                let gb = &w[b * Rows8::<S>::GBB..];
                let aq = &a.qs[(row * a.blocks + b) * QK..][..QK];
                for h in 0..S {
                    let mut isum = 0i32;
                    for i in h * Rows8::<S>::SUB..(h + 1) * Rows8::<S>::SUB {
                        let wq = gb[Rows8::<S>::quant_at(c, i)] as i8;
                        isum += wq as i32 * aq[i] as i32;
                    }
                    sum += isum as f32 * Rows8::<S>::scale(gb, c, h) * a.scales[row * a.blocks + b];
                }
            }
            out[r * GROUP + c] = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` must hold `a.blocks` group blocks of `Rows8<S>`;
    /// rows `r0..r0+NR` must exist in `a`; `out` must hold `NR * 8` values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const S: usize, const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32],
    ) {
        let gbb = group_block_bytes(S);
        debug_assert!(w.len() >= a.blocks * gbb && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * GROUP);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        let ap = a.qs.as_ptr();
        let sp = a.scales.as_ptr();
        let steps = QK / 4 / S;
        for b in 0..a.blocks {
            let gb = wp.add(b * gbb);
            // (Q6_K's 320 bytes: the same five lines as Q8_0's 288.)
            prefetch_ahead::<{ group_block_bytes(2) }>(gb);
            let qs = gb.add(GROUP * 4 * S);
            for h in 0..S {
                let mut isum = [_mm256_setzero_si256(); NR];
                for c in h * steps..(h + 1) * steps {
                    let wv = _mm256_loadu_si256(qs.add(c * 32) as *const __m256i);
                    let aw = _mm256_sign_epi8(wv, wv);
                    for (r, s) in isum.iter_mut().enumerate() {
                        let at = ap.add((r0 + r) * a.blocks * QK + b * QK + c * 4);
                        let av = _mm256_set1_epi32((at as *const i32).read_unaligned());
                        let sa = _mm256_sign_epi8(av, wv);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones);
                        *s = _mm256_add_epi32(*s, p);
                    }
                }
                let dw = _mm256_loadu_ps(gb.add(h * GROUP * 4) as *const f32);
                for r in 0..NR {
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(*sp.add((r0 + r) * a.blocks + b)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), d, acc[r]);
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP), *v);
        }
    }
}

/// The AVX-512 VNNI kernel for Q8_0 (one scale a block): `vpdpbusd` multiplies unsigned bytes by
/// signed ones, so each weight vector is flipped to `w + 128` (one XOR, shared by the tile's rows)
/// and the block's sum corrected by `-128 * dw * sum(a)`, the activations' block sum that the
/// quantizer keeps (`QuantizedRows::sums`): Q4_1's form with a minimum of `-128 dw`. One
/// instruction per 4-value step and row, where AVX2 needs `sign`, `maddubs`, `madd` and an add.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2, FMA, AVX512VL and AVX512VNNI; `w` must hold `a.blocks` group
    /// blocks of `Rows8<1>`; rows `r0..r0+NR` must exist in `a`; `out` must hold `NR * 8` values.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn tile<const NR: usize>(w: &[u8], a: &QuantizedRows, r0: usize, out: &mut [f32]) {
        let gbb = group_block_bytes(1);
        debug_assert!(w.len() >= a.blocks * gbb && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * GROUP);
        let flip = _mm256_set1_epi8(-128);
        let m128 = _mm256_set1_ps(-128.0);
        let mut acc = [_mm256_setzero_ps(); NR];
        let wp = w.as_ptr();
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let gb = wp.add(b * gbb);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(gb);
            let qs = gb.add(GROUP * 4);
            let mut isum = [[_mm256_setzero_si256(); 2]; NR];
            for c in 0..QK / 4 {
                let wv =
                    _mm256_xor_si256(_mm256_loadu_si256(qs.add(c * 32) as *const __m256i), flip);
                for (r, s) in isum.iter_mut().enumerate() {
                    let at = ap.add((r0 + r) * a.blocks * QK + b * QK + c * 4);
                    let av = _mm256_set1_epi32((at as *const i32).read_unaligned());
                    s[c % 2] = _mm256_dpbusd_epi32(s[c % 2], wv, av);
                }
            }
            let dw = _mm256_loadu_ps(gb as *const f32);
            let mw = _mm256_mul_ps(dw, m128);
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*a.scales.get_unchecked(ai)));
                let i = _mm256_add_epi32(isum[r][0], isum[r][1]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), d, acc[r]);
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP), *v);
        }
    }
}

/// Two groups of Q8_0 (16 output columns) a call on 512-bit vectors, for the steps of 8 rows and
/// more where this CPU runs 512-bit `vpdpbusd` faster than two 256-bit ones (the answer the Q4_1
/// pair kernel measured, `q4_1x8::wide_vnni_pays`): each activation broadcast and scale product
/// feeds both groups, half the issue slots a column of the one-group `vnni::tile`. The output
/// projection of a 16-row decode step (49,152 columns) is its main user.
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni_pair {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight f32 values at `lo` then eight at `hi`, in one register (two groups' scales; the
    /// tile kernel `amx_int8` reads Q8_0's with it too).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in super::super) unsafe fn halves(lo: *const u8, hi: *const u8) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(lo as *const f32))),
            _mm256_castps_pd(_mm256_loadu_ps(hi as *const f32)),
        ))
    }

    /// # Safety
    /// The CPU must support AVX2, FMA, AVX512F/BW/VL and AVX512VNNI; `w` must hold two groups of
    /// `a.blocks` group blocks of `Rows8<1>`; rows `r0..r0+NR` must exist in `a`; `out` must
    /// hold `NR * 16` values.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile512<const NR: usize>(
        w: &[u8],
        a: &QuantizedRows,
        r0: usize,
        out: &mut [f32],
    ) {
        let gbb = group_block_bytes(1);
        let gbytes = a.blocks * gbb;
        debug_assert!(w.len() >= 2 * gbytes && r0 + NR <= a.rows);
        debug_assert!(out.len() >= NR * 2 * GROUP);
        let flip = _mm512_set1_epi8(-128);
        let m128 = _mm512_set1_ps(-128.0);
        let mut acc = [_mm512_setzero_ps(); NR];
        let (w0, w1) = (w.as_ptr(), w.as_ptr().add(gbytes));
        let ap = a.qs.as_ptr();
        for b in 0..a.blocks {
            let (g0, g1) = (w0.add(b * gbb), w1.add(b * gbb));
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g0);
            prefetch_ahead::<GROUP_BLOCK_BYTES>(g1);
            let (q0, q1) = (g0.add(GROUP * 4), g1.add(GROUP * 4));
            let mut isum = [_mm512_setzero_si512(); NR];
            for c in 0..QK / 4 {
                let v = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(q0.add(c * 32) as *const __m256i)),
                    _mm256_loadu_si256(q1.add(c * 32) as *const __m256i),
                );
                let v = _mm512_xor_si512(v, flip);
                for (r, s) in isum.iter_mut().enumerate() {
                    let at = ap.add((r0 + r) * a.blocks * QK + b * QK + c * 4);
                    let av = _mm512_set1_epi32((at as *const i32).read_unaligned());
                    *s = _mm512_dpbusd_epi32(*s, v, av);
                }
            }
            let dw = halves(g0, g1);
            let mw = _mm512_mul_ps(dw, m128);
            for r in 0..NR {
                let ai = (r0 + r) * a.blocks + b;
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*a.scales.get_unchecked(ai)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), d, acc[r]);
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.sums.get_unchecked(ai)), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * 2 * GROUP), *v);
        }
    }
}

/// One group against rows `r0..r0+nr` (`nr <= 4`) into `out` (`nr x 8`).
fn tile<const S: usize>(
    w: &[u8],
    a: &QuantizedRows,
    r0: usize,
    nr: usize,
    out: &mut [f32],
    isa: Isa,
) {
    assert!(nr <= TILE_ROWS && r0 + nr <= a.rows && w.len() >= a.blocks * group_block_bytes(S));
    assert!(out.len() >= nr * GROUP);
    #[cfg(target_arch = "x86_64")]
    if let (1, Some(_vnni)) = (S, isa.avx512_vnni()) {
        // SAFETY: the token proves AVX2, FMA, AVX512VL and AVX512VNNI; S = 1, bounds asserted
        // above.
        unsafe { dispatch_rows!(nr, vnni::tile(w, a, r0, out)) }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2 and FMA; bounds asserted above.
        unsafe {
            match nr {
                4 => avx2::tile::<S, 4>(w, a, r0, out),
                3 => avx2::tile::<S, 3>(w, a, r0, out),
                2 => avx2::tile::<S, 2>(w, a, r0, out),
                _ => avx2::tile::<S, 1>(w, a, r0, out),
            }
        }
        return;
    }
    tile_scalar::<S>(w, a, r0, nr, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::model::kernels::q8_0::to_gguf_bytes as q8_0_bytes;
    use crate::model::kernels::test_data::{assert_matches_reference, candle_quantized, lcg};
    use candle_core::quantized::GgmlDType;

    #[test]
    fn repacked_rows_read_back_and_match_the_q8_0_kernel() {
        let (m, k, n) = (6, 128, 21);
        let wf = lcg(3, n * k);
        let bytes = q8_0_bytes(&wf, n, k);
        let rp = Repacked::from_q8_0(&bytes, n, k);
        // Rows read back exactly as GGUF's dequantization gives them.
        let mut row = vec![0f32; k];
        for j in 0..n {
            rp.dequantize_row(j, &mut row);
            for b in 0..k / QK {
                let src = &bytes[(j * k / QK + b) * BLOCK_BYTES..];
                let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
                for i in 0..QK {
                    assert_eq!(row[b * QK + i], d * (src[2 + i] as i8) as f32);
                }
            }
        }
        // Same products as the row-at-a-time Q8_0 kernel.
        let x = lcg(4, m * k);
        let want = super::super::q8_0::matmul(&x, m, k, &bytes, n);
        let got = rp.matmul(&x, m);
        for (a, b) in want.iter().zip(&got) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn q6_k_rows_read_back_exactly_as_candle_dequantizes_them() {
        let (k, n) = (512, 13);
        let (bytes, deq) = candle_quantized(8, n, k, GgmlDType::Q6K);
        assert_eq!(bytes.len(), n * k / QK_K * Q6_K_BLOCK_BYTES);
        let rp = Q6kRepacked::from_q6_k(&bytes, n, k);
        let mut got = vec![0f32; k];
        for j in 0..n {
            rp.dequantize_row(j, &mut got);
            assert_eq!(got, deq[j * k..(j + 1) * k], "row {j}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// On Q6_K weights the SIMD and scalar kernels agree, and both match an f64 reference on
        /// candle's dequantized weights and the quantized activations.
        #[test]
        fn q6_k_products_match_a_reference(m in 1usize..7, kb in 1usize..4, n in 1usize..30, seed in any::<u64>()) {
            let k = kb * QK_K;
            let (bytes, deq) = candle_quantized(seed, n, k, GgmlDType::Q6K);
            let rp = Q6kRepacked::from_q6_k(&bytes, n, k);
            let x = lcg(seed ^ 0x99, m * k);
            let a = quantize_rows(&x, m, k);
            for isa in Isa::available() {
                assert_matches_reference(&rp.matmul_with(&x, m, isa), &a, &deq, n);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The 512-bit Q8_0 pair kernel, called whatever `wide_vnni_pays` chose here, against
        /// the scalar reference on each group, 1 to `PAIR_TILE_ROWS` rows from any first row (on
        /// a CPU with AVX-512 VNNI; elsewhere nothing runs it).
        #[test]
        #[cfg(target_arch = "x86_64")]
        fn the_pair_kernel_equals_scalar(kb in 1usize..7, nr in 1usize..=PAIR_TILE_ROWS, r0 in 0usize..3, seed in any::<u64>()) {
            let Some(_vnni) = crate::model::kernels::cpu::Avx512Vnni::detect() else {
                return Ok(());
            };
            let (n, k, m) = (16, kb * QK, PAIR_TILE_ROWS + 3);
            let rp = Repacked::from_q8_0(&q8_0_bytes(&lcg(seed ^ 0xabc, n * k), n, k), n, k);
            let a = quantize_rows(&lcg(seed, m * k), m, k);
            let mut got = [0f32; PAIR_TILE_ROWS * 16];
            // SAFETY: the CPU has AVX-512 VNNI (detected above); both groups and rows
            // r0..r0 + nr (at most 18 of 19) exist.
            unsafe { dispatch_pair_rows!(nr, vnni_pair::tile512(rp.groups(0, 2), &a, r0, &mut got)) };
            let mut want = [0f32; PAIR_TILE_ROWS * 16];
            for (r, want) in want.chunks_exact_mut(16).take(nr).enumerate() {
                pair_by_halves(rp.groups(0, 2), 1, want, |wh, one| {
                    tile_scalar::<1>(wh, &a, r0 + r, 1, one)
                });
            }
            for (i, (g, w)) in got[..nr * 16].iter().zip(&want[..nr * 16]).enumerate() {
                prop_assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "nr {nr} r0 {r0} [{i}]: {g} vs {w}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// SIMD and scalar kernels agree on odd shapes (rows not a multiple of the tile or of
        /// the pair kernel's tile, columns not a multiple of the group or of the task).
        #[test]
        fn simd_equals_scalar(m in 1usize..72, kb in 1usize..7, n in 1usize..70, seed in any::<u64>()) {
            let k = kb * QK;
            let x = lcg(seed, m * k);
            let rp = Repacked::from_q8_0(&q8_0_bytes(&lcg(seed ^ 0xabc, n * k), n, k), n, k);
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
