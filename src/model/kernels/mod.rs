//! Hand-written CPU kernels for the step batch, where candle's are slow for our shapes.
//!
//! candle's quantized matmul runs one dot product per (activation row, weight row) pair and stays
//! at ~39 GFLOP/s on this machine whatever the batch, so a step over 16 sequences costs 16 steps
//! over one. Activations are quantized once per call (`q8_0::quantize_rows`, ggml's Q8_0 with
//! Q8_1's block sums). `q8_0x8` (Q8_0, Q6_K), `q4_1x8` (Q4_1, Q4_0) and `q4_kx8` (Q4_K) hold
//! weights repacked eight rows at a time, so one weight load serves 8 output columns and up to 4
//! activation rows with no horizontal sums (the engine's projections and the tied embedding use
//! them); `attn` is the attention tile (`attn_amx` the same on the tile units for prefill
//! rows), `silu` the MLP activation, `norm` the RMS norm, `rope` RoPE; `q8_0` is the earlier
//! row-at-a-time Q8_0 kernel, kept as the benchmark's baseline (`--kernels`) and as a reference
//! in tests; `amx` runs big steps on Intel's tile units from a bf16 copy; `roof` measures this machine's peaks (8-bit dot products, F32 FMAs, read
//! bandwidth) that the kernels' speed is stated against. Each kernel has a scalar reference that proptests compare it with on odd shapes. The
//! SIMD paths run only with a token from runtime CPU feature detection (`cpu::Isa`); the scalar
//! one runs everywhere else.

/// Calls a kernel that is const-generic over its activation row count with `nr` (1 to 4) rows:
/// `dispatch_rows!(nr, avx2::tile(w, a, r0, out))` becomes `avx2::tile::<4>(w, a, r0, out)` etc.
macro_rules! dispatch_rows {
    ($nr:expr, $($f:ident)::+ ($($arg:expr),* $(,)?)) => {
        match $nr {
            4 => $($f)::+::<4>($($arg),*),
            3 => $($f)::+::<3>($($arg),*),
            2 => $($f)::+::<2>($($arg),*),
            _ => $($f)::+::<1>($($arg),*),
        }
    };
}

/// As `dispatch_rows!` for the 512-bit pair kernels, with `nr` 1 to `q8_0x8::PAIR_TILE_ROWS`
/// (16): one decoded weight vector then serves every row of a 16-sequence step.
macro_rules! dispatch_pair_rows {
    ($nr:expr, $($f:ident)::+ ($($arg:expr),* $(,)?)) => {
        match $nr {
            16 => $($f)::+::<16>($($arg),*),
            15 => $($f)::+::<15>($($arg),*),
            14 => $($f)::+::<14>($($arg),*),
            13 => $($f)::+::<13>($($arg),*),
            12 => $($f)::+::<12>($($arg),*),
            11 => $($f)::+::<11>($($arg),*),
            10 => $($f)::+::<10>($($arg),*),
            9 => $($f)::+::<9>($($arg),*),
            8 => $($f)::+::<8>($($arg),*),
            7 => $($f)::+::<7>($($arg),*),
            6 => $($f)::+::<6>($($arg),*),
            5 => $($f)::+::<5>($($arg),*),
            4 => $($f)::+::<4>($($arg),*),
            3 => $($f)::+::<3>($($arg),*),
            2 => $($f)::+::<2>($($arg),*),
            _ => $($f)::+::<1>($($arg),*),
        }
    };
}

/// How far ahead the 8-row kernels prefetch their weights (about two Q4_1 groups at k = 576): at a
/// few rows a tile waits on its weight loads, not on its arithmetic, and the hardware prefetcher
/// alone left a step's projections at 53-65% of the read roof, its 2-row and 4-row steps at twice
/// and three times the one-row step (docs/performance.md, "One team of threads for a step" and
/// "Prefetching at every row count").
pub(crate) const WEIGHTS_AHEAD: usize = 5120;

/// Prefetches into L1 the `LEN` bytes `WEIGHTS_AHEAD` past `p`, a line at a time (a block whose
/// lines the previous call covered costs a hint each). Prefetches never fault, so running past a
/// matrix's end is harmless.
#[inline(always)]
pub(crate) fn prefetch_ahead<const LEN: usize>(p: *const u8) {
    prefetch_lines::<LEN>(p.wrapping_add(WEIGHTS_AHEAD));
}

