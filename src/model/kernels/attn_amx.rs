//! The attention tile on Intel's tile units (AMX) for tiles of many query rows: a prefill chunk's
//! GQA rows against the positions they see.
//!
//! Why: a chunk of a long prompt, deep in its context, is bound by attention on CPUs (each of its
//! query rows against every earlier position), and the F32 kernel (`attn`) runs it at a fraction
//! of the F32 FMA peak while `tdpbf16ps` has ~13x that peak on the same cores (docs/performance.md,
//! "Intel Xeon with AMX"). A reply's decode rows, drafts and all, stay on `attn` (bf16 would
//! make speculating change a reply), and so does an F32 cache, the setting that asks for exact
//! attention.
//!
//! Shape (the one llama.cpp's and oneDNN's CPU flash attention take on AMX, written here because
//! candle has no paged attention on CPU): one KV head's positions are packed once per layer into
//! bf16 tiles in the layout `tdpbf16ps` reads as its `B` operand (`Packed`; a long prompt's packs
//! are kept from step to step, only new positions packed: `model::tile_packs`): K as 16 positions x
//! 32 dimensions a tile, (even, odd) dimension pairs, for `Q . K^T`; V as 32 positions x 16
//! dimensions a tile, (even, odd) position pairs, for `P . V`; a Q8 cache's scales are applied as
//! they are packed. The tasks of that head then share the packs: per 16 query rows (rounded to
//! bf16), the scores come off the tiles in F32, each row's softmax runs in F32 over the positions
//! it sees (`attn::softmax`), its weights are rounded to bf16, and the weighted sum of values
//! comes off the tiles in F32. Two passes over a row's positions, as `attn` does, rather than
//! flash attention's running rescale: a 16-row block's scores over 8,000 positions are 512 KiB,
//! which L2 holds.
//!
//! The instructions are written with `asm!` and run only with the `cpu::Amx` token. `reference`
//! computes the same thing from the same bf16 roundings in F64; a seeded proptest compares the two
//! on odd shapes and cache types, and `attn`'s tests compare it with the F32 kernel.

use std::cell::RefCell;

#[cfg(any(test, not(target_arch = "x86_64")))]
use super::amx::bf16_bits;
use super::amx::{configure, release, to_bf16, KB, TILE, TILE_ELEMS};
use super::attn::KvElem;
use super::cpu::Amx;
use super::{lines, Lines};

/// Query rows (`MIN_TOKENS` tokens at least) from which a sequence's attention runs on the tiles:
/// a tile takes 16 rows; 4 tokens of a GQA group of 3 already ran 1.2x faster than the F32
/// kernel at 300 positions, 8 tokens 1.3-1.8x (`cargo bench --bench engine -- --attention 4
/// --chunk 8 --context 300`).
pub(crate) const MIN_ROWS: usize = 12;

/// Tokens from which a prompt's run may take the tiles (with `MIN_ROWS` rows). A reply's decode
/// never does, whatever its drafts (`SeqMeta::exact`): the tiles round to bf16, and speculating
/// must not change what a reply samples. The cost model prices the attention of prompt runs this
/// long apart from decode rows' (`engine::cost`).
pub const MIN_TOKENS: usize = 4;

/// Query rows a task takes on the tiles: with a GQA group of 3, 32 tokens (six row tiles).
pub(crate) const TASK_ROWS: usize = 96;

/// Whether the tiles run heads of `d` values (whole 64-value groups of four output tiles).
pub(crate) fn supports(d: usize) -> bool {
    d.is_multiple_of(64) && d <= 256
}

/// A Q8 cache layer's K and V scales for one KV head (`[slots, heads]` from the head's own), or
/// `None` for F32 and F16.
type Scales<'a> = Option<(&'a [half::f16], &'a [half::f16])>;

/// The K and V scales of the position whose row starts at `at` (1 and 1 without scales).
#[inline]
fn scale_at(scales: Scales, at: usize, d: usize) -> (f32, f32) {
    match scales {
        Some((ks, vs)) => (ks[at / d].to_f32(), vs[at / d].to_f32()),
        None => (1.0, 1.0),
    }
}

/// One KV head's positions `0..n` as bf16 tiles (module doc), padded with zeros to whole
/// 32-position blocks.
#[derive(Debug)]
pub(crate) struct Packed {
    n: usize,
    d: usize,
    k: Lines<u16>,
    v: Lines<u16>,
}

