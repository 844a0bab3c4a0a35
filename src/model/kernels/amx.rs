//! Big steps on Intel's tile units (AMX, Sapphire Rapids and later): a bf16 copy of a weight
//! matrix laid out as the `tdpbf16ps` instruction reads it, times activations rounded to bf16,
//! summed in F32.
//!
//! Why a copy: the roof report on such a machine (docs/performance.md, "Intel Xeon with AMX")
//! measured the tile units' bf16 peak at 3.5x the 512-bit `vpdpbusd` one. The quantized layouts
//! keep a scale (and a minimum) per 32 values, and the tiles sum over the whole tile before
//! anything can scale them; dequantizing each block on the fly was estimated (not measured) to
//! cost about what the tile work does at a step's sizes, so each matrix is dequantized once at
//! load into the layout below (2 bytes a weight, within `engine.amx_weights_mib`; llama.cpp's AMX
//! backend instead rescales int8 tiles after every block). Small steps (decode) keep the
//! quantized kernels: they read 3.2x fewer bytes a weight, and reading is what bounds them.
//!
//! Layout: panels of 16 weight rows (the rows padded with zeros to a multiple of 32); per panel
//! and 32-value block, one 1 KiB `B` tile of 16 rows x 16 (even, odd) pairs: element
//! `[kr][2c + j]` is weight row `16p + c`, value `32b + 2kr + j`, which is the pair order
//! `tdpbf16ps` multiplies with an activation tile's row (16 tokens x 32 values). A call converts
//! the activations to bf16 once, as tiles too (rows padded to a multiple of 32; 1 KiB a tile,
//! so each tile load reads one contiguous run), then each task takes blocks of
//! 32 weight rows and runs 2 x 2 output tiles per 32 tokens: per 32-value block, two activation
//! tiles and two weight tiles loaded (the weights with the T1 hint, which keeps them out of L1,
//! where the activation tiles stay), four `tdpbf16ps`.
//!
//! Epilogues: a layer on the tiles writes as little as it can. `Tiles::matmul_silu_mul` runs a
//! gate block and its up block into L1 and writes only `silu(gate) * up`, as `down`'s bf16
//! input tiles (`ActTiles`); `Tiles::matmul_tiles_add` adds the `o` and `down` products into
//! the residual stream; `ActTiles::from_rows` rounds an RMS norm's rows as they come. Each is
//! the same bits as the separate steps (proptests), which wrote a 512-token step's F32
//! products to memory and read them back: 6 MiB for gate/up alone, and on a host reading ~23
//! GB/s that traffic cost more than the tile work (docs/performance.md, "The MLP's activation
//! in the tiles' epilogue"). A block's epilogue runs on the vector units a few rows at a time
//! between the tile instructions of the next block's product (`Tiles::each_block`), so the
//! two overlap rather than take turns.
//!
//! The tile instructions are written with `asm!` (Rust's AMX intrinsics are unstable) and run
//! only with the `cpu::Amx` token, which runtime detection hands out after Linux granted this
//! process the tile state. The scalar reference (`reference`) computes the same products of
//! bf16 values in F64; a seeded proptest compares the two on odd shapes.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::model::team::{self, SharedMut};

use super::cpu::Amx;
use std::mem::MaybeUninit;

use super::{lines, lines_written, prefetch_lines, Lines};

/// Rows of a tile; also the F32 columns of an output tile.
pub(crate) const TILE: usize = 16;
/// bf16 values in a tile row (64 bytes): one 32-value block.
pub(crate) const KB: usize = 32;
/// u16 elements in one weight tile.
pub(crate) const TILE_ELEMS: usize = TILE * KB;
/// Weight rows (and tokens) per task block: two tiles each way.
const BLOCK: usize = 32;

/// 32-value blocks up to which a row block's activation tiles (2 KiB a block) stay in L1 beside
/// the weight tiles passing through: at k = 576 (18) loading the weights with the T1 hint and
/// no prefetch was fastest, at k = 1536 (`down`, 48) prefetching them (docs/performance.md,
/// "Epilogues that overlap the tiles").
const L1_BLOCKS: usize = 20;

/// How many 32-value blocks ahead `block_2x2` prefetches its weight tiles into L1 past
/// `L1_BLOCKS`: at a 512-row step 1 and 2 took 6% off gate/up and 17% off qkv, 4 less
/// (docs/performance.md, "The MLP's activation in the tiles' epilogue").
const TILES_AHEAD: usize = 2;

/// Rows (tokens) from which a projection with a bf16 copy runs on the tiles: below it the
/// quantized kernels read fewer bytes (docs/performance.md, "Intel Xeon with AMX").
pub const AMX_MIN_ROWS: usize = 32;

/// Bytes of bf16 copies the weights loaded from now on may still take (`engine.amx_weights_mib`,
/// set at each model load; 1 GiB until then).
static BUDGET: Budget = Budget(AtomicUsize::new(1024 << 20));

/// Sets how many MiB of bf16 copies the weights loaded from now on may take (0: none).
pub fn set_budget_mib(mib: usize) {
    BUDGET
        .0
        .store(mib.saturating_mul(1 << 20), Ordering::SeqCst);
}

/// Bytes the budget has left.
pub fn budget_left() -> usize {
    BUDGET.0.load(Ordering::SeqCst)
}

