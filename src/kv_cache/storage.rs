//! The KV cache tensors: one K and one V tensor of shape `[layers, num_blocks * block_size,
//! num_kv_heads * head_dim]`, F32, F16 or Q8 codes (`engine.kv_dtype`; Q8 adds a scale tensor
//! `[layers, slots, num_kv_heads]` for each, `kv_cache::q8`); each layer works on its views. Rows
//! are slots; a block is `block_size` consecutive rows. One allocation each (not one per layer) so
//! that the allocator maps fresh zero pages instead of clearing heap memory: a 1 GiB cache then
//! costs nothing at start-up and pages are touched only as sequences fill them.
//!
//! Writes go through candle's in-place `scatter_set`, so they work on every device; the CPU fast
//! attention path reads the same tensors as plain slices.
//!
//! Every write stamps the blocks it touched, per layer (`Written`): what is derived from a
//! block's rows and kept across steps (the tile packs of a long prompt, `model::tile_packs`)
//! knows from the stamps whether the rows are still the ones it was made from. Stamps come from
//! one counter for the whole process, so no two writes anywhere, in any cache, share one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};
use crate::kv_cache::q8;

/// What one token's K and V take: `layers` of `kv_dim` values each, `heads` rows of
/// `kv_dim / heads` (the model says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_dim: usize,
    pub heads: usize,
}

/// What the cache stores for each value (`engine.kv_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    /// 8-bit codes with an F16 scale per head row (`kv_cache::q8`).
    Q8,
}

impl KvDtype {
    /// The configuration's names: `f32`, `f16`, `q8_0`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            "q8_0" => Some(KvDtype::Q8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8 => "q8_0",
        }
    }

    /// The candle type of the K and V tensors (the codes, for Q8).
    pub fn storage(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::F16 => DType::F16,
            KvDtype::Q8 => DType::U8,
        }
    }
}

/// One layer's views of the cache: K and V `[slots, kv_dim]`, and for Q8 their scales
/// `[slots, heads]`.
pub struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
    pub scales: Option<(Tensor, Tensor)>,
    /// When each block of this layer was last written (`None`: not tracked, as for views made
    /// outside a `KvCache`).
    pub written: Option<Written>,
}

/// One layer's write stamps, a stamp per block: it changes whenever any row of the block is
/// written, copied into or shifted into.
#[derive(Clone)]
pub struct Written {
    pub layer: usize,
    pub block_size: usize,
    stamps: Arc<[AtomicU64]>,
}

impl Written {
    /// Block `block`'s current stamp.
    pub fn stamp(&self, block: u32) -> u64 {
        self.stamps[block as usize].load(Ordering::Acquire)
    }
}

/// The next unused stamp (of `n` taken together).
fn new_stamps(n: usize) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(n as u64, Ordering::Relaxed)
}

impl LayerKv {
    /// K of rows `slots` (`[n]` u32) as the values they hold, `[n, kv_dim]` F32.
    pub fn keys(&self, slots: &Tensor) -> Result<Tensor> {
        rows_f32(&self.k, self.scales.as_ref().map(|s| &s.0), slots)
    }

    /// V of rows `slots`, as `keys`.
    pub fn values(&self, slots: &Tensor) -> Result<Tensor> {
        rows_f32(&self.v, self.scales.as_ref().map(|s| &s.1), slots)
    }
}

/// Where a step's rows go, in the layout candle's scatter wants: `[tokens, kv_dim]` u32, each row
/// filled with its slot id, and for Q8 the same `[tokens, heads]` for the scales. Made once a step
/// by `KvCache::slot_index`.
pub struct SlotIndex {
    /// Row i's slot (the CPU writes rows straight from it: `WriteRows`).
    slots: Vec<u32>,
    rows: Tensor,
    heads: Option<Tensor>,
    /// The blocks the rows are in.
    blocks: Vec<u32>,
}

/// How big the cache is and how it is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub block_size: usize,
    pub num_blocks: usize,
}

impl KvCacheSpec {
    /// Bytes one token takes across all layers (K and V, with Q8's scales).
    pub fn bytes_per_token(shape: KvShape, dtype: KvDtype) -> usize {
        let row = match dtype {
            KvDtype::Q8 => shape.kv_dim + shape.heads * DType::F16.size_in_bytes(),
            _ => shape.kv_dim * dtype.storage().size_in_bytes(),
        };
        2 * shape.layers * row
    }