impl Default for Packed {
    fn default() -> Self {
        Packed {
            n: 0,
            d: 0,
            k: Lines::new(64),
            v: Lines::new(64),
        }
    }
}

impl Packed {
    /// Packs positions `0..n` of one KV head: position `p`'s `d` values start at `rows[p]` in `k`
    /// and `v`; a Q8 cache's `scales` (K, V) at `rows[p] / d`. Positions `0..keep` are kept as
    /// they are (packed before from the same rows, with the same `d`; 0 packs all): only
    /// positions `keep..n` are read and written. Reuses this pack's memory.
    ///
    /// # Panics
    /// When an offset points outside `k`, `v` or the scales, `d` is not supported, `keep` is not
    /// a whole number of 32-position blocks or more than this pack holds, or `d` differs from
    /// the pack's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pack_from<T: KvElem>(
        &mut self,
        _amx: Amx,
        keep: usize,
        n: usize,
        rows: &[usize],
        k: &[T],
        v: &[T],
        d: usize,
        scales: Scales,
    ) {
        assert!(supports(d), "head size {d}");
        assert!(rows.len() >= n, "a row offset for every position");
        assert!(
            keep.is_multiple_of(KB) && keep <= self.n.min(n) && (keep == 0 || d == self.d),
            "kept positions {keep} of {} packed",
            self.n
        );
        let last = rows[keep..n].iter().copied().max().unwrap_or(0) + d;
        assert!(
            last <= k.len() && last <= v.len(),
            "row offsets inside the cache"
        );
        if let Some((ks, vs)) = scales {
            assert!(
                last / d <= ks.len() && last / d <= vs.len(),
                "scales inside"
            );
        }
        let padded = n.div_ceil(KB) * KB;
        self.n = n;
        self.d = d;
        // Every position in `keep..n` is written; the rest of the last 32-position block is
        // zeroed (K's and V's tiles of one block are contiguous).
        let last = (padded - KB) * d..padded * d;
        for buf in [&mut self.k, &mut self.v] {
            buf.resize(padded * d, 0);
            if n > keep {
                buf[last.clone()].fill(0);
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token implies AVX-512 F/BW/VL and F16C; offsets checked above, the packs
        // sized for `padded` positions.
        unsafe {
            simd::pack(self, keep, rows, k, v, scales)
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.pack_scalar(keep, rows, k, v, scales);
    }

    /// `pack_from`'s layout one value at a time (the reference for the vector code).
    #[cfg(any(test, not(target_arch = "x86_64")))]
    fn pack_scalar<T: KvElem>(
        &mut self,
        keep: usize,
        rows: &[usize],
        k: &[T],
        v: &[T],
        scales: Scales,
    ) {
        let (n, d) = (self.n, self.d);
        let scale = |p: usize| scale_at(scales, rows[p], d);
        let kbs = d / KB;
        let dts = d / TILE;
        let mut vals = vec![0u16; d];
        for p in keep..n {
            let (ks, vs) = scale(p);
            // K: tile (position tile, 32-value block), row = dimension pair, column = position.
            let row = &k[rows[p]..rows[p] + d];
            for (x, y) in vals.iter_mut().zip(row) {
                *x = bf16_bits(y.to_f32() * ks);
            }
            let (pt, c) = (p / TILE, p % TILE);
            for (i, pair) in vals.chunks_exact(2).enumerate() {
                let (b, r) = (2 * i / KB, (2 * i % KB) / 2);
                let at = (pt * kbs + b) * TILE_ELEMS + r * KB + 2 * c;
                self.k[at] = pair[0];
                self.k[at + 1] = pair[1];
            }
            // V: tile (32-position block, 16-value column tile), row = position pair, column =
            // dimension.
            let row = &v[rows[p]..rows[p] + d];
            let (pb, w) = (p / KB, p % KB);
            for (i, y) in row.iter().enumerate() {
                let (dt, c) = (i / TILE, i % TILE);
                let at = (pb * dts + dt) * TILE_ELEMS + (w / 2) * KB + 2 * c + w % 2;
                self.v[at] = bf16_bits(y.to_f32() * vs);
            }
        }
    }
}

/// `out[r] = softmax(q[r] . K[0..ctx[r]]^T) . V[0..ctx[r]]` for every row (`q`: `[rows, d]`,
/// already times the softmax scale; `out` the same shape), from `packed` (which holds every
/// position a row sees). Returns each row's softmax statistics, as `attn::attend` does.
///
/// # Panics
/// When the shapes disagree or a row sees a position the pack does not hold.
pub(crate) fn tile(
    amx: Amx,
    q: &[f32],
    ctx: &[usize],
    packed: &Packed,
    out: &mut [f32],
) -> Vec<(f32, f32)> {
    let d = packed.d;
    let n = ctx.len();
    assert_eq!(q.len(), n * d, "query rows are d wide");
    assert_eq!(out.len(), n * d, "output rows are d wide");
    assert!(
        ctx.iter().all(|&c| c > 0 && c <= packed.n),
        "every row sees 1..={} positions",
        packed.n
    );
    let stride = packed.n.div_ceil(KB) * KB;
    let kbs = d / KB;
    let dts = d / TILE;
    let mut qa = lines(0u16, TILE * d);
    // A 16-row block's scores and weights, kept by the thread for its next tiles (at long contexts
    // they are too big for the allocator to keep, and fresh pages cost page faults each time).
    let (mut s, mut pw) =
        SCRATCH.with(|c| std::mem::replace(&mut *c.borrow_mut(), (Lines::new(64), Lines::new(64))));
    s.resize(TILE * stride, 0.0);
    pw.resize(TILE * stride, 0);
    let mut o = lines(0f32, TILE * d);
    let mut inv = [0f32; TILE];
    let mut stats = Vec::with_capacity(n);
    // SAFETY: the token proves the tiles run here and this process may use them. Every tile load
    // reads inside `qa` (16 rows of `d`), `packed.k` / `packed.v` (positions below `blocks * 32 <=
    // stride`, the pack's padded length) or `pw` (16 rows of `stride`); every store writes inside
    // `s` (16 rows of `stride`) or `o` (16 rows of `d`).
    unsafe {
        configure();
        for r0 in (0..n).step_by(TILE) {
            let rows = TILE.min(n - r0);
            let seen = ctx[r0..r0 + rows].iter().copied().max().unwrap_or(0);
            let blocks = seen.div_ceil(KB);
            for (r, dst) in qa.chunks_exact_mut(d).enumerate() {
                match q.get((r0 + r) * d..(r0 + r + 1) * d) {
                    Some(src) if r < rows => to_bf16(amx, src, dst),
                    _ => dst.fill(0),
                }
            }
            for b in 0..blocks {
                scores(
                    qa.as_ptr(),
                    d,
                    kbs,
                    packed.k.as_ptr().add(2 * b * kbs * TILE_ELEMS),
                    s.as_mut_ptr().add(b * KB),
                    stride,
                );
            }
            for r in 0..TILE {
                let row = &mut pw[r * stride..r * stride + blocks * KB];
                if r >= rows {
                    row.fill(0);
                    continue;
                }
                let c = ctx[r0 + r];
                let st = weights(amx, &s[r * stride..r * stride + c], row);
                inv[r] = 1.0 / st.1;
                stats.push(st);
                row[c..].fill(0);
            }
            for g in (0..dts).step_by(4) {
                weighted_values(
                    pw.as_ptr(),
                    stride,
                    packed.v.as_ptr().add(g * TILE_ELEMS),
                    dts,
                    blocks,
                    o.as_mut_ptr().add(g * TILE),
                    d,
                );
            }
            // The weights were not normalized: each row's sum divides its output.
            for ((dst, src), f) in out[r0 * d..(r0 + rows) * d]
                .chunks_exact_mut(d)
                .zip(o.chunks_exact(d))
                .zip(&inv)
            {
                dst.iter_mut().zip(src).for_each(|(y, x)| *y = x * f);
            }
        }
        release();
    }
    SCRATCH.with(|c| *c.borrow_mut() = (s, pw));
    stats
}

thread_local! {
    /// `tile`'s scores and weights buffers, reused.
    static SCRATCH: RefCell<(Lines<f32>, Lines<u16>)> = RefCell::new((Lines::new(64), Lines::new(64)));
}

/// Scores of 16 query rows (`qa`, bf16, rows of `d`) against 32 positions (`k`: their two position
/// tiles' `kbs` blocks each, consecutive) into `s` (rows `stride` floats apart).
///
/// # Safety
/// Tiles configured; the reads and writes described inside their buffers.
#[inline(always)]
unsafe fn scores(qa: *const u16, d: usize, kbs: usize, k: *const u16, s: *mut f32, stride: usize) {
    tile_asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
    for b in 0..kbs {
        tile_asm!(
            "tileloadd tmm2, [{q} + {qs}*1]",
            "tileloadd tmm6, [{k0} + {ks}*1]",
            "tileloadd tmm7, [{k1} + {ks}*1]",
            "tdpbf16ps tmm0, tmm2, tmm6",
            "tdpbf16ps tmm1, tmm2, tmm7",
            q = in(reg) qa.add(b * KB),
            qs = in(reg) d * 2,
            k0 = in(reg) k.add(b * TILE_ELEMS),
            k1 = in(reg) k.add((kbs + b) * TILE_ELEMS),
            ks = in(reg) KB * 2,
            options(nostack, readonly)
        );
    }
    tile_asm!(
        "tilestored [{s0} + {ss}*1], tmm0",
        "tilestored [{s1} + {ss}*1], tmm1",
        s0 = in(reg) s,
        s1 = in(reg) s.add(TILE),
        ss = in(reg) stride * 4,
        options(nostack)
    );
}

/// 64 output columns of 16 rows: `o[r][c] = sum_p w[r][p] . v[p][c]` over `blocks` 32-position
/// blocks (`w` bf16 rows `stride` apart; `v` the first of four consecutive column tiles of block
/// 0, blocks `dts` tiles apart), stored into `o` (rows `d` floats apart).
///
/// # Safety
/// Tiles configured; the reads and writes described inside their buffers.
#[inline(always)]
unsafe fn weighted_values(
    w: *const u16,
    stride: usize,
    v: *const u16,
    dts: usize,
    blocks: usize,
    o: *mut f32,
    d: usize,
) {
    tile_asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
    for b in 0..blocks {
        let vb = v.add(b * dts * TILE_ELEMS);
        tile_asm!(
            "tileloadd tmm4, [{w} + {ws}*1]",
            "tileloadd tmm5, [{v0} + {vs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{v1} + {vs}*1]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{v2} + {vs}*1]",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{v3} + {vs}*1]",
            "tdpbf16ps tmm3, tmm4, tmm5",
            w = in(reg) w.add(b * KB),
            ws = in(reg) stride * 2,
            v0 = in(reg) vb,
            v1 = in(reg) vb.add(TILE_ELEMS),
            v2 = in(reg) vb.add(2 * TILE_ELEMS),
            v3 = in(reg) vb.add(3 * TILE_ELEMS),
            vs = in(reg) KB * 2,
            options(nostack, readonly)
        );
    }
    tile_asm!(
        "tilestored [{o0} + {os}*1], tmm0",
        "tilestored [{o1} + {os}*1], tmm1",
        "tilestored [{o2} + {os}*1], tmm2",
        "tilestored [{o3} + {os}*1], tmm3",
        o0 = in(reg) o,
        o1 = in(reg) o.add(TILE),
        o2 = in(reg) o.add(2 * TILE),
        o3 = in(reg) o.add(3 * TILE),
        os = in(reg) d * 4,
        options(nostack)
    );
}

/// A row's softmax weights, not normalized: `w[p] = bf16(exp(s[p] - max))` for the row's
/// positions; returns (max, the sum of the F32 exponentials).
fn weights(_amx: Amx, s: &[f32], w: &mut [u16]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the token implies AVX-512 F/BW/VL and BF16; `simd::weights` checks `w`'s length.
    return unsafe { simd::weights(s, w) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX tiles exist on x86_64 only")
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use std::arch::x86_64::*;

    use super::{KvElem, Packed, Scales, KB, TILE, TILE_ELEMS};

    /// A degree-5 fit of `2^r` on `[-1/2, 1/2]`, lowest power first (relative error 2.2e-7
    /// in F32, below the bf16 rounding the weights take and near the F32 sum's own).
    const EXP2_POLY: [f32; 6] = [
        1.000_000_1,
        0.693_146_94,
        0.240_221_22,
        0.055_507_425,
        0.009_675_469,
        0.001_326_698,
    ];

    /// `exp(x - m)` in 16 lanes, as `2^t` with `t = x log2(e) - m log2(e)` (`ml` = `m log2(e)`):
    /// `t`'s nearest integer `n` and the fit of `2^(t - n)`, scaled by `2^n` (`vscalefps`). Lanes
    /// where `t < -125` (scores 86.6 below the maximum, or `-inf`) are 0, so no lane is subnormal.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp16(x: __m512, ml: __m512) -> __m512 {
        let t = _mm512_fmsub_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), ml);
        let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(t, _mm512_set1_ps(-125.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let r = _mm512_sub_ps(t, n);
        let mut p = _mm512_set1_ps(EXP2_POLY[5]);
        for c in EXP2_POLY[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        _mm512_maskz_scalef_ps(live, p, n)
    }

    /// F32 lanes rounded to bf16 (to nearest, ties to even; no NaN here), each in its lane's low
    /// 16 bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn bf16_lanes(x: __m512) -> __m512i {
        let b = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let round = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
        _mm512_srli_epi32::<16>(_mm512_add_epi32(b, round))
    }

    /// 16 values from `p` as F32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16<T: KvElem>(p: *const T) -> __m512 {
        let lo = _mm512_castps256_ps512(T::load8(p));
        let hi = _mm256_castps_pd(T::load8(p.add(8)));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(lo), hi))
    }

    /// `Packed::pack_from` sixteen values at a time: K's (even, odd) dimension pairs as 32-bit words
    /// scattered to their position's column, V's position pairs interleaved as whole tile rows.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA, F16C; `p` sized and the offsets checked by `pack_from`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn pack<T: KvElem>(
        p: &mut Packed,
        keep: usize,
        rows: &[usize],
        k: &[T],
        v: &[T],
        scales: Scales,
    ) {
        let (n, d) = (p.n, p.d);
        let (kbs, dts) = (d / KB, d / TILE);
        let scale = |i: usize| super::scale_at(scales, rows[i], d);
        // A position tile at a time: each position's block as 16 words in a register, the 16
        // registers transposed so that tile row r holds word r of every position.
        // The rows sit where the block table put them, a pattern the hardware prefetchers do not
        // follow: ask for the next tile's (`attn` does the same).
        let ahead = |x: &[T], i: usize| {
            if let Some(&at) = rows[..n].get(i) {
                let p = x.as_ptr().add(at) as *const i8;
                for off in (0..d * std::mem::size_of::<T>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
                }
            }
        };
        for pt in keep / TILE..n.div_ceil(TILE) {
            for c in 0..TILE {
                ahead(k, (pt + 1) * TILE + c);
            }
            for b in 0..kbs {
                let mut words = [_mm512_setzero_si512(); TILE];
                for (c, w) in words.iter_mut().enumerate() {
                    let i = pt * TILE + c;
                    if i >= n {
                        break;
                    }
                    let ks = _mm512_set1_ps(scale(i).0);
                    let row = k.as_ptr().add(rows[i] + b * KB);
                    let lo = bf16_lanes(_mm512_mul_ps(load16(row), ks));
                    let hi = bf16_lanes(_mm512_mul_ps(load16(row.add(TILE)), ks));
                    *w = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                        _mm512_cvtepi32_epi16(hi),
                    );
                }
                let dst = p.k.as_mut_ptr().add((pt * kbs + b) * TILE_ELEMS) as *mut __m512i;
                for (r, x) in transpose16(words).iter().enumerate() {
                    _mm512_storeu_si512(dst.add(r) as _, *x);
                }
            }
        }
        let vp = p.v.as_mut_ptr();
        for i in (keep..n).step_by(2) {
            ahead(v, i + TILE);
            ahead(v, i + TILE + 1);
            let r0 = v.as_ptr().add(rows[i]);
            // An odd last position pairs with zeros.
            let r1 = (i + 1 < n).then(|| (v.as_ptr().add(rows[i + 1]), scale(i + 1).1));
            let s0 = _mm512_set1_ps(scale(i).1);
            let (pb, w) = (i / KB, i % KB);
            for dt in 0..dts {
                let a = bf16_lanes(_mm512_mul_ps(load16(r0.add(dt * TILE)), s0));
                let b = match r1 {
                    Some((r1, s1)) => {
                        bf16_lanes(_mm512_mul_ps(load16(r1.add(dt * TILE)), _mm512_set1_ps(s1)))
                    }
                    None => _mm512_setzero_si512(),
                };
                let pair = _mm512_or_si512(a, _mm512_slli_epi32::<16>(b));
                let at = vp.add((pb * dts + dt) * TILE_ELEMS + (w / 2) * KB);
                _mm512_storeu_si512(at as _, pair);
            }
        }
    }

    /// The 16 x 16 transpose of 32-bit words: row `c` of the result is word `c` of every input.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::model::kernels) unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Pairs of rows interleaved, then pairs of pairs: within each 128-bit lane `l`, u[4i + j]
        // holds word 4l + j of rows 4i..4i + 4.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 2], t[4 * i + 1], t[4 * i + 3]);
            u[4 * i] = _mm512_unpacklo_epi64(a, b);
            u[4 * i + 1] = _mm512_unpackhi_epi64(a, b);
            u[4 * i + 2] = _mm512_unpacklo_epi64(c, d);
            u[4 * i + 3] = _mm512_unpackhi_epi64(c, d);
        }
        // Then lane l of u[j], u[4 + j], u[8 + j], u[12 + j] side by side is word 4l + j.
        let mut out = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_i32x4::<0xdd>(u[j], u[4 + j]);
            let v2 = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
            let v3 = _mm512_shuffle_i32x4::<0xdd>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
            out[8 + j] = _mm512_shuffle_i32x4::<0xdd>(v0, v2);
            out[4 + j] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            out[12 + j] = _mm512_shuffle_i32x4::<0xdd>(v1, v3);
        }
        out
    }

    /// `super::weights` sixteen positions at a time.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and BF16; `w.len() >= s.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn weights(s: &[f32], w: &mut [u16]) -> (f32, f32) {
        let c = s.len();
        assert!(w.len() >= c);
        let (sp, wp) = (s.as_ptr(), w.as_mut_ptr());
        let none = _mm512_set1_ps(f32::NEG_INFINITY);
        let lanes = |i: usize| -> __mmask16 {
            if c - i >= 16 {
                0xffff
            } else {
                (1u16 << (c - i)) - 1
            }
        };
        // Four running maxima and two running sums, so that neither pass waits on one
        // register's latency at each vector.
        let mut mv = [none; 4];
        let mut i = 0;
        while i + 64 <= c {
            for (j, v) in mv.iter_mut().enumerate() {
                *v = _mm512_max_ps(*v, _mm512_loadu_ps(sp.add(i + 16 * j)));
            }
            i += 64;
        }
        while i < c {
            mv[0] = _mm512_max_ps(mv[0], _mm512_mask_loadu_ps(none, lanes(i), sp.add(i)));
            i += 16;
        }
        let m = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_max_ps(mv[0], mv[1]),
            _mm512_max_ps(mv[2], mv[3]),
        ));
        let ml = _mm512_set1_ps(m * std::f32::consts::LOG2_E);
        let mut sum = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i < c {
            let k = lanes(i);
            let e = exp16(_mm512_mask_loadu_ps(none, k, sp.add(i)), ml);
            sum[(i / 16) % 2] = _mm512_add_ps(sum[(i / 16) % 2], e);
            // `vcvtneps2bf16` rounds to nearest even as `bf16_lanes` does; it flushes
            // subnormals, which `exp16` never returns.
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
            _mm256_mask_storeu_epi16(wp.add(i) as *mut i16, k, h);
            i += 16;
        }
        (m, _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1])))
    }
}

