//! Projections: CPU Q8_0 / Q4_1 / Q4_0 / Q4_K / Q6_K matrices repacked for our 8-row kernels
//! (`Packed`), anything else through candle's `QMatMul`, plus:
//!
//! - **Dense path for big steps.** candle's quantized CPU matmul runs one dot product per (row,
//!   column) pair and its speed does not grow with the rows, while its F32 gemm's does (figures:
//!   docs/performance.md, "Measurements behind constants in the code"). A step with at
//!   least `DENSE_MIN_ROWS` tokens (repacked: `Q8_0_DENSE_MIN_ROWS`, `Q4_1_DENSE_MIN_ROWS`,
//!   except where the repacked kernel wins at every size and never goes dense: Q4_1 with AVX2
//!   or AVX-512 VNNI, Q8_0 with VNNI; `Packed::dense_from`) dequantizes the weight into a
//!   buffer that is dropped right after and runs the F32 gemm.
//! - **Tile units for big steps.** On CPUs with AMX a repacked matrix also keeps a bf16 copy
//!   (`kernels::amx`, within `engine.amx_weights_mib`), and steps of `amx::AMX_MIN_ROWS` rows or
//!   more run on it (`Packed::on_tiles`); smaller ones keep the 8-row kernels.
//! - **Fused projections.** Q, K and V (and gate and up) read the same input; stored as one matrix
//!   they cost one activation quantization and one thread-pool dispatch instead of three.
//! - **The MLP on the tiles.** Where a stacked `[gate; up]` and `down` both run on the tiles
//!   (`mlp_on_tiles`), the activation `silu(gate) * up` is computed in the gate/up kernel's
//!   epilogue and handed to `down` as bf16 tiles (`amx::Tiles::matmul_silu_mul`), the same bits
//!   as the three steps apart.

use std::borrow::Cow;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};

use super::kernels::cpu::{Amx, Isa};
use super::kernels::q8_0::{quantize_rows, QuantizedRows};
use super::kernels::q8_0x8::RowGroups;
use super::kernels::with_cpu_slice;
use super::kernels::{amx, q4_1x8, q4_kx8, q8_0x8};
use super::profile::{time, Part};
use crate::error::Result;

/// Rows (tokens) from which a quantized projection runs as dequantize + F32 gemm on CPU: where the
/// two paths cross on SmolLM2's projections (docs/performance.md, "Measurements behind constants
/// in the code").
pub const DENSE_MIN_ROWS: usize = 48;

/// One weight matrix `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    w: Weight,
}

#[derive(Debug, Clone)]
enum Weight {
    /// Anything candle stores (dense, other quantized types, any device).
    Candle(QMatMul),
    /// Q8_0 or Q4_1 on CPU, repacked eight rows at a time.
    Packed(Arc<Packed>),
}

/// A CPU weight matrix `[n, k]` in one of the 8-row layouts, and on CPUs with AMX a bf16 copy
/// for big steps (`kernels::amx`).
#[derive(Debug)]
pub struct Packed {
    layout: Layout,
    tiles: Option<amx::Tiles>,
}

/// The 8-row layouts (`kernels::q8_0x8`, `kernels::q4_1x8`, `kernels::q4_kx8`).
#[derive(Debug)]
enum Layout {
    Q8_0(q8_0x8::Repacked),
    /// Q4_1, and Q4_0 repacked losslessly as Q4_1 blocks.
    Q4_1(q4_1x8::Repacked),
    /// Q4_K with its compact sub-block scales.
    Q4K(q4_kx8::Repacked),
    /// Q6_K: 8-bit quants with a scale per 16 values.
    Q6K(q8_0x8::Q6kRepacked),
}

/// Runs `$e` with `$r` bound to whichever layout `$p` holds (a static dispatch per layout).
macro_rules! each_layout {
    ($p:expr, $r:ident => $e:expr) => {
        match &$p.layout {
            Layout::Q8_0($r) => $e,
            Layout::Q4_1($r) => $e,
            Layout::Q4K($r) => $e,
            Layout::Q6K($r) => $e,
        }
    };
}

