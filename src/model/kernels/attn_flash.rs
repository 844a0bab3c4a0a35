//! The attention of a prompt's query rows on AVX-512 where there are no tile units (AMX): blocks of
//! positions with a running softmax (FlashAttention's online softmax, Dao et al. 2022; the shape
//! llama.cpp's and oneDNN's CPU flash attention take), each block's products as F32 register-tiled
//! matrix products.
//!
//! Why: `attn`'s kernel takes a few rows against a few keys at a time, a horizontal sum for every
//! score and an F16 conversion of every key and value for every pair of rows. On a prefill step it
//! ran at about a fifth of the 512-bit F32 FMA peak and was over a quarter of the step on AVX-512
//! cores without AMX (docs/performance.md). Here a block of `BLOCK` positions is converted to F32
//! once for all the task's rows (keys transposed, `[d][BLOCK]`, so a query row's scores for 16
//! positions are one register of FMAs with the query value broadcast; values as rows, so the
//! weighted sums are FMAs with the weight broadcast), and a task's scores never leave the block
//! (`[rows, BLOCK]` in L1), whatever the context's length.
//!
//! Per block and row: scores, the row's new maximum (the output so far and the sum rescaled when it
//! grows), the weights `exp(score - max)` (`attn::exp16_minus`), their sum, then the weighted
//! values added to the output. At the end each row is divided by its sum; the statistics returned
//! are `attn::attend`'s (largest score, sum of `exp(score - largest)`). Everything stays in F32; a
//! Q8 cache's scales multiply keys and values as they are converted.
//!
//! Where the CPU has AVX-512 BF16, the cache is F16 or Q8, and the bf16 form measures faster than
//! the F32 one (`bf16_pays`: Zen 4, not Intel's Emerald Rapids without tile units), the same blocks
//! run as bf16 dot products (`Width::Bf16`, `simd::tile_bf16`): `vdpbf16ps` sums two bf16
//! products into each F32 lane, twice the products of an F32 FMA, so scores and weighted sums
//! take half the instructions. Queries, scaled keys and values, and each block's weights are
//! rounded to bf16 as the tile units round them (`attn_amx`); scores, the softmax and the sums
//! stay in F32. An F32 cache, the setting that asks for exact attention, keeps the F32 form. On
//! real text the rounding moves the default model's predictions by a mean KL of ~0.0001 (F32
//! weights both ways; docs/performance.md, "bf16 attention on Zen 4"). `reference_bf16` (tests)
//! computes the same roundings in F64; a seeded proptest compares the two.
//!
//! Only a prompt's runs take it (`model::attention` decides, as for `attn_amx`; a short run after a
//! long history in parts of its positions, merged after): a reply's decode rows stay on `attn`,
//! so speculating never changes a reply. `attn::tile_scalar` is the reference;
//! a seeded proptest compares the two on odd shapes and every cache type.

use super::attn::{KvElem, Tile};
use super::cpu::{Avx2, Avx512Bf16, Avx512Vnni, Isa};

/// Positions a block takes: 64 positions of a 64-wide head are 16 KiB of keys and 16 of values
/// in F32, and a task's 96 rows of scores 24 KiB.
pub(crate) const BLOCK: usize = 64;

/// Whether the kernel runs heads of `d` values.
pub(crate) fn supports(d: usize) -> bool {
    d == 64 || d == 128
}

/// The kernel's form, with the token that proves the CPU runs it: bf16 dot products on 512-bit
/// registers where the level has AVX-512 BF16 and they measure faster (Zen 4: `vdpbf16ps` sums two
/// products a lane, twice the F32 FMA's rate), else F32 on 512-bit registers on AVX-512 (Ice
/// Lake: half the instructions of the 256-bit form for the same FMAs), else AVX2's 256-bit ones
/// (Zen 3 and older).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    Bf16(Avx512Bf16),
    W512(Avx512Vnni),
    W256(Avx2),
}

impl Width {
    /// The fastest form this level runs, or `None` without AVX2. With `exact` (an F32 cache, the
    /// setting that asks for exact attention, as on the tile units) never bf16.
    pub(crate) fn of(isa: Isa, exact: bool) -> Option<Width> {
        match (isa.avx512_bf16(), isa.avx512_vnni(), isa.avx2()) {
            (Some(b), _, _) if !exact && bf16_pays(b) => Some(Width::Bf16(b)),
            (_, Some(v), _) => Some(Width::W512(v)),
            (_, None, Some(a)) => Some(Width::W256(a)),
            _ => None,
        }
    }
}

/// The form a prompt's attention runs on at level `isa` with an F16 or Q8 cache, as the roof
/// report names its peak: `amx` (the tile units, `attn_amx`), `bf16`, `f32`, or `none` (the
/// generic kernel, without AVX2).
pub fn prompt_form(isa: Isa) -> &'static str {
    if isa.amx().is_some() {
        return "amx";
    }
    match Width::of(isa, false) {
        Some(Width::Bf16(_)) => "bf16",
        Some(_) => "f32",
        None => "none",
    }
}