/// The reference: `tile` from the same bf16 roundings (queries; keys and values times their Q8
/// scales; the normalized softmax weights), the scores, softmax and sums in F64.
#[cfg(test)]
pub(crate) fn reference<T: KvElem>(
    q: &[f32],
    ctx: &[usize],
    rows: &[usize],
    k: &[T],
    v: &[T],
    d: usize,
    scales: Scales,
) -> Vec<f32> {
    let bf = |x: f32| crate::model::kernels::amx::bf16_value(bf16_bits(x)) as f64;
    let scale = |p: usize| scale_at(scales, rows[p], d);
    let mut out = vec![0f32; q.len()];
    for (r, &c) in ctx.iter().enumerate() {
        let qr = &q[r * d..(r + 1) * d];
        let s: Vec<f64> = (0..c)
            .map(|p| {
                let kr = &k[rows[p]..rows[p] + d];
                qr.iter()
                    .zip(kr)
                    .map(|(a, b)| bf(*a) * bf(b.to_f32() * scale(p).0))
                    .sum()
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for i in 0..d {
            let y: f64 = (0..c)
                .map(|p| bf(e[p] as f32) * bf(v[rows[p] + i].to_f32() * scale(p).1))
                .sum();
            out[r * d + i] = (y / sum) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_data::{amx_for_test, lcg};
    use super::*;
    use proptest::prelude::*;

    /// A row's weights are its exponentials rounded as `bf16_bits` rounds them (the tile
    /// units' conversion instruction against the scalar rounding), on rows of every length
    /// mod 16 with scores far below the maximum (exponentials near the smallest normal and
    /// zeroed).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn weights_round_the_exponentials_as_bf16_bits_does() {
        use std::arch::x86_64::*;
        let Some(amx) = amx_for_test("weights_round_the_exponentials_as_bf16_bits_does") else {
            return;
        };
        for c in 1..70usize {
            let s: Vec<f32> = lcg(c as u64, c)
                .iter()
                .map(|x| x * 60.0 - (c % 3) as f32 * 10.0)
                .collect();
            let mut got = vec![0u16; c];
            let (m, _) = weights(amx, &s, &mut got);
            let want: Vec<u16> = s
                .iter()
                .map(|&x| {
                    // SAFETY: the token implies AVX-512 F.
                    let e = unsafe {
                        let ml = _mm512_set1_ps(m * std::f32::consts::LOG2_E);
                        _mm512_cvtss_f32(simd::exp16(_mm512_set1_ps(x), ml))
                    };
                    bf16_bits(e)
                })
                .collect();
            assert_eq!(got, want, "{c} positions");
        }
    }

    /// `simd::exp16` is `exp(x - m)` to 2e-7 x (1 + |x| + |m|) relative (the F32 rounding of
    /// `x` and `m` in powers of two grows with them), at maxima of either sign and scores
    /// down to 86 below; 0 from 87 below and for `-inf`; never subnormal.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp16_is_the_exponential_within_its_arguments_rounding() {
        use std::arch::x86_64::*;
        let Some(_amx) = amx_for_test("exp16_is_the_exponential_within_its_arguments_rounding")
        else {
            return;
        };
        let exp = |x: f32, m: f32| -> f32 {
            // SAFETY: the token implies AVX-512 F.
            unsafe {
                let ml = _mm512_set1_ps(m * std::f32::consts::LOG2_E);
                _mm512_cvtss_f32(simd::exp16(_mm512_set1_ps(x), ml))
            }
        };
        for m in [0.0f32, 3.7, -12.25, 40.5] {
            for i in 0..=90_000 {
                let x = m - i as f32 * 0.001;
                let (got, want) = (exp(x, m) as f64, ((x - m) as f64).exp());
                if x - m >= -86.0 {
                    let err = (got - want).abs() / want;
                    let bound = 2e-7 * (1.0 + x.abs() as f64 + m.abs() as f64);
                    assert!(err <= bound, "exp({x} - {m}) = {got}, want {want}");
                } else if x - m <= -87.0 {
                    assert_eq!(got, 0.0, "exp({x} - {m}) is zeroed");
                }
                assert!(
                    got == 0.0 || got >= f32::MIN_POSITIVE as f64,
                    "{got} is subnormal"
                );
            }
            assert_eq!(exp(f32::NEG_INFINITY, m), 0.0);
        }
    }

    /// The tiles against `reference` on `n` rows seeing up to `c` positions (rows of one token
    /// share a position, as a GQA group does), offsets shuffled as a block table's are.
    fn check<T: KvElem>(
        amx: Amx,
        n: usize,
        c: usize,
        d: usize,
        seed: u64,
        elem: impl Fn(f32) -> T,
        q8: bool,
    ) {
        let slots = c + 7;
        let k: Vec<T> = lcg(seed, slots * d).into_iter().map(&elem).collect();
        let v: Vec<T> = lcg(seed ^ 0x5bd1, slots * d)
            .into_iter()
            .map(&elem)
            .collect();
        let sc = |s: u64| -> Vec<half::f16> {
            lcg(s, slots)
                .into_iter()
                .map(|x| half::f16::from_f32(0.01 + x.abs() * 0.02))
                .collect()
        };
        let (ks, vs) = (sc(seed ^ 0x77), sc(seed ^ 0x99));
        let scales = q8.then_some((&ks[..], &vs[..]));
        let rows: Vec<usize> = (0..c).map(|p| ((p * 5 + 3) % slots) * d).collect();
        let q: Vec<f32> = lcg(seed ^ 0x1234, n * d)
            .into_iter()
            .map(|x| x * 0.3)
            .collect();
        // Three rows a token; the last token sees all `c` positions.
        let tokens = n.div_ceil(3);
        let ctx: Vec<usize> = (0..n)
            .map(|r| (c + r / 3 + 1).saturating_sub(tokens).max(1))
            .collect();
        let mut packed = Packed::default();
        packed.pack_from(amx, 0, c, &rows, &k, &v, d, scales);
        let mut got = vec![0f32; n * d];
        tile(amx, &q, &ctx, &packed, &mut got);
        let want = reference(&q, &ctx, &rows, &k, &v, d, scales);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // F32 sums of bf16 products, and a weight may round the other way at a bf16 boundary.
            assert!(
                (g - w).abs() <= 2e-3 * (1.0 + w.abs()),
                "n {n} c {c} d {d}: out[{i}] = {g}, reference {w}"
            );
        }
    }

    /// The vector packing lays out exactly what the scalar one does, for every cache type and an
    /// odd number of positions.
    #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
    #[test]
    fn packs_equal_the_scalar_layout() {
        let Some(amx) = amx_for_test("packs_equal_the_scalar_layout") else {
            return;
        };
        fn both<T: KvElem>(amx: Amx, d: usize, elem: impl Fn(f32) -> T, q8: bool) {
            let (n, slots) = (77, 90);
            let k: Vec<T> = lcg(5, slots * d).into_iter().map(&elem).collect();
            let v: Vec<T> = lcg(6, slots * d).into_iter().map(&elem).collect();
            let sc: Vec<half::f16> = lcg(7, slots)
                .into_iter()
                .map(|x| half::f16::from_f32(0.5 + x))
                .collect();
            let scales = q8.then_some((&sc[..], &sc[..]));
            let rows: Vec<usize> = (0..n).map(|p| ((p * 7 + 2) % slots) * d).collect();
            let mut fast = Packed::default();
            fast.pack_from(amx, 0, n, &rows, &k, &v, d, scales);
            let mut slow = Packed::default();
            slow.pack_from(amx, 0, n, &rows, &k, &v, d, scales);
            slow.k.fill(0);
            slow.v.fill(0);
            slow.pack_scalar(0, &rows, &k, &v, scales);
            assert!(fast.k == slow.k, "K, d {d}");
            assert!(fast.v == slow.v, "V, d {d}");
            // Grown from a kept prefix: 64 positions kept, the rest (one more than before,
            // from other rows) packed on top, as a whole pack of the new rows lays them out.
            let mut moved = rows.clone();
            moved[64..]
                .iter_mut()
                .for_each(|r| *r = (*r + 3 * d) % (slots * d));
            moved.push(((n + 5) % slots) * d);
            let mut grown = Packed::default();
            grown.pack_from(amx, 0, n, &rows, &k, &v, d, scales);
            grown.pack_from(amx, 64, n + 1, &moved, &k, &v, d, scales);
            let mut whole = Packed::default();
            whole.pack_from(amx, 0, n + 1, &moved, &k, &v, d, scales);
            assert!(grown.k == whole.k, "grown K, d {d}");
            assert!(grown.v == whole.v, "grown V, d {d}");
            // Cut back to a kept prefix and packed again: the positions past it zeroed.
            grown.pack_from(amx, 32, 40, &moved, &k, &v, d, scales);
            whole.pack_from(amx, 0, 40, &moved, &k, &v, d, scales);
            assert!(grown.k == whole.k && grown.v == whole.v, "cut, d {d}");
        }
        both(amx, 64, |x| x, false);
        both(amx, 128, half::f16::from_f32, false);
        both(amx, 64, |x| (x * 60.0 + 128.0) as u8, true);
    }

    #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
    #[test]
    fn tiles_match_the_reference_on_a_prefill_chunk() {
        let Some(amx) = amx_for_test("tiles_match_the_reference_on_a_prefill_chunk") else {
            return;
        };
        check(amx, 96, 300, 64, 1, half::f16::from_f32, false);
        check(amx, 48, 70, 128, 2, |x| x, false);
        check(amx, 33, 45, 64, 3, |x| (x * 60.0 + 128.0) as u8, true);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        #[cfg_attr(not(amx_tiles), ignore = "this CPU has no AMX tiles")]
        #[test]
        fn tiles_match_the_reference_on_odd_shapes(
            n in 1usize..70, c in 1usize..140, wide in any::<bool>(), kind in 0u8..3, seed in any::<u64>()
        ) {
            if let Some(amx) = amx_for_test("tiles_match_the_reference_on_odd_shapes") {
                let d = if wide { 128 } else { 64 };
                let c = c.max(n.div_ceil(3));
                match kind {
                    0 => check(amx, n, c, d, seed, |x| x, false),
                    1 => check(amx, n, c, d, seed, half::f16::from_f32, false),
                    _ => check(amx, n, c, d, seed, |x| (x * 60.0 + 128.0) as u8, true),
                }
            }
        }
    }
}