/// Bytes left for copies.
struct Budget(AtomicUsize);

impl Budget {
    /// Takes `bytes`; false (taking nothing) when less is left.
    fn take(&self, bytes: usize) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(bytes)
            })
            .is_ok()
    }
}

/// A `[n, k]` weight matrix as bf16 tiles.
#[derive(Debug, Clone)]
pub struct Tiles {
    n: usize,
    k: usize,
    data: Lines<u16>,
}

/// F32 to bf16, rounding to nearest even (NaN stays NaN).
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// bf16 back to F32 (exact).
#[inline]
pub fn bf16_value(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

impl Tiles {
    /// The copy's memory as (address, bytes).
    pub fn span(&self) -> (usize, usize) {
        (self.data.as_ptr() as usize, self.data.len() * 2)
    }

    /// The copy of `w` (`[n, k]`, row-major F32; `k` a multiple of 32), when the budget has room
    /// for it (`w` gives its values only then); `amx` says the tiles can run it at all.
    pub fn within_budget(
        _amx: Amx,
        n: usize,
        k: usize,
        w: impl FnOnce() -> Vec<f32>,
    ) -> Option<Tiles> {
        let bytes = n.div_ceil(BLOCK) * BLOCK * k * 2;
        BUDGET.take(bytes).then(|| Tiles::from_f32(&w(), n, k))
    }

    /// Lays `w` out as tiles.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Tiles {
        assert!(
            k > 0 && k.is_multiple_of(KB),
            "k = {k} is not a positive multiple of {KB}"
        );
        assert_eq!(w.len(), n * k);
        let blocks = k / KB;
        let panels = n.div_ceil(BLOCK) * BLOCK / TILE;
        let mut data = lines(0u16, panels * blocks * TILE_ELEMS);
        data.par_chunks_mut(blocks * TILE_ELEMS)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..TILE {
                    let row = p * TILE + c;
                    if row >= n {
                        break;
                    }
                    let src = &w[row * k..(row + 1) * k];
                    for (i, &v) in src.iter().enumerate() {
                        let (b, kk) = (i / KB, i % KB);
                        panel[b * TILE_ELEMS + (kk / 2) * KB + 2 * c + kk % 2] = bf16_bits(v);
                    }
                }
            });
        Tiles { n, k, data }
    }

    /// (rows, columns).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// `out[m, n] = x[m, k] . w[n, k]` on the tile units, with `x` rounded to bf16.
    pub fn matmul(&self, amx: Amx, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_tiles(amx, &ActTiles::from_f32(amx, x, m, self.k))
    }

    /// `out[m, n] = x[m, k] . w[n, k]` on the tile units, `x` already rounded and laid out.
    pub fn matmul_tiles(&self, amx: Amx, xa: &ActTiles) -> Vec<f32> {
        let (n, m) = (self.n, xa.m);
        let m_pad = m.div_ceil(BLOCK) * BLOCK;
        let n_blocks = n.div_ceil(BLOCK);
        let n_pad = n_blocks * BLOCK;
        // The result is padded to whole blocks both ways and cut to `m x n` after (no copy
        // where `n` is a multiple of 32, as a Llama's widths are).
        let mut y: Vec<f32> = Vec::with_capacity(m_pad * n_pad);
        let out = SharedMut(y.as_mut_ptr());
        self.each_block(
            amx,
            xa,
            n_blocks,
            self.k / KB,
            // SAFETY: `j < n_blocks`; `slot` holds a 32 x 32 result.
            |j, rows, slot, step| unsafe { rows.times(j, slot.as_mut_ptr(), BLOCK, step) },
            |r, j, slot, rows| {
                let out = &out;
                for row in rows {
                    // SAFETY: row `r + row < m_pad` and columns `32j..32j + 32` lie inside
                    // `y`'s `m_pad x n_pad` capacity, and tasks own disjoint column blocks.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            slot.as_ptr().add(row * BLOCK),
                            out.0.add((r + row) * n_pad + j * BLOCK),
                            BLOCK,
                        )
                    }
                }
            },
        );
        // SAFETY: the epilogues above copied every row of every block of the `m_pad x n_pad`
        // result.
        unsafe { y.set_len(m_pad * n_pad) };
        if n_pad == n {
            y.truncate(m * n);
            return y;
        }
        let mut out = vec![0f32; m * n];
        team::chunks_mut(&mut out, n, 8, |r, d| {
            d.copy_from_slice(&y[r * n_pad..][..n])
        });
        out
    }

    /// `y[m, n] += x[m, k] . w[n, k]` on the tile units: the same bits as `matmul_tiles` then
    /// adding its result to `y`, without writing that result to memory and reading it back
    /// (the residual stream after a layer's `o` and `down` projections).
    pub fn matmul_tiles_add(&self, amx: Amx, xa: &ActTiles, y: &mut [f32]) {
        let (n, m) = (self.n, xa.m);
        assert_eq!(y.len(), m * n, "{} values for {m} x {n}", y.len());
        let out = SharedMut(y.as_mut_ptr());
        self.each_block(
            amx,
            xa,
            n.div_ceil(BLOCK),
            self.k / KB,
            // SAFETY: `j` is a block of the weights; `slot` holds a 32 x 32 result.
            |j, xr, slot, step| unsafe { xr.times(j, slot.as_mut_ptr(), BLOCK, step) },
            |r, j, slot, rows| {
                let out = &out;
                let (last, cols) = (BLOCK.min(m - r), BLOCK.min(n - j * BLOCK));
                let (from, to) = (rows.start.min(last), rows.end.min(last));
                // SAFETY: `slot` holds a 32 x 32 result; rows `r + from..r + to` and columns
                // `32j..32j + cols` lie inside `y` (`m x n`), and tasks own disjoint column
                // blocks.
                unsafe {
                    add_block(
                        amx.vnni(),
                        slot.as_ptr().add(from * BLOCK),
                        out.0.add((r + from) * n + j * BLOCK),
                        n,
                        to - from,
                        cols,
                    );
                }
            },
        );
    }

    /// For `[gate; up]` stacked (`n = 2 * inter`, `inter` a multiple of 32): `silu(gate) * up` of
    /// each row of `x`, rounded to bf16 as the tiles of the next projection's input (`down`'s).
    ///
    /// The same bits as `matmul_tiles`, then `silu::silu_mul_rows`, then `ActTiles::from_f32`:
    /// each task runs a gate block and its up block into two 32 x 32 results in L1 and writes
    /// only the 32 x 32 bf16 activations, so the `[m, 2 * inter]` F32 product (6 MiB at a
    /// 512-token step) and the F32 activation are never written to memory and read back
    /// (docs/performance.md, "The MLP's activation in the tiles' epilogue").
    pub fn matmul_silu_mul(&self, amx: Amx, xa: &ActTiles) -> ActTiles {
        let (n, m) = (self.n, xa.m);
        assert!(
            n.is_multiple_of(2 * BLOCK),
            "[gate; up] of {n} rows is not two whole blocks of {BLOCK}"
        );
        let (inter, m_pad) = (n / 2, m.div_ceil(BLOCK) * BLOCK);
        let (g_blocks, out_blocks) = (inter / BLOCK, inter / KB);
        let fill = |act: &mut [MaybeUninit<u16>]| {
            let dst = SharedMut(act.as_mut_ptr() as *mut u16);
            self.each_block(
                amx,
                xa,
                g_blocks,
                2 * (self.k / KB),
                // SAFETY: gate block `j` and up block `j + g_blocks` lie inside the weights;
                // `slot` holds two 32 x 32 results.
                |j, xr, slot, step| unsafe {
                    xr.times(j, slot.as_mut_ptr(), BLOCK, step);
                    xr.times(
                        j + g_blocks,
                        slot.as_mut_ptr().add(BLOCK * BLOCK),
                        BLOCK,
                        step,
                    );
                },
                |r, j, slot, rows| {
                    let dst = &dst;
                    // SAFETY: `slot` holds the gate and up results; rows `r..r + 32` are row
                    // tiles `r / 16` and the next, columns `32j..32j + 32` their block `j`,
                    // inside `act`'s `m_pad x inter`, and tasks own disjoint `j`.
                    unsafe {
                        silu_mul_into_tiles(
                            amx.vnni(),
                            slot.as_ptr(),
                            dst.0.add(((r / TILE) * out_blocks + j) * TILE_ELEMS),
                            out_blocks * TILE_ELEMS,
                            rows,
                        );
                    }
                },
            )
        };
        ActTiles {
            m,
            k: inter,
            // SAFETY: the tasks write every row block (padding rows included) of every 32-value
            // block `j < inter / 32`, which is all of the buffer.
            data: unsafe { lines_written(m_pad * inter, fill) },
        }
    }

    /// The tile loop every product shares. Tasks take runs of the first `col_blocks` 32-column
    /// blocks and visit every 32-row block `r` of `xa` (outside) with each of their blocks `j`
    /// (inside). For each pair, `product(j, rows, slot, step)` runs the tiles into `slot` (room
    /// for two 32 x 32 results), `rows` multiplying rows `r..r + 32` by any weight block
    /// (`RowBlock::times`), and calls `step` once per 32-value block, `steps` times in all. The
    /// pair before it is finished meanwhile from the other slot: at each step
    /// `epilogue(r', j', slot', rows)` turns a share of its 32 rows into output, so the vector
    /// units work while the tile unit multiplies (an epilogue run after its product instead
    /// left the tile unit idle: docs/performance.md, "Epilogues that overlap the tiles").
    ///
    /// Row blocks outside: a row block's activation tiles (36 KiB at k = 576) stay in L1 while
    /// the task's weight panels come from L2 (faster than the other order: docs/performance.md,
    /// "Tile loads that start on a cache line").
    fn each_block(
        &self,
        _amx: Amx,
        xa: &ActTiles,
        col_blocks: usize,
        steps: usize,
        product: impl Fn(usize, &RowBlock, &mut [f32], &mut dyn FnMut()) + Sync,
        epilogue: impl Fn(usize, usize, &[f32], Range<usize>) + Sync,
    ) {
        const SLOT: usize = 2 * BLOCK * BLOCK;
        let (k, m) = (self.k, xa.m);
        assert_eq!(xa.k, k, "activations {} wide for {k}", xa.k);
        let (m_pad, blocks) = (m.div_ceil(BLOCK) * BLOCK, k / KB);
        let per_task = col_blocks.div_ceil(team::size() * 4).max(1);
        team::run(col_blocks.div_ceil(per_task), |t| {
            let mut slots = lines(0f32, 2 * SLOT);
            // The pair whose products wait in the other slot for their epilogue, and the pairs
            // run (a pair takes slot `runs % 2`).
            let (mut pending, mut runs): (Option<(usize, usize)>, usize) = (None, 0);
            // SAFETY: the `Amx` token proves the tiles run here and that this process may use
            // them; `r < m_pad`, so rows `r..r + 32` lie inside `xa` (rows padded to whole
            // blocks).
            unsafe {
                configure();
                for r in (0..m_pad).step_by(BLOCK) {
                    let rows = RowBlock {
                        x: xa.data.as_ptr().add(r * k),
                        w: self.data.as_ptr(),
                        blocks,
                        n_blocks: self.n.div_ceil(BLOCK),
                    };
                    for j in t * per_task..((t + 1) * per_task).min(col_blocks) {
                        let (first, second) = slots.split_at_mut(SLOT);
                        let (slot, other) = if runs.is_multiple_of(2) {
                            (first, &*second)
                        } else {
                            (second, &*first)
                        };
                        let (mut taken, mut done) = (0, 0);
                        let mut step = || {
                            taken += 1;
                            if let Some((pr, pj)) = pending {
                                let to = (taken * BLOCK).div_ceil(steps).min(BLOCK);
                                if to > done {
                                    epilogue(pr, pj, other, done..to);
                                    done = to;
                                }
                            }
                        };
                        product(j, &rows, slot, &mut step);
                        if let Some((pr, pj)) = pending.filter(|_| done < BLOCK) {
                            epilogue(pr, pj, other, done..BLOCK);
                        }
                        pending = Some((r, j));
                        runs += 1;
                    }
                }
                if let Some((pr, pj)) = pending {
                    epilogue(pr, pj, &slots[((runs - 1) % 2) * SLOT..][..SLOT], 0..BLOCK);
                }
                release();
            }
        });
    }
}