    /// The largest whole number of blocks that fits in `bytes`.
    pub fn from_bytes(shape: KvShape, dtype: KvDtype, block_size: usize, bytes: usize) -> Self {
        let per_block = Self::bytes_per_token(shape, dtype) * block_size;
        KvCacheSpec {
            block_size,
            num_blocks: bytes / per_block,
        }
    }

    pub fn from_tokens(block_size: usize, tokens: usize) -> Self {
        KvCacheSpec {
            block_size,
            num_blocks: tokens.div_ceil(block_size),
        }
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// Per-layer K/V tensors.
pub struct KvCache {
    spec: KvCacheSpec,
    shape: KvShape,
    kv_dim: usize,
    layers: usize,
    dtype: KvDtype,
    k: Tensor,
    v: Tensor,
    /// Q8's scales for K and V.
    scales: Option<(Tensor, Tensor)>,
    /// Per layer, each block's write stamp (`Written`).
    stamps: Vec<Arc<[AtomicU64]>>,
}

impl KvCache {
    pub fn new(shape: KvShape, spec: KvCacheSpec, dtype: KvDtype, device: &Device) -> Result<Self> {
        if shape.heads == 0 || !shape.kv_dim.is_multiple_of(shape.heads) {
            return Err(EngineError::KvCache(format!(
                "rows of {} values do not split into {} heads",
                shape.kv_dim, shape.heads
            )));
        }
        if spec.block_size == 0 || spec.num_blocks == 0 {
            return Err(EngineError::KvCache(format!(
                "the cache needs at least one block of at least one token (block_size {}, blocks {})",
                spec.block_size, spec.num_blocks
            )));
        }
        let dims = (shape.layers, spec.num_slots(), shape.kv_dim);
        let k = lazy_zeros(dims, dtype.storage(), device)?;
        let v = lazy_zeros(dims, dtype.storage(), device)?;
        advise_huge_pages(&k);
        advise_huge_pages(&v);
        let scales = match dtype {
            KvDtype::Q8 => {
                let dims = (shape.layers, spec.num_slots(), shape.heads);
                let ks = lazy_zeros(dims, DType::F16, device)?;
                let vs = lazy_zeros(dims, DType::F16, device)?;
                advise_huge_pages(&ks);
                advise_huge_pages(&vs);
                Some((ks, vs))
            }
            _ => None,
        };
        let stamps = (0..shape.layers)
            .map(|_| {
                let first = new_stamps(spec.num_blocks);
                (0..spec.num_blocks as u64)
                    .map(|b| AtomicU64::new(first + b))
                    .collect()
            })
            .collect();
        Ok(KvCache {
            spec,
            shape,
            kv_dim: shape.kv_dim,
            layers: shape.layers,
            dtype,
            k,
            v,
            scales,
            stamps,
        })
    }

    /// Stamps `blocks` of `layers` as written now.
    fn stamp(&self, layers: std::ops::Range<usize>, blocks: &[u32]) {
        for layer in layers {
            let stamps = &self.stamps[layer];
            let first = new_stamps(blocks.len());
            for (i, &b) in blocks.iter().enumerate() {
                if let Some(s) = stamps.get(b as usize) {
                    s.store(first + i as u64, Ordering::Release);
                }
            }
        }
    }

    /// The blocks of `slots`, each once.
    fn blocks_of(&self, slots: &[u32]) -> Vec<u32> {
        let bs = self.spec.block_size as u32;
        let mut blocks: Vec<u32> = slots.iter().map(|s| s / bs).collect();
        blocks.sort_unstable();
        blocks.dedup();
        blocks
    }

    pub fn spec(&self) -> KvCacheSpec {
        self.spec
    }

    pub fn block_size(&self) -> usize {
        self.spec.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.spec.num_blocks
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Total bytes of K and V over all layers (with Q8's scales).
    pub fn bytes(&self) -> usize {
        KvCacheSpec::bytes_per_token(self.shape, self.dtype) * self.spec.num_slots()
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Views of one layer's K and V, `[slots, kv_dim]`, and their scales (no copy).
    pub fn layer(&self, layer: usize) -> Result<LayerKv> {
        Ok(LayerKv {
            k: self.k.get(layer)?,
            v: self.v.get(layer)?,
            scales: match &self.scales {
                Some((ks, vs)) => Some((ks.get(layer)?, vs.get(layer)?)),
                None => None,
            },
            written: Some(Written {
                layer,
                block_size: self.spec.block_size,
                stamps: self.stamps[layer].clone(),
            }),
        })
    }

    /// The scatter index of a step's rows (`slots[i]`: row i's slot), on the cache's device.
    pub fn slot_index(&self, slots: &[u32]) -> Result<SlotIndex> {
        let index = |width: usize| -> Result<Tensor> {
            Ok(
                Tensor::from_slice(slots, (slots.len(), 1), self.k.device())?
                    .broadcast_as((slots.len(), width))?
                    .contiguous()?,
            )
        };
        Ok(SlotIndex {
            slots: slots.to_vec(),
            rows: index(self.kv_dim)?,
            heads: match self.scales {
                Some(_) => Some(index(self.shape.heads)?),
                None => None,
            },
            blocks: self.blocks_of(slots),
        })
    }

    /// Copies the first `slots` slots of block `src` into block `dst`, K and V of every layer.
    pub fn copy_slots(&self, src: u32, dst: u32, slots: usize) -> Result<()> {
        let bs = self.spec.block_size;
        let (from, to) = (src as usize * bs, dst as usize * bs);
        let from: Vec<u32> = (from..from + slots).map(|r| r as u32).collect();
        let to: Vec<u32> = (to..to + slots).map(|r| r as u32).collect();
        let from = Tensor::from_vec(from, slots, self.k.device())?;
        let to = self.slot_index(&to)?;
        for layer in 0..self.layers {
            self.copy_rows(&self.layer(layer)?, &from, &to)?;
        }
        self.stamp(0..self.layers, &to.blocks);
        Ok(())
    }

    /// Copies one layer's rows `from` (`[n]` u32) to the rows of `to`, K and V as they are
    /// stored. The rows go through a buffer of their own (`index_select`): a view of the cache
    /// would read the storage `scatter_set` writes.
    fn copy_rows(&self, kv: &LayerKv, from: &Tensor, to: &SlotIndex) -> Result<()> {
        kv.k.scatter_set(&to.rows, &kv.k.index_select(from, 0)?, 0)?;
        kv.v.scatter_set(&to.rows, &kv.v.index_select(from, 0)?, 0)?;
        if let (Some((ks, vs)), Some(heads)) = (&kv.scales, &to.heads) {
            ks.scatter_set(heads, &ks.index_select(from, 0)?, 0)?;
            vs.scatter_set(heads, &vs.index_select(from, 0)?, 0)?;
        }
        Ok(())
    }

    /// Moves the K/V of rows `src` to rows `dst` in every layer, K turned by `rot`: the context
    /// shift's copy (`kv_cache::manager::SlotShift`). On the CPU one pass over the rows, in place
    /// (a candle in-place op, where gather, convert and scatter would each make a copy);
    /// elsewhere candle's ops (`shift_slots_generic`). `src` and `dst` must not share a row.
    pub fn shift_slots(&self, src: &[u32], dst: &[u32], rot: &KeyRotation) -> Result<()> {
        if src.len() != dst.len() || rot.heads * rot.cos.len() * 2 != self.kv_dim {
            return Err(EngineError::KvCache(format!(
                "a shift of {} rows to {} with a rotation of {} heads x {} pairs on rows of {}",
                src.len(),
                dst.len(),
                rot.heads,
                rot.cos.len(),
                self.kv_dim
            )));
        }
        if !self.k.device().is_cpu() || self.scales.is_some() {
            return self.shift_slots_generic(src, dst, rot);
        }
        self.stamp(0..self.layers, &self.blocks_of(dst));
        let op = |turn| ShiftRows {
            src,
            dst,
            width: self.kv_dim,
            layers: self.layers,
            slots: self.spec.num_slots(),
            turn,
        };
        self.k.inplace_op1(&op(Some(rot)))?;
        self.v.inplace_op1(&op(None))?;
        Ok(())
    }

    /// `shift_slots` with candle's tensor operations, for every device and for the Q8 cache (K
    /// read back as F32, turned, and quantized again; V's codes and scales moved as they are).
    pub fn shift_slots_generic(&self, src: &[u32], dst: &[u32], rot: &KeyRotation) -> Result<()> {
        let device = self.k.device();
        let from = Tensor::from_slice(src, src.len(), device)?;
        let to = self.slot_index(dst)?;
        self.stamp(0..self.layers, &to.blocks);
        let half = rot.cos.len();
        let cos = Tensor::from_slice(&rot.cos, (1, 1, 1, half), device)?;
        let sin = Tensor::from_slice(&rot.sin, (1, 1, 1, half), device)?;
        let n = src.len();
        for layer in 0..self.layers {
            let kv = self.layer(layer)?;
            let k = kv.keys(&from)?;
            let k = k.reshape((n, rot.heads, 2, half))?;
            let (x1, x2) = (k.narrow(2, 0, 1)?, k.narrow(2, 1, 1)?);
            let y1 = (x1.broadcast_mul(&cos)? + x2.broadcast_mul(&sin)?)?;
            let y2 = (x2.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
            let k = Tensor::cat(&[y1, y2], 2)?.reshape((n, self.kv_dim))?;
            kv.v.scatter_set(&to.rows, &kv.v.index_select(&from, 0)?, 0)?;
            if let (Some((_, vs)), Some(heads)) = (&kv.scales, &to.heads) {
                vs.scatter_set(heads, &vs.index_select(&from, 0)?, 0)?;
            }
            self.put(&kv.k, kv.scales.as_ref().map(|s| &s.0), &to, &k)?;
        }
        Ok(())
    }

    /// Writes `k`, `v` (`[tokens, kv_dim]`, any float type) into the rows of `index`, quantized
    /// where the cache is Q8.
    pub fn write(&self, layer: usize, index: &SlotIndex, k: &Tensor, v: &Tensor) -> Result<()> {
        let kv = self.layer(layer)?;
        let (ks, vs) = match &kv.scales {
            Some((ks, vs)) => (Some(ks), Some(vs)),
            None => (None, None),
        };
        self.stamp(layer..layer + 1, &index.blocks);
        self.put(&kv.k, ks, index, k)?;
        self.put(&kv.v, vs, index, v)
    }

    /// `write` from F32 rows `stride` apart in `rows` (a step's stacked Q/K/V projections): K
    /// is columns `k_from..k_from + kv_dim` of each row, V `v_from..v_from + kv_dim`. An F32 or
    /// F16 cache on the CPU takes them straight from `rows`, an F16 one rounded as it goes by
    /// `round` (`Rounding`; the model passes its F16C kernel); others through `write`.
    pub fn write_rows(
        &self,
        layer: usize,
        index: &SlotIndex,
        rows: &[f32],
        stride: usize,
        (k_from, v_from): (usize, usize),
        round: Rounding,
    ) -> Result<()> {
        let w = self.kv_dim;
        if stride == 0 || !rows.len().is_multiple_of(stride) || k_from.max(v_from) + w > stride {
            return Err(EngineError::KvCache(format!(
                "K at {k_from} and V at {v_from}, {w} wide, in rows {stride} wide ({} values)",
                rows.len()
            )));
        }
        let kv = self.layer(layer)?;
        if kv.scales.is_some() || !kv.k.device().is_cpu() {
            let n = rows.len() / stride;
            let columns = |from: usize| -> Result<Tensor> {
                let c: Vec<f32> = (rows.chunks_exact(stride))
                    .flat_map(|r| &r[from..from + w])
                    .copied()
                    .collect();
                Ok(Tensor::from_vec(c, (n, w), &Device::Cpu)?)
            };
            return self.write(layer, index, &columns(k_from)?, &columns(v_from)?);
        }
        self.stamp(layer..layer + 1, &index.blocks);
        for (t, from) in [(&kv.k, k_from), (&kv.v, v_from)] {
            t.inplace_op1(&WriteRows {
                slots: &index.slots,
                width: w,
                rows,
                stride,
                from,
                round,
            })?;
        }
        Ok(())
    }

    /// Writes rows `x` into one of a layer's tensors `t` (and its `scales` for Q8).
    fn put(
        &self,
        t: &Tensor,
        scales: Option<&Tensor>,
        index: &SlotIndex,
        x: &Tensor,
    ) -> Result<()> {
        let (Some(scales), Some(heads)) = (scales, &index.heads) else {
            if t.device().is_cpu() && x.device().is_cpu() {
                let rows = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                t.inplace_op1(&WriteRows {
                    slots: &index.slots,
                    width: self.kv_dim,
                    rows: &rows,
                    stride: self.kv_dim,
                    from: 0,
                    round: &round_one_by_one,
                })?;
            } else {
                let x = x.to_dtype(t.dtype())?.contiguous()?;
                t.scatter_set(&index.rows, &x, 0)?;
            }
            return Ok(());
        };
        let (codes, s) = if x.device().is_cpu() {
            // The step's rows are on the CPU already: quantize them as plain values.
            let (n, width) = x.dims2()?;
            let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let (codes, s) = q8::quantize_rows(&xs, width / self.shape.heads);
            (
                Tensor::from_vec(codes, (n, width), x.device())?,
                Tensor::from_vec(s, (n, self.shape.heads), x.device())?,
            )
        } else {
            q8::quantize(x, self.shape.heads)?
        };
        t.scatter_set(&index.rows, &codes, 0)?;
        scales.scatter_set(heads, &s, 0)?;
        Ok(())
    }
}

/// Rows `from` of one layer's K or V as F32 (dequantized with `scales` for Q8).
fn rows_f32(t: &Tensor, scales: Option<&Tensor>, from: &Tensor) -> Result<Tensor> {
    let x = t.index_select(from, 0)?;
    match scales {
        Some(s) => q8::dequantize(&x, &s.index_select(from, 0)?),
        None => Ok(x.to_dtype(DType::F32)?),
    }
}

/// Half-split RoPE (Hugging Face layout: dimension `i` of a head pairs with `i + head_dim/2`)
/// turned back by an angle per pair: the context shift's rotation of cached K from position p to
/// p - delta, where `cos`/`sin` are those of delta times each pair's frequency (the model's
/// tables give them: `Llama::key_rotation`). Pair (x1, x2) becomes
/// (x1 cos + x2 sin, x2 cos - x1 sin).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRotation {
    pub heads: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl KeyRotation {
    /// Turns one row (`heads * 2 * cos.len()` values) in place.
    pub fn apply(&self, row: &mut [f32]) {
        let half = self.cos.len();
        for head in row.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2, c, s) = (a[i], b[i], self.cos[i], self.sin[i]);
                a[i] = x1 * c + x2 * s;
                b[i] = x2 * c - x1 * s;
            }
        }
    }
}

/// The CPU in-place op of `KvCache::write` and `write_rows` for F32 and F16 caches: columns
/// `from..from + width` of the step's F32 row i (`stride` apart in `rows`) written into slot
/// `slots[i]` of one layer's K or V (`[slots, width]`), rounded to F16 for an F16 cache
/// (`round`, the bits of candle's `to_dtype`). candle's `scatter_set` takes a slot id per
/// value and moves them one at a time, and converting the rows first was a pass of its own
/// (docs/performance.md); this writes each row whole, from where the projections left it.
struct WriteRows<'a> {
    slots: &'a [u32],
    width: usize,
    rows: &'a [f32],
    stride: usize,
    from: usize,
    round: Rounding<'a>,
}

/// How F32 values become an F16 cache's: to nearest, ties to even, as candle's `to_dtype` (and
/// `half::f16::from_f32`) round. Passed in so that the layers above can hand down their SIMD
/// kernel (`model::kernels::f16`), which this layer may not use.
pub type Rounding<'a> = &'a (dyn Fn(&[f32], &mut [half::f16]) + Sync);

/// `Rounding` one value at a time (`write`'s rows, and the tests' reference).
pub fn round_one_by_one(src: &[f32], dst: &mut [half::f16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s);
    }
}

impl WriteRows<'_> {
    fn run<T>(&self, dst: &mut [T], put: impl Fn(&[f32], &mut [T])) -> candle_core::Result<()> {
        let w = self.width;
        if self.rows.len() != self.slots.len() * self.stride || self.from + w > self.stride {
            return Err(candle_core::Error::Msg(format!(
                "{} values for {} rows of {} holding {w} at {}",
                self.rows.len(),
                self.slots.len(),
                self.stride,
                self.from
            )));
        }
        // Checked first: a bad slot writes nothing.
        if let Some(slot) = self
            .slots
            .iter()
            .find(|&&s| (s as usize + 1) * w > dst.len())
        {
            return Err(candle_core::Error::Msg(format!(
                "slot {slot} outside the cache's {}",
                dst.len() / w
            )));
        }
        for (row, &slot) in self.rows.chunks_exact(self.stride).zip(self.slots) {
            let at = slot as usize * w;
            put(&row[self.from..self.from + w], &mut dst[at..at + w]);
        }
        Ok(())
    }
}

