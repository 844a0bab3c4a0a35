//! Q4_1 and Q8_0 weights (`q4_1x8`'s and `q8_0x8`'s 8-row layouts, as loaded; Q4_0 is repacked
//! into Q4_1's) times Q8_0 activations on Intel's tile units (AMX-INT8), for the decode steps of
//! a few to a few dozen replies.
//!
//! Why: at 16 rows the 512-bit VNNI pair kernel (`q4_1x8::vnni_pair`) ran at ~20% of this
//! machine's 8-bit peak (the roof report, `cargo bench --bench engine -- --roof`): per activation
//! row and 32-value block it broadcasts the activations and runs eight `vpdpbusd`, four rows at a
//! time. One `tdpbsud` multiplies 16 activation rows by 16 weight rows over a block; what stays on
//! the vector units is unpacking the weights (once per block for all 16 rows) and the per-block
//! scaling, which the format needs whatever multiplies. Both kernels prefetch the weights as the
//! VNNI ones do (`kernels::prefetch_ahead`): from a few rows on, a step's matmuls wait on reading
//! them, and the tiles leave the vector units less to do meanwhile.
//!
//! The same numbers as the VNNI kernel, to the bit: the tile sums a block's 32 products exactly in
//! int32, as `vpdpbusd` does, and the scaling is the same F32 operations in the same order
//! (`acc = fma(f32(s), d * da, acc); acc = fma(m, sa, acc)`). Which kernel a step's size picks
//! therefore never changes a row's result (tests compare them bit for bit), and the weights need
//! no other copy: each block is unpacked into a 512-byte B tile (8 rows of 16 weight rows x 4
//! values). For Q4_1 the layout makes that two masks: the low nibbles of a group block's `s`-th 32
//! bytes are values `8s..8s + 3` of each of its 8 rows, the high ones `8s + 4..8s + 8`, which are
//! tile rows `2s` and `2s + 1` for 8 of the 16 columns; a pair of groups fills the 16. Q8_0's
//! quants are tile rows already; they are flipped to unsigned bytes as the VNNI kernel flips them
//! (its `-128 * d * sum(a)` term then matches too).
//!
//! Activations are laid out once per call as tiles of 16 rows x 32 bytes, zero rows past the last,
//! so a tile load never reads past them. Tasks take runs of group pairs; each configures the tiles
//! once (C 16 x 64 bytes, A 16 x 32, B 8 x 64), runs every 16-row chunk of its pairs and releases
//! them. The tile instructions are written with `asm!` and run only with the `cpu::Amx` token.

use crate::model::team::{self, SharedMut};

use super::cpu::Amx;
use super::q4_1x8::{self, GROUP_BLOCK_BYTES};
use super::q8_0::{QuantizedRows, QK};
use super::q8_0x8::{self, RowGroups, GROUP};
use super::{lines, prefetch_ahead};

/// Activation rows (and C tile rows) per tile.
const ROWS: usize = 16;
/// Bytes of one activation tile: 16 rows of a 32-value block.
const A_TILE: usize = ROWS * QK;
/// Offset of the minimums, then of the nibbles, in a Q4_1 group block (`q4_1x8`'s layout).
const MINS: usize = GROUP * 2;
const QS: usize = GROUP * 4;

/// Rows from which a Q4_1 matmul runs here rather than on the VNNI kernels: at 2 rows the tiles'
/// per-block work, the same for 1 row as for 16, lost to the VNNI tile; at 4 they tied; from 6
/// they won (docs/performance.md, "AMX-INT8 for decode steps" and "Prefetching at every row
/// count").
pub const MIN_ROWS: usize = 5;

/// Rows from which a Q8_0 matmul (the default model's LM head) runs here rather than on the VNNI
/// kernels: with both prefetching, the tiles won or tied from 2 rows to 16 (docs/performance.md,
/// "Prefetching at every row count").
pub const Q8_0_MIN_ROWS: usize = 2;

/// `out[m, n] = a[m, k] . w[n, k]` for Q4_1 (and Q4_0) weights `w` on the tile units: the same
/// values as `w.matmul_quantized_with(a, Isa::Avx512Vnni(..))`.
pub fn matmul_q4_1(amx: Amx, w: &q4_1x8::Repacked, a: &QuantizedRows) -> Vec<f32> {
    matmul::<false>(amx, w, GROUP_BLOCK_BYTES, a)
}

/// `out[m, n] = a[m, k] . w[n, k]` for Q8_0 weights `w` on the tile units: the same values as
/// `w.matmul_quantized_with(a, Isa::Avx512Vnni(..))`.
/// (Generic over the layout's scales per block so that `Rows8<S>` can call it; only `S = 1` is
/// Q8_0.)
pub fn matmul_q8_0<const S: usize>(amx: Amx, w: &q8_0x8::Rows8<S>, a: &QuantizedRows) -> Vec<f32> {
    assert_eq!(S, 1, "Q8_0 has one scale per row and block");
    matmul::<true>(amx, w, q8_0x8::GROUP_BLOCK_BYTES, a)
}