/// 32 activation rows (`x`: their two row tiles' `blocks` tiles each) against the weights'
/// 32-row blocks (`w`: `n_blocks` of them, panels of `blocks` tiles), inside `each_block`'s
/// configured tiles.
struct RowBlock {
    x: *const u16,
    w: *const u16,
    blocks: usize,
    n_blocks: usize,
}

impl RowBlock {
    /// Stores the rows times weight block `jj` (32 x 32 F32) at `y`, rows `stride` floats apart,
    /// calling `step` after each 32-value block.
    ///
    /// # Safety
    /// Called inside `each_block`'s task (tiles configured); `y` must hold 32 rows of 32 floats
    /// at that stride, written by no other thread meanwhile.
    unsafe fn times(&self, jj: usize, y: *mut f32, stride: usize, step: &mut dyn FnMut()) {
        assert!(jj < self.n_blocks, "weight block {jj} of {}", self.n_blocks);
        let w0 = self.w.add(jj * 2 * self.blocks * TILE_ELEMS);
        block_2x2(
            self.x,
            w0,
            w0.add(self.blocks * TILE_ELEMS),
            self.blocks,
            y,
            stride,
            step,
        );
    }
}

/// A step's activations rounded to bf16 (`to_bf16`'s bits) as the tile units read them: per 16
/// rows and 32-value block one 1 KiB tile, so a tile load reads one contiguous run; rows padded
/// with zeros to a multiple of 32.
pub struct ActTiles {
    m: usize,
    k: usize,
    data: Lines<u16>,
}