impl candle_core::InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "kv-write-rows"
    }

    fn cpu_fwd(
        &self,
        dst: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage;
        let Some((d0, d1)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("the KV cache is contiguous".into()));
        };
        match dst {
            CpuStorage::F16(d) => self.run(&mut d[d0..d1], |s, d| (self.round)(s, d)),
            CpuStorage::F32(d) => self.run(&mut d[d0..d1], |s, d| d.copy_from_slice(s)),
            _ => Err(candle_core::Error::Msg(
                "an F16 or F32 cache takes rows whole".into(),
            )),
        }
    }
}

/// The CPU in-place op of `KvCache::shift_slots` over one of the cache's tensors
/// (`[layers, slots, width]`): each layer's row `src[i]` copied to row `dst[i]`, turned by `turn`
/// when given (K) or as it is (V).
struct ShiftRows<'a> {
    src: &'a [u32],
    dst: &'a [u32],
    width: usize,
    layers: usize,
    slots: usize,
    turn: Option<&'a KeyRotation>,
}

impl ShiftRows<'_> {
    /// `load` and `store` convert a row (slice conversions: F16's use F16C where the CPU has
    /// it, ~20x faster than converting one value at a time).
    fn run<T: Copy>(
        &self,
        data: &mut [T],
        load: fn(&[T], &mut [f32]),
        store: fn(&[f32], &mut [T]),
    ) {
        let w = self.width;
        let mut row = vec![0f32; w];
        for layer in 0..self.layers {
            let base = layer * self.slots * w;
            for (&s, &d) in self.src.iter().zip(self.dst) {
                let (s, d) = (base + s as usize * w, base + d as usize * w);
                match self.turn {
                    None => data.copy_within(s..s + w, d),
                    Some(turn) => {
                        load(&data[s..s + w], &mut row);
                        turn.apply(&mut row);
                        store(&row, &mut data[d..d + w]);
                    }
                }
            }
        }
    }
}