/// Whether the bf16 form runs faster here than the 512-bit F32 one: `cpu::second_pays` with
/// `LLAMA_RELAY_PROMPT_ATTENTION` (`f32` or `bf16`), timed once (a few milliseconds) on a chat
/// turn's shape held in cache: 81 query rows (27 tokens of 3 heads a KV head) over 256 positions
/// of an F16 cache, 64 values a head. `vdpbf16ps` takes two products a lane; on Zen 4 that is
/// twice the F32 FMA's rate, on Intel cores without tile units half of it (Emerald Rapids:
/// docs/performance.md, "bf16 attention measured, not assumed").
fn bf16_pays(b: Avx512Bf16) -> bool {
    use std::sync::OnceLock;
    static PAYS: OnceLock<bool> = OnceLock::new();
    *PAYS.get_or_init(|| {
        let (d, n, rows) = (64, 256, 81);
        let value = |i: usize| half::f16::from_f32((i * 37 % 101) as f32 / 50.0 - 1.0);
        let k: Vec<half::f16> = (0..n * d).map(value).collect();
        let v: Vec<half::f16> = (0..n * d).map(|i| value(i + 7)).collect();
        let q: Vec<f32> = (0..rows * d)
            .map(|i| (i % 13) as f32 / 52.0 - 0.1)
            .collect();
        let ctx: Vec<usize> = (0..rows).map(|r| n - rows / 3 + r / 3 + 1).collect();
        let at: Vec<usize> = (0..n).map(|p| p * d).collect();
        let t = Tile {
            q: &q,
            from: 0,
            ctx: &ctx,
            rows: &at,
            k: &k,
            v: &v,
            d,
            scales: None,
        };
        let pass = |w: Width, out: &mut [f32]| {
            std::hint::black_box(tile(w, &t, out));
        };
        let (mut f32_out, mut bf16_out) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        super::cpu::second_pays(
            "a prompt's attention",
            "LLAMA_RELAY_PROMPT_ATTENTION",
            ["f32", "bf16"],
            4,
            || pass(Width::W512(b.vnni()), &mut f32_out),
            || pass(Width::Bf16(b), &mut bf16_out),
        )
    })
}