impl Packed {
    /// Repacks a CPU Q8_0, Q4_1, Q4_0, Q4_K or Q6_K matrix (Q4_0 as Q4_1 with minimum `-8 d`);
    /// `None` for anything else.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if !q.device().is_cpu() || q.rank() != 2 {
            return Ok(None);
        }
        let (n, k) = q.shape().dims2()?;
        if !k.is_multiple_of(32) {
            return Ok(None);
        }
        let layout = match q.dtype() {
            GgmlDType::Q8_0 => Layout::Q8_0(q8_0x8::Repacked::from_q8_0(&q.data()?, n, k)),
            GgmlDType::Q4_1 => Layout::Q4_1(q4_1x8::Repacked::from_q4_1(&q.data()?, n, k)),
            GgmlDType::Q4_0 => Layout::Q4_1(q4_1x8::Repacked::from_q4_0(&q.data()?, n, k)),
            GgmlDType::Q4K => Layout::Q4K(q4_kx8::Repacked::from_q4_k(&q.data()?, n, k)),
            GgmlDType::Q6K => Layout::Q6K(q8_0x8::Q6kRepacked::from_q6_k(&q.data()?, n, k)),
            _ => return Ok(None),
        };
        let mut packed = Packed {
            layout,
            tiles: None,
        };
        if let Some(t) = Isa::best().amx() {
            packed.tiles = amx::Tiles::within_budget(t, n, k, || packed.dequantize());
        }
        Ok(Some(packed))
    }

    /// Whether a `rows`-row step runs on the quantized 8-row kernels (rather than the tiles or
    /// the dense path) at level `isa`.
    fn quantized_at(&self, rows: usize, isa: Isa) -> bool {
        rows < self.dense_from(isa) && self.on_tiles(rows, isa).is_none()
    }

    /// The bf16 copy and the token to run it, when a `rows`-row step runs on the tile units at
    /// level `isa`.
    fn on_tiles(&self, rows: usize, isa: Isa) -> Option<(&amx::Tiles, Amx)> {
        let t = isa.amx().filter(|_| rows >= amx::AMX_MIN_ROWS)?;
        Some((self.tiles.as_ref()?, t))
    }

    /// Whether a `rows`-row step runs on the quantized 8-row kernels (`matmul_quantized`) at
    /// this CPU's level.
    pub fn quantized_rows_at(&self, rows: usize) -> bool {
        self.quantized_at(rows, Isa::best())
    }

    /// The bf16 copy and the token to run it, when a `rows`-row step runs on the tile units.
    pub fn tiles_at(&self, rows: usize) -> Option<(&amx::Tiles, Amx)> {
        self.on_tiles(rows, Isa::best())
    }

    /// (rows, columns).
    pub fn dims(&self) -> (usize, usize) {
        each_layout!(self, r => r.dims())
    }

    /// The memory this matrix's kernels stream, as (address, bytes): its repacked groups, and
    /// the bf16 copy where it has one (`huge_pages::collapse`).
    pub fn spans(&self) -> Vec<(usize, usize)> {
        let groups = each_layout!(self, r => r.groups(0, r.dims().0.div_ceil(q8_0x8::GROUP)));
        let mut spans = vec![(groups.as_ptr() as usize, groups.len())];
        spans.extend(self.tiles.as_ref().map(amx::Tiles::span));
        spans
    }

    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        each_layout!(self, r => r.dequantize_row(row, out))
    }

    pub fn dequantize(&self) -> Vec<f32> {
        each_layout!(self, r => r.dequantize())
    }

    /// `out[m, n]` for activations already quantized.
    pub fn matmul_quantized(&self, a: &QuantizedRows) -> Vec<f32> {
        each_layout!(self, r => r.matmul_quantized(a))
    }

    /// Rows from which `forward_rows` takes the dense path, at instruction-set level `isa`: with
    /// AVX-512 VNNI the Q8_0 and Q4_1 kernels stay ahead of dequantize + gemm at every size, and
    /// with AVX2 the Q4_1 kernel does (never dense: `usize::MAX`); the scalar level, AVX2's
    /// Q8_0 and the K-quants keep the thresholds (docs/performance.md, "The roof report" and
    /// "AVX2 only").
    fn dense_from(&self, isa: Isa) -> usize {
        match self.layout {
            // The VNNI level includes AVX2.
            Layout::Q4_1(_) if isa.avx2().is_some() => usize::MAX,
            Layout::Q8_0(_) if isa.avx512_vnni().is_some() => usize::MAX,
            Layout::Q8_0(_) | Layout::Q6K(_) => Q8_0_DENSE_MIN_ROWS,
            Layout::Q4_1(_) | Layout::Q4K(_) => Q4_1_DENSE_MIN_ROWS,
        }
    }

    /// `x[rows, k] . w^T` as `[rows, n]`: the packed kernel, or from `*_DENSE_MIN_ROWS` rows on the
    /// dense path (dequantize, then candle's F32 gemm).
    pub fn forward_rows(&self, xs: &[f32], rows: usize) -> Result<Vec<f32>> {
        self.forward_rows_at(xs, rows, Isa::best())
    }

    /// `forward_rows` as level `isa` chooses its path (tests try each level's choice).
    fn forward_rows_at(&self, xs: &[f32], rows: usize, isa: Isa) -> Result<Vec<f32>> {
        let (n, k) = self.dims();
        if let Some((tiles, t)) = self.on_tiles(rows, isa) {
            return Ok(tiles.matmul(t, xs, rows));
        }
        if rows < self.dense_from(isa) {
            return Ok(self.matmul(xs, rows));
        }
        let w = Tensor::from_vec(self.dequantize(), (n, k), &Device::Cpu)?;
        let x = Tensor::from_slice(xs, (rows, k), &Device::Cpu)?;
        Ok(x.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// `out[m, n] = x[m, k] . w[n, k]`. Each method matches on the layout rather than going
    /// through `&dyn RowGroups`: the dynamic call made decode steps slower (docs/performance.md,
    /// "Measurements behind constants in the code").
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        each_layout!(self, r => r.matmul(x, m))
    }
}

