//! The attention tile kernel: one sequence, one KV head, a tile of query rows (the GQA group's query
//! heads of one or more consecutive tokens) against the cached positions each row sees, read through
//! the paged cache's row offsets.
//!
//! Written by hand because candle has no paged attention on CPU. The shape follows the register-tiled
//! matmuls next door rather than one dot product per (row, position): scores take two query rows
//! against four key rows at a time (eight accumulators, one key load serving both rows, the four
//! sums of a row reduced together with `hadd`), and the weighted sum of values takes two rows over
//! 32 columns (again eight accumulators, one value load serving both rows). With
//! several tokens in a tile (a prefill chunk) positions go in blocks of `POS_BLOCK` so a block's keys
//! and values stay in L1 while every row group uses them; K and V rows of the next positions are
//! prefetched, since one KV head's row is a few cache lines at the stride of a whole cache row, a
//! pattern the hardware prefetchers follow poorly, and a decode step's rows come from DRAM.
//!
//! A Q8 cache (`kv_cache::q8`) is read the same way: its codes load into F32 lanes like F16
//! values, and each position's scale multiplies its scores (K) and its softmax weights (V) between
//! the passes, so the inner loops are the same for every cache type and a Q8 position reads half
//! the bytes of an F16 one.
//!
//! `cargo bench --bench engine -- --attention 1 --chunk 29 --context 479` measures it alone.
//! `tile_scalar` is the reference (and the path on CPUs without AVX2 + FMA + F16C
//! and for head sizes other than 64 and 128); a proptest compares the two on odd shapes.

use super::cpu::Isa;

/// An element of the KV cache: F32, F16 or a Q8 code, read into F32 lanes as it is loaded.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight values from `p` as F32 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must point to 8 readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen values from `p` as F32 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `p` must point to 16 readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// The cache as Q8 codes, when it is one (the 8-bit score kernel reads them as bytes).
    fn codes(_k: &[Self]) -> Option<&[u8]> {
        None
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl KvElem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// A Q8 code (`kv_cache::q8`): the value in units of its row's scale, plus 128. The scale is
/// applied per position (`Tile::scales`).
impl KvElem for u8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32 - 128.0
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_cvtepi32_ps(_mm256_sub_epi32(codes, _mm256_set1_epi32(128)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, _mm512_set1_epi32(128)))
    }
    fn codes(k: &[Self]) -> Option<&[u8]> {
        Some(k)
    }
}

/// Query rows quantized for the 8-bit score kernel: each row's codes (its values over its
/// largest magnitude, in -127..=127), its scale, and the sum of its codes (which takes the
/// cache codes' offset of 128 back out of each product).
pub(crate) struct QueryCodes {
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub sum: Vec<i32>,
}

/// Quantizes query rows of `d` values (`QueryCodes`), as llama.cpp quantizes the query to Q8_0
/// against a Q8_0 cache. `tile_scalar` over `queries_as_quantized` is the 8-bit score kernel's
/// reference (its integer products are exact).
pub(crate) fn quantize_queries(q: &[f32], d: usize) -> QueryCodes {
    let rows = q.len() / d;
    let mut out = QueryCodes {
        q: Vec::with_capacity(q.len()),
        scale: Vec::with_capacity(rows),
        sum: Vec::with_capacity(rows),
    };
    for row in q.chunks_exact(d) {
        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let start = out.q.len();
        out.q.extend(
            row.iter()
                .map(|x| (x * inv).round().clamp(-127.0, 127.0) as i8),
        );
        out.sum.push(out.q[start..].iter().map(|&c| c as i32).sum());
        out.scale.push(scale);
    }
    out
}

/// Positions per block when a tile has more than one row group: 16 rows of a 64-wide head are
/// 4 KiB of keys (F32), which stay in L1 while each pair of rows uses them.
const POS_BLOCK: usize = 16;

/// How many positions ahead the kernel asks for K and V rows (the fastest of 4, 8 and 16 on a
/// 16-sequence decode step).
const PREFETCH_AHEAD: usize = 8;

/// One tile of attention work.
pub(crate) struct Tile<'a, T> {
    /// Query rows, `[rows, d]`, already multiplied by the softmax scale.
    pub q: &'a [f32],
    /// The first position the tile covers: rows see positions `from..ctx[r]` (a decode row's
    /// history can be cut into parts that run in parallel, then merged with `merge_parts`).
    pub from: usize,
    /// Where each row's positions end (`ctx[r] > from`).
    pub ctx: &'a [usize],
    /// Element offset of each position's row in `k` and `v` (this KV head's `d` values start there).
    pub rows: &'a [usize],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d: usize,
    /// A Q8 cache's K and V scales for this head: position `p`'s at `rows[p] / d` (rows of
    /// `heads * d` codes, one scale per head row). `None` for F32 and F16.
    pub scales: Option<(&'a [half::f16], &'a [half::f16])>,
}

impl<T> Tile<'_, T> {
    /// The largest context of the tile's rows, once the shapes are checked: `out` (`[rows, d]`)
    /// and the query rows `d` wide, every row seeing a position past `from`, a row offset for
    /// every position, and every offset (and Q8 scale offset) inside the cache.
    ///
    /// # Panics
    /// When one of those does not hold (a bug in the caller: block tables are validated when a
    /// step is planned).
    pub(crate) fn checked(&self, out: &[f32]) -> usize {
        let n = self.ctx.len();
        assert_eq!(self.q.len(), n * self.d, "query rows are d wide");
        assert_eq!(out.len(), n * self.d, "output rows are d wide");
        let cmax = self.ctx.iter().copied().max().unwrap_or(0);
        assert!(
            self.ctx.iter().all(|&c| c > self.from),
            "every row sees at least one position"
        );
        assert!(cmax <= self.rows.len(), "a row offset for every position");
        let last = self.rows[self.from..cmax]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            + self.d;
        assert!(
            last <= self.k.len() && last <= self.v.len(),
            "row offsets inside the cache"
        );
        if let Some((ks, vs)) = self.scales {
            let last = last / self.d;
            assert!(
                last <= ks.len() && last <= vs.len(),
                "scale offsets inside the cache"
            );
        }
        cmax
    }

    /// Asks for the keys and values of positions `from..to` (this head's `d` values of each) into
    /// L2: a hint that never faults and never changes a result. A block
    /// kernel asks for its next block while it works on this one, since a head's values are a
    /// line or two at the stride of a whole cache row, a pattern the hardware prefetchers follow
    /// poorly, and a step's rows come from DRAM.
    pub(crate) fn prefetch_l2(&self, from: usize, to: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let bytes = self.d * std::mem::size_of::<T>();
            let to = to.min(self.rows.len());
            for &at in &self.rows[from.min(to)..to] {
                // SAFETY: prefetching is a hint: it never faults, whatever the address.
                unsafe {
                    prefetch_bytes_l2(self.k.as_ptr().wrapping_add(at), bytes);
                    prefetch_bytes_l2(self.v.as_ptr().wrapping_add(at), bytes);
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (from, to);
    }

    /// Position `p`'s K and V scales (1 and 1 without a Q8 cache's scales).
    #[inline]
    pub(crate) fn scale(&self, p: usize) -> (f32, f32) {
        match self.scales {
            Some((ks, vs)) => {
                let at = self.rows[p] / self.d;
                (ks[at].to_f32(), vs[at].to_f32())
            }
            None => (1.0, 1.0),
        }
    }

    /// Each position's K and V scale, positions `0..n`, when the cache has them. `D == self.d`
    /// (a constant, so the offsets' division is a shift).
    fn position_scales<const D: usize>(&self, n: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        use half::slice::HalfFloatSliceExt;
        let (ks, vs) = self.scales?;
        let at = |s: &[half::f16]| -> Vec<f32> {
            let h: Vec<half::f16> = self.rows[..n].iter().map(|&r| s[r / D]).collect();
            let mut f = vec![0f32; n];
            h.convert_to_f32_slice(&mut f);
            f
        };
        Some((at(ks), at(vs)))
    }
}

/// Multiplies each row's entries of `s` (`[rows, stride]`, row r's first `ctx[r]` in use) by the
/// positions' `scale`.
fn scale_rows(s: &mut [f32], stride: usize, ctx: &[usize], scale: &[f32]) {
    for (row, &c) in s.chunks_mut(stride).zip(ctx) {
        for (x, k) in row[..c].iter_mut().zip(scale) {
            *x *= k;
        }
    }
}

/// `out[r] = softmax(q[r] . K[from..ctx[r]]^T) . V[from..ctx[r]]` for every row of the tile; `out`
/// is `[rows, d]`. Returns each row's softmax statistics (largest score, sum of `exp(score - max)`),
/// which `merge_parts` needs.
///
/// # Panics
/// When the shapes disagree or a row offset points outside `k` or `v` (a bug in the caller: block
/// tables are validated when a step is planned).
pub(crate) fn attend<T: KvElem>(isa: Isa, t: &Tile<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    let cmax = t.checked(out);
    // The kernels count positions from the tile's first one.
    let cmax = cmax - t.from;
    let ctx: Vec<usize> = t.ctx.iter().map(|c| c - t.from).collect();
    let t = Tile {
        from: 0,
        ctx: &ctx,
        rows: &t.rows[t.from..],
        ..*t
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2, FMA and F16C; the shapes and every row offset below `cmax`
        // were checked above.
        // A Q8 cache's scores in 8-bit integers where the CPU has VNNI.
        let vnni = isa.avx512_vnni().filter(|_| T::codes(t.k).is_some());
        match t.d {
            64 => return unsafe { avx2::tile::<T, 64>(&t, cmax, out, vnni) },
            128 => return unsafe { avx2::tile::<T, 128>(&t, cmax, out, vnni) },
            _ => {}
        }
    }
    tile_scalar(&t, out)
}

/// One token's query rows for `heads` consecutive KV heads of one sequence (a reply's decode row):
/// the GQA groups one after another, `[heads * group, d]`, already multiplied by the softmax
/// scale, over positions `from..ctx` read through `rows`, which point at the first head's values
/// (head `h`'s lie `h * d` further on: a cache row holds every KV head of its position).
pub(crate) struct Heads<'a, T> {
    pub q: &'a [f32],
    pub group: usize,
    pub heads: usize,
    pub from: usize,
    pub ctx: usize,
    pub rows: &'a [usize],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d: usize,
    /// A Q8 cache's K and V scales from the first head's (`Tile::scales`; head `h`'s `h` further).
    pub scales: Option<(&'a [half::f16], &'a [half::f16])>,
}