impl ActTiles {
    /// `x` (`m` rows of `k`, a multiple of 32) as tiles.
    pub fn from_f32(amx: Amx, x: &[f32], m: usize, k: usize) -> ActTiles {
        assert_eq!(x.len(), m * k);
        // SAFETY: `to_bf16_tiles` writes its whole row tile.
        unsafe {
            Self::by_tile(amx, m, k, |r0, rows, dst| {
                to_bf16_tiles(amx, &x[r0 * k..(r0 + rows) * k], k, dst)
            })
        }
    }

    /// Rows `0..m` of `k` values, each written by `row(r, out)` into an F32 scratch row and
    /// rounded as `from_f32` rounds it: the same tiles as `from_f32` of the rows, without the
    /// `m x k` F32 matrix in memory (a layer's RMS norm feeds its projections this way).
    ///
    /// # Safety
    /// `row` must write every value of the `out` it is given.
    pub unsafe fn from_rows(
        amx: Amx,
        m: usize,
        k: usize,
        row: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
    ) -> ActTiles {
        // SAFETY: `to_bf16_tiles` writes its whole row tile.
        unsafe {
            Self::by_tile(amx, m, k, |r0, rows, dst| {
                let mut f32s: Vec<f32> = Vec::with_capacity(rows * k);
                let spare = &mut f32s.spare_capacity_mut()[..rows * k];
                for (i, out) in spare.chunks_exact_mut(k).enumerate() {
                    row(r0 + i, out);
                }
                // SAFETY: `row` writes all `k` values of each row (the caller's promise).
                f32s.set_len(rows * k);
                to_bf16_tiles(amx, &f32s, k, dst);
            })
        }
    }