/// Either format (`Q8`: Q8_0, else Q4_1) in its 8-row layout, `gbb` bytes a group block.
fn matmul<const Q8: bool>(
    _amx: Amx,
    w: &impl RowGroups,
    gbb: usize,
    a: &QuantizedRows,
) -> Vec<f32> {
    let (n, k) = w.dims();
    assert_eq!(
        a.blocks * QK,
        k,
        "activations {} wide for {k}",
        a.blocks * QK
    );
    let (m, blocks) = (a.rows, a.blocks);
    let chunks = m.div_ceil(ROWS);
    // Activation tiles: chunk c, block b at `(c * blocks + b) * A_TILE`, rows 32 bytes apart.
    let mut at = lines(0i8, chunks * blocks * A_TILE);
    for r in 0..m {
        let (c, t) = (r / ROWS, r % ROWS);
        for b in 0..blocks {
            at[(c * blocks + b) * A_TILE + t * QK..][..QK]
                .copy_from_slice(&a.qs[r * k + b * QK..][..QK]);
        }
    }
    let groups = n.div_ceil(GROUP);
    let pairs = groups.div_ceil(2);
    let gbytes = blocks * gbb;
    // A lone last group runs beside zeros (scales 0, its columns not copied out).
    let zeros = vec![0u8; if groups % 2 == 1 { gbytes } else { 0 }];
    let per_task = pairs.div_ceil(team::size() * 4).max(1);
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let base = SharedMut(out.as_mut_ptr());
    team::run(pairs.div_ceil(per_task), |t| {
        let base = &base;
        let mut buf = Scratch {
            c: [0; RUN * ROWS * 16],
            b: [0; RUN * 8 * 64],
            y: [0.0; ROWS * 16],
        };
        // SAFETY: the token proves the tiles (AMX-TILE and AMX-INT8) and AVX-512 F/BW/VL, F16C and
        // FMA (implied by its VNNI token); every pointer below stays inside the buffers named.
        unsafe {
            configure();
            for p in t * per_task..((t + 1) * per_task).min(pairs) {
                let g = 2 * p;
                let count = if g + 2 <= groups { 2 } else { 1 };
                let g0 = w.groups(g, count).as_ptr();
                let g1 = if count == 2 {
                    g0.add(gbytes)
                } else {
                    zeros.as_ptr()
                };
                let c0 = g * GROUP;
                let cols = (count * GROUP).min(n - c0);
                for c in 0..chunks {
                    let r0 = c * ROWS;
                    let nr = ROWS.min(m - r0);
                    let args = (
                        g0,
                        g1,
                        gbb,
                        blocks,
                        at.as_ptr().add(c * blocks * A_TILE),
                        a.scales.as_ptr().add(r0 * blocks),
                        a.sums.as_ptr().add(r0 * blocks),
                        &mut buf,
                    );
                    dispatch16!(nr, pair_chunk, Q8, args);
                    for r in 0..nr {
                        // SAFETY: row r0 + r < m, columns c0..c0 + cols <= n: inside the m * n
                        // allocation; only this task writes these columns.
                        std::ptr::copy_nonoverlapping(
                            buf.y.as_ptr().add(r * 16),
                            base.0.add((r0 + r) * n + c0),
                            cols,
                        );
                    }
                }
            }
            release();
        }
    });
    // SAFETY: the pairs cover columns 0..n and each pair's chunks rows 0..m.
    unsafe { out.set_len(m * n) };
    out
}

/// Blocks whose tile work runs back to back before their scaling (each in its own C tile), so
/// the tile units' latency (load, multiply, store, then the vector loads) is paid once per run.
const RUN: usize = 4;

/// A task's tile buffers: the C tiles stored, the unpacked B tiles, a chunk's results.
#[repr(C, align(64))]
struct Scratch {
    c: [i32; RUN * ROWS * 16],
    b: [u8; RUN * 8 * 64],
    y: [f32; ROWS * 16],
}