/// Whether `attend_heads` runs its own kernel for heads of `d` values over an F32 or F16 cache
/// here, so that a decode row is worth one task for all its KV heads: AVX2 (the 256-bit kernel,
/// or the 512-bit one where AVX-512 measured faster than it, `avx512::pays`). Without AVX2, and
/// for a Q8 cache (whose scores take the 8-bit kernel per head), `attend_heads` runs `attend`
/// head by head, and a task per head spreads better over the threads.
pub(crate) fn heads_kernel<T: KvElem>(isa: Isa, d: usize) -> bool {
    std::mem::size_of::<T>() > 1 && matches!(d, 64 | 128) && isa.avx2().is_some()
}

/// `attend` for the rows of a decode step's token over several KV heads (`Heads`); returns each
/// row's softmax statistics, heads in order.
///
/// # Panics
/// When the shapes disagree or a row offset points outside `k` or `v`, as `attend`.
pub(crate) fn attend_heads<T: KvElem>(isa: Isa, t: &Heads<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    let (g, d) = (t.group, t.d);
    assert_eq!(t.q.len(), t.heads * g * d, "query rows are d wide");
    assert_eq!(out.len(), t.q.len(), "output rows are d wide");
    assert!(t.ctx > t.from, "every row sees at least one position");
    assert!(t.ctx <= t.rows.len(), "a row offset for every position");
    let last = t.rows[t.from..t.ctx].iter().copied().max().unwrap_or(0) + t.heads * d;
    assert!(
        last <= t.k.len() && last <= t.v.len(),
        "row offsets inside the cache"
    );
    #[cfg(target_arch = "x86_64")]
    if t.scales.is_none() && heads_kernel::<T>(isa, d) {
        if isa.avx512_vnni().is_some_and(avx512::pays) {
            // SAFETY: the token proves AVX-512; shapes and offsets checked above.
            match d {
                64 => return unsafe { avx512::heads::<T, 64>(t, out) },
                128 => return unsafe { avx512::heads::<T, 128>(t, out) },
                _ => {}
            }
        }
        if isa.avx2().is_some() {
            // SAFETY: the token proves AVX2, FMA and F16C; shapes and offsets checked above.
            match d {
                64 => return unsafe { avx2::heads::<T, 64>(t, out) },
                128 => return unsafe { avx2::heads::<T, 128>(t, out) },
                _ => {}
            }
        }
    }
    per_head(isa, t, out)
}

/// `attend_heads` through `attend`, one KV head at a time.
fn per_head<T: KvElem>(isa: Isa, t: &Heads<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    let (g, d) = (t.group, t.d);
    let ctx = vec![t.ctx; g];
    let mut stats = Vec::with_capacity(t.heads * g);
    for h in 0..t.heads {
        let tile = Tile {
            q: &t.q[h * g * d..(h + 1) * g * d],
            from: t.from,
            ctx: &ctx,
            rows: t.rows,
            k: &t.k[h * d..],
            v: &t.v[h * d..],
            d,
            scales: t.scales.map(|(k, v)| (&k[h..], &v[h..])),
        };
        stats.extend(attend(isa, &tile, &mut out[h * g * d..(h + 1) * g * d]));
    }
    stats
}

#[cfg(test)]
/// The query rows as the 8-bit score kernel sees them: quantized (`quantize_queries`) and read
/// back.
pub(crate) fn queries_as_quantized(q: &[f32], d: usize) -> Vec<f32> {
    let c = quantize_queries(q, d);
    c.q.chunks_exact(d)
        .zip(&c.scale)
        .flat_map(|(row, s)| row.iter().map(move |&x| x as f32 * s))
        .collect()
}

#[cfg(test)]
/// Whether `attend` at `isa` computes a tile's scores from quantized queries (a Q8 cache on a CPU
/// with VNNI, for the head sizes the SIMD path takes).
pub(crate) fn quantizes_queries<T: KvElem>(isa: Isa, t: &Tile<T>) -> bool {
    isa.avx512_vnni().is_some() && T::codes(t.k).is_some() && matches!(t.d, 64 | 128)
}

/// Combines the outputs of parts of one row's positions (each normalized over its own part, with
/// its statistics from `attend`) into the row's attention over all of them: each part weighs
/// `sum * exp(max - overall max)`, the flash-decoding merge.
pub(crate) fn merge_parts(parts: &[(&[f32], (f32, f32))], out: &mut [f32]) {
    let m = parts
        .iter()
        .map(|(_, (m, _))| *m)
        .fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = parts
        .iter()
        .map(|(_, (pm, l))| l * (pm - m).exp())
        .collect();
    let inv = 1.0 / w.iter().sum::<f32>();
    out.fill(0.0);
    for ((o, _), w) in parts.iter().zip(&w) {
        for (y, x) in out.iter_mut().zip(o.iter()) {
            *y += x * w * inv;
        }
    }
}

/// The reference: one row at a time, one dot product per position.
pub(crate) fn tile_scalar<T: KvElem>(t: &Tile<T>, out: &mut [f32]) -> Vec<(f32, f32)> {
    let d = t.d;
    let mut s = Vec::new();
    let mut stats = Vec::with_capacity(t.ctx.len());
    let scale = |p: usize| t.scale(p);
    for (r, &c) in t.ctx.iter().enumerate() {
        let q = &t.q[r * d..(r + 1) * d];
        s.clear();
        s.extend((t.from..c).map(|p| dot(q, &t.k[t.rows[p]..t.rows[p] + d]) * scale(p).0));
        stats.push(softmax(Isa::Scalar, &mut s));
        let o = &mut out[r * d..(r + 1) * d];
        o.fill(0.0);
        for (p, &w) in (t.from..c).zip(&s) {
            let w = w * scale(p).1;
            for (y, x) in o.iter_mut().zip(&t.v[t.rows[p]..t.rows[p] + d]) {
                *y += w * x.to_f32();
            }
        }
    }
    stats
}

#[inline]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight independent lanes so the compiler keeps one vector accumulator.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i].to_f32();
    }
    s
}