    /// The tiles of `m` rows of `k` values, a task a row tile: `tile(r0, rows, dst)` fills row
    /// tile `dst` (16 rows of `k`) from rows `r0..r0 + rows`, padding rows included.
    ///
    /// # Safety
    /// `tile` must write every value of its `dst` (as `to_bf16_tiles` does).
    unsafe fn by_tile(
        _amx: Amx,
        m: usize,
        k: usize,
        tile: impl Fn(usize, usize, &mut [MaybeUninit<u16>]) + Sync,
    ) -> ActTiles {
        assert!(
            k > 0 && k.is_multiple_of(KB),
            "k = {k} is not a positive multiple of {KB}"
        );
        let m_pad = m.div_ceil(BLOCK) * BLOCK;
        let fill = |buf: &mut [MaybeUninit<u16>]| {
            team::chunks_mut(buf, TILE * k, 1, |mt, dst| {
                let r0 = (mt * TILE).min(m);
                tile(r0, TILE.min(m - r0), dst)
            })
        };
        // SAFETY: every row tile is handed to `tile`, which writes it whole (the caller's
        // promise).
        let data = unsafe { lines_written(m_pad * k, fill) };
        ActTiles { m, k, data }
    }

    /// (rows, values a row).
    pub fn dims(&self) -> (usize, usize) {
        (self.m, self.k)
    }
}

/// A gate and an up result (`s`: two 32 x 32 F32 blocks, row-major, gate first) as `silu(g) * u`
/// rounded to bf16, into two row tiles' block (`dst`: rows 0-15 there, rows 16-31
/// `tile_stride` elements on). The 512-bit SiLU kernel's and the rounding's own operations, so
/// the same bits as the unfused path.
///
/// # Safety
/// AVX-512 F/BW, AVX2 and FMA (the VNNI token's); `s` 2 x 1,024 floats, 64-byte aligned; `dst`
/// and `dst + tile_stride` each 512 writable u16, 32-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn silu_mul_into_tiles(
    _vnni: super::cpu::Avx512Vnni,
    s: *const f32,
    dst: *mut u16,
    tile_stride: usize,
    rows: Range<usize>,
) {
    use std::arch::x86_64::*;
    for row in rows {
        let to = dst.add((row / TILE) * tile_stride + (row % TILE) * KB);
        for h in 0..2 {
            let g = _mm512_load_ps(s.add(row * BLOCK + h * 16));
            let u = _mm512_load_ps(s.add(BLOCK * BLOCK + row * BLOCK + h * 16));
            let v = super::silu::avx512::silu_mul16(g, u);
            _mm256_store_si256(to.add(h * 16) as *mut __m256i, bf16x16(v));
        }
    }
}

/// `y[r][c] += s[r][c]` for the first `rows` rows and `cols` columns of a 32 x 32 result `s`
/// (row-major), `y`'s rows `stride` floats apart: one F32 add a value, as `add_assign` does.
///
/// # Safety
/// AVX-512 F (the VNNI token's); `s` 1,024 floats, 64-byte aligned; `y` as described.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_block(
    _vnni: super::cpu::Avx512Vnni,
    s: *const f32,
    y: *mut f32,
    stride: usize,
    rows: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let masks = [0, 16].map(|c0: usize| {
        let n = cols.saturating_sub(c0).min(16);
        ((1u32 << n) - 1) as __mmask16
    });
    for r in 0..rows {
        for (h, &mask) in masks.iter().enumerate() {
            let (from, to) = (s.add(r * BLOCK + h * 16), y.add(r * stride + h * 16));
            let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, to), _mm512_load_ps(from));
            _mm512_mask_storeu_ps(to, mask, sum);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn add_block(
    _vnni: super::cpu::Avx512Vnni,
    _s: *const f32,
    _y: *mut f32,
    _stride: usize,
    _rows: usize,
    _cols: usize,
) {
    unreachable!("AMX tiles exist on x86_64 only")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn silu_mul_into_tiles(
    _vnni: super::cpu::Avx512Vnni,
    _s: *const f32,
    _dst: *mut u16,
    _tile_stride: usize,
    _rows: Range<usize>,
) {
    unreachable!("AMX tiles exist on x86_64 only")
}

/// Rounds `src` to bf16 into `dst` (`bf16_bits`, the same bits): 16 values at a time on AVX-512,
/// which every CPU with the tile units has (the scalar loop was not vectorized: its NaN branch
/// kept it one value at a time, a few milliseconds of a 62-row step).
pub(crate) fn to_bf16(amx: Amx, src: &[f32], dst: &mut [u16]) {
    assert!(
        dst.len() >= src.len(),
        "{} values into {}",
        src.len(),
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        let _vnni = amx.vnni();
        // SAFETY: the AVX-512 VNNI token (from the tile units') proves AVX-512 F/BW; `dst` holds
        // `src.len()` values (asserted above).
        unsafe { to_bf16_avx512(src, dst) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = amx;
        to_bf16_scalar(src, dst);
    }
}

/// Up to 16 rows of `k` values (`src`) rounded to bf16 (`to_bf16`'s bits) into one row tile's
/// blocks (`dst`: per 32-value block `b`, 16 rows of 32 at `(b * 16 + r) * 32`), zeros in the
/// rows past `src`'s, so every value of `dst` is written. One call for the whole tile: a call
/// per 32-value block cost more than the rounding.
///
/// # Panics
/// When `k` is not a multiple of 32, `src` is not whole rows, there are more than 16, or `dst`
/// is not 16 rows of `k`.
pub(crate) fn to_bf16_tiles(amx: Amx, src: &[f32], k: usize, dst: &mut [MaybeUninit<u16>]) {
    assert!(k.is_multiple_of(KB) && src.len().is_multiple_of(k.max(1)));
    assert!(
        src.len() <= TILE * k && dst.len() == TILE * k,
        "one row tile"
    );
    let rows = src.len() / k.max(1);
    #[cfg(target_arch = "x86_64")]
    {
        let _vnni = amx.vnni();
        // SAFETY: the AVX-512 VNNI token (from the tile units') proves AVX-512 F/BW; every
        // block written lies inside `dst` (asserted above).
        unsafe { to_bf16_tiles_avx512(src, k, dst.as_mut_ptr() as *mut u16) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = amx;
        for (r, row) in src.chunks_exact(k).enumerate() {
            for (b, vals) in row.chunks_exact(KB).enumerate() {
                for (d, &v) in dst[(b * TILE + r) * KB..][..KB].iter_mut().zip(vals) {
                    d.write(bf16_bits(v));
                }
            }
        }
    }
    for b in 0..k / KB {
        dst[(b * TILE + rows) * KB..(b + 1) * TILE * KB].fill(MaybeUninit::new(0));
    }
}

/// # Safety
/// AVX-512 F and BW; the shapes `to_bf16_tiles` asserts (`dst`: 16 rows of `k` writable).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn to_bf16_tiles_avx512(src: &[f32], k: usize, dst: *mut u16) {
    use std::arch::x86_64::*;
    for (r, row) in src.chunks_exact(k).enumerate() {
        for (b, vals) in row.chunks_exact(KB).enumerate() {
            let to = dst.add((b * TILE + r) * KB);
            for h in 0..KB / 16 {
                let x = _mm512_loadu_ps(vals.as_ptr().add(h * 16));
                _mm256_storeu_si256(to.add(h * 16) as *mut __m256i, bf16x16(x));
            }
        }
    }
}

/// The scalar reference of `to_bf16`.
fn to_bf16_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_bits(s);
    }
}