impl Linear {
    /// Wraps a weight, repacking CPU Q8_0 and Q4_1 matrices into the 8-row layouts (the GGUF
    /// bytes are dropped with the `QMatMul` unless something else holds them).
    pub fn new(w: QMatMul) -> Result<Self> {
        if let QMatMul::QTensor(q) = &w {
            if let Some(p) = Packed::from_qtensor(q)? {
                return Ok(Self::packed(Arc::new(p)));
            }
        }
        Ok(Linear {
            w: Weight::Candle(w),
        })
    }

    /// A projection over an already repacked matrix (tied embeddings share theirs).
    pub fn packed(w: Arc<Packed>) -> Self {
        Linear {
            w: Weight::Packed(w),
        }
    }

    /// The repacked weight, when this projection has one (the CPU layer path needs it).
    /// The memory of a repacked matrix (`Packed::spans`); none for candle's.
    pub fn spans(&self) -> Vec<(usize, usize)> {
        self.as_packed().map(Packed::spans).unwrap_or_default()
    }

    pub fn as_packed(&self) -> Option<&Packed> {
        match &self.w {
            Weight::Packed(p) => Some(p),
            Weight::Candle(_) => None,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let q = match &self.w {
            Weight::Packed(p) => return forward_packed(p, x),
            Weight::Candle(QMatMul::QTensor(q)) => q,
            Weight::Candle(w) => return Ok(w.forward(x)?),
        };
        let rows = x.dim(0)?;
        if q.device().is_cpu() && rows >= DENSE_MIN_ROWS {
            let w = q.dequantize(&q.device())?;
            return Ok(x.matmul(&w.t()?)?);
        }
        Ok(QMatMul::QTensor(q.clone()).forward(x)?)
    }

    /// Stacks projections that share their input into one `[sum of outs, in]` matrix, when they
    /// are stored alike (same quantized type, or all dense). `None` when they are not.
    pub fn stack(parts: &[QMatMul]) -> Result<Option<Linear>> {
        let quantized: Option<Vec<&std::sync::Arc<QTensor>>> = parts
            .iter()
            .map(|p| match p {
                QMatMul::QTensor(q) => Some(q),
                _ => None,
            })
            .collect();
        if let Some(qs) = quantized {
            let dtype = qs[0].dtype();
            if qs.iter().any(|q| q.dtype() != dtype) || !qs[0].device().is_cpu() {
                return Ok(None);
            }
            let cols = qs[0].shape().dims2()?.1;
            let mut rows = 0;
            let mut bytes = Vec::new();
            for q in &qs {
                let (r, c) = q.shape().dims2()?;
                if c != cols {
                    return Ok(None);
                }
                rows += r;
                bytes.extend_from_slice(&q.data()?);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
            let q = QTensor::new(storage, (rows, cols))?;
            return Ok(Some(Linear::new(QMatMul::from_qtensor(q)?)?));
        }
        let dense: Option<Vec<&Tensor>> = parts
            .iter()
            .map(|p| match p {
                QMatMul::Tensor(t) => Some(t),
                _ => None,
            })
            .collect();
        match dense {
            Some(ts) => Ok(Some(Linear::new(QMatMul::Tensor(Tensor::cat(&ts, 0)?))?)),
            None => Ok(None),
        }
    }
}

/// Rows from which a repacked Q8_0 projection runs as dequantize + F32 gemm: the 8-row kernel
/// keeps its speed as rows grow, so dequantizing first only pays near 256 rows on SmolLM2's
/// shapes (docs/performance.md, "Measurements behind constants in the code").
pub const Q8_0_DENSE_MIN_ROWS: usize = 192;

/// The same for Q4_1 (and Q4_K) at the scalar level; with AVX2 or AVX-512 VNNI a Q4_1 step never
/// goes dense, nor a Q8_0 step with VNNI (`Packed::dense_from`; docs/performance.md, "The roof
/// report" and "AVX2 only").
pub const Q4_1_DENSE_MIN_ROWS: usize = 512;

/// `x [.., k] . w^T` for a repacked matrix: the 8-row kernel for small steps, dequantize + F32
/// gemm from `Q8_0_DENSE_MIN_ROWS` / `Q4_1_DENSE_MIN_ROWS` rows.
fn forward_packed(p: &Packed, x: &Tensor) -> Result<Tensor> {
    let (n, k) = p.dims();
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / k;
    let x2 = x.reshape((rows, k))?.contiguous()?;
    let out = with_cpu_slice(&x2, |xs| p.forward_rows(xs, rows))??;
    *dims.last_mut().expect("a matrix") = n;
    Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
}

#[derive(Debug, Clone)]
pub enum ProjectionGroup {
    Stacked {
        linear: Linear,
        outs: Vec<usize>,
    },
    Separate {
        linears: Vec<Linear>,
        outs: Vec<usize>,
    },
}

impl ProjectionGroup {
    pub fn new(parts: Vec<QMatMul>, outs: Vec<usize>) -> Result<Self> {
        Ok(match Linear::stack(&parts)? {
            Some(linear) => ProjectionGroup::Stacked { linear, outs },
            None => ProjectionGroup::Separate {
                linears: parts
                    .into_iter()
                    .map(Linear::new)
                    .collect::<Result<Vec<_>>>()?,
                outs,
            },
        })
    }

    /// The memory of the group's repacked matrices (`Packed::spans`).
    pub fn spans(&self) -> Vec<(usize, usize)> {
        match self {
            ProjectionGroup::Stacked { linear, .. } => linear.spans(),
            ProjectionGroup::Separate { linears, .. } => {
                linears.iter().flat_map(Linear::spans).collect()
            }
        }
    }

    /// The group's repacked weights and each part's width, when every part is repacked.
    pub fn as_packed(&self) -> Option<(PackedGroup<'_>, &[usize])> {
        match self {
            ProjectionGroup::Stacked { linear, outs } => {
                Some((PackedGroup::Stacked(linear.as_packed()?), outs))
            }
            ProjectionGroup::Separate { linears, outs } => {
                let parts = linears
                    .iter()
                    .map(Linear::as_packed)
                    .collect::<Option<_>>()?;
                Some((PackedGroup::Parts(parts), outs))
            }
        }
    }

    /// One `[tokens, out_i]` tensor per projection.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            ProjectionGroup::Separate { linears, .. } => {
                linears.iter().map(|l| l.forward(x)).collect()
            }
            ProjectionGroup::Stacked { linear, outs } => {
                let y = linear.forward(x)?;
                let mut start = 0;
                let mut res = Vec::with_capacity(outs.len());
                for &o in outs {
                    res.push(y.narrow(1, start, o)?.contiguous()?);
                    start += o;
                }
                Ok(res)
            }
        }
    }
}