/// In-place softmax of one row of scores. With AVX2 the max, the exponentials (`exp8_minus`, eight
/// at a time) and their sum run in vector registers: libm's scalar `expf` was a large share of a
/// prefill chunk's attention at long context, and then the scalar sum (one dependent add per
/// position, ~12% of a chunk's attention).
/// Returns the largest score and the sum of `exp(score - largest)`.
pub(crate) fn softmax(isa: Isa, s: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if let Some(_avx2) = isa.avx2() {
        // SAFETY: the token proves AVX2 and FMA.
        return unsafe { softmax_avx2(s) };
    }
    // Eight lanes, so the compiler vectorizes the max and the sum.
    let mut lanes = [f32::NEG_INFINITY; 8];
    for c in s.chunks(8) {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    let m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0f32; 8];
    for c in s.chunks_mut(8) {
        for (l, x) in sums.iter_mut().zip(c) {
            *x = (*x - m).exp();
            *l += *x;
        }
    }
    let sum = sums.iter().sum::<f32>();
    let inv = 1.0 / sum;
    for x in s.iter_mut() {
        *x *= inv;
    }
    (m, sum)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(s: &mut [f32]) -> (f32, f32) {
    use std::arch::x86_64::*;
    let n = s.len();
    let p = s.as_mut_ptr();
    let full = n / 8 * 8;
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
    let m = lanes
        .iter()
        .chain(&s[full..])
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sv = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        let e = exp8_minus(_mm256_loadu_ps(p.add(i)), m);
        _mm256_storeu_ps(p.add(i), e);
        sv = _mm256_add_ps(sv, e);
        i += 8;
    }
    _mm256_storeu_ps(lanes.as_mut_ptr(), sv);
    let mut sum: f32 = lanes.iter().sum();
    for x in &mut s[full..] {
        *x = (*x - m).exp();
        sum += *x;
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    let mut i = 0;
    while i < full {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
        i += 8;
    }
    for x in &mut s[full..] {
        *x *= 1.0 / sum;
    }
    (m, sum)
}

/// Cephes' `expf`: `ln 2` in two parts for the range reduction, and the degree-5 polynomial's
/// coefficients, highest first (`exp8_minus` here, `attn_amx`'s sixteen-lane one).
pub(crate) const LN2_PARTS: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `exp(x[i] - m)` for 8 values, `x[i] - m <= 0`: Cephes' `expf` (range reduction by `ln 2` in two
/// parts, degree-5 polynomial, 2^n by the exponent bits), within 2 ulp of libm; results below
/// `exp(-87)` flush to 0, as softmax weights that small do not count.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp8_minus(x: std::arch::x86_64::__m256, m: f32) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let v = _mm256_sub_ps(x, _mm256_set1_ps(m));
    let tiny = _mm256_cmp_ps(v, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    let v = _mm256_max_ps(v, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(
        _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[0]), v);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[1]), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    ));
    _mm256_andnot_ps(tiny, _mm256_mul_ps(e, pow2))
}

/// `exp(x - m)` for 16 values (`attn::exp8_minus` on 512-bit vectors); lanes below
/// `exp(-87)` (and `-inf`) give 0.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp16_minus(
    x: std::arch::x86_64::__m512,
    m: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let v = _mm512_sub_ps(x, m);
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, _mm512_set1_ps(-87.0));
    let v = _mm512_max_ps(v, _mm512_set1_ps(-87.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(v, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_PARTS[0]), v);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_PARTS[1]), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let e = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    )));
    _mm512_maskz_mul_ps(!tiny, e, pow2)
}

/// Asks for `bytes` from `p` into L1 (a hint: never faults, no effect on results).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_bytes<T>(p: *const T, bytes: usize) {
    prefetch_hinted::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(p, bytes)
}

/// Asks for `bytes` from `p` into L2 (a hint, as `prefetch_bytes`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_bytes_l2<T>(p: *const T, bytes: usize) {
    prefetch_hinted::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(p, bytes)
}

/// Every cache line of `bytes` from `p`, with `_mm_prefetch`'s `HINT`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_hinted<const HINT: i32, T>(p: *const T, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        std::arch::x86_64::_mm_prefetch::<HINT>((p as *const i8).wrapping_add(off));
        off += 64;
    }
}

/// One pass of a decode-row kernel (`avx2::heads`, `avx512::heads`) over a group of query rows
/// of one KV head: the rows' queries (scores pass) or softmax weights (values pass), the cache
/// row offsets of positions `0..n`, this head's keys or values and the cache row's first head's
/// (to prefetch whole rows from, `pf` bytes of each, when `pf` > 0), the scores out (scores pass)
/// or the rows' first output column (values pass).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Pass<T> {
    rows_in: *const f32,
    rows: *const usize,
    n: usize,
    kv: *const T,
    kv0: *const T,
    out: *mut f32,
    pf: usize,
    /// In the first scores pass, the values' first head, whose rows the pass asks for too (into
    /// L2), so the values pass finds them close; null otherwise.
    then: *const T,
}

#[cfg(target_arch = "x86_64")]
impl<T> Pass<T> {
    /// A scores pass's prefetching at positions `p..p + 4`: with `pf` > 0, `pf` bytes of each of
    /// the rows `PREFETCH_AHEAD` positions on, from `kv0` (into L1) and from `then` (into L2)
    /// where it is not null.
    ///
    /// # Safety
    /// `rows` must hold `n` offsets (the pass's shapes, checked by `attend_heads`).
    #[inline(always)]
    unsafe fn ask_ahead(&self, p: usize) {
        if self.pf > 0 && p + PREFETCH_AHEAD + 4 <= self.n {
            for j in 0..4 {
                let at = *self.rows.add(p + PREFETCH_AHEAD + j);
                prefetch_bytes(self.kv0.add(at), self.pf);
                if !self.then.is_null() {
                    prefetch_bytes_l2(self.then.add(at), self.pf);
                }
            }
        }
    }
}

