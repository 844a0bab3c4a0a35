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
//! Only a prompt's runs take it (`model::attention` decides, as for `attn_amx`): a reply's decode
//! rows stay on `attn`, so speculating never changes a reply. `attn::tile_scalar` is the reference;
//! a seeded proptest compares the two on odd shapes and every cache type.

use super::attn::{KvElem, Tile};
use super::cpu::Avx512Vnni;

/// Positions a block takes: 64 positions of a 64-wide head are 16 KiB of keys and 16 of values
/// in F32, and a task's 96 rows of scores 24 KiB.
pub(crate) const BLOCK: usize = 64;

/// Whether the kernel runs heads of `d` values.
pub(crate) fn supports(d: usize) -> bool {
    d == 64 || d == 128
}

/// `attn::attend` for a prompt's rows (`t.from == 0`): `out` is `[rows, d]`; returns each row's
/// softmax statistics.
///
/// # Panics
/// When the shapes disagree, `t.from != 0`, the head size is not `supports`ed, or a row offset
/// points outside `k` or `v`.
pub(crate) fn tile<T: KvElem>(vnni: Avx512Vnni, t: &Tile<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    let n = t.ctx.len();
    assert!(supports(t.d), "head size {}", t.d);
    assert_eq!(t.from, 0, "a prompt's rows start at position 0");
    assert_eq!(t.q.len(), n * t.d, "query rows are d wide");
    assert_eq!(out.len(), n * t.d, "output rows are d wide");
    assert!(t.ctx.iter().all(|&c| c > 0), "every row sees a position");
    let cmax = t.ctx.iter().copied().max().unwrap_or(0);
    assert!(cmax <= t.rows.len(), "a row offset for every position");
    let last = t.rows[..cmax].iter().copied().max().unwrap_or(0) + t.d;
    assert!(
        last <= t.k.len() && last <= t.v.len(),
        "row offsets inside the cache"
    );
    if let Some((ks, vs)) = t.scales {
        let last = last / t.d;
        assert!(
            last <= ks.len() && last <= vs.len(),
            "scale offsets inside the cache"
        );
    }
    let _ = vnni;
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the token proves AVX-512 F (and AVX2, FMA, F16C); shapes and every row offset
        // below `cmax` checked above.
        match t.d {
            64 => unsafe { simd::tile::<T, 64>(t, cmax, out) },
            _ => unsafe { simd::tile::<T, 128>(t, cmax, out) },
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the token exists only on x86-64")
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::super::attn::exp16_minus;
    use super::super::attn_amx::simd::transpose16;
    use super::super::{lines, Lines};
    use super::{KvElem, Tile, BLOCK};

    /// Rows a register tile takes: 6 rows x 4 vectors of accumulators beside the 4 loaded vectors
    /// of keys (or values) fit the 32 registers.
    const ROWS: usize = 6;
    /// Vectors of 16 lanes in a block.
    const VB: usize = BLOCK / 16;

    /// A row's positions in the block at `pb`: how many it sees (`0..=BLOCK`).
    #[inline]
    fn seen(ctx: usize, pb: usize) -> usize {
        ctx.saturating_sub(pb).min(BLOCK)
    }

    /// Lanes `0..count` (`count <= 16`) of a vector.
    #[inline]
    fn lanes(count: usize) -> __mmask16 {
        ((1u32 << count) - 1) as __mmask16
    }

    /// # Safety
    /// AVX-512 F; `t` checked by `super::tile` (`cmax` its largest context); `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile<T: KvElem, const D: usize>(
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
        let scale = |p: usize| match t.scales {
            Some((ks, vs)) => (ks[t.rows[p] / D].to_f32(), vs[t.rows[p] / D].to_f32()),
            None => (1.0, 1.0),
        };
        for pb in (0..cmax).step_by(BLOCK) {
            // The rows that see this block, and how far any of them sees into it.
            let first = (0..n).find(|&r| t.ctx[r] > pb).unwrap_or(n);
            let reach = (first..n).map(|r| seen(t.ctx[r], pb)).max().unwrap_or(0);
            if reach == 0 {
                continue;
            }
            convert::<T, D>(t, pb, reach, &scale, &mut kt, &mut vb);
            let mut r = first;
            while r < n {
                let nr = ROWS.min(n - r);
                let (q, sp) = (t.q.as_ptr().add(r * D), s.as_mut_ptr().add(r * BLOCK));
                match nr {
                    6 => scores::<D, 6>(q, kt.as_ptr(), sp),
                    5 => scores::<D, 5>(q, kt.as_ptr(), sp),
                    4 => scores::<D, 4>(q, kt.as_ptr(), sp),
                    3 => scores::<D, 3>(q, kt.as_ptr(), sp),
                    2 => scores::<D, 2>(q, kt.as_ptr(), sp),
                    _ => scores::<D, 1>(q, kt.as_ptr(), sp),
                }
                r += nr;
            }
            for r in first..n {
                let row = s.as_mut_ptr().add(r * BLOCK);
                let o = out.as_mut_ptr().add(r * D);
                weights::<D>(row, seen(t.ctx[r], pb), &mut max[r], &mut sum[r], o);
            }
            let mut r = first;
            while r < n {
                let nr = ROWS.min(n - r);
                let w = s.as_ptr().add(r * BLOCK);
                for c in (0..D).step_by(64) {
                    let (v, o) = (vb.as_ptr().add(c), out.as_mut_ptr().add(r * D + c));
                    match nr {
                        6 => values::<D, 6>(w, v, o, reach),
                        5 => values::<D, 5>(w, v, o, reach),
                        4 => values::<D, 4>(w, v, o, reach),
                        3 => values::<D, 3>(w, v, o, reach),
                        2 => values::<D, 2>(w, v, o, reach),
                        _ => values::<D, 1>(w, v, o, reach),
                    }
                }
                r += nr;
            }
        }
        for (r, o) in out.chunks_exact_mut(D).enumerate() {
            let inv = _mm512_set1_ps(1.0 / sum[r]);
            for c in (0..D).step_by(16) {
                let p = o.as_mut_ptr().add(c);
                _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), inv));
            }
        }
        max.into_iter().zip(sum).collect()
    }

    /// Positions `pb..pb + count` as F32, a Q8 cache's scales applied: keys transposed into `kt`
    /// (`[D][BLOCK]`, positions past `count` zero), values as rows into `vb` (`[BLOCK][D]`, rows
    /// `0..count`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn convert<T: KvElem, const D: usize>(
        t: &Tile<T>,
        pb: usize,
        count: usize,
        scale: &impl Fn(usize) -> (f32, f32),
        kt: &mut [f32],
        vb: &mut [f32],
    ) {
        let (k, v) = (t.k.as_ptr(), t.v.as_ptr());
        for j in 0..VB {
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
                    _mm512_storeu_si512(kt.as_mut_ptr().add((c + i) * BLOCK + j * 16) as _, *x);
                }
            }
        }
        for at in 0..count {
            let p = pb + at;
            let sv = _mm512_set1_ps(scale(p).1);
            for c in (0..D).step_by(16) {
                let x = T::load16(v.add(t.rows[p] + c));
                _mm512_storeu_ps(vb.as_mut_ptr().add(at * D + c), _mm512_mul_ps(x, sv));
            }
        }
    }

    /// `s[r][0..BLOCK] = q[r] . kt` for `NR` query rows (`D` apart) against a block's transposed
    /// keys.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn scores<const D: usize, const NR: usize>(q: *const f32, kt: *const f32, s: *mut f32) {
        let mut acc = [[_mm512_setzero_ps(); VB]; NR];
        for c in 0..D {
            let kv: [__m512; VB] =
                std::array::from_fn(|j| _mm512_loadu_ps(kt.add(c * BLOCK + j * 16)));
            for (r, a) in acc.iter_mut().enumerate() {
                let qv = _mm512_set1_ps(*q.add(r * D + c));
                for j in 0..VB {
                    a[j] = _mm512_fmadd_ps(qv, kv[j], a[j]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, x) in a.iter().enumerate() {
                _mm512_storeu_ps(s.add(r * BLOCK + j * 16), *x);
            }
        }
    }

    /// One row's block of scores (`s`, the first `seen` of them in use) into its weights
    /// `exp(score - max)` (zero past `seen`), with its running maximum and sum: when the maximum
    /// grows, the sum and the output row so far (`o`, `D` values) are rescaled to it.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn weights<const D: usize>(
        s: *mut f32,
        seen: usize,
        max: &mut f32,
        sum: &mut f32,
        o: *mut f32,
    ) {
        let none = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut x = [none; VB];
        let mut mv = none;
        for (j, xj) in x.iter_mut().enumerate() {
            let count = seen.saturating_sub(j * 16).min(16);
            *xj = _mm512_mask_loadu_ps(none, super::simd::lanes(count), s.add(j * 16));
            mv = _mm512_max_ps(mv, *xj);
        }
        let m = _mm512_reduce_max_ps(mv);
        if m > *max {
            if *max > f32::NEG_INFINITY {
                let alpha = (*max - m).exp();
                *sum *= alpha;
                let av = _mm512_set1_ps(alpha);
                for c in (0..D).step_by(16) {
                    _mm512_storeu_ps(o.add(c), _mm512_mul_ps(_mm512_loadu_ps(o.add(c)), av));
                }
            }
            *max = m;
        }
        let mv = _mm512_set1_ps(*max);
        let mut total = _mm512_setzero_ps();
        for (j, xj) in x.iter().enumerate() {
            let e = exp16_minus(*xj, mv);
            total = _mm512_add_ps(total, e);
            _mm512_storeu_ps(s.add(j * 16), e);
        }
        *sum += _mm512_reduce_add_ps(total);
    }

    /// `o[r][0..64] += sum_p w[r][p] * vb[p][0..64]` for `NR` rows (`w` rows `BLOCK` apart, `o`
    /// rows `D` apart; `vb` rows `D` apart), positions `0..count`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn values<const D: usize, const NR: usize>(
        w: *const f32,
        vb: *const f32,
        o: *mut f32,
        count: usize,
    ) {
        let mut acc: [[__m512; 4]; NR] = std::array::from_fn(|r| {
            std::array::from_fn(|j| _mm512_loadu_ps(o.add(r * D + j * 16)))
        });
        for p in 0..count {
            let vv: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(vb.add(p * D + j * 16)));
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*w.add(r * BLOCK + p));
                for j in 0..4 {
                    a[j] = _mm512_fmadd_ps(wv, vv[j], a[j]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, x) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * D + j * 16), *x);
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

    fn check<T: KvElem>(
        vnni: Avx512Vnni,
        c: &Case,
        k: &[T],
        v: &[T],
        scales: Option<(&[half::f16], &[half::f16])>,
    ) -> Result<(), TestCaseError> {
        let t = Tile {
            q: &c.q,
            from: 0,
            ctx: &c.ctx,
            rows: &c.rows,
            k,
            v,
            d: c.d,
            scales,
        };
        let mut want = vec![0f32; c.q.len()];
        let want_stats = tile_scalar(&t, &mut want);
        let mut got = vec![f32::NAN; c.q.len()];
        let stats = tile(vnni, &t, &mut got);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "value {i} (row {}): {a} vs {b}",
                i / c.d
            );
        }
        for (r, ((m, s), (wm, ws))) in stats.iter().zip(&want_stats).enumerate() {
            prop_assert!(
                (m - wm).abs() <= 1e-5 * (1.0 + wm.abs()),
                "row {r}'s largest score: {m} vs {wm}"
            );
            prop_assert!((s - ws).abs() <= 1e-4 * ws, "row {r}'s sum: {s} vs {ws}");
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 40, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The blocked kernel equals the reference: row counts that leave partial register tiles,
        /// contexts that end inside a block and rows that start in a later block than others,
        /// one to three rows per token, both head sizes, F32, F16 and Q8 caches.
        #[test]
        fn blocks_equal_the_reference(
            seed in any::<u64>(),
            d in prop::sample::select(vec![64usize, 128]),
            n_rows in 1usize..110,
            ctx0 in 0usize..200,
            per_token in 1usize..4,
        ) {
            let Some(vnni) = Avx512Vnni::detect() else {
                eprintln!("blocks_equal_the_reference: skipped, this CPU has no AVX-512 VNNI");
                return Ok(());
            };
            let c = case(seed, d, n_rows, ctx0, per_token);
            check::<f32>(vnni, &c, &c.k, &c.v, None)?;
            let k16: Vec<half::f16> = c.k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v16: Vec<half::f16> = c.v.iter().map(|&x| half::f16::from_f32(x)).collect();
            check(vnni, &c, &k16, &v16, None)?;
            let q = q8(&c);
            check(vnni, &c, &q.k.0, &q.v.0, Some((&q.k.1, &q.v.1)))?;
        }
    }
}