/// Repacked projections that share their input, for the CPU layer path: one stacked matrix, or
/// separate ones where the types differ (Q4_K_M files store some layers' v_proj or down_proj in
/// Q6_K beside Q4_K), which then share one activation quantization. Either way the result is
/// the parts' outputs side by side, `[rows, sum of outs]`, as the stacked matrix gives them.
pub enum PackedGroup<'a> {
    Stacked(&'a Packed),
    Parts(Vec<&'a Packed>),
}

/// A layer's MLP on the tile units: the stacked `[gate; up]` copy, `down`'s, and the token.
pub struct MlpTiles<'a> {
    pub gate_up: &'a amx::Tiles,
    pub down: &'a amx::Tiles,
    pub amx: Amx,
}

/// The MLP's copies when a `rows`-row step runs both of its projections on the tile units and
/// `[gate; up]` is one stacked matrix of two `down`-wide halves, each whole 32-row blocks (as
/// `amx::Tiles::matmul_silu_mul` needs).
pub fn mlp_on_tiles<'a>(
    gate_up: &PackedGroup<'a>,
    down: &'a Packed,
    rows: usize,
) -> Option<MlpTiles<'a>> {
    let PackedGroup::Stacked(gu) = gate_up else {
        return None;
    };
    let ((gu, amx), (down, _)) = (gu.tiles_at(rows)?, down.tiles_at(rows)?);
    let (n, inter) = (gu.dims().0, down.dims().1);
    (n == 2 * inter && inter.is_multiple_of(32)).then_some(MlpTiles {
        gate_up: gu,
        down,
        amx,
    })
}