/// The plan both decode-row kernels follow: each KV head's GQA group in groups of up to
/// `per_group` query rows; scores by `qk(rows in the group, pass)`, each row's softmax, then the
/// weighted values by `pv(rows in the group, pass)`, `cols` columns a pass. The first group of
/// the first head asks for the whole cache rows ahead (keys in its scores pass, values in its
/// first values pass), so the other heads find them in cache; its scores pass also asks for the
/// values' rows into L2, and the first `PREFETCH_AHEAD` positions' rows are asked for before the
/// passes, so neither pass starts on rows still in DRAM (a step's rows come from DRAM: the
/// layer's weights pass through the caches in between; docs/performance.md, "Decode rows that
/// start on rows in cache").
///
/// # Safety
/// AVX2 and FMA; `t` checked by `attend_heads`; `D == t.d`, a multiple of `cols`; `qk` and
/// `pv` safe to call with passes inside `t`'s shapes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn heads_passes<T: KvElem, const D: usize>(
    t: &Heads<T>,
    out: &mut [f32],
    per_group: usize,
    cols: usize,
    qk: impl Fn(usize, Pass<T>),
    pv: impl Fn(usize, Pass<T>),
) -> Vec<(f32, f32)> {
    let (g, n) = (t.group, t.ctx - t.from);
    let rows = t.rows[t.from..].as_ptr();
    let row_bytes = t.heads * D * std::mem::size_of::<T>();
    let mut s = vec![0f32; t.heads * g * n];
    let (q, k, v, sp) = (t.q.as_ptr(), t.k.as_ptr(), t.v.as_ptr(), s.as_mut_ptr());
    // The first positions' rows, which the passes' prefetching (`PREFETCH_AHEAD` positions on)
    // never asks for: keys into L1, values into L2.
    for p in 0..n.min(PREFETCH_AHEAD) {
        prefetch_bytes(k.add(*rows.add(p)), row_bytes);
        prefetch_bytes_l2(v.add(*rows.add(p)), row_bytes);
    }
    // (head, first row, rows).
    let groups: Vec<(usize, usize, usize)> = (0..t.heads)
        .flat_map(|h| {
            (0..g)
                .step_by(per_group)
                .map(move |r| (h, h * g + r, (g - r).min(per_group)))
        })
        .collect();
    for &(h, r, nr) in &groups {
        let pass = Pass {
            rows_in: q.add(r * D),
            rows,
            n,
            kv: k.add(h * D),
            kv0: k,
            out: sp.add(r * n),
            pf: if r == 0 { row_bytes } else { 0 },
            then: if r == 0 { v } else { std::ptr::null() },
        };
        qk(nr, pass);
    }
    let stats: Vec<(f32, f32)> = s.chunks_exact_mut(n).map(|row| softmax_avx2(row)).collect();
    let op = out.as_mut_ptr();
    for &(h, r, nr) in &groups {
        for col in (0..D).step_by(cols) {
            let pass = Pass {
                rows_in: sp.add(r * n),
                rows,
                n,
                kv: v.add(h * D + col),
                kv0: v,
                out: op.add(r * D + col),
                pf: if r == 0 && col == 0 { row_bytes } else { 0 },
                then: std::ptr::null(),
            };
            pv(nr, pass);
        }
    }
    stats
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{
        heads_passes, prefetch_bytes, quantize_queries, scale_rows, softmax_avx2, Heads, KvElem,
        Pass, Tile, POS_BLOCK, PREFETCH_AHEAD,
    };
    use crate::model::kernels::cpu::Avx512Vnni;

    /// Rows the 8-bit score kernel takes at once: 4 rows x 4 positions of `i32` accumulators fit
    /// AVX-512's 32 vector registers beside the loaded keys, so a decode step's GQA group (3 or 4
    /// query heads) reads each key once.
    const VNNI_ROWS: usize = 4;

    /// Every row's scores over a Q8 cache (`s[r * cmax + p]`, before the keys' scales): the
    /// query rows quantized to 8 bits (`quantize_queries`) and multiplied with the codes by
    /// `vpdpbusd`, 32 products an instruction where the F32 path does 8.
    ///
    /// # Safety
    /// AVX2, FMA, AVX-512 F/VL/VNNI; `t` checked by `attend`; `D == t.d`, a multiple of 32.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn scores_vnni<T, const D: usize>(
        t: &Tile<T>,
        codes: &[u8],
        cmax: usize,
        s: &mut [f32],
    ) {
        let qc = quantize_queries(t.q, D);
        let (rows, k, sp) = (t.rows.as_ptr(), codes.as_ptr(), s.as_mut_ptr());
        for (r, nr, pb, pe, first) in visits(t.ctx, VNNI_ROWS, cmax) {
            let pf = if first { cmax } else { 0 };
            let rq = RowsQ {
                q: qc.q.as_ptr().add(r * D),
                scale: &qc.scale[r..r + nr],
                sum: &qc.sum[r..r + nr],
            };
            let sr = sp.add(r * cmax);
            match nr {
                4 => qk_vnni::<D, 4>(&rq, rows, k, sr, cmax, pb, pe, pf),
                3 => qk_vnni::<D, 3>(&rq, rows, k, sr, cmax, pb, pe, pf),
                2 => qk_vnni::<D, 2>(&rq, rows, k, sr, cmax, pb, pe, pf),
                _ => qk_vnni::<D, 1>(&rq, rows, k, sr, cmax, pb, pe, pf),
            }
        }
    }

    /// `NR` quantized query rows (`D` apart) with their scales and code sums.
    struct RowsQ<'a> {
        q: *const i8,
        scale: &'a [f32],
        sum: &'a [i32],
    }

    /// The four sums of `a[0..4]` in one vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum4_epi32(a: [__m256i; 4]) -> __m128i {
        let t0 = _mm256_hadd_epi32(a[0], a[1]);
        let t1 = _mm256_hadd_epi32(a[2], a[3]);
        let t2 = _mm256_hadd_epi32(t0, t1);
        _mm_add_epi32(_mm256_castsi256_si128(t2), _mm256_extracti128_si256(t2, 1))
    }

    /// `qk` over Q8 codes with quantized query rows: score = row scale x (codes . query codes -
    /// 128 x query code sum), for positions `pb..pe`; prefetches keys ahead while below `pf`.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn qk_vnni<const D: usize, const NR: usize>(
        rq: &RowsQ,
        rows: *const usize,
        k: *const u8,
        s: *mut f32,
        stride: usize,
        pb: usize,
        pe: usize,
        pf: usize,
    ) {
        let q = rq.q;
        let finish = |r: usize, sums: __m128i| -> __m128 {
            let sums = _mm_sub_epi32(sums, _mm_set1_epi32(128 * rq.sum[r]));
            _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(rq.scale[r]))
        };
        let mut p = pb;
        while p + 4 <= pe {
            let kr = key_rows::<u8, D>(k, rows, p, pf);
            let mut acc = [[_mm256_setzero_si256(); 4]; NR];
            let mut c = 0;
            while c < D {
                let kv = [
                    _mm256_loadu_si256(kr[0].add(c) as *const __m256i),
                    _mm256_loadu_si256(kr[1].add(c) as *const __m256i),
                    _mm256_loadu_si256(kr[2].add(c) as *const __m256i),
                    _mm256_loadu_si256(kr[3].add(c) as *const __m256i),
                ];
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_loadu_si256(q.add(r * D + c) as *const __m256i);
                    for j in 0..4 {
                        a[j] = _mm256_dpbusd_epi32(a[j], kv[j], qv);
                    }
                }
                c += 32;
            }
            for (r, a) in acc.iter().enumerate() {
                _mm_storeu_ps(s.add(r * stride + p), finish(r, hsum4_epi32(*a)));
            }
            p += 4;
        }
        while p < pe {
            let kr = k.add(*rows.add(p));
            let mut acc = [_mm256_setzero_si256(); NR];
            let mut c = 0;
            while c < D {
                let kv = _mm256_loadu_si256(kr.add(c) as *const __m256i);
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_loadu_si256(q.add(r * D + c) as *const __m256i);
                    *a = _mm256_dpbusd_epi32(*a, kv, qv);
                }
                c += 32;
            }
            for (r, a) in acc.iter().enumerate() {
                let z = _mm256_setzero_si256();
                *s.add(r * stride + p) = _mm_cvtss_f32(finish(r, hsum4_epi32([*a, z, z, z])));
            }
            p += 1;
        }
    }

    /// Rows a micro-kernel takes at once: 2 rows x 4 accumulators + 4 loaded vectors + the query or
    /// weight vectors fit the 16 ymm registers (3 rows spilled an accumulator to the stack every
    /// position, and the store-to-load round trip made the loop ~2x slower).
    const ROWS: usize = 2;

    /// # Safety
    /// AVX2, FMA and F16C; `t` checked by `attend` (`cmax` its largest context); `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<T: KvElem, const D: usize>(
        t: &Tile<T>,
        cmax: usize,
        out: &mut [f32],
        vnni: Option<Avx512Vnni>,
    ) -> Vec<(f32, f32)> {
        let n = t.ctx.len();
        let visits = visits(t.ctx, ROWS, cmax);
        let mut s = vec![0f32; n * cmax];
        let (q, rows, k, v) = (t.q.as_ptr(), t.rows.as_ptr(), t.k.as_ptr(), t.v.as_ptr());
        let sp = s.as_mut_ptr();
        match (vnni, T::codes(t.k)) {
            (Some(_vnni), Some(codes)) => {
                // SAFETY: the token proves AVX-512 F/VL/VNNI; offsets as for `qk`.
                scores_vnni::<T, D>(t, codes, cmax, &mut s);
            }
            _ => {
                for &(r, nr, pb, pe, first) in &visits {
                    let pf = if first { cmax } else { 0 };
                    let (qr, sr) = (q.add(r * D), sp.add(r * cmax));
                    match nr {
                        2 => qk::<T, D, 2>(qr, rows, k, sr, cmax, pb, pe, pf),
                        _ => qk::<T, D, 1>(qr, rows, k, sr, cmax, pb, pe, pf),
                    }
                }
            }
        }
        let scales = t.position_scales::<D>(cmax);
        if let Some((ks, _)) = &scales {
            scale_rows(&mut s, cmax, t.ctx, ks);
        }
        let mut stats = Vec::with_capacity(n);
        for (r, &c) in t.ctx.iter().enumerate() {
            let row = &mut s[r * cmax..(r + 1) * cmax];
            stats.push(softmax_avx2(&mut row[..c]));
            row[c..].fill(0.0);
        }
        if let Some((_, vs)) = &scales {
            scale_rows(&mut s, cmax, t.ctx, vs);
        }
        out.fill(0.0);
        let (sp, op) = (s.as_ptr(), out.as_mut_ptr());
        for &(r, nr, pb, pe, first) in &visits {
            for col in (0..D).step_by(32) {
                let pf = if first && col == 0 { cmax } else { 0 };
                let (wr, or, vc) = (sp.add(r * cmax), op.add(r * D + col), v.add(col));
                match nr {
                    2 => pv::<T, D, 2>(wr, cmax, rows, vc, or, pb, pe, pf),
                    _ => pv::<T, D, 1>(wr, cmax, rows, vc, or, pb, pe, pf),
                }
            }
        }
        stats
    }

    /// What a pass over a tile visits, block by block: (first row, rows, positions pb..pe,
    /// whether this group is the first to reach the block and so prefetches ahead for everyone),
    /// for row groups of up to `per_group` rows, each up to the furthest position its rows see.
    fn visits(
        ctx: &[usize],
        per_group: usize,
        cmax: usize,
    ) -> Vec<(usize, usize, usize, usize, bool)> {
        let n = ctx.len();
        let groups: Vec<(usize, usize, usize)> = (0..n)
            .step_by(per_group)
            .map(|r| {
                let nr = per_group.min(n - r);
                (r, nr, ctx[r..r + nr].iter().copied().max().unwrap_or(0))
            })
            .collect();
        // One group (a decode step's GQA heads): no reuse to block for, one pass.
        let block = if groups.len() == 1 { cmax } else { POS_BLOCK };
        let mut visits = Vec::new();
        for pb in (0..cmax).step_by(block) {
            let reaching = groups.iter().filter(|g| g.2 > pb);
            for (i, &(r, nr, c)) in reaching.enumerate() {
                visits.push((r, nr, pb, (pb + block).min(c), i == 0));
            }
        }
        visits
    }

    /// The key rows of positions `p..p + 4`; prefetches those `PREFETCH_AHEAD` further on while
    /// they are below `pf`.
    #[inline(always)]
    unsafe fn key_rows<T, const D: usize>(
        k: *const T,
        rows: *const usize,
        p: usize,
        pf: usize,
    ) -> [*const T; 4] {
        if p + PREFETCH_AHEAD + 4 <= pf {
            for j in 0..4 {
                prefetch::<T, D>(k.add(*rows.add(p + PREFETCH_AHEAD + j)));
            }
        }
        [
            k.add(*rows.add(p)),
            k.add(*rows.add(p + 1)),
            k.add(*rows.add(p + 2)),
            k.add(*rows.add(p + 3)),
        ]
    }

    /// Asks for the `D` values at `p` (a hint: never faults, no effect on results).
    #[inline(always)]
    unsafe fn prefetch<T, const D: usize>(p: *const T) {
        prefetch_bytes(p, D * std::mem::size_of::<T>());
    }

    /// The four sums of `a[0..4]` in one vector.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum4(a: [__m256; 4]) -> __m128 {
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1))
    }

    /// Scores of `NR` query rows (`q`, `D` apart) for positions `pb..pe` into `s[r * stride + p]`;
    /// prefetches keys `PREFETCH_AHEAD` positions ahead while they are below `pf`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn qk<T: KvElem, const D: usize, const NR: usize>(
        q: *const f32,
        rows: *const usize,
        k: *const T,
        s: *mut f32,
        stride: usize,
        pb: usize,
        pe: usize,
        pf: usize,
    ) {
        let mut p = pb;
        while p + 4 <= pe {
            let kr = key_rows::<T, D>(k, rows, p, pf);
            let mut acc = [[_mm256_setzero_ps(); 4]; NR];
            let mut c = 0;
            while c < D {
                let kv = [
                    T::load8(kr[0].add(c)),
                    T::load8(kr[1].add(c)),
                    T::load8(kr[2].add(c)),
                    T::load8(kr[3].add(c)),
                ];
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_loadu_ps(q.add(r * D + c));
                    for j in 0..4 {
                        a[j] = _mm256_fmadd_ps(qv, kv[j], a[j]);
                    }
                }
                c += 8;
            }
            for (r, a) in acc.iter().enumerate() {
                _mm_storeu_ps(s.add(r * stride + p), hsum4(*a));
            }
            p += 4;
        }
        while p < pe {
            let kr = k.add(*rows.add(p));
            let mut acc = [_mm256_setzero_ps(); NR];
            let mut c = 0;
            while c < D {
                let kv = T::load8(kr.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(r * D + c)), kv, *a);
                }
                c += 8;
            }
            for (r, a) in acc.iter().enumerate() {
                let h = hsum4([
                    *a,
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                ]);
                *s.add(r * stride + p) = _mm_cvtss_f32(h);
            }
            p += 1;
        }
    }

    /// `out[r][0..32] += sum_p w[r * stride + p] * v(p)[0..32]` for `NR` rows (`out` rows `D`
    /// apart), positions `pb..pe`; prefetches values ahead while they are below `pf`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv<T: KvElem, const D: usize, const NR: usize>(
        w: *const f32,
        stride: usize,
        rows: *const usize,
        v: *const T,
        out: *mut f32,
        pb: usize,
        pe: usize,
        pf: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 4]; NR];
        for (r, a) in acc.iter_mut().enumerate() {
            for (i, x) in a.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(out.add(r * D + 8 * i));
            }
        }
        for p in pb..pe {
            if p + PREFETCH_AHEAD < pf {
                prefetch::<T, D>(v.add(*rows.add(p + PREFETCH_AHEAD)));
            }
            let vr = v.add(*rows.add(p));
            let vv = [
                T::load8(vr),
                T::load8(vr.add(8)),
                T::load8(vr.add(16)),
                T::load8(vr.add(24)),
            ];
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_broadcast_ss(&*w.add(r * stride + p));
                for i in 0..4 {
                    a[i] = _mm256_fmadd_ps(wv, vv[i], a[i]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, x) in a.iter().enumerate() {
                _mm256_storeu_ps(out.add(r * D + 8 * i), *x);
            }
        }
    }

    /// Query rows a pass of `heads` takes at once: 3 rows x 4 positions of accumulators beside
    /// one key vector fit the 16 ymm registers (each FMA reads its query from memory), so a GQA
    /// group of 3 converts each key once.
    const HEAD_ROWS: usize = 3;

    /// Value columns a pass of `heads` takes: 3 rows x 4 vectors of accumulators, three
    /// broadcast weights and the value vector they share fill the 16 ymm registers.
    const HEAD_COLS: usize = 32;

    /// `attend_heads` for one decode row over all its KV heads, which lie side by side in a cache
    /// row (`heads_passes`): one task reads a position's row once instead of a KV head's bytes
    /// at the stride of the row per task.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `t` checked by `attend_heads`; `D == t.d`, a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn heads<T: KvElem, const D: usize>(
        t: &Heads<T>,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        // SAFETY (both closures): the passes lie inside `t`'s shapes, checked by `attend_heads`.
        let qk = |nr: usize, p: Pass<T>| match nr {
            3 => qk_heads::<T, D, 3>(p),
            2 => qk_heads::<T, D, 2>(p),
            _ => qk_heads::<T, D, 1>(p),
        };
        let pv = |nr: usize, p: Pass<T>| match nr {
            3 => pv_heads::<T, D, 3>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
            2 => pv_heads::<T, D, 2>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
            _ => pv_heads::<T, D, 1>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
        };
        heads_passes::<T, D>(t, out, HEAD_ROWS, HEAD_COLS, qk, pv)
    }

    /// Scores of `NR` query rows (`q`, `D` apart) for positions `0..n` into `s[r * n + p]`, keys
    /// at `kh + rows[p]` (`Pass`'s fields), each key vector loaded once for the `NR` rows;
    /// prefetching ahead as `Pass::ask_ahead` says.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn qk_heads<T: KvElem, const D: usize, const NR: usize>(pass: Pass<T>) {
        let (q, rows, kh, s, n) = (pass.rows_in, pass.rows, pass.kv, pass.out, pass.n);
        let mut p = 0;
        while p + 4 <= n {
            pass.ask_ahead(p);
            let kr = [
                kh.add(*rows.add(p)),
                kh.add(*rows.add(p + 1)),
                kh.add(*rows.add(p + 2)),
                kh.add(*rows.add(p + 3)),
            ];
            let mut acc = [[_mm256_setzero_ps(); 4]; NR];
            let mut c = 0;
            while c < D {
                for (j, kp) in kr.iter().enumerate() {
                    let kv = T::load8(kp.add(c));
                    for (r, a) in acc.iter_mut().enumerate() {
                        a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(r * D + c)), kv, a[j]);
                    }
                }
                c += 8;
            }
            for (r, a) in acc.iter().enumerate() {
                _mm_storeu_ps(s.add(r * n + p), hsum4(*a));
            }
            p += 4;
        }
        while p < n {
            let kr = kh.add(*rows.add(p));
            let mut acc = [_mm256_setzero_ps(); NR];
            let mut c = 0;
            while c < D {
                let kv = T::load8(kr.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(r * D + c)), kv, *a);
                }
                c += 8;
            }
            for (r, a) in acc.iter().enumerate() {
                let z = _mm256_setzero_ps();
                *s.add(r * n + p) = _mm_cvtss_f32(hsum4([*a, z, z, z]));
            }
            p += 1;
        }
    }

    /// `out[r][0..HEAD_COLS] = sum_p w[r * n + p] * v(p)[0..HEAD_COLS]` for `NR` rows (`out` rows
    /// `D` apart), values at `vh + rows[p]`; with `pf` > 0, asks for `pf` bytes of each row ahead
    /// from `v0 + rows[p]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pv_heads<T: KvElem, const D: usize, const NR: usize>(
        w: *const f32,
        n: usize,
        rows: *const usize,
        vh: *const T,
        v0: *const T,
        out: *mut f32,
        pf: usize,
    ) {
        const CV: usize = HEAD_COLS / 8;
        let mut acc = [[_mm256_setzero_ps(); CV]; NR];
        for p in 0..n {
            if pf > 0 && p + PREFETCH_AHEAD < n {
                prefetch_bytes(v0.add(*rows.add(p + PREFETCH_AHEAD)), pf);
            }
            let vr = vh.add(*rows.add(p));
            let mut wv = [_mm256_setzero_ps(); NR];
            for (r, x) in wv.iter_mut().enumerate() {
                *x = _mm256_broadcast_ss(&*w.add(r * n + p));
            }
            for i in 0..CV {
                let vv = T::load8(vr.add(8 * i));
                for (r, a) in acc.iter_mut().enumerate() {
                    a[i] = _mm256_fmadd_ps(wv[r], vv, a[i]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, x) in a.iter().enumerate() {
                _mm256_storeu_ps(out.add(r * D + 8 * i), *x);
            }
        }
    }
}

/// The decode kernel on 512-bit vectors: one task reads a position's keys (then values) for all
/// the KV heads of its row, which lie side by side in the cache row, instead of one KV head's
/// 128 bytes at the stride of the whole row per task; the first head's pass prefetches the whole
/// rows, so the other heads find them in cache. Scores take up to 4 query rows against 4 keys
/// (16 accumulators of 16 lanes; each key converted to F32 once for the 4 rows, where the 256-bit
/// kernel's 2-row groups convert it twice for a group of 3), reduced 4 positions at a time by
/// 128-bit lane shuffles; values take up to 4 rows over 64 columns (16 accumulators).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use super::{heads_passes, prefetch_bytes, Heads, KvElem, Pass, PREFETCH_AHEAD};
    use crate::model::kernels::cpu::{wide_pays, Avx512Vnni};

    /// Query rows a pass takes at once (4 x 4 accumulators beside 4 keys fit 32 registers).
    const ROWS: usize = 4;

    /// Whether `heads` runs faster than the 256-bit `avx2::heads` here: `cpu::wide_pays` with
    /// `LLAMA_RELAY_ATTN_WIDTH`, timed once (a few milliseconds) over the same cache-resident
    /// decode row, 3 KV heads of 3 query rows, 512 positions (the token proves AVX-512).
    pub(super) fn pays(_vnni: Avx512Vnni) -> bool {
        static PAYS: OnceLock<bool> = OnceLock::new();
        *PAYS.get_or_init(|| {
            let (n_heads, group, d, n) = (3, 3, 64, 512);
            let width = n_heads * d;
            let values = |salt: usize| -> Vec<half::f16> {
                (0..n * width)
                    .map(|i| half::f16::from_f32(((i * 37 + salt) % 101) as f32 / 50.0 - 1.0))
                    .collect()
            };
            let (k, v) = (values(1), values(7));
            let q: Vec<f32> = (0..n_heads * group * d)
                .map(|i| (i % 13) as f32 / 40.0 - 0.15)
                .collect();
            // Positions in a shuffled order, as blocks lie in the cache.
            let rows: Vec<usize> = (0..n).map(|p| (p * 173 % n) * width).collect();
            let t = Heads {
                q: &q,
                group,
                heads: n_heads,
                from: 0,
                ctx: n,
                rows: &rows,
                k: &k,
                v: &v,
                d,
                scales: None,
            };
            let (mut o1, mut o2) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            wide_pays(
                "decode attention (a row over all heads)",
                "LLAMA_RELAY_ATTN_WIDTH",
                10,
                || {
                    // SAFETY: the token proves AVX2, FMA and F16C; the row offsets lie in the cache.
                    unsafe { super::avx2::heads::<half::f16, 64>(&t, &mut o1) };
                    std::hint::black_box(&o1);
                },
                || {
                    // SAFETY: the token proves AVX-512; the row offsets lie in the cache.
                    unsafe { heads::<half::f16, 64>(&t, &mut o2) };
                    std::hint::black_box(&o2);
                },
            )
        })
    }

    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F/BW/VL; `t` checked by `attend_heads`; `D == t.d`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn heads<T: KvElem, const D: usize>(
        t: &Heads<T>,
        out: &mut [f32],
    ) -> Vec<(f32, f32)> {
        // SAFETY (both closures): the passes lie inside `t`'s shapes, checked by `attend_heads`.
        let qk = |nr: usize, p: Pass<T>| match nr {
            4 => qk::<T, D, 4>(p),
            3 => qk::<T, D, 3>(p),
            2 => qk::<T, D, 2>(p),
            _ => qk::<T, D, 1>(p),
        };
        let pv = |nr: usize, p: Pass<T>| match nr {
            4 => pv::<T, D, 4>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
            3 => pv::<T, D, 3>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
            2 => pv::<T, D, 2>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
            _ => pv::<T, D, 1>(p.rows_in, p.n, p.rows, p.kv, p.kv0, p.out, p.pf),
        };
        heads_passes::<T, D>(t, out, ROWS, 64, qk, pv)
    }

    /// The four sums of `a[0..4]` in one vector: 128-bit lanes of pairs added (`shuffle_f32x4`),
    /// then of the pairs' sums, leaving vector `j`'s four partial sums in lane `j`, which two
    /// in-lane swaps add up.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum4(a: [__m512; 4]) -> __m128 {
        // [a0.0 a0.1 a1.0 a1.1] + [a0.2 a0.3 a1.2 a1.3] (128-bit lanes).
        let p01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[0], a[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[0], a[1]),
        );
        let p23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[2], a[3]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[2], a[3]),
        );
        // Lane j: four partial sums of a[j].
        let w = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(p01, p23),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(p01, p23),
        );
        let w = _mm512_add_ps(w, _mm512_permute_ps::<0b10_11_00_01>(w));
        let w = _mm512_add_ps(w, _mm512_permute_ps::<0b01_00_11_10>(w));
        let lane0 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
        _mm512_castps512_ps128(_mm512_permutexvar_ps(lane0, w))
    }

    /// Scores of `NR` query rows (`q`, `D` apart) for positions `0..n` into `s[r * n + p]`, keys
    /// at `kh + rows[p]` (`Pass`'s fields); prefetching ahead as `Pass::ask_ahead` says (from
    /// the row's first head).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn qk<T: KvElem, const D: usize, const NR: usize>(pass: Pass<T>) {
        let (q, rows, kh, s, n) = (pass.rows_in, pass.rows, pass.kv, pass.out, pass.n);
        let mut p = 0;
        while p + 4 <= n {
            pass.ask_ahead(p);
            let kr = [
                kh.add(*rows.add(p)),
                kh.add(*rows.add(p + 1)),
                kh.add(*rows.add(p + 2)),
                kh.add(*rows.add(p + 3)),
            ];
            let mut acc = [[_mm512_setzero_ps(); 4]; NR];
            let mut c = 0;
            while c < D {
                let kv = [
                    T::load16(kr[0].add(c)),
                    T::load16(kr[1].add(c)),
                    T::load16(kr[2].add(c)),
                    T::load16(kr[3].add(c)),
                ];
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm512_loadu_ps(q.add(r * D + c));
                    for j in 0..4 {
                        a[j] = _mm512_fmadd_ps(qv, kv[j], a[j]);
                    }
                }
                c += 16;
            }
            for (r, a) in acc.iter().enumerate() {
                _mm_storeu_ps(s.add(r * n + p), hsum4(*a));
            }
            p += 4;
        }
        while p < n {
            let kr = kh.add(*rows.add(p));
            let mut acc = [_mm512_setzero_ps(); NR];
            let mut c = 0;
            while c < D {
                let kv = T::load16(kr.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(r * D + c)), kv, *a);
                }
                c += 16;
            }
            for (r, a) in acc.iter().enumerate() {
                *s.add(r * n + p) = _mm512_reduce_add_ps(*a);
            }
            p += 1;
        }
    }

    /// `out[r][0..64] = sum_p w[r * n + p] * v(p)[0..64]` for `NR` rows (`out` rows `D` apart),
    /// values at `vh + rows[p]`; with `pf` > 0, asks for `pf` bytes of each row ahead from
    /// `v0 + rows[p]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn pv<T: KvElem, const D: usize, const NR: usize>(
        w: *const f32,
        n: usize,
        rows: *const usize,
        vh: *const T,
        v0: *const T,
        out: *mut f32,
        pf: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; NR];
        for p in 0..n {
            if pf > 0 && p + PREFETCH_AHEAD < n {
                prefetch_bytes(v0.add(*rows.add(p + PREFETCH_AHEAD)), pf);
            }
            let vr = vh.add(*rows.add(p));
            let vv = [
                T::load16(vr),
                T::load16(vr.add(16)),
                T::load16(vr.add(32)),
                T::load16(vr.add(48)),
            ];
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*w.add(r * n + p));
                for i in 0..4 {
                    a[i] = _mm512_fmadd_ps(wv, vv[i], a[i]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, x) in a.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * D + 16 * i), *x);
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::kernels::test_data::{lcg, lcg_states};
    use proptest::prelude::*;

    #[test]
    fn softmax_matches_libm_exp() {
        // Scores spread over the range softmax sees, with a row length that leaves a scalar tail.
        let row: Vec<f32> = (0..1003)
            .map(|i| ((i * 37 % 1000) as f32 - 900.0) * 0.11)
            .collect();
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = row.iter().map(|&x| ((x - m) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        for isa in Isa::available() {
            let mut got = row.clone();
            softmax(isa, &mut got);
            for (g, w) in got.iter().zip(&e) {
                let w = w / sum;
                assert!(
                    (*g as f64 - w).abs() <= 1e-6 * w + 1e-30,
                    "{isa:?}: {g} vs {w}"
                );
            }
        }
    }

    /// A tile over a shuffled cache of `slots` rows `width` wide, this head's values at `off`.
    pub(crate) struct Case {
        pub(crate) q: Vec<f32>,
        pub(crate) ctx: Vec<usize>,
        pub(crate) rows: Vec<usize>,
        pub(crate) k: Vec<f32>,
        pub(crate) v: Vec<f32>,
        pub(crate) d: usize,
    }

    pub(crate) fn case(seed: u64, d: usize, n_rows: usize, ctx0: usize, per_token: usize) -> Case {
        let heads = 3;
        let width = heads * d;
        let positions = ctx0 + n_rows.div_ceil(per_token);
        let slots = positions + 7;
        let order = lcg_states(seed ^ 0x77, slots);
        let mut perm: Vec<usize> = (0..slots).collect();
        perm.sort_by_key(|&i| order[i]);
        let off = d; // the middle head of three
        Case {
            q: lcg(seed, n_rows * d).iter().map(|x| x * 0.6).collect(),
            // Rows come `per_token` to a token, tokens one position apart (a chunk's causal rows).
            ctx: (0..n_rows).map(|r| ctx0 + r / per_token + 1).collect(),
            rows: perm[..positions].iter().map(|&s| s * width + off).collect(),
            k: lcg(seed ^ 1, slots * width),
            v: lcg(seed ^ 2, slots * width),
            d,
        }
    }

    /// The case's cache as Q8 codes and scales (`kv_cache::q8`), and what they stand for.
    pub(crate) struct Q8Case {
        pub(crate) k: (Vec<u8>, Vec<half::f16>),
        pub(crate) v: (Vec<u8>, Vec<half::f16>),
        k_values: Vec<f32>,
        v_values: Vec<f32>,
    }

    pub(crate) fn q8(c: &Case) -> Q8Case {
        use crate::kv_cache::q8::{dequantize_rows, quantize_rows};
        let (k, v) = (quantize_rows(&c.k, c.d), quantize_rows(&c.v, c.d));
        Q8Case {
            k_values: dequantize_rows(&k.0, &k.1, c.d),
            v_values: dequantize_rows(&v.0, &v.1, c.d),
            k,
            v,
        }
    }

    fn check<T: KvElem>(
        c: &Case,
        k: &[T],
        v: &[T],
        scales: Option<(&[half::f16], &[half::f16])>,
    ) -> std::result::Result<(), TestCaseError> {
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
        let mut plain = vec![0f32; c.q.len()];
        tile_scalar(&t, &mut plain);
        let q8q = queries_as_quantized(&c.q, c.d);
        let mut of_codes = vec![0f32; c.q.len()];
        tile_scalar(&Tile { q: &q8q, ..t }, &mut of_codes);
        for isa in Isa::simd_levels_for_test("tiled_equals_reference") {
            let want = if quantizes_queries(isa, &t) {
                &of_codes
            } else {
                &plain
            };
            let mut got = vec![0f32; c.q.len()];
            attend(isa, &t, &mut got);
            for (a, b) in got.iter().zip(want) {
                prop_assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{isa:?}: {a} vs {b}"
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The tiled kernel equals the reference: row counts that leave partial groups, contexts that
        /// leave partial position quads and blocks, one to three rows per token, F32, F16 and Q8
        /// caches, both head sizes the SIMD path takes (64, 128; other sizes run the reference
        /// itself).
        #[test]
        fn tiled_equals_reference(
            seed in any::<u64>(),
            d in prop::sample::select(vec![64usize, 128]),
            n_rows in 1usize..26,
            ctx0 in 0usize..70,
            per_token in 1usize..4,
        ) {
            let c = case(seed, d, n_rows, ctx0, per_token);
            check::<f32>(&c, &c.k, &c.v, None)?;
            let k16: Vec<half::f16> = c.k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v16: Vec<half::f16> = c.v.iter().map(|&x| half::f16::from_f32(x)).collect();
            check(&c, &k16, &v16, None)?;
            let q = q8(&c);
            check(&c, &q.k.0, &q.v.0, Some((&q.k.1, &q.v.1)))?;
        }
    }

    /// A decode row over `heads` KV heads of `group` rows each, over positions `from..from + len`
    /// of a shuffled cache whose rows hold 4 KV heads, the row's first at head `h0`.
    struct HeadsCase {
        q: Vec<f32>,
        rows: Vec<usize>,
        k: Vec<f32>,
        v: Vec<f32>,
        group: usize,
        heads: usize,
        from: usize,
        ctx: usize,
        d: usize,
    }

    #[allow(clippy::too_many_arguments)]
    fn heads_case(
        seed: u64,
        d: usize,
        group: usize,
        heads: usize,
        h0: usize,
        from: usize,
        len: usize,
    ) -> HeadsCase {
        let width = 4 * d;
        let ctx = from + len;
        let slots = ctx + 5;
        let order = lcg_states(seed ^ 0x55, slots);
        let mut perm: Vec<usize> = (0..slots).collect();
        perm.sort_by_key(|&i| order[i]);
        HeadsCase {
            q: lcg(seed, heads * group * d)
                .iter()
                .map(|x| x * 0.6)
                .collect(),
            rows: perm[..ctx].iter().map(|&s| s * width + h0 * d).collect(),
            k: lcg(seed ^ 1, slots * width),
            v: lcg(seed ^ 2, slots * width),
            group,
            heads,
            from,
            ctx,
            d,
        }
    }

    /// Every level's `attend_heads`, and the 256-bit and 512-bit kernels themselves where the CPU
    /// has them (whichever was measured faster here), against `tile_scalar` head by head.
    fn check_heads<T: KvElem>(
        c: &HeadsCase,
        k: &[T],
        v: &[T],
    ) -> std::result::Result<(), TestCaseError> {
        let (g, d) = (c.group, c.d);
        let ctx = vec![c.ctx; g];
        let mut want = vec![0f32; c.q.len()];
        let mut want_st = Vec::new();
        for h in 0..c.heads {
            let t = Tile {
                q: &c.q[h * g * d..(h + 1) * g * d],
                from: c.from,
                ctx: &ctx,
                rows: &c.rows,
                k: &k[h * d..],
                v: &v[h * d..],
                d,
                scales: None,
            };
            want_st.extend(tile_scalar(&t, &mut want[h * g * d..(h + 1) * g * d]));
        }
        let t = Heads {
            q: &c.q,
            group: g,
            heads: c.heads,
            from: c.from,
            ctx: c.ctx,
            rows: &c.rows,
            k,
            v,
            d,
            scales: None,
        };
        let mut runs = Vec::new();
        for isa in Isa::simd_levels_for_test("heads_equal_the_reference") {
            let mut got = vec![0f32; c.q.len()];
            let st = attend_heads(isa, &t, &mut got);
            runs.push((format!("{isa:?}"), got, st));
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::best().avx2().is_some() {
            let mut got = vec![0f32; c.q.len()];
            // SAFETY: the CPU has AVX2, FMA and F16C; the case's offsets lie in its cache.
            let st = unsafe {
                match d {
                    64 => avx2::heads::<T, 64>(&t, &mut got),
                    _ => avx2::heads::<T, 128>(&t, &mut got),
                }
            };
            runs.push(("the 256-bit kernel".into(), got, st));
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::best().avx512_vnni().is_some() {
            let mut got = vec![0f32; c.q.len()];
            // SAFETY: the CPU has AVX-512; the case's offsets lie in its cache.
            let st = unsafe {
                match d {
                    64 => avx512::heads::<T, 64>(&t, &mut got),
                    _ => avx512::heads::<T, 128>(&t, &mut got),
                }
            };
            runs.push(("the 512-bit kernel".into(), got, st));
        }
        for (name, got, st) in runs {
            for (a, b) in got.iter().zip(&want) {
                prop_assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{}: {} vs {}",
                    name,
                    a,
                    b
                );
            }
            prop_assert_eq!(st.len(), want_st.len());
            for (a, b) in st.iter().zip(&want_st) {
                prop_assert!(
                    (a.0 - b.0).abs() <= 1e-4 && (a.1 - b.1).abs() <= 1e-4 * b.1,
                    "{}: stats {:?} vs {:?}",
                    name,
                    a,
                    b
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// The decode kernel over all of a row's KV heads equals the reference: GQA groups of 1 to
        /// 9 rows (whole and partial groups of 4), 1 to 3 heads from any head of the cache row,
        /// contexts that leave partial position quads, parts that start past position 0, F32 and
        /// F16 caches, both head sizes it takes.
        #[test]
        fn heads_equal_the_reference(
            seed in any::<u64>(),
            d in prop::sample::select(vec![64usize, 128]),
            group in 1usize..10,
            heads in 1usize..4,
            h0 in 0usize..2,
            from in 0usize..40,
            len in 1usize..90,
        ) {
            let c = heads_case(seed, d, group, heads, h0, from, len);
            check_heads::<f32>(&c, &c.k, &c.v)?;
            let k16: Vec<half::f16> = c.k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v16: Vec<half::f16> = c.v.iter().map(|&x| half::f16::from_f32(x)).collect();
            check_heads(&c, &k16, &v16)?;
        }
    }

    #[test]
    #[should_panic(expected = "row offsets inside the cache")]
    fn heads_past_the_cache_row_are_refused() {
        // Two heads from the cache row's fourth: the second lies past the last row's end.
        let c = heads_case(9, 64, 3, 2, 3, 0, 20);
        let t = Heads {
            q: &c.q,
            group: 3,
            heads: 2,
            from: 0,
            ctx: c.ctx,
            rows: &c.rows,
            k: &c.k[..c.rows.iter().max().unwrap() + 64],
            v: &c.v,
            d: 64,
            scales: None,
        };
        attend_heads(Isa::best(), &t, &mut vec![0f32; c.q.len()]);
    }

    /// Attention over a Q8 cache is attention over the values its codes stand for: the scales
    /// are applied to the right positions (of the right head) in every kernel, and with the
    /// positions cut into parts.
    #[test]
    fn q8_attention_is_attention_over_its_values() {
        for (d, n_rows, ctx0, per_token) in [(64, 3, 300, 3), (128, 17, 40, 2), (40, 2, 90, 1)] {
            let c = case(5, d, n_rows, ctx0, per_token);
            let q = q8(&c);
            for from in [0, 13] {
                let run = |isa, k: &[u8], v: &[u8]| {
                    let mut o = vec![0f32; c.q.len()];
                    let t = Tile {
                        q: &c.q,
                        from,
                        ctx: &c.ctx,
                        rows: &c.rows,
                        k,
                        v,
                        d,
                        scales: Some((&q.k.1, &q.v.1)),
                    };
                    let st = attend(isa, &t, &mut o);
                    (o, st)
                };
                let mut want = vec![0f32; c.q.len()];
                let t = Tile {
                    q: &c.q,
                    from,
                    ctx: &c.ctx,
                    rows: &c.rows,
                    k: &q.k_values[..],
                    v: &q.v_values[..],
                    d,
                    scales: None,
                };
                let want_st = tile_scalar(&t, &mut want);
                let q8q = queries_as_quantized(&c.q, d);
                let mut of_codes = vec![0f32; c.q.len()];
                let codes_st = tile_scalar(&Tile { q: &q8q, ..t }, &mut of_codes);
                for isa in Isa::available() {
                    let (got, st) = run(isa, &q.k.0, &q.v.0);
                    let quantized = isa.avx512_vnni().is_some() && matches!(d, 64 | 128);
                    let (want, want_st) = if quantized {
                        (&of_codes, &codes_st)
                    } else {
                        (&want, &want_st)
                    };
                    for (a, b) in got.iter().zip(want) {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "{isa:?} d {d}: {a} vs {b}"
                        );
                    }
                    for (a, b) in st.iter().zip(want_st) {
                        assert!((a.0 - b.0).abs() <= 1e-4 && (a.1 - b.1).abs() <= 1e-4 * b.1);
                    }
                }
                // Quantized queries move each output by little: the 8-bit scores' rounding.
                let apart = of_codes
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                eprintln!("d {d} from {from}: quantized queries move outputs by {apart}");
                assert!(
                    apart <= 2e-2,
                    "d {d}: quantized queries moved an output by {apart}"
                );
            }
        }
    }

    /// A decode row's positions cut into parts, each attended alone and merged, equal the whole
    /// (the flash-decoding split `fast_cpu` uses when a step has too few tasks for its threads).
    #[test]
    fn parts_merge_into_the_whole() {
        for (d, ctx0) in [(64, 299), (128, 130), (40, 77)] {
            let c = case(11, d, 3, ctx0, 3);
            let full = |from: usize, ctx: &[usize], out: &mut [f32]| {
                let t = Tile {
                    q: &c.q,
                    from,
                    ctx,
                    rows: &c.rows,
                    k: &c.k,
                    v: &c.v,
                    d,
                    scales: None,
                };
                attend(Isa::best(), &t, out)
            };
            let mut want = vec![0f32; c.q.len()];
            full(0, &c.ctx, &mut want);
            let n = c.ctx[0];
            let cuts = [0, n / 3, n / 2 + 5, n];
            let outs: Vec<_> = cuts
                .windows(2)
                .map(|w| {
                    let ctx = vec![w[1]; 3];
                    let mut o = vec![0f32; c.q.len()];
                    let st = full(w[0], &ctx, &mut o);
                    (o, st)
                })
                .collect();
            for r in 0..3 {
                let parts: Vec<(&[f32], (f32, f32))> = outs
                    .iter()
                    .map(|(o, st)| (&o[r * d..(r + 1) * d], st[r]))
                    .collect();
                let mut got = vec![0f32; d];
                merge_parts(&parts, &mut got);
                for (a, b) in got.iter().zip(&want[r * d..(r + 1) * d]) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d {d}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "row offsets inside the cache")]
    fn offsets_outside_the_cache_are_refused() {
        let c = case(3, 64, 3, 5, 3);
        let t = Tile {
            q: &c.q,
            from: 0,
            ctx: &c.ctx,
            rows: &c.rows,
            k: &c.k[..c.k.len() / 4],
            v: &c.v,
            d: 64,
            scales: None,
        };
        attend(Isa::best(), &t, &mut vec![0f32; c.q.len()]);
    }
}
