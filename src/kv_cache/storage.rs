//! The KV cache tensors: one K and one V tensor of shape `[layers, num_blocks * block_size,
//! num_kv_heads * head_dim]`, F32 or F16 (`engine.kv_dtype`); each layer works on its view. Rows are slots; a block is
//! `block_size` consecutive rows. One allocation each (not one per layer) so that the allocator maps
//! fresh zero pages instead of clearing heap memory: a 1 GiB cache then costs nothing at start-up
//! and pages are touched only as sequences fill them.
//!
//! Writes go through candle's in-place `scatter_set`, so they work on every device; the CPU fast
//! attention path reads the same tensors as plain slices.

use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};

/// What one token's K and V take: `layers` of `kv_dim` values each (the model says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_dim: usize,
}

/// How big the cache is and how it is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub block_size: usize,
    pub num_blocks: usize,
}

impl KvCacheSpec {
    /// Bytes one token takes across all layers (K and V).
    pub fn bytes_per_token(shape: KvShape, dtype: DType) -> usize {
        2 * shape.layers * shape.kv_dim * dtype.size_in_bytes()
    }

    /// The largest whole number of blocks that fits in `bytes`.
    pub fn from_bytes(shape: KvShape, dtype: DType, block_size: usize, bytes: usize) -> Self {
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
    kv_dim: usize,
    layers: usize,
    dtype: DType,
    k: Tensor,
    v: Tensor,
}

impl KvCache {
    pub fn new(shape: KvShape, spec: KvCacheSpec, dtype: DType, device: &Device) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F16) {
            return Err(EngineError::KvCache(format!(
                "the cache holds F32 or F16, not {dtype:?}"
            )));
        }
        if spec.block_size == 0 || spec.num_blocks == 0 {
            return Err(EngineError::KvCache(format!(
                "the cache needs at least one block of at least one token (block_size {}, blocks {})",
                spec.block_size, spec.num_blocks
            )));
        }
        let dims = (shape.layers, spec.num_slots(), shape.kv_dim);
        let k = lazy_zeros(dims, dtype, device)?;
        let v = lazy_zeros(dims, dtype, device)?;
        advise_huge_pages(&k);
        advise_huge_pages(&v);
        Ok(KvCache {
            spec,
            kv_dim: shape.kv_dim,
            layers: shape.layers,
            dtype,
            k,
            v,
        })
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