/// `attn::attend` for a prompt's rows over positions `t.from..` (a part of a long history, merged
/// after with `attn::merge_parts`, or all of it): `out` is `[rows, d]`; returns each row's softmax
/// statistics.
///
/// # Panics
/// When the head size is not `supports`ed, or `Tile::checked` fails.
pub(crate) fn tile<T: KvElem>(width: Width, t: &Tile<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    assert!(supports(t.d), "head size {}", t.d);
    let cmax = t.checked(out);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the token proves the width's features; shapes and every row offset below
        // `cmax` checked above.
        unsafe {
            match (width, t.d) {
                (Width::Bf16(_), 64) => simd::tile_bf16::<T, 64>(t, cmax, out),
                (Width::Bf16(_), _) => simd::tile_bf16::<T, 128>(t, cmax, out),
                (Width::W512(_), 64) => simd::tile512::<T, 64>(t, cmax, out),
                (Width::W512(_), _) => simd::tile512::<T, 128>(t, cmax, out),
                (Width::W256(_), 64) => simd::tile256::<T, 64>(t, cmax, out),
                (Width::W256(_), _) => simd::tile256::<T, 128>(t, cmax, out),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (width, cmax);
        unreachable!("the tokens exist only on x86-64")
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::super::attn::{exp16_minus, exp8_minus};
    use super::super::attn_amx::simd::transpose16;
    use super::super::{lines, Lines};
    use super::{KvElem, Tile, BLOCK};

    /// F32 vectors of one width: the kernel is written once over this. Every method is inlined
    /// into the entry point whose target features cover the width (`tile512`, `tile256`).
    pub(super) trait Vector: Copy {
        /// Lanes a vector.
        const LANES: usize;
        /// Rows a register tile takes: `ROWS` x 4 accumulators beside the loaded vectors fit the
        /// register file (32 vectors on AVX-512, 16 on AVX2).
        const ROWS: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        /// `LANES` cache values from `p` as F32.
        unsafe fn cache<T: KvElem>(p: *const T) -> Self;
        /// Lanes `0..count` from `p` (`count <= LANES`), `-inf` in the others.
        unsafe fn first(p: *const f32, count: usize) -> Self;
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
        unsafe fn mul(a: Self, b: Self) -> Self;
        unsafe fn add(a: Self, b: Self) -> Self;
        unsafe fn max(a: Self, b: Self) -> Self;
        unsafe fn reduce_max(self) -> f32;
        unsafe fn reduce_add(self) -> f32;
        /// `exp(x - m)`, 0 below `exp(-87)` and for `-inf`.
        unsafe fn exp_minus(self, m: f32) -> Self;
        /// Keys of positions `pb..pb + count` transposed into `kt` (`[D][BLOCK]`), each scaled by
        /// its position's K scale; positions past `count` zero.
        unsafe fn keys<T: KvElem, const D: usize>(
            t: &Tile<T>,
            pb: usize,
            count: usize,
            scale: &impl Fn(usize) -> (f32, f32),
            kt: *mut f32,
        );
    }

    #[derive(Clone, Copy)]
    pub(super) struct V512(__m512);
    #[derive(Clone, Copy)]
    pub(super) struct V256(__m256);

    impl Vector for V512 {
        const LANES: usize = 16;
        const ROWS: usize = 6;
        #[inline(always)]
        unsafe fn zero() -> Self {
            V512(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            V512(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            V512(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn cache<T: KvElem>(p: *const T) -> Self {
            V512(T::load16(p))
        }
        #[inline(always)]
        unsafe fn first(p: *const f32, count: usize) -> Self {
            let lanes = ((1u32 << count) - 1) as __mmask16;
            V512(_mm512_mask_loadu_ps(
                _mm512_set1_ps(f32::NEG_INFINITY),
                lanes,
                p,
            ))
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            V512(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            V512(_mm512_mul_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            V512(_mm512_add_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            V512(_mm512_max_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            _mm512_reduce_max_ps(self.0)
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            _mm512_reduce_add_ps(self.0)
        }
        #[inline(always)]
        unsafe fn exp_minus(self, m: f32) -> Self {
            V512(exp16_minus(self.0, _mm512_set1_ps(m)))
        }
        #[inline(always)]
        unsafe fn keys<T: KvElem, const D: usize>(
            t: &Tile<T>,
            pb: usize,
            count: usize,
            scale: &impl Fn(usize) -> (f32, f32),
            kt: *mut f32,
        ) {
            let k = t.k.as_ptr();
            for j in 0..BLOCK / 16 {
                for c in (0..D).step_by(16) {
                    let mut words = [_mm512_setzero_si512(); 16];
                    for (i, w) in words.iter_mut().enumerate() {
                        let at = j * 16 + i;
                        if at < count {
                            let p = pb + at;
                            let x = T::load16(k.add(t.rows[p] + c));
                            *w = _mm512_castps_si512(_mm512_mul_ps(x, _mm512_set1_ps(scale(p).0)));
                        }
                    }
                    for (i, x) in transpose16(words).iter().enumerate() {
                        _mm512_storeu_si512(kt.add((c + i) * BLOCK + j * 16) as _, *x);
                    }
                }
            }
        }
    }

    impl Vector for V256 {
        const LANES: usize = 8;
        const ROWS: usize = 3;
        #[inline(always)]
        unsafe fn zero() -> Self {
            V256(_mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            V256(_mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            V256(_mm256_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn cache<T: KvElem>(p: *const T) -> Self {
            V256(T::load8(p))
        }
        #[inline(always)]
        unsafe fn first(p: *const f32, count: usize) -> Self {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), idx);
            let x = _mm256_maskload_ps(p, lanes);
            V256(_mm256_blendv_ps(
                _mm256_set1_ps(f32::NEG_INFINITY),
                x,
                _mm256_castsi256_ps(lanes),
            ))
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            V256(_mm256_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            V256(_mm256_mul_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            V256(_mm256_add_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            V256(_mm256_max_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            let h = _mm_max_ps(
                _mm256_castps256_ps128(self.0),
                _mm256_extractf128_ps(self.0, 1),
            );
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            let h = _mm_add_ps(
                _mm256_castps256_ps128(self.0),
                _mm256_extractf128_ps(self.0, 1),
            );
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
        }
        #[inline(always)]
        unsafe fn exp_minus(self, m: f32) -> Self {
            V256(exp8_minus(self.0, m))
        }
        #[inline(always)]
        unsafe fn keys<T: KvElem, const D: usize>(
            t: &Tile<T>,
            pb: usize,
            count: usize,
            scale: &impl Fn(usize) -> (f32, f32),
            kt: *mut f32,
        ) {
            let k = t.k.as_ptr();
            for j in 0..BLOCK / 8 {
                for c in (0..D).step_by(8) {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (i, w) in r.iter_mut().enumerate() {
                        let at = j * 8 + i;
                        if at < count {
                            let p = pb + at;
                            let x = T::load8(k.add(t.rows[p] + c));
                            *w = _mm256_mul_ps(x, _mm256_set1_ps(scale(p).0));
                        }
                    }
                    for (i, x) in transpose8(r).iter().enumerate() {
                        _mm256_storeu_ps(kt.add((c + i) * BLOCK + j * 8), *x);
                    }
                }
            }
        }
    }

    /// The 8 x 8 transpose of F32 lanes: row `c` of the result is lane `c` of every input.
    #[inline(always)]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        // Within each 128-bit half, t[0], t[2] hold lanes (0, 1) and t[1], t[3] lanes (2, 3) of
        // rows 0..4, as pairs: shuffle the pairs together.
        let u: [__m256; 8] = std::array::from_fn(|i| {
            let g = i / 4 * 4;
            let (a, b) = (t[g + i % 2], t[g + 2 + i % 2]);
            if (i % 4) < 2 {
                _mm256_shuffle_ps::<0x44>(a, b)
            } else {
                _mm256_shuffle_ps::<0xee>(a, b)
            }
        });
        // u[g + 0..4] hold lanes 0, 2, 1, 3 (low half) and 4, 6, 5, 7 (high half) of rows
        // g..g + 4; the halves of u[0..4] and u[4..8] combine into whole rows.
        let order = [0, 2, 1, 3];
        std::array::from_fn(|c| {
            let (i, high) = (order[c % 4], c >= 4);
            if high {
                _mm256_permute2f128_ps::<0x31>(u[i], u[4 + i])
            } else {
                _mm256_permute2f128_ps::<0x20>(u[i], u[4 + i])
            }
        })
    }

    /// # Safety
    /// AVX-512 F/BW/VL (and AVX2, FMA, F16C); `t` checked by `super::tile`; `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile512<T: KvElem, const D: usize>(
        t: &Tile<T>,
        cmax: usize,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        drive::<V512, T, D>(t, cmax, out)
    }

    /// # Safety
    /// AVX2, FMA, F16C; `t` checked by `super::tile`; `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile256<T: KvElem, const D: usize>(
        t: &Tile<T>,
        cmax: usize,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        drive::<V256, T, D>(t, cmax, out)
    }

    /// A row's positions in the block at `pb`: how many it sees (`0..=BLOCK`).
    #[inline(always)]
    fn seen(ctx: usize, pb: usize) -> usize {
        ctx.saturating_sub(pb).min(BLOCK)
    }

    /// The blocks of positions `t.from..cmax` that some row sees, in order, as (the block's first
    /// position, the first row that sees it, how far any row sees into it): the rows' ends rise,
    /// so the rows from the first all see it. Each block asks for the next one's rows into L2
    /// (`Tile::prefetch_l2`) as it is handed out, so they arrive while it is worked on.
    fn blocks<'t, T: KvElem>(
        t: &'t Tile<T>,
        cmax: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 't {
        let n = t.ctx.len();
        t.prefetch_l2(t.from, (t.from + BLOCK).min(cmax));
        (t.from..cmax).step_by(BLOCK).filter_map(move |pb| {
            t.prefetch_l2(pb + BLOCK, (pb + 2 * BLOCK).min(cmax));
            let first = (0..n).find(|&r| t.ctx[r] > pb).unwrap_or(n);
            let reach = (first..n).map(|r| seen(t.ctx[r], pb)).max().unwrap_or(0);
            (reach > 0).then_some((pb, first, reach))
        })
    }

    /// Each output row divided by its softmax sum.
    #[inline(always)]
    unsafe fn normalize<V: Vector, const D: usize>(out: &mut [f32], sum: &[f32]) {
        for (r, o) in out.chunks_exact_mut(D).enumerate() {
            let inv = V::splat(1.0 / sum[r]);
            for c in (0..D).step_by(V::LANES) {
                let p = o.as_mut_ptr().add(c);
                V::mul(V::load(p), inv).store(p);
            }
        }
    }

    /// The kernel (module doc) at width `V`.
    #[inline(always)]
    unsafe fn drive<V: Vector, T: KvElem, const D: usize>(
        t: &Tile<T>,
        cmax: usize,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        let n = t.ctx.len();
        let mut kt: Lines<f32> = lines(0f32, D * BLOCK);
        let mut vb: Lines<f32> = lines(0f32, BLOCK * D);
        let mut s: Lines<f32> = lines(0f32, n * BLOCK);
        let mut max = vec![f32::NEG_INFINITY; n];
        let mut sum = vec![0f32; n];
        out.fill(0.0);
        let scale = |p: usize| t.scale(p);
        // Positions (scores) and output columns (values) a register tile covers: 4 vectors.
        let span = 4 * V::LANES;
        for (pb, first, reach) in blocks(t, cmax) {
            V::keys::<T, D>(t, pb, reach, &scale, kt.as_mut_ptr());
            values_in::<V, T, D>(t, pb, reach, &scale, vb.as_mut_ptr());
            let mut r = first;
            while r < n {
                let nr = V::ROWS.min(n - r);
                for c in (0..reach).step_by(span) {
                    let q = t.q.as_ptr().add(r * D);
                    let (k, sp) = (kt.as_ptr().add(c), s.as_mut_ptr().add(r * BLOCK + c));
                    match nr {
                        6 => scores::<V, D, 6>(q, k, sp),
                        5 => scores::<V, D, 5>(q, k, sp),
                        4 => scores::<V, D, 4>(q, k, sp),
                        3 => scores::<V, D, 3>(q, k, sp),
                        2 => scores::<V, D, 2>(q, k, sp),
                        _ => scores::<V, D, 1>(q, k, sp),
                    }
                }
                r += nr;
            }
            for r in first..n {
                let row = s.as_mut_ptr().add(r * BLOCK);
                let o = out.as_mut_ptr().add(r * D);
                weights::<V, D>(row, seen(t.ctx[r], pb), &mut max[r], &mut sum[r], o);
            }
            let mut r = first;
            while r < n {
                let nr = V::ROWS.min(n - r);
                let w = s.as_ptr().add(r * BLOCK);
                for c in (0..D).step_by(span) {
                    let (v, o) = (vb.as_ptr().add(c), out.as_mut_ptr().add(r * D + c));
                    match nr {
                        6 => values::<V, D, 6>(w, v, o, reach),
                        5 => values::<V, D, 5>(w, v, o, reach),
                        4 => values::<V, D, 4>(w, v, o, reach),
                        3 => values::<V, D, 3>(w, v, o, reach),
                        2 => values::<V, D, 2>(w, v, o, reach),
                        _ => values::<V, D, 1>(w, v, o, reach),
                    }
                }
                r += nr;
            }
        }
        normalize::<V, D>(out, &sum);
        max.into_iter().zip(sum).collect()
    }

    /// Values of positions `pb..pb + count` as F32 rows into `vb` (`[BLOCK][D]`), each scaled by
    /// its position's V scale.
    #[inline(always)]
    unsafe fn values_in<V: Vector, T: KvElem, const D: usize>(
        t: &Tile<T>,
        pb: usize,
        count: usize,
        scale: &impl Fn(usize) -> (f32, f32),
        vb: *mut f32,
    ) {
        let v = t.v.as_ptr();
        for at in 0..count {
            let p = pb + at;
            let sv = V::splat(scale(p).1);
            for c in (0..D).step_by(V::LANES) {
                V::mul(V::cache(v.add(t.rows[p] + c)), sv).store(vb.add(at * D + c));
            }
        }
    }

    /// `s[r][0..4 lanes] = q[r] . kt[.][0..4 lanes]` for `NR` query rows (`D` apart; `s` rows
    /// `BLOCK` apart) against a block's transposed keys (`kt` rows `BLOCK` apart).
    #[inline(always)]
    unsafe fn scores<V: Vector, const D: usize, const NR: usize>(
        q: *const f32,
        kt: *const f32,
        s: *mut f32,
    ) {
        let mut acc = [[V::zero(); 4]; NR];
        for c in 0..D {
            let kv: [V; 4] = std::array::from_fn(|j| V::load(kt.add(c * BLOCK + j * V::LANES)));
            for (r, a) in acc.iter_mut().enumerate() {
                let qv = V::splat(*q.add(r * D + c));
                for j in 0..4 {
                    a[j] = V::fmadd(qv, kv[j], a[j]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, x) in a.iter().enumerate() {
                x.store(s.add(r * BLOCK + j * V::LANES));
            }
        }
    }

    /// One row's block of scores (`s`, the first `seen` of them in use) into its weights
    /// `exp(score - max)` (zero past `seen`), with its running maximum and sum: when the maximum
    /// grows, the sum and the output row so far (`o`, `D` values) are rescaled to it.
    #[inline(always)]
    unsafe fn weights<V: Vector, const D: usize>(
        s: *mut f32,
        seen: usize,
        max: &mut f32,
        sum: &mut f32,
        o: *mut f32,
    ) {
        let lanes = |j: usize| seen.saturating_sub(j * V::LANES).min(V::LANES);
        let mut mv = V::splat(f32::NEG_INFINITY);
        for j in 0..BLOCK / V::LANES {
            mv = V::max(mv, V::first(s.add(j * V::LANES), lanes(j)));
        }
        let m = mv.reduce_max();
        if m > *max {
            if *max > f32::NEG_INFINITY {
                let alpha = (*max - m).exp();
                *sum *= alpha;
                let av = V::splat(alpha);
                for c in (0..D).step_by(V::LANES) {
                    V::mul(V::load(o.add(c)), av).store(o.add(c));
                }
            }
            *max = m;
        }
        let mut total = V::zero();
        for j in 0..BLOCK / V::LANES {
            let e = V::first(s.add(j * V::LANES), lanes(j)).exp_minus(*max);
            total = V::add(total, e);
            e.store(s.add(j * V::LANES));
        }
        *sum += total.reduce_add();
    }

    /// `o[r][0..4 lanes] += sum_p w[r][p] * vb[p][0..4 lanes]` for `NR` rows (`w` rows `BLOCK`
    /// apart, `o` and `vb` rows `D` apart), positions `0..count`.
    #[inline(always)]
    unsafe fn values<V: Vector, const D: usize, const NR: usize>(
        w: *const f32,
        vb: *const f32,
        o: *mut f32,
        count: usize,
    ) {
        let mut acc: [[V; 4]; NR] =
            std::array::from_fn(|r| std::array::from_fn(|j| V::load(o.add(r * D + j * V::LANES))));
        for p in 0..count {
            let vv: [V; 4] = std::array::from_fn(|j| V::load(vb.add(p * D + j * V::LANES)));
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = V::splat(*w.add(r * BLOCK + p));
                for j in 0..4 {
                    a[j] = V::fmadd(wv, vv[j], a[j]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, x) in a.iter().enumerate() {
                x.store(o.add(r * D + j * V::LANES));
            }
        }
    }

    /// bf16 values as the instructions take them: a 512-bit register of 32.
    #[inline(always)]
    unsafe fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are 64 bytes of plain vector data.
        std::mem::transmute::<__m512i, __m512bh>(x)
    }

    /// Two 16-lane F32 vectors as 32 bf16 values (round to nearest even), `lo`'s first, as 16
    /// words of (even, odd) pairs.
    #[inline(always)]
    unsafe fn pairs(lo: __m512, hi: __m512) -> __m512i {
        // SAFETY: as `bh`.
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
    }

    /// The kernel (module doc) on bf16 dot products (`vdpbf16ps`): the query rows, each block's
    /// keys and values and each row's weights rounded to bf16 as the tile units round them
    /// (`attn_amx`), every product summed in F32, the softmax in F32 as in `drive`. Keys of a
    /// block are (even, odd) dimension pairs a word, transposed (`kt`: `[D / 2][BLOCK]` words), so
    /// a row's scores for 16 positions are one register of `vdpbf16ps` with the row's pair
    /// broadcast: half the instructions of the F32 form. Values are (even, odd) position pairs a
    /// word (`vb`: `[BLOCK / 2][D]` words), the weights' pairs broadcast.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and BF16 (and AVX2, FMA, F16C); `t` checked by `super::tile`; `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn tile_bf16<T: KvElem, const D: usize>(
        t: &Tile<T>,
        cmax: usize,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        let n = t.ctx.len();
        let mut qb: Lines<u32> = lines(0u32, n * D / 2);
        for r in 0..n {
            for c in (0..D).step_by(32) {
                let q = t.q.as_ptr().add(r * D + c);
                let w = pairs(_mm512_loadu_ps(q), _mm512_loadu_ps(q.add(16)));
                _mm512_storeu_si512(qb.as_mut_ptr().add((r * D + c) / 2) as _, w);
            }
        }
        let mut kt: Lines<u32> = lines(0u32, D / 2 * BLOCK);
        let mut vb: Lines<u32> = lines(0u32, BLOCK / 2 * D);
        let mut s: Lines<f32> = lines(0f32, n * BLOCK);
        let mut wb: Lines<u32> = lines(0u32, n * BLOCK / 2);
        let mut max = vec![f32::NEG_INFINITY; n];
        let mut sum = vec![0f32; n];
        out.fill(0.0);
        let scale = |p: usize| t.scale(p);
        for (pb, first, reach) in blocks(t, cmax) {
            keys_bf16::<T, D>(t, pb, reach, &scale, kt.as_mut_ptr());
            values_in_bf16::<T, D>(t, pb, reach, &scale, vb.as_mut_ptr());
            let mut r = first;
            while r < n {
                let nr = V512::ROWS.min(n - r);
                for c in (0..reach).step_by(64) {
                    let q = qb.as_ptr().add(r * D / 2);
                    let (k, sp) = (kt.as_ptr().add(c), s.as_mut_ptr().add(r * BLOCK + c));
                    pair_tile(nr, q, D / 2, k, BLOCK, D / 2, sp, BLOCK, false);
                }
                r += nr;
            }
            for r in first..n {
                let row = s.as_mut_ptr().add(r * BLOCK);
                let o = out.as_mut_ptr().add(r * D);
                weights::<V512, D>(row, seen(t.ctx[r], pb), &mut max[r], &mut sum[r], o);
                for j in (0..BLOCK).step_by(32) {
                    let w = pairs(
                        _mm512_loadu_ps(row.add(j)),
                        _mm512_loadu_ps(row.add(j + 16)),
                    );
                    _mm512_storeu_si512(wb.as_mut_ptr().add((r * BLOCK + j) / 2) as _, w);
                }
            }
            let span = reach.div_ceil(2);
            let mut r = first;
            while r < n {
                let nr = V512::ROWS.min(n - r);
                let w = wb.as_ptr().add(r * BLOCK / 2);
                for c in (0..D).step_by(64) {
                    let (v, o) = (vb.as_ptr().add(c), out.as_mut_ptr().add(r * D + c));
                    pair_tile(nr, w, BLOCK / 2, v, D, span, o, D, true);
                }
                r += nr;
            }
        }
        normalize::<V512, D>(out, &sum);
        max.into_iter().zip(sum).collect()
    }

    /// Keys of positions `pb..pb + count`, each scaled by its position's K scale and rounded to
    /// bf16, into `kt` as `[D / 2][BLOCK]` words of (even, odd) dimension pairs; positions past
    /// `count` zero.
    #[inline(always)]
    unsafe fn keys_bf16<T: KvElem, const D: usize>(
        t: &Tile<T>,
        pb: usize,
        count: usize,
        scale: &impl Fn(usize) -> (f32, f32),
        kt: *mut u32,
    ) {
        let k = t.k.as_ptr();
        for j in 0..BLOCK / 16 {
            for c in (0..D).step_by(32) {
                let mut words = [_mm512_setzero_si512(); 16];
                for (i, w) in words.iter_mut().enumerate() {
                    let at = j * 16 + i;
                    if at < count {
                        let p = pb + at;
                        let sk = _mm512_set1_ps(scale(p).0);
                        let row = k.add(t.rows[p] + c);
                        *w = pairs(
                            _mm512_mul_ps(T::load16(row), sk),
                            _mm512_mul_ps(T::load16(row.add(16)), sk),
                        );
                    }
                }
                for (i, x) in transpose16(words).iter().enumerate() {
                    _mm512_storeu_si512(kt.add((c / 2 + i) * BLOCK + j * 16) as _, *x);
                }
            }
        }
    }

    /// Values of positions `pb..pb + count`, each scaled by its position's V scale and rounded to
    /// bf16, into `vb` as `[BLOCK / 2][D]` words of (even, odd) position pairs; an odd count's last
    /// pair has a zero second value.
    #[inline(always)]
    unsafe fn values_in_bf16<T: KvElem, const D: usize>(
        t: &Tile<T>,
        pb: usize,
        count: usize,
        scale: &impl Fn(usize) -> (f32, f32),
        vb: *mut u32,
    ) {
        let v = t.v.as_ptr();
        // Word m of the result: value m of the first position, then value m of the second.
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for pair in 0..count.div_ceil(2) {
            let p = pb + 2 * pair;
            let s0 = _mm512_set1_ps(scale(p).1);
            let second = (2 * pair + 1 < count).then(|| (p + 1, _mm512_set1_ps(scale(p + 1).1)));
            for c in (0..D).step_by(16) {
                let a = _mm512_mul_ps(T::load16(v.add(t.rows[p] + c)), s0);
                let b = match second {
                    Some((p1, s1)) => _mm512_mul_ps(T::load16(v.add(t.rows[p1] + c)), s1),
                    None => _mm512_setzero_ps(),
                };
                let w = _mm512_permutexvar_epi16(interleave, pairs(a, b));
                _mm512_storeu_si512(vb.add(pair * D + c) as _, w);
            }
        }
    }

    /// `out[r][0..64] = sum_i a[r][i] . b[i][0..64]` (from zero) or `+=` (with `add`) for `nr`
    /// rows (`nr <= 6`) of bf16 pairs, one word a step: `a`'s rows `a_row` words apart, `b`'s
    /// steps `b_row` words apart, `out`'s rows `o_row` values apart. The scores are the query
    /// rows' dimension pairs against a block's transposed key pairs; the weighted sums are the
    /// weights' position pairs against the values' rows of pairs.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pair_tile(
        nr: usize,
        a: *const u32,
        a_row: usize,
        b: *const u32,
        b_row: usize,
        steps: usize,
        out: *mut f32,
        o_row: usize,
        add: bool,
    ) {
        let args = (a, a_row, b, b_row, steps, out, o_row, add);
        match nr {
            6 => pair_products::<6>(args),
            5 => pair_products::<5>(args),
            4 => pair_products::<4>(args),
            3 => pair_products::<3>(args),
            2 => pair_products::<2>(args),
            _ => pair_products::<1>(args),
        }
    }

    /// `pair_tile` for `NR` rows: `NR` x 4 accumulators.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    unsafe fn pair_products<const NR: usize>(
        (a, a_row, b, b_row, steps, out, o_row, add): (
            *const u32,
            usize,
            *const u32,
            usize,
            usize,
            *mut f32,
            usize,
            bool,
        ),
    ) {
        let mut acc: [[__m512; 4]; NR] = std::array::from_fn(|r| {
            std::array::from_fn(|j| match add {
                true => _mm512_loadu_ps(out.add(r * o_row + j * 16)),
                false => _mm512_setzero_ps(),
            })
        });
        for i in 0..steps {
            let bv: [__m512bh; 4] =
                std::array::from_fn(|j| bh(_mm512_loadu_si512(b.add(i * b_row + j * 16) as _)));
            for (r, x) in acc.iter_mut().enumerate() {
                let av = bh(_mm512_set1_epi32(*a.add(r * a_row + i) as i32));
                for j in 0..4 {
                    x[j] = _mm512_dpbf16_ps(x[j], av, bv[j]);
                }
            }
        }
        for (r, x) in acc.iter().enumerate() {
            for (j, v) in x.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * o_row + j * 16), *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::attn::tests::{case, q8, Case};
    use super::super::attn::tile_scalar;
    use super::*;
    use proptest::prelude::*;

    /// The case's rows over positions `from..` of the cache `k`, `v` (with a Q8 cache's scales).
    fn tile_of<'a, T: KvElem>(
        c: &'a Case,
        from: usize,
        k: &'a [T],
        v: &'a [T],
        scales: Option<(&'a [half::f16], &'a [half::f16])>,
    ) -> Tile<'a, T> {
        Tile {
            q: &c.q,
            from,
            ctx: &c.ctx,
            rows: &c.rows,
            k,
            v,
            d: c.d,
            scales,
        }
    }

    /// Each row's statistics as the reference's: the largest score within `max_tol` (relative,
    /// plus as much absolute), the sum within 1e-4 of it.
    fn same_stats(
        stats: &[(f32, f32)],
        want: &[(f32, f32)],
        max_tol: f32,
    ) -> Result<(), TestCaseError> {
        for (r, ((m, s), (wm, ws))) in stats.iter().zip(want).enumerate() {
            prop_assert!(
                (m - wm).abs() <= max_tol * (1.0 + wm.abs()),
                "row {r}'s largest score: {m} vs {wm}"
            );
            prop_assert!((s - ws).abs() <= 1e-4 * ws, "row {r}'s sum: {s} vs {ws}");
        }
        Ok(())
    }

    fn check<T: KvElem>(
        width: Width,
        c: &Case,
        from: usize,
        k: &[T],
        v: &[T],
        scales: Option<(&[half::f16], &[half::f16])>,
    ) -> Result<(), TestCaseError> {
        let t = tile_of(c, from, k, v, scales);
        let mut want = vec![0f32; c.q.len()];
        let want_stats = tile_scalar(&t, &mut want);
        let mut got = vec![f32::NAN; c.q.len()];
        let stats = tile(width, &t, &mut got);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{width:?}, value {i} (row {}): {a} vs {b}",
                i / c.d
            );
        }
        same_stats(&stats, &want_stats, 1e-5)
    }

    /// The bf16 form of `tile` computed in F64 from the kernel's roundings: the query rows, the
    /// scaled keys and values, and each block's weights `exp(score - running max)` (F32) rounded
    /// to bf16, blocks of `BLOCK` positions from `t.from` as the kernel takes them. Returns the
    /// output rows and each row's statistics.
    fn reference_bf16<T: KvElem>(t: &Tile<T>) -> (Vec<f32>, Vec<(f32, f32)>) {
        use super::super::amx::{bf16_bits, bf16_value};
        let bf = |x: f32| bf16_value(bf16_bits(x)) as f64;
        let d = t.d;
        let mut out = vec![0f32; t.q.len()];
        let mut stats = Vec::new();
        for (r, &c) in t.ctx.iter().enumerate() {
            let q: Vec<f64> = t.q[r * d..(r + 1) * d].iter().map(|&x| bf(x)).collect();
            let (mut m, mut sum, mut o) = (f64::NEG_INFINITY, 0f64, vec![0f64; d]);
            for pb in (t.from..c).step_by(BLOCK) {
                let ps = pb..(pb + BLOCK).min(c);
                let s: Vec<f64> = ps
                    .clone()
                    .map(|p| {
                        let (kr, sk) = (&t.k[t.rows[p]..t.rows[p] + d], t.scale(p).0);
                        q.iter().zip(kr).map(|(a, b)| a * bf(b.to_f32() * sk)).sum()
                    })
                    .collect();
                let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if top > m {
                    let alpha = (m - top).exp();
                    sum *= alpha;
                    o.iter_mut().for_each(|x| *x *= alpha);
                    m = top;
                }
                for (p, x) in ps.zip(&s) {
                    let e = (x - m).exp() as f32;
                    sum += e as f64;
                    let (vr, sv) = (&t.v[t.rows[p]..t.rows[p] + d], t.scale(p).1);
                    for (y, v) in o.iter_mut().zip(vr) {
                        *y += bf(e) * bf(v.to_f32() * sv);
                    }
                }
            }
            for (y, x) in out[r * d..(r + 1) * d].iter_mut().zip(&o) {
                *y = (x / sum) as f32;
            }
            stats.push((m as f32, sum as f32));
        }
        (out, stats)
    }

    /// The bf16 form against `reference_bf16` (the same roundings: tight) and against the exact
    /// reference (`attn::tile_scalar`: within bf16's rounding of queries, keys, values and
    /// weights).
    fn check_bf16<T: KvElem>(
        b: Avx512Bf16,
        c: &Case,
        from: usize,
        k: &[T],
        v: &[T],
        scales: Option<(&[half::f16], &[half::f16])>,
    ) -> Result<(), TestCaseError> {
        let t = tile_of(c, from, k, v, scales);
        let (want, want_stats) = reference_bf16(&t);
        let mut exact = vec![0f32; c.q.len()];
        tile_scalar(&t, &mut exact);
        let mut got = vec![f32::NAN; c.q.len()];
        let stats = tile(Width::Bf16(b), &t, &mut got);
        for (i, ((a, w), x)) in got.iter().zip(&want).zip(&exact).enumerate() {
            // F32 sums of bf16 products, and a weight may round the other way at a bf16 boundary.
            prop_assert!(
                (a - w).abs() <= 4e-3 * (1.0 + w.abs()),
                "value {i} (row {}): {a} vs the bf16 reference {w}",
                i / c.d
            );
            prop_assert!(
                (a - x).abs() <= 5e-2 * (1.0 + x.abs()),
                "value {i} (row {}): {a} vs the exact reference {x}",
                i / c.d
            );
        }
        same_stats(&stats, &want_stats, 1e-4)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 40, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The bf16 form (AVX-512 BF16) equals the reference computed from its roundings, and the
        /// exact one within them, on the shapes `blocks_equal_the_reference` takes.
        #[test]
        fn bf16_blocks_equal_the_reference_of_their_roundings(
            seed in any::<u64>(),
            d in prop::sample::select(vec![64usize, 128]),
            n_rows in 1usize..110,
            ctx0 in 0usize..200,
            per_token in 1usize..4,
            from_share in 0usize..4,
        ) {
            let Some(b) = Avx512Bf16::detect() else {
                eprintln!("bf16_blocks_equal_the_reference_of_their_roundings: skipped, this CPU has no AVX-512 BF16");
                return Ok(());
            };
            let c = case(seed, d, n_rows, ctx0, per_token);
            let k16: Vec<half::f16> = c.k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v16: Vec<half::f16> = c.v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let q = q8(&c);
            let from = c.ctx.iter().min().map_or(0, |&m| m.saturating_sub(1) * from_share / 4);
            check_bf16::<f32>(b, &c, from, &c.k, &c.v, None)?;
            check_bf16(b, &c, from, &k16, &v16, None)?;
            check_bf16(b, &c, from, &q.k.0, &q.v.0, Some((&q.k.1, &q.v.1)))?;
        }

        /// The blocked kernel equals the reference: row counts that leave partial register tiles,
        /// contexts that end inside a block and rows that start in a later block than others,
        /// one to three rows per token, both head sizes, F32, F16 and Q8 caches, both widths; from
        /// position 0 or, as a part of a long history, from a later one.
        #[test]
        fn blocks_equal_the_reference(
            seed in any::<u64>(),
            d in prop::sample::select(vec![64usize, 128]),
            n_rows in 1usize..110,
            ctx0 in 0usize..200,
            per_token in 1usize..4,
            from_share in 0usize..4,
        ) {
            let widths: Vec<Width> = Avx512Vnni::detect()
                .map(Width::W512)
                .into_iter()
                .chain(Avx2::detect().map(Width::W256))
                .collect();
            if widths.is_empty() {
                eprintln!("blocks_equal_the_reference: skipped, this CPU has no AVX2");
            }
            let c = case(seed, d, n_rows, ctx0, per_token);
            let k16: Vec<half::f16> = c.k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v16: Vec<half::f16> = c.v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let q = q8(&c);
            // Every row sees a position past `from`.
            let from = c.ctx.iter().min().map_or(0, |&m| m.saturating_sub(1) * from_share / 4);
            for w in widths {
                check::<f32>(w, &c, from, &c.k, &c.v, None)?;
                check(w, &c, from, &k16, &v16, None)?;
                check(w, &c, from, &q.k.0, &q.v.0, Some((&q.k.1, &q.v.1)))?;
            }
        }
    }
}