impl candle_core::InplaceOp1 for ShiftRows<'_> {
    fn name(&self) -> &'static str {
        "kv-shift-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage;
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("the KV cache is contiguous".into()))?;
        if end - start != self.layers * self.slots * self.width {
            return Err(candle_core::Error::Msg(
                "a KV cache tensor of another shape".into(),
            ));
        }
        match storage {
            CpuStorage::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                self.run(
                    &mut v[start..end],
                    |x, r| x.convert_to_f32_slice(r),
                    |r, x| x.convert_from_f32_slice(r),
                )
            }
            CpuStorage::F32(v) => self.run(
                &mut v[start..end],
                |x, r| r.copy_from_slice(x),
                |r, x| x.copy_from_slice(r),
            ),
            _ => {
                return Err(candle_core::Error::Msg(
                    "the KV cache holds F16 or F32".into(),
                ))
            }
        }
        Ok(())
    }
}

/// Zeros whose pages the allocator maps fresh (a zeroed allocation) instead of writing them:
/// candle's `zeros` writes every F16 element one by one, which made a 1 GiB F16 cache resident
/// the moment it was made. On the CPU the F16 buffer is allocated as zeroed `u16`s and
/// reinterpreted (same layout); F32 (`vec![0f32; n]`) and other devices go through candle.
fn lazy_zeros(dims: (usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor> {
    match (dtype, device) {
        (DType::U8, Device::Cpu) => Ok(Tensor::from_vec(
            vec![0u8; dims.0 * dims.1 * dims.2],
            dims,
            device,
        )?),
        (DType::F16, Device::Cpu) => {
            use half::vec::HalfBitsVecExt;
            let v: Vec<half::f16> = vec![0u16; dims.0 * dims.1 * dims.2].reinterpret_into();
            Ok(Tensor::from_vec(v, dims, device)?)
        }
        _ => Ok(Tensor::zeros(dims, dtype, device)?),
    }
}

/// Asks Linux to back a CPU tensor's untouched pages with 2 MiB pages (`MADV_HUGEPAGE`; a no-op
/// elsewhere, on other devices, or where transparent huge pages are off). Attention reads each
/// sequence's rows scattered over the whole cache, one layer after another: with 4 KiB pages a
/// 16-sequence decode step touches ~40,000 pages, far beyond the TLB (the step's time with and
/// without: docs/performance.md, "Measurements behind constants in the code"). Pages
/// are still touched only as sequences fill them, 2 MiB at a time.
fn advise_huge_pages(t: &Tensor) {
    use candle_core::{CpuStorage, Storage};
    let (storage, _) = t.storage_and_layout();
    let (ptr, bytes) = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => (v.as_ptr() as usize, v.len() * 4),
        Storage::Cpu(CpuStorage::F16(v)) => (v.as_ptr() as usize, v.len() * 2),
        Storage::Cpu(CpuStorage::U8(v)) => (v.as_ptr() as usize, v.len()),
        _ => return,
    };
    crate::huge_pages::advise(ptr, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// This process's resident memory (Linux `/proc/self/statm`).
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        // SAFETY: sysconf reads a constant.
        pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, rng_seed: proptest::test_runner::RngSeed::Fixed(17), ..ProptestConfig::default() })]
        /// `write_rows` from stacked rows (K and V at any columns of rows of any width) stores
        /// what `write` stores from those columns, in every cache type; an F16 cache holds candle's
        /// `to_dtype(F16)` bits (which the candle-op layer path writes) on any values: ties,
        /// subnormals, overflow to infinity, NaNs as NaNs.
        #[test]
        fn stacked_rows_write_as_their_columns_do(
            bits in prop::collection::vec(prop_oneof![
                any::<u32>().prop_map(|b| b & 0xbfff_ffff),
                any::<u32>(),
                Just(0x3f80_1000u32), Just(0x3f80_3000),
                Just(0x3380_0000), Just(0x477f_f000),
                Just(0x4780_0000), Just(0x0000_0001),
                Just(0x7fc0_0001),
            ], 24..200),
            extra in 0usize..9, k_at in 0usize..9, v_at in 0usize..9,
        ) {
            let shape = KvShape { layers: 2, kv_dim: 8, heads: 2 };
            let stride = 8 + extra;
            let (k_from, v_from) = (k_at % (extra + 1), v_at % (extra + 1));
            let n = (bits.len() / stride).min(16);
            let rows: Vec<f32> = bits[..n * stride].iter().map(|&b| f32::from_bits(b)).collect();
            let slots: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 3) % 16).collect();
            let dev = Device::Cpu;
            let t = Tensor::from_vec(rows.clone(), (n, stride), &dev).unwrap();
            let (k, v) = (t.narrow(1, k_from, 8).unwrap(), t.narrow(1, v_from, 8).unwrap());
            let finite = rows.iter().all(|x| x.is_finite());
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
                if dtype == KvDtype::Q8 && !finite {
                    continue;
                }
                let spec = KvCacheSpec::from_tokens(4, 16);
                let (a, b) = (KvCache::new(shape, spec, dtype, &dev).unwrap(), KvCache::new(shape, spec, dtype, &dev).unwrap());
                let index = a.slot_index(&slots).unwrap();
                a.write_rows(1, &index, &rows, stride, (k_from, v_from), &round_one_by_one).unwrap();
                b.write(1, &index, &k.contiguous().unwrap(), &v.contiguous().unwrap()).unwrap();
                let bits_of = |c: &KvCache, val: bool| -> Vec<u64> {
                    let l = c.layer(1).unwrap();
                    let x = if val { &l.v } else { &l.k };
                    match x.dtype() {
                        DType::F16 => x.flatten_all().unwrap().to_vec1::<half::f16>().unwrap().iter().map(|h| h.to_bits() as u64).collect(),
                        DType::F32 => x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|h| h.to_bits() as u64).collect(),
                        _ => x.flatten_all().unwrap().to_vec1::<u8>().unwrap().iter().map(|&h| h as u64).collect(),
                    }
                };
                for val in [false, true] {
                    let (got, want) = (bits_of(&a, val), bits_of(&b, val));
                    // NaNs may carry other payloads: compare them as NaNs.
                    let nan = |x: u64| match dtype {
                        KvDtype::F16 => half::f16::from_bits(x as u16).is_nan(),
                        KvDtype::F32 => f32::from_bits(x as u32).is_nan(),
                        KvDtype::Q8 => false,
                    };
                    for (g, w) in got.iter().zip(&want) {
                        prop_assert!(g == w || nan(*g) && nan(*w), "{:?} {} vs {}", dtype, g, w);
                    }
                }
                if dtype == KvDtype::F16 {
                    // And those are candle's roundings.
                    let l = a.layer(1).unwrap();
                    let i = Tensor::from_slice(&slots, n, &dev).unwrap();
                    let got = l.k.index_select(&i, 0).unwrap().flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
                    let want = k.to_dtype(DType::F16).unwrap().flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
                    for (g, w) in got.iter().zip(&want) {
                        prop_assert!(g.to_bits() == w.to_bits() || g.is_nan() && w.is_nan(), "{} vs {}", g, w);
                    }
                }
            }
            // Columns past the rows, or rows that are not whole, are errors.
            let c = KvCache::new(shape, KvCacheSpec::from_tokens(4, 16), KvDtype::F16, &dev).unwrap();
            let index = c.slot_index(&slots).unwrap();
            prop_assert!(c.write_rows(0, &index, &rows, stride, (extra + 1, 0), &round_one_by_one).is_err());
            prop_assert!(c.write_rows(0, &index, &rows[1..], stride, (0, 0), &round_one_by_one).is_err());
        }
    }

    /// Every cache type writes rows where the index says and copies blocks whole: a Q8 cache's
    /// rows read back as their quantized values, codes and scales moved together.
    #[test]
    fn rows_written_and_copied_read_back_in_every_type() {
        let shape = KvShape {
            layers: 2,
            kv_dim: 16,
            heads: 2,
        };
        let spec = KvCacheSpec::from_tokens(4, 16);
        let dev = Device::Cpu;
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let cache = KvCache::new(shape, spec, dtype, &dev).unwrap();
            let slots = [5u32, 4, 6];
            let x: Vec<f32> = (0..48)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let k = Tensor::from_vec(x.clone(), (3, 16), &dev).unwrap();
            let v = (&k * -2.0).unwrap();
            let index = cache.slot_index(&slots).unwrap();
            cache.write(1, &index, &k, &v).unwrap();
            // Block 1 (slots 4..8) into block 3, three slots.
            cache.copy_slots(1, 3, 3).unwrap();
            let l = cache.layer(1).unwrap();
            let read = |l: &LayerKv, v: bool, rows: &[u32]| -> Vec<f32> {
                let i = Tensor::from_slice(rows, rows.len(), &dev).unwrap();
                let x = if v { l.values(&i) } else { l.keys(&i) };
                x.unwrap().flatten_all().unwrap().to_vec1().unwrap()
            };
            let want = |x: &[f32]| -> Vec<f32> {
                match dtype {
                    KvDtype::F32 => x.to_vec(),
                    KvDtype::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                    KvDtype::Q8 => {
                        let (c, s) = q8::quantize_rows(x, 8);
                        q8::dequantize_rows(&c, &s, 8)
                    }
                }
            };
            let vx: Vec<f32> = x.iter().map(|v| v * -2.0).collect();
            assert_eq!(read(&l, false, &slots), want(&x), "{dtype:?} K");
            assert_eq!(read(&l, true, &slots), want(&vx), "{dtype:?} V");
            assert_eq!(
                read(&l, false, &[13, 12, 14]),
                want(&x),
                "{dtype:?} copied K"
            );
            assert_eq!(
                read(&l, true, &[13, 12, 14]),
                want(&vx),
                "{dtype:?} copied V"
            );
            // The other layer, and the other slots of this one, were not touched.
            let l0 = cache.layer(0).unwrap();
            assert!(read(&l0, false, &slots).iter().all(|&v| v == 0.0));
            assert!(read(&l, false, &[0, 7, 8, 15]).iter().all(|&v| v == 0.0));
            // A slot past the cache is an error, not a write elsewhere.
            let past = cache.slot_index(&[3, 16]).unwrap();
            let two = k.narrow(0, 0, 2).unwrap();
            assert!(cache.write(0, &past, &two, &two).is_err(), "{dtype:?}");
            if dtype != KvDtype::Q8 {
                let l0 = cache.layer(0).unwrap();
                assert!(
                    read(&l0, false, &[3]).iter().all(|&v| v == 0.0),
                    "{dtype:?}"
                );
            }
        }
    }

    /// A new cache costs address space, not memory: its pages become resident as sequences
    /// fill them (a 1 GiB F16 cache was resident at start-up when candle wrote its zeros).
    #[test]
    fn a_fresh_cache_is_not_resident() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let shape = KvShape {
                layers: 4,
                kv_dim: 256,
                heads: 4,
            };
            let spec = KvCacheSpec::from_bytes(shape, dtype, 16, 512 << 20);
            let before = resident_bytes();
            let cache = KvCache::new(shape, spec, dtype, &Device::Cpu).unwrap();
            let grown = resident_bytes().saturating_sub(before);
            assert!(
                grown < 64 << 20,
                "{dtype:?}: {} MiB resident after making a 512 MiB cache",
                grown >> 20
            );
            drop(cache);
        }
    }
}