    /// Total bytes of K and V over all layers.
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.spec.num_slots() * self.kv_dim * self.dtype.size_in_bytes()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Views of one layer's K and V, `[slots, kv_dim]` (no copy).
    pub fn layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.k.get(layer)?, self.v.get(layer)?))
    }

    /// Copies the first `slots` slots of block `src` into block `dst`, K and V of every layer.
    pub fn copy_slots(&self, src: u32, dst: u32, slots: usize) -> Result<()> {
        let bs = self.spec.block_size;
        let (from, to) = (src as usize * bs, dst as usize * bs);
        let rows: Vec<u32> = (to..to + slots).map(|r| r as u32).collect();
        let index = Tensor::from_vec(rows, (slots, 1), self.k.device())?
            .broadcast_as((slots, self.kv_dim))?
            .contiguous()?;
        // The rows into a buffer of their own (`Tensor::copy` would clone the whole cache):
        // x * 1 + 0 is exact in every float type.
        let rows = |t: &Tensor| t.narrow(0, from, slots)?.affine(1.0, 0.0);
        for layer in 0..self.layers {
            let (kc, vc) = self.layer(layer)?;
            kc.scatter_set(&index, &rows(&kc)?, 0)?;
            vc.scatter_set(&index, &rows(&vc)?, 0)?;
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
        if !self.k.device().is_cpu() {
            return self.shift_slots_generic(src, dst, rot);
        }
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

    /// `shift_slots` with candle's tensor operations, for every device.
    pub fn shift_slots_generic(&self, src: &[u32], dst: &[u32], rot: &KeyRotation) -> Result<()> {
        let device = self.k.device();
        let from = Tensor::from_slice(src, src.len(), device)?;
        let to = Tensor::from_slice(dst, dst.len(), device)?
            .reshape((dst.len(), 1))?
            .broadcast_as((dst.len(), self.kv_dim))?
            .contiguous()?;
        let half = rot.cos.len();
        let cos = Tensor::from_slice(&rot.cos, (1, 1, 1, half), device)?;
        let sin = Tensor::from_slice(&rot.sin, (1, 1, 1, half), device)?;
        let n = src.len();
        for layer in 0..self.layers {
            let (kc, vc) = self.layer(layer)?;
            let k = kc.index_select(&from, 0)?.to_dtype(DType::F32)?;
            let k = k.reshape((n, rot.heads, 2, half))?;
            let (x1, x2) = (k.narrow(2, 0, 1)?, k.narrow(2, 1, 1)?);
            let y1 = (x1.broadcast_mul(&cos)? + x2.broadcast_mul(&sin)?)?;
            let y2 = (x2.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
            let k = Tensor::cat(&[y1, y2], 2)?.reshape((n, self.kv_dim))?;
            let v = vc.index_select(&from, 0)?;
            kc.scatter_set(&to, &k.to_dtype(self.dtype)?.contiguous()?, 0)?;
            vc.scatter_set(&to, &v.contiguous()?, 0)?;
        }
        Ok(())
    }

    /// Writes `k`, `v` (`[tokens, kv_dim]`) into the rows `slot_index` (`[tokens, kv_dim]` u32, each
    /// row filled with its slot id, as candle's scatter wants).
    pub fn write(&self, layer: usize, slot_index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kc, vc) = self.layer(layer)?;
        kc.scatter_set(slot_index, &k.to_dtype(self.dtype)?.contiguous()?, 0)?;
        vc.scatter_set(slot_index, &v.to_dtype(self.dtype)?.contiguous()?, 0)?;
        Ok(())
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

/// Asks Linux to back a CPU tensor's untouched pages with 2 MiB pages (`MADV_HUGEPAGE`; a no-op
/// elsewhere, on other devices, or where transparent huge pages are off). Attention reads each
/// sequence's rows scattered over the whole cache, one layer after another: with 4 KiB pages a
/// 16-sequence decode step touches ~40,000 pages, far beyond the TLB (the step's time with and
/// without: docs/performance.md, "Measurements behind constants in the code"). Pages
/// are still touched only as sequences fill them, 2 MiB at a time.
/// Zeros whose pages the allocator maps fresh (a zeroed allocation) instead of writing them:
/// candle's `zeros` writes every F16 element one by one, which made a 1 GiB F16 cache resident
/// the moment it was made. On the CPU the F16 buffer is allocated as zeroed `u16`s and
/// reinterpreted (same layout); F32 (`vec![0f32; n]`) and other devices go through candle.
fn lazy_zeros(dims: (usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor> {
    match (dtype, device) {
        (DType::F16, Device::Cpu) => {
            use half::vec::HalfBitsVecExt;
            let v: Vec<half::f16> = vec![0u16; dims.0 * dims.1 * dims.2].reinterpret_into();
            Ok(Tensor::from_vec(v, dims, device)?)
        }
        _ => Ok(Tensor::zeros(dims, dtype, device)?),
    }
}

fn advise_huge_pages(t: &Tensor) {
    #[cfg(target_os = "linux")]
    {
        use candle_core::{CpuStorage, Storage};
        const HUGE: usize = 2 << 20;
        let (storage, _) = t.storage_and_layout();
        let (ptr, bytes) = match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => (v.as_ptr() as usize, v.len() * 4),
            Storage::Cpu(CpuStorage::F16(v)) => (v.as_ptr() as usize, v.len() * 2),
            _ => return,
        };
        // Only whole huge pages inside the allocation.
        let start = ptr.next_multiple_of(HUGE);
        let end = (ptr + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside a live allocation; MADV_HUGEPAGE changes how pages are
            // backed, never their contents.
            let rc = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            };
            if rc != 0 {
                tracing::debug!(
                    "madvise(MADV_HUGEPAGE) on the KV cache failed: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's resident memory (Linux `/proc/self/statm`).
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        // SAFETY: sysconf reads a constant.
        pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
    }

    /// A new cache costs address space, not memory: its pages become resident as sequences
    /// fill them (a 1 GiB F16 cache was resident at start-up when candle wrote its zeros).
    #[test]
    fn a_fresh_cache_is_not_resident() {
        for dtype in [DType::F32, DType::F16] {
            let shape = KvShape {
                layers: 4,
                kv_dim: 256,
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