/// Prefetches into L1 the `LEN` bytes from `p`, a line at a time (a hint: it never faults).
#[inline(always)]
pub(crate) fn prefetch_lines<const LEN: usize>(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut off = 0;
        while off < LEN {
            // SAFETY: SSE is baseline on x86_64, and a prefetch touches no memory it could
            // fault on.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `asm!` on x86_64, for the tile instructions (`amx`, `attn_amx`: Rust's AMX intrinsics are
/// unstable). Elsewhere no `cpu::Amx` token can exist (detection answers no), so nothing reaches
/// the functions that use it; they only need to compile.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_asm {
    ($($t:tt)*) => { std::arch::asm!($($t)*) };
}
#[cfg(not(target_arch = "x86_64"))]
macro_rules! tile_asm {
    ($($t:tt)*) => {
        unreachable!("AMX tiles exist on x86_64 only")
    };
}

pub mod amx;
pub mod amx_int8;
pub mod attn;
pub(crate) mod attn_amx;
pub(crate) mod attn_flash;
pub use attn_flash::prompt_form;
pub mod cpu;
pub mod f16;
pub mod norm;
pub mod q4_1x8;
pub mod q4_kx8;
pub mod q8_0;
pub mod q8_0x8;
pub mod roof;
pub mod rope;
pub mod silu;

use candle_core::{Storage, Tensor};

/// A buffer whose first element starts a cache line (64 bytes), for what the kernels load whole
/// lines or tile rows from. glibc's `malloc` hands out 16-byte-aligned blocks; a tile load
/// (`tileloadd`, 16 rows of 64 bytes) from such a block reads every row across two lines, several
/// times slower (docs/performance.md, "Tile loads that start on a cache line"), and a 32-byte
/// vector load from it splits a line every other time. `aligned-vec` does the allocation.
pub(crate) type Lines<T> = aligned_vec::AVec<T, aligned_vec::ConstAlign<64>>;

/// `len` copies of `value` in a `Lines` buffer.
pub(crate) fn lines<T: Clone>(value: T, len: usize) -> Lines<T> {
    let mut v = Lines::with_capacity(64, len);
    v.resize(len, value);
    v
}

/// A `Lines` buffer of `len` values written by `fill`, without zeroing it first (at a prompt's
/// 512 rows the zeroing, on one thread, cost a few percent of the step).
///
/// # Safety
/// `fill` must write every value of the slice it is given.
pub(crate) unsafe fn lines_written<T: Copy>(
    len: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) -> Lines<T> {
    let mut v: Lines<std::mem::MaybeUninit<T>> = Lines::with_capacity(64, len);
    // SAFETY: `MaybeUninit` values need no initialization.
    unsafe { v.set_len(len) };
    fill(&mut v);
    // SAFETY: the caller's `fill` wrote every value.
    unsafe { assume_written(v) }
}

/// A buffer whose every value has been written, as its values.
///
/// # Safety
/// Every value of `v` must be initialized.
pub(crate) unsafe fn assume_written<T: Copy>(v: Lines<std::mem::MaybeUninit<T>>) -> Lines<T> {
    let (ptr, align, len, cap) = v.into_raw_parts();
    // SAFETY: `MaybeUninit<T>` has `T`'s layout; the allocation, alignment, length and capacity
    // are the ones just taken apart; the caller vouches the values are initialized.
    unsafe { Lines::from_raw_parts(ptr as *mut T, align, len, cap) }
}

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

/// Runs `f` on the contents of a contiguous CPU tensor of element type `T` (F32 or F16 here).
pub fn with_cpu_slice_of<T: candle_core::WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> R,
) -> Result<R> {
    if !t.is_contiguous() {
        return Err(EngineError::InvalidBatch(
            "CPU kernels need contiguous tensors".into(),
        ));
    }
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let v = T::cpu_storage_as_slice(cpu).map_err(|e| {
                EngineError::InvalidBatch(format!("CPU kernel on the wrong element type: {e}"))
            })?;
            let start = layout.start_offset();
            Ok(f(&v[start..start + t.elem_count()]))
        }
        _ => Err(EngineError::InvalidBatch(
            "CPU kernels run on CPU tensors only".into(),
        )),
    }
}

/// Deterministic test data for the kernels' tests.
#[cfg(test)]
pub(crate) mod test_data {
    /// The AMX token, or a note on stderr that the calling test compares nothing on this CPU.
    pub fn amx_for_test(test: &str) -> Option<super::cpu::Amx> {
        let t = super::cpu::Amx::detect();
        if t.is_none() {
            eprintln!("{test}: skipped, this CPU (or kernel) gives this process no AMX tiles");
        }
        t
    }

    /// `n` successive states of a 64-bit LCG started from `seed`.
    pub fn lcg_states(seed: u64, n: usize) -> Vec<u64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                x
            })
            .collect()
    }

    /// GGUF bytes of `[n, k]` random values in [-1, 1) quantized by candle to `dtype` (ggml's
    /// quantizer), and candle's dequantization of them.
    pub fn candle_quantized(
        seed: u64,
        n: usize,
        k: usize,
        dtype: candle_core::quantized::GgmlDType,
    ) -> (Vec<u8>, Vec<f32>) {
        use candle_core::{quantized::QTensor, Device, Tensor};
        let w = Tensor::from_vec(lcg(seed, n * k), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap();
        (
            q.data().unwrap().to_vec(),
            deq.flatten_all().unwrap().to_vec1().unwrap(),
        )
    }

    /// Asserts that `got` (`[m, n]`) is, within f32 rounding, the f64 product of the quantized
    /// activations `a` with the dequantized weights `deq` (`[n, k]`).
    pub fn assert_matches_reference(
        got: &[f32],
        a: &crate::model::kernels::q8_0::QuantizedRows,
        deq: &[f32],
        n: usize,
    ) {
        let k = a.blocks * crate::model::kernels::q8_0::QK;
        for r in 0..a.rows {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| {
                        let av = a.scales[r * a.blocks + i / 32] as f64 * a.qs[r * k + i] as f64;
                        deq[j * k + i] as f64 * av
                    })
                    .sum();
                let g = got[r * n + j] as f64;
                assert!(
                    (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "({r},{j}): {g} vs {want}"
                );
            }
        }
    }

    /// `n` values in [-1, 1).
    pub fn lcg(seed: u64, n: usize) -> Vec<f32> {
        lcg_states(seed, n)
            .into_iter()
            .map(|x| ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_on_a_cache_line_and_hold_the_value() {
        for len in [1usize, 7, 64, 1000, 1 << 20] {
            let a = lines(3u16, len);
            let b = lines(0.5f32, len);
            assert_eq!(a.as_ptr() as usize % 64, 0, "u16 x {len}");
            assert_eq!(b.as_ptr() as usize % 64, 0, "f32 x {len}");
            assert!(a.len() == len && a.iter().all(|&x| x == 3));
            assert!(b.len() == len && b.iter().all(|&x| x == 0.5));
        }
    }
}