/// Runs `pair_chunk::<NR, Q8>` for `nr` (1..=16) rows.
macro_rules! dispatch16 {
    ($nr:expr, $f:ident, $q8:ident, $args:expr) => {{
        let (g0, g1, gbb, blocks, at, sc, su, buf) = $args;
        macro_rules! call {
            ($n:literal) => {
                $f::<$n, $q8>(g0, g1, gbb, blocks, at, sc, su, buf)
            };
        }
        match $nr {
            16 => call!(16),
            15 => call!(15),
            14 => call!(14),
            13 => call!(13),
            12 => call!(12),
            11 => call!(11),
            10 => call!(10),
            9 => call!(9),
            8 => call!(8),
            7 => call!(7),
            6 => call!(6),
            5 => call!(5),
            4 => call!(4),
            3 => call!(3),
            2 => call!(2),
            _ => call!(1),
        }
    }};
}
use dispatch16;

/// Loads the tile configuration: palette 1; tmm0-3 C tiles (16 rows x 16 int32), tmm4 and tmm6
/// A tiles (16 rows x 32 bytes), tmm5 and tmm7 B tiles (8 rows x 64 bytes).
///
/// # Safety
/// The CPU must have AMX and the process the permission (`cpu::Amx`).
unsafe fn configure() {
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut cfg = Config([0; 64]);
    cfg.0[0] = 1;
    let (c, a, b) = ((64, ROWS as u8), (QK as u16, ROWS as u8), (64, 8));
    let tiles: [(u16, u8); 8] = [c, c, c, c, a, b, a, b];
    for (t, (colsb, rows)) in tiles.into_iter().enumerate() {
        cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
        cfg.0[48 + t] = rows;
    }
    tile_asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Gives the tile state back.
///
/// # Safety
/// As `configure`.
unsafe fn release() {
    tile_asm!("tilerelease", options(nostack, nomem));
}

/// Two groups (`g0`, `g1`: `blocks` group blocks of `gbb` bytes each; Q8_0's layout if `Q8`,
/// else Q4_1's) against `NR` activation rows (`at`: their tiles, one per block; `sc`/`su`: the
/// rows' scales and scaled sums, `blocks` apart) into `buf.y` (`NR x 16`).
///
/// # Safety
/// Tiles configured (`configure`); AVX-512 F/BW/VL, F16C, FMA; the buffers as described.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_chunk<const NR: usize, const Q8: bool>(
    g0: *const u8,
    g1: *const u8,
    gbb: usize,
    blocks: usize,
    at: *const i8,
    sc: *const f32,
    su: *const f32,
    buf: &mut Scratch,
) {
    use std::arch::x86_64::*;
    let low = _mm512_set1_epi8(0x0F);
    let flip = _mm512_set1_epi8(-128);
    let m128 = _mm512_set1_ps(-128.0);
    let mut acc = [_mm512_setzero_ps(); NR];
    let halves = |p0: *const u8, p1: *const u8| {
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(p0 as *const __m128i)),
            _mm_loadu_si128(p1 as *const __m128i),
        ))
    };
    // 32 bytes at `p0` then 32 at `p1`, in one register.
    let joined = |p0: *const u8, p1: *const u8| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(p0 as *const __m256i)),
            _mm256_loadu_si256(p1 as *const __m256i),
        )
    };
    // One block's tile work into C tile `c`, from A tile `a` and B tile `b` (alternate pairs,
    // so a run's loads need not wait for the previous block's multiply).
    macro_rules! dp {
        ($c:literal, $a:literal, $b:literal, $at:expr, $w:expr) => {
            tile_asm!(
                concat!("tilezero tmm", $c),
                concat!("tileloadd tmm", $a, ", [{a} + {as_}*1]"),
                concat!("tileloadd tmm", $b, ", [{w} + {ws}*1]"),
                // Signed activations times unsigned nibbles.
                concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
                a = in(reg) $at,
                as_ = in(reg) QK,
                w = in(reg) $w,
                ws = in(reg) 64usize,
                options(nostack, readonly)
            )
        };
    }
    macro_rules! st {
        ($c:literal, $to:expr) => {
            tile_asm!(
                concat!("tilestored [{c} + {cs}*1], tmm", $c),
                c = in(reg) $to,
                cs = in(reg) 64usize,
                options(nostack)
            )
        };
    }
    // A run of blocks: unpack their B tiles, multiply each into its own C tile, store the C
    // tiles, then scale. (Issuing the next run's tile work before this run's scaling, with the C
    // tiles in alternating buffers, measured no faster.)
    for b0 in (0..blocks).step_by(RUN) {
        let run = RUN.min(blocks - b0);
        for j in 0..run {
            let b = b0 + j;
            let (w0, w1) = (g0.add(b * gbb), g1.add(b * gbb));
            for p in [w0, w1] {
                if Q8 {
                    prefetch_ahead::<{ q8_0x8::GROUP_BLOCK_BYTES }>(p);
                } else {
                    prefetch_ahead::<GROUP_BLOCK_BYTES>(p);
                }
            }
            let dst = buf.b.as_mut_ptr().add(j * 512) as *mut __m512i;
            if Q8 {
                // Q8_0's quants are tile rows already (4 values of each of 8 rows a 32-byte
                // line): flipped to unsigned, as the VNNI kernels flip them.
                for s in 0..8 {
                    let v = joined(w0.add(GROUP * 4 + s * 32), w1.add(GROUP * 4 + s * 32));
                    _mm512_store_si512(dst.add(s), _mm512_xor_si512(v, flip));
                }
            } else {
                for s in 0..4 {
                    let v = joined(w0.add(QS + s * 32), w1.add(QS + s * 32));
                    _mm512_store_si512(dst.add(2 * s), _mm512_and_si512(v, low));
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    _mm512_store_si512(dst.add(2 * s + 1), hi);
                }
            }
        }
        for j in 0..run {
            let (a, w) = (at.add((b0 + j) * A_TILE), buf.b.as_ptr().add(j * 512));
            match j {
                0 => dp!("0", "4", "5", a, w),
                1 => dp!("1", "6", "7", a, w),
                2 => dp!("2", "4", "5", a, w),
                _ => dp!("3", "6", "7", a, w),
            }
        }
        for j in 0..run {
            let c = buf.c.as_mut_ptr().add(j * ROWS * 16);
            match j {
                0 => st!("0", c),
                1 => st!("1", c),
                2 => st!("2", c),
                _ => st!("3", c),
            }
        }
        for j in 0..run {
            let b = b0 + j;
            let (w0, w1) = (g0.add(b * gbb), g1.add(b * gbb));
            // Q8_0: f32 scales, and the flip's `-128 * d` in place of a minimum.
            let (dw, mw) = if Q8 {
                let dw = q8_0x8::vnni_pair::halves(w0, w1);
                (dw, _mm512_mul_ps(dw, m128))
            } else {
                (halves(w0, w1), halves(w0.add(MINS), w1.add(MINS)))
            };
            let c = buf.c.as_ptr().add(j * ROWS * 16);
            for (r, acc) in acc.iter_mut().enumerate() {
                let s32 = _mm512_load_si512(c.add(r * 16) as *const __m512i);
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(*sc.add(r * blocks + b)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), d, *acc);
                *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*su.add(r * blocks + b)), *acc);
            }
        }
    }
    for (r, v) in acc.iter().enumerate() {
        _mm512_storeu_ps(buf.y.as_mut_ptr().add(r * 16), *v);
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_chunk<const NR: usize, const Q8: bool>(
    _g0: *const u8,
    _g1: *const u8,
    _gbb: usize,
    _blocks: usize,
    _at: *const i8,
    _sc: *const f32,
    _su: *const f32,
    _buf: &mut Scratch,
) {
    unreachable!("AMX tiles exist on x86_64 only")
}

#[cfg(test)]
mod tests {
    use super::super::cpu::Isa;
    use super::super::q8_0::quantize_rows;
    use super::super::q8_0x8::matmul_grouped;
    use super::super::test_data::{amx_for_test, candle_quantized, lcg};
    use super::*;
    use candle_core::quantized::GgmlDType;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// On the tiles, bit for bit the VNNI kernels' result: any rows (1 to past two chunks),
        /// any number of groups (odd ones, a partial last group), any number of blocks.
        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn tiles_equal_the_vnni_kernels_bit_for_bit(
            m in 1usize..40, kb in 1usize..7, n in 1usize..70, seed in any::<u64>()
        ) {
            let Some(amx) = amx_for_test("tiles_equal_the_vnni_kernels_bit_for_bit") else {
                return Ok(());
            };
            let k = kb * QK;
            let a = quantize_rows(&lcg(seed ^ 0x5a5a, m * k), m, k);
            let vnni = Isa::Avx512Vnni(amx.vnni());
            let (bytes, _) = candle_quantized(seed, n, k, GgmlDType::Q4_1);
            let q4 = q4_1x8::Repacked::from_q4_1(&bytes, n, k);
            let (got, want) = (matmul_q4_1(amx, &q4, &a), q4.matmul_quantized_with(&a, vnni));
            prop_assert_eq!(got.len(), want.len());
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), e.to_bits(), "Q4_1 m {} n {} k {} [{}]: {} vs {}", m, n, k, i, g, e);
            }
            let (bytes, _) = candle_quantized(seed, n, k, GgmlDType::Q8_0);
            let q8 = q8_0x8::Repacked::from_q8_0(&bytes, n, k);
            let (got, want) = (matmul_q8_0(amx, &q8, &a), matmul_grouped(&q8, &a, vnni));
            prop_assert_eq!(got.len(), want.len());
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), e.to_bits(), "Q8_0 m {} n {} k {} [{}]: {} vs {}", m, n, k, i, g, e);
            }
        }
    }
}