/// # Safety
/// AVX-512 F and BW; `dst` at least as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn to_bf16_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n16 = src.len() / 16 * 16;
    for i in (0..n16).step_by(16) {
        let x = _mm512_loadu_ps(src.as_ptr().add(i));
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, bf16x16(x));
    }
    to_bf16_scalar(&src[n16..], &mut dst[n16..]);
}

/// Sixteen values rounded to bf16 (`bf16_bits`' bits, NaNs kept quiet).
///
/// # Safety
/// AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn bf16x16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let (one, bias, quiet) = (
        _mm512_set1_epi32(1),
        _mm512_set1_epi32(0x7fff),
        _mm512_set1_epi32(0x40),
    );
    let b = _mm512_castps_si512(x);
    let hi = _mm512_srli_epi32::<16>(b);
    let round = _mm512_add_epi32(bias, _mm512_and_si512(hi, one));
    let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, round));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, quiet)))
}

/// Loads the tile configuration: palette 1, all eight tiles 16 rows x 64 bytes.
///
/// # Safety
/// The CPU must have AMX and the process the permission (`cpu::Amx`).
pub(crate) unsafe fn configure() {
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut cfg = Config([0; 64]);
    cfg.0[0] = 1;
    for t in 0..8 {
        cfg.0[16 + 2 * t] = 64;
        cfg.0[48 + t] = TILE as u8;
    }
    tile_asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Gives the tile state back (so a context switch no longer saves 8 KiB for this thread).
///
/// # Safety
/// As `configure`.
pub(crate) unsafe fn release() {
    tile_asm!("tilerelease", options(nostack, nomem));
}

/// 32 tokens x 32 weight rows: `y[r][c] = sum_b x[r][32b..] . w_c[32b..]`, with `x` the bf16
/// activations as tiles (per 16 rows, `blocks` tiles of 16 rows x 32 values, 1 KiB each),
/// `w0`/`w1` the two panels' tiles, `y` row stride `y_stride` floats.
///
/// # Safety
/// Tiles configured (`configure`); 2 x `blocks` tiles at `x`, `blocks` tiles at `w0` and `w1`,
/// 32 rows of 32 floats at `y`.
#[inline(always)]
unsafe fn block_2x2(
    x: *const u16,
    w0: *const u16,
    w1: *const u16,
    blocks: usize,
    y: *mut f32,
    y_stride: usize,
    step: &mut dyn FnMut(),
) {
    let x_stride = KB * 2;
    let ys = y_stride * 4;
    tile_asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
    for b in 0..blocks {
        let a0 = x.add(b * TILE_ELEMS);
        let a1 = a0.add(blocks * TILE_ELEMS);
        let b0 = w0.add(b * TILE_ELEMS);
        let b1 = w1.add(b * TILE_ELEMS);
        // The weight tiles come from L2 (the task's panels, re-read for every row block) and
        // are loaded with the T1 hint, which keeps them out of L1, where the row block's
        // activation tiles stay. Where those do not fit, both come from L2 and the loads wait
        // on the weights: then they are prefetched (past the last block the hints are dropped).
        if blocks > L1_BLOCKS && b + TILES_AHEAD < blocks {
            prefetch_lines::<{ TILE_ELEMS * 2 }>(b0.add(TILES_AHEAD * TILE_ELEMS) as *const u8);
            prefetch_lines::<{ TILE_ELEMS * 2 }>(b1.add(TILES_AHEAD * TILE_ELEMS) as *const u8);
        }
        tile_asm!(
            "tileloadd tmm4, [{a0} + {xs}*1]",
            "tileloaddt1 tmm6, [{b0} + {ws}*1]",
            "tileloaddt1 tmm7, [{b1} + {ws}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {xs}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            b0 = in(reg) b0,
            b1 = in(reg) b1,
            xs = in(reg) x_stride,
            ws = in(reg) KB * 2,
            options(nostack, readonly)
        );
        step();
    }
    tile_asm!(
        "tilestored [{y0} + {ys}*1], tmm0",
        "tilestored [{y1} + {ys}*1], tmm1",
        "tilestored [{y2} + {ys}*1], tmm2",
        "tilestored [{y3} + {ys}*1], tmm3",
        y0 = in(reg) y,
        y1 = in(reg) y.add(TILE),
        y2 = in(reg) y.add(TILE * y_stride),
        y3 = in(reg) y.add(TILE * y_stride + TILE),
        ys = in(reg) ys,
        options(nostack)
    );
}

/// The tile units' bf16 peak loop for the roof report: `iters` x 4 independent `tdpbf16ps`
/// (16 x 16 x 32 multiply-adds each) with no memory traffic; returns the operations done (a
/// multiply and an add count two) and a value the compiler cannot drop.
pub fn peak(_amx: Amx, iters: usize) -> (f64, i64) {
    let src = vec![0u16; TILE_ELEMS];
    let mut dst = vec![0f32; TILE * TILE];
    // SAFETY: the `Amx` token proves the tiles run here; the loads read `src` (1 KiB), the store
    // writes `dst` (1 KiB).
    unsafe {
        configure();
        tile_asm!(
            "tileloadd tmm4, [{s} + {st}*1]",
            "tileloadd tmm6, [{s} + {st}*1]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            s = in(reg) src.as_ptr(),
            st = in(reg) KB * 2,
            options(nostack, readonly)
        );
        for _ in 0..iters {
            tile_asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm6",
                "tdpbf16ps tmm3, tmm4, tmm6",
                options(nostack, nomem)
            );
        }
        tile_asm!(
            "tilestored [{d} + {st}*1], tmm0",
            d = in(reg) dst.as_mut_ptr(),
            st = in(reg) TILE * 4,
            options(nostack)
        );
        release();
    }
    let ops = (iters * 4 * TILE * TILE * KB * 2) as f64;
    (ops, std::hint::black_box(dst[0]) as i64)
}

