//! Hand-written CPU kernels for the step batch, where candle's are slow for our shapes.
//!
//! candle's quantized matmul runs one dot product per (activation row, weight row) pair and stays
//! at ~39 GFLOP/s on this machine whatever the batch, so a step over 16 sequences costs 16 steps
//! over one. `q8_0` loads each weight block once for a tile of activation rows; `q4_1` does the
//! same for Q4_1 weights kept as stored (`weights = "keep"`), where candle has only a scalar loop.
//! Each kernel has a scalar reference that the tests compare it with; the SIMD path is chosen at run time by CPU
//! feature detection.

pub mod q4_1;
pub mod q8_0;
pub mod q8_0x8;
pub mod rope;

use candle_core::{Storage, Tensor};

use crate::error::{EngineError, Result};

/// Runs `f` on the F32 contents of a contiguous CPU tensor.
pub fn with_cpu_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if !t.is_contiguous() {
        return Err(EngineError::InvalidBatch(
            "CPU kernels need contiguous tensors".into(),
        ));
    }
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(candle_core::CpuStorage::F32(v)) => {
            let start = layout.start_offset();
            Ok(f(&v[start..start + t.elem_count()]))
        }
        _ => Err(EngineError::InvalidBatch(
            "CPU kernels run on F32 CPU tensors only".into(),
        )),
    }
}