impl PackedGroup<'_> {
    /// The stacked matrix's bf16 copy and the token, when the group is one stacked matrix and a
    /// `rows`-row step runs it on the tile units.
    pub fn stacked_tiles_at(&self, rows: usize) -> Option<(&amx::Tiles, Amx)> {
        match self {
            PackedGroup::Stacked(p) => p.tiles_at(rows),
            PackedGroup::Parts(_) => None,
        }
    }

    pub fn forward_rows(&self, xs: &[f32], rows: usize) -> Result<Vec<f32>> {
        let parts = match self {
            PackedGroup::Stacked(p) => return p.forward_rows(xs, rows),
            PackedGroup::Parts(parts) => parts,
        };
        let total: usize = parts.iter().map(|p| p.dims().0).sum();
        let k = parts.first().map_or(0, |p| p.dims().1);
        let outs: Vec<Vec<f32>> = if parts.iter().all(|p| p.quantized_at(rows, Isa::best())) {
            let a = time(Part::Quantize, || quantize_rows(xs, rows, k));
            parts.iter().map(|p| p.matmul_quantized(&a)).collect()
        } else {
            parts
                .iter()
                .map(|p| p.forward_rows(xs, rows))
                .collect::<Result<_>>()?
        };
        let mut out = Vec::with_capacity(rows * total);
        for r in 0..rows {
            for (p, o) in parts.iter().zip(&outs) {
                let n = p.dims().0;
                out.extend_from_slice(&o[r * n..(r + 1) * n]);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let d = max_abs(&(a - b).unwrap());
        assert!(d <= tol, "max diff {d}");
    }

    #[test]
    fn dense_path_matches_quantized_path() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (96, 64), &dev).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let deq = q.dequantize(&dev).unwrap();
        // Candle's copy (the Q4_1 and other-type path) and the repacked one (Q8_0).
        let q = std::sync::Arc::new(q);
        let kept = Linear {
            w: Weight::Candle(QMatMul::from_arc(q.clone()).unwrap()),
        };
        let lin = Linear::new(QMatMul::from_arc(q).unwrap()).unwrap();
        assert!(matches!(lin.w, Weight::Packed(_)));
        for (lin, dense_rows) in [(&kept, DENSE_MIN_ROWS), (&lin, Q8_0_DENSE_MIN_ROWS)] {
            let x = Tensor::randn(0f32, 1.0, (dense_rows, 64), &dev).unwrap();
            let exact = x.matmul(&deq.t().unwrap()).unwrap();
            let dense = match lin.as_packed() {
                // The level whose choice is the dense path at these rows (AVX2 and scalar keep
                // the threshold), whatever this CPU has.
                Some(p) => {
                    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let out = p.forward_rows_at(&xs, dense_rows, Isa::Scalar).unwrap();
                    Tensor::from_vec(out, (dense_rows, 96), &dev).unwrap()
                }
                None => lin.forward(&x).unwrap(),
            };
            close(&dense, &exact, 1e-4);
            // The quantized kernels agree up to activation quantization.
            let small = lin.forward(&x.narrow(0, 0, 5).unwrap()).unwrap();
            close(&small, &exact.narrow(0, 0, 5).unwrap(), 0.5);
        }
    }

    #[test]
    fn big_steps_stay_on_the_kernels_that_lead() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (32, 64), &dev).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let q = std::sync::Arc::new(QTensor::quantize(&w, dtype).unwrap());
            let lin = Linear::new(QMatMul::from_arc(q).unwrap()).unwrap();
            let p = lin.as_packed().expect("repacked");
            for isa in Isa::available() {
                let dense_from = p.dense_from(isa);
                let kernel = isa.avx512_vnni().is_some()
                    || (isa.avx2().is_some() && dtype == GgmlDType::Q4_1);
                if kernel {
                    assert_eq!(dense_from, usize::MAX, "{dtype:?} {}", isa.name());
                } else {
                    assert!(
                        dense_from <= Q4_1_DENSE_MIN_ROWS,
                        "{dtype:?} {}",
                        isa.name()
                    );
                }
            }
        }
    }

    #[test]
    fn big_steps_run_on_the_tiles_where_the_cpu_has_them() {
        // Weights get their tile copy at the level the engine runs (`LLAMA_RELAY_ISA` may cap it).
        let amx = Isa::best();
        if amx.amx().is_none() {
            eprintln!(
                "big_steps_run_on_the_tiles_where_the_cpu_has_them: skipped, no AMX at this level"
            );
            return;
        }
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (72, 96), &dev).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let q = std::sync::Arc::new(QTensor::quantize(&w, dtype).unwrap());
            let deq = q.dequantize(&dev).unwrap();
            let lin = Linear::new(QMatMul::from_arc(q).unwrap()).unwrap();
            let p = lin.as_packed().expect("repacked");
            assert!(
                p.tiles.is_some(),
                "{dtype:?}: no bf16 copy within the default budget"
            );
            let rows = amx::AMX_MIN_ROWS + 3;
            assert!(p.on_tiles(rows, amx).is_some() && !p.quantized_at(rows, amx));
            assert!(p.on_tiles(amx::AMX_MIN_ROWS - 1, amx).is_none());
            let x = Tensor::randn(0f32, 1.0, (rows, 96), &dev).unwrap();
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = p.forward_rows_at(&xs, rows, amx).unwrap();
            let got = Tensor::from_vec(got, (rows, 72), &dev).unwrap();
            let exact = x.matmul(&deq.t().unwrap()).unwrap();
            // Activations and weights rounded to bf16 (8 bits of mantissa): ~0.4% of each term.
            close(&got, &exact, 0.01 * max_abs(&exact));
        }
    }

    #[test]
    fn k_quants_run_repacked_and_agree_with_candle() {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            let w = Tensor::randn(0f32, 1.0, (40, 512), &dev).unwrap();
            let q = std::sync::Arc::new(QTensor::quantize(&w, dtype).unwrap());
            let deq = q.dequantize(&dev).unwrap();
            let lin = Linear::new(QMatMul::from_arc(q.clone()).unwrap()).unwrap();
            assert!(
                matches!(
                    (dtype, lin.as_packed().map(|p| &p.layout)),
                    (GgmlDType::Q4K, Some(Layout::Q4K(_))) | (GgmlDType::Q6K, Some(Layout::Q6K(_)))
                ),
                "{dtype:?} became {:?}",
                lin.as_packed()
            );
            // Against candle's own kernel (Q8_K activations) and the exact product on the
            // dequantized weights: equal up to activation quantization.
            let x = Tensor::randn(0f32, 1.0, (5, 512), &dev).unwrap();
            let ours = lin.forward(&x).unwrap();
            let theirs = QMatMul::from_arc(q).unwrap().forward(&x).unwrap();
            let exact = x.matmul(&deq.t().unwrap()).unwrap();
            let scale = max_abs(&exact);
            close(&ours, &exact, 0.02 * scale);
            close(&ours, &theirs, 0.02 * scale);
        }
    }

    #[test]
    fn stacked_projections_equal_separate_ones() {
        let dev = Device::Cpu;
        let mk = |r| {
            QMatMul::from_qtensor(
                QTensor::quantize(
                    &Tensor::randn(0f32, 1.0, (r, 64), &dev).unwrap(),
                    GgmlDType::Q8_0,
                )
                .unwrap(),
            )
            .unwrap()
        };
        let parts = vec![mk(64), mk(32), mk(32)];
        let x = Tensor::randn(0f32, 1.0, (3, 64), &dev).unwrap();
        let sep: Vec<Tensor> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
        let g = ProjectionGroup::new(parts, vec![64, 32, 32]).unwrap();
        assert!(matches!(g, ProjectionGroup::Stacked { .. }));
        for (a, b) in g.forward(&x).unwrap().iter().zip(&sep) {
            close(a, b, 1e-5);
        }
        // Mixed types stay separate.
        let w = Tensor::randn(0f32, 1.0, (32, 64), &dev).unwrap();
        let mixed = vec![mk(32), QMatMul::Tensor(w)];
        assert!(matches!(
            ProjectionGroup::new(mixed, vec![32, 32]).unwrap(),
            ProjectionGroup::Separate { .. }
        ));
    }
}