/// The scalar reference: the same products of bf16-rounded values, summed in F64.
pub fn reference(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut s = 0f64;
            for i in 0..k {
                let a = bf16_value(bf16_bits(x[r * k + i])) as f64;
                let b = bf16_value(bf16_bits(w[c * k + i])) as f64;
                s += a * b;
            }
            out[r * n + c] = s as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_data::{amx_for_test, lcg};
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_seed: proptest::test_runner::RngSeed::Fixed(31), ..ProptestConfig::default() })]
        /// The 16-lane rounding gives `bf16_bits`' bits on any values (NaNs, infinities,
        /// subnormals, ties) and any length (on a CPU with the tile units).
        #[test]
        fn bf16_rounding_sixteen_at_a_time_equals_the_scalar_one(
            bits in prop::collection::vec(prop_oneof![
                any::<u32>(),
                Just(0x7fc0_0001u32), Just(0xff80_0000), Just(0x3f80_8000), Just(0x3f81_8000),
                Just(0x0000_8001), Just(0x7f7f_ffff),
            ], 0..70),
        ) {
            let Some(amx) = amx_for_test("bf16_rounding_sixteen_at_a_time_equals_the_scalar_one") else {
                return Ok(());
            };
            let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let (mut got, mut want) = (vec![0u16; src.len()], vec![0u16; src.len()]);
            to_bf16(amx, &src, &mut got);
            to_bf16_scalar(&src, &mut want);
            prop_assert_eq!(got, want);
        }
    }

    /// A row tile rounded in one call holds `to_bf16`'s bits for every block, zeros past the rows
    /// (whatever the buffer held).
    #[test]
    fn a_row_tile_rounded_at_once_equals_block_by_block() {
        let Some(amx) = amx_for_test("a_row_tile_rounded_at_once_equals_block_by_block") else {
            return;
        };
        for (rows, k) in [(16, 576), (5, 64), (1, 32), (0, 96)] {
            let src: Vec<f32> = lcg(rows as u64 + 7, rows * k);
            // Garbage first: the call writes every value.
            let mut got = vec![MaybeUninit::new(0xAAAAu16); TILE * k];
            to_bf16_tiles(amx, &src, k, &mut got);
            // SAFETY: every value was initialized above.
            let got: Vec<u16> = got.iter().map(|v| unsafe { v.assume_init() }).collect();
            let mut want = vec![0u16; TILE * k];
            for r in 0..rows {
                for b in 0..k / KB {
                    let vals = &src[r * k + b * KB..][..KB];
                    to_bf16_scalar(vals, &mut want[(b * TILE + r) * KB..][..KB]);
                }
            }
            assert_eq!(got, want, "{rows} rows of {k}");
        }
    }

    fn check(amx: Amx, m: usize, n: usize, k: usize, seed: u64) {
        let w = lcg(seed, n * k);
        let x = lcg(seed ^ 0x9e37, m * k);
        let got = Tiles::from_f32(&w, n, k).matmul(amx, &x, m);
        let want = reference(&w, n, k, &x, m);
        for r in 0..m {
            for c in 0..n {
                // The tiles sum pairs in F32: allow a few roundings of the largest possible sum.
                let bound: f32 = (0..k)
                    .map(|i| (x[r * k + i] * w[c * k + i]).abs())
                    .sum::<f32>()
                    * 1e-5
                    + 1e-6;
                let (g, e) = (got[r * n + c], want[r * n + c]);
                assert!(
                    (g - e).abs() <= bound,
                    "m {m} n {n} k {k}: out[{r}][{c}] = {g}, reference {e}"
                );
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_value(bf16_bits(-2.5)), -2.5);
        assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
    }

    #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
    #[test]
    fn tiles_match_the_reference_on_the_models_shapes() {
        let Some(amx) = amx_for_test("tiles_match_the_reference_on_the_models_shapes") else {
            return;
        };
        check(amx, 64, 960, 576, 1);
        check(amx, 33, 576, 1536, 2);
    }

    #[test]
    fn the_budget_bounds_the_copies() {
        let b = Budget(AtomicUsize::new(1 << 20));
        assert!(b.take(1 << 19));
        assert!(!b.take(1 << 20), "only half a MiB was left");
        assert!(b.take(1 << 19));
        assert!(!b.take(1));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The MLP's activation computed in the gate/up kernel's epilogue is, to the bit, the
        /// gate/up product, then `silu_mul_rows`, then rounding to tiles: any rows (padding
        /// within a row block and past it), any width of whole blocks (up to 3 a task, so each
        /// epilogue runs beside the next pair's product, across row blocks too), gates from -24
        /// to 24.
        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn silu_in_the_epilogue_equals_the_three_steps_bit_for_bit(
            m in 1usize..70, inter_blocks in 1usize..24, kb in 1usize..4, seed in any::<u64>()
        ) {
            let Some(amx) = amx_for_test("silu_in_the_epilogue_equals_the_three_steps_bit_for_bit") else {
                return Ok(());
            };
            let (inter, k) = (inter_blocks * BLOCK, kb * KB);
            let w = lcg(seed, 2 * inter * k);
            let x: Vec<f32> = lcg(seed ^ 0x77, m * k).iter().map(|v| v * 4.0).collect();
            let tiles = Tiles::from_f32(&w, 2 * inter, k);
            let xa = ActTiles::from_f32(amx, &x, m, k);
            let fused = tiles.matmul_silu_mul(amx, &xa);
            let gu = tiles.matmul_tiles(amx, &xa);
            let act = super::super::silu::silu_mul_rows(&gu, 2 * inter, &gu[inter..], 2 * inter, inter, m);
            let want = ActTiles::from_f32(amx, &act, m, inter);
            prop_assert_eq!(fused.dims(), want.dims());
            prop_assert_eq!(&fused.data[..], &want.data[..]);
        }

        /// Rows written one at a time into scratch give `from_f32`'s tiles.
        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn tiles_from_rows_equal_tiles_from_the_matrix(m in 0usize..70, kb in 1usize..4, seed in any::<u64>()) {
            let Some(amx) = amx_for_test("tiles_from_rows_equal_tiles_from_the_matrix") else {
                return Ok(());
            };
            let k = kb * KB;
            let x = lcg(seed, m * k);
            // SAFETY: the closure writes all `k` values of each row.
            let got = unsafe {
                ActTiles::from_rows(amx, m, k, |r, out| {
                    for (o, &v) in out.iter_mut().zip(&x[r * k..][..k]) {
                        o.write(v);
                    }
                })
            };
            let want = ActTiles::from_f32(amx, &x, m, k);
            prop_assert_eq!(got.dims(), want.dims());
            prop_assert_eq!(&got.data[..], &want.data[..]);
        }

        /// Adding the product in the epilogue is, to the bit, the product then one F32 add a
        /// value: any rows and any width (partial last blocks of both; up to 3 blocks a task).
        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn the_product_added_in_the_epilogue_equals_adding_it_after(
            m in 1usize..70, n in 1usize..760, kb in 1usize..4, seed in any::<u64>()
        ) {
            let Some(amx) = amx_for_test("the_product_added_in_the_epilogue_equals_adding_it_after") else {
                return Ok(());
            };
            let k = kb * KB;
            let tiles = Tiles::from_f32(&lcg(seed, n * k), n, k);
            let xa = ActTiles::from_f32(amx, &lcg(seed ^ 0x77, m * k), m, k);
            let y0 = lcg(seed ^ 0x99, m * n);
            let mut got = y0.clone();
            tiles.matmul_tiles_add(amx, &xa, &mut got);
            let want: Vec<f32> = y0.iter().zip(tiles.matmul_tiles(amx, &xa)).map(|(a, b)| a + b).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
        }

        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn tiles_match_the_reference_on_odd_shapes(
            m in 1usize..70, n in 1usize..90, blocks in 1usize..20, seed in any::<u64>()
        ) {
            if let Some(amx) = amx_for_test("tiles_match_the_reference_on_odd_shapes") {
                check(amx, m, n, blocks * KB, seed);
            }
        }
    }
}
