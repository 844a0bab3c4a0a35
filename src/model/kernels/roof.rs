//! This machine's roof, measured rather than assumed from a data sheet: the peak rate of the 8-bit
//! dot product the quantized kernels are built on (`vpdpbusd`, on 256- and 512-bit vectors where
//! AVX-512 VNNI is detected; AVX2's `vpmaddubsw` summed in 16 bits otherwise), the F32 FMA peak,
//! and the read bandwidth from memory, each on a given number of threads. The kernels' speed is
//! stated as a share of these (`cargo bench --bench engine -- --roof`), which is how a kernel
//! change is judged on a machine class: the ratio of one run, not a figure from another machine.
//!
//! Each peak is a loop of independent accumulators (enough to hide the instruction's latency on
//! every core this project runs on) with no memory traffic; the bandwidth is a streaming sum over
//! a buffer far larger than the last-level cache. Like the kernels, the SIMD loops run only with a
//! token from runtime detection (`cpu::Isa`); a CPU without one gets the scalar loops' figures.
//! Written here because no crate measures these for a Rust program (llama.cpp and vLLM print no
//! roof; `likwid-bench` and STREAM are C tools outside the build).

use std::sync::Barrier;
use std::time::Instant;

use crate::model::kernels::cpu::Isa;

/// The measured peaks, on `threads` threads.
#[derive(Debug, Clone, PartialEq)]
pub struct Roof {
    pub threads: usize,
    /// The instruction-set level the loops ran at.
    pub isa: &'static str,
    /// 8-bit multiply-adds, in GOP/s (a multiply and an add are two operations, as GFLOP/s
    /// counts an FMA), on 256-bit vectors (the kernels' width today).
    pub int8_256: f64,
    /// The same on 512-bit vectors, where AVX-512 VNNI is detected: above `int8_256` only on
    /// cores that run 512-bit `vpdpbusd` at full rate (not on Zen 4, which splits it in two).
    pub int8_512: Option<f64>,
    /// F32 FMAs, in GFLOP/s, on 256-bit vectors, and on 512-bit ones where AVX-512 is detected.
    pub f32_256: f64,
    pub f32_512: Option<f64>,
    /// Reading memory, in GB/s (10^9 bytes).
    pub read_gbs: f64,
    /// bf16 multiply-adds on the tile units (`tdpbf16ps`), in GFLOP/s, where AMX is detected.
    pub amx_bf16: Option<f64>,
    /// bf16 pair products summed into F32 (`vdpbf16ps`, 512-bit), in GFLOP/s, where AVX-512 BF16
    /// is detected: the roof of a prompt's attention there (`attn_flash`).
    pub bf16_512: Option<f64>,
}

impl Roof {
    /// Measures the roof on `threads` threads (each loop the median of `reps`).
    pub fn measure(isa: Isa, threads: usize, reps: usize) -> Roof {
        let threads = threads.max(1);
        let reps = reps.max(3);
        let peak = |width: Width, kind: Kind| {
            median_rate(reps, threads, |iters| run(isa, width, kind, iters))
        };
        let wide = isa.avx512_vnni().is_some();
        Roof {
            threads,
            isa: isa.name(),
            int8_256: peak(Width::W256, Kind::Int8),
            int8_512: wide.then(|| peak(Width::W512, Kind::Int8)),
            f32_256: peak(Width::W256, Kind::F32),
            f32_512: wide.then(|| peak(Width::W512, Kind::F32)),
            read_gbs: read_bandwidth(isa, threads, reps),
            amx_bf16: isa
                .amx()
                .map(|t| median_rate(reps, threads, |iters| super::amx::peak(t, iters))),
            bf16_512: isa.avx512_bf16().map(|_| peak(Width::W512, Kind::Bf16)),
        }
    }

    /// The best F32 FMA rate this machine showed, at either width.
    pub fn f32(&self) -> f64 {
        self.f32_256.max(self.f32_512.unwrap_or(0.0))
    }

    /// The best 8-bit rate this machine showed, at either width.
    pub fn int8(&self) -> f64 {
        self.int8_256.max(self.int8_512.unwrap_or(0.0))
    }

    /// Each peak the higher of two measurements on the same machine and threads. A roof is the
    /// best the machine does; on a VM whose speed swings between phases one measurement can
    /// land in a slow one, which would overstate every share stated against it.
    pub fn best_of(&self, other: &Roof) -> Roof {
        let hi = f64::max;
        let hi_opt = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Roof {
            threads: self.threads,
            isa: self.isa,
            int8_256: hi(self.int8_256, other.int8_256),
            int8_512: hi_opt(self.int8_512, other.int8_512),
            f32_256: hi(self.f32_256, other.f32_256),
            f32_512: hi_opt(self.f32_512, other.f32_512),
            read_gbs: hi(self.read_gbs, other.read_gbs),
            amx_bf16: hi_opt(self.amx_bf16, other.amx_bf16),
            bf16_512: hi_opt(self.bf16_512, other.bf16_512),
        }
    }
}

#[derive(Clone, Copy)]
enum Width {
    W256,
    W512,
}

#[derive(Clone, Copy)]
enum Kind {
    Int8,
    F32,
    Bf16,
}

/// Accumulators per loop: more than latency x throughput of `vpdpbusd` and `vfmadd` on every
/// core this project runs on (5 x 2 on Zen 4, 5 x 1-2 on Ice Lake), fewer than the 16 registers
/// of AVX2.
const ACC: usize = 12;

/// Runs `iters` iterations of a peak loop; returns the operations done (and a value the
/// compiler cannot drop).
fn run(isa: Isa, width: Width, kind: Kind, iters: usize) -> (f64, i64) {
    let (per, sink) = peak_loop(isa, width, kind, iters);
    ((ACC * per * iters) as f64, sink)
}

/// The loop for this level, width and kind: the operations one accumulator does an iteration,
/// and the loop's value.
fn peak_loop(isa: Isa, width: Width, kind: Kind, iters: usize) -> (usize, i64) {
    #[cfg(target_arch = "x86_64")]
    {
        let (vnni, avx2) = (isa.avx512_vnni().is_some(), isa.avx2().is_some());
        let bf16 = isa.avx512_bf16().is_some();
        // SAFETY: each loop runs only with the token that proves its features (`vnni`: AVX-512
        // F/BW/VL/VNNI; `bf16`: AVX-512 F and BF16; `avx2`: AVX2 and FMA).
        unsafe {
            match (kind, width) {
                (Kind::Bf16, _) if bf16 => return (64, x86::dpbf16_512(iters)),
                (Kind::Int8, Width::W512) if vnni => return (128, x86::dpbusd_512(iters)),
                (Kind::F32, Width::W512) if vnni => return (32, x86::fma_512(iters)),
                (Kind::Int8, _) if vnni => return (64, x86::dpbusd_256(iters)),
                // vpmaddubsw: 32 byte products summed in pairs (16-bit), the 32 multiply-adds
                // of one 256-bit vpdpbusd; the kernels add them up in 16 bits, then widen.
                (Kind::Int8, _) if avx2 => return (64, x86::maddubs_256(iters)),
                (Kind::F32, _) if avx2 => return (16, x86::fma_256(iters)),
                _ => {}
            }
        }
    }
    let _ = (isa, width);
    match kind {
        Kind::Int8 => (2, scalar_int8(iters)),
        Kind::F32 | Kind::Bf16 => (2, scalar_f32(iters) as i64),
    }
}

fn scalar_int8(iters: usize) -> i64 {
    let (a, b) = std::hint::black_box((3i32, 5i32));
    let mut acc = [0i32; ACC];
    for _ in 0..iters {
        for (i, x) in acc.iter_mut().enumerate() {
            *x = x.wrapping_add(a * (b + i as i32));
        }
    }
    acc.iter().map(|&x| i64::from(x)).sum()
}

fn scalar_f32(iters: usize) -> f64 {
    let (a, b) = std::hint::black_box((1.000_001f32, 1e-7f32));
    let mut acc = [1.0f32; ACC];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = x.mul_add(a, b);
        }
    }
    acc.iter().map(|&x| f64::from(x)).sum()
}

/// Operations a second of `f` (given iterations, returning operations done and a sink value) on
/// `threads` threads started together, the median of `reps` runs sized to about 50 ms each.
fn median_rate(reps: usize, threads: usize, f: impl Fn(usize) -> (f64, i64) + Sync) -> f64 {
    // Size the run: double the iterations until one thread takes 20 ms.
    let mut iters = 1 << 12;
    loop {
        let t = Instant::now();
        std::hint::black_box(f(iters));
        if t.elapsed().as_secs_f64() > 0.02 || iters > 1 << 34 {
            break;
        }
        iters *= 2;
    }
    let iters = iters * 5 / 2;
    let mut rates: Vec<f64> = (0..reps)
        .map(|_| {
            let (ops, secs) = on_threads(threads, || f(iters));
            ops / secs / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// Runs `f` on `threads` threads released together; the operations they did and the seconds
/// from the release to the last one's end.
fn on_threads(threads: usize, f: impl Fn() -> (f64, i64) + Sync) -> (f64, f64) {
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let r = f();
                    (r, Instant::now())
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        let mut ops = 0.0;
        let mut end = t0;
        for h in handles {
            let ((o, sink), t) = h.join().expect("a roof thread");
            std::hint::black_box(sink);
            ops += o;
            end = end.max(t);
        }
        (ops, (end - t0).as_secs_f64())
    })
}

/// Bytes each thread streams in a bandwidth run: well past any last-level cache here (32 MiB on
/// the EPYCs, 48 MiB on Ice Lake-SP).
const STREAM_BYTES: usize = 128 << 20;

/// GB/s of `threads` threads each summing its own `STREAM_BYTES` buffer (the median of `reps`
/// passes, after one that faults the pages in), on 2 MiB pages where the kernel gives them, as
/// the weights are (`huge_pages`).
fn read_bandwidth(isa: Isa, threads: usize, reps: usize) -> f64 {
    let bufs: Vec<Vec<u64>> = (0..threads)
        .map(|t| vec![t as u64 + 1; STREAM_BYTES / 8])
        .collect();
    let spans: Vec<(usize, usize)> = bufs
        .iter()
        .map(|b| (b.as_ptr() as usize, b.len() * 8))
        .collect();
    crate::huge_pages::collapse(&spans);
    let pass = || {
        let next = std::sync::atomic::AtomicUsize::new(0);
        on_threads(threads, || {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let sum = sum_words(isa, &bufs[i]);
            (STREAM_BYTES as f64, sum as i64)
        })
    };
    pass();
    let mut rates: Vec<f64> = (0..reps)
        .map(|_| {
            let (bytes, secs) = pass();
            bytes / secs / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn sum_words(isa: Isa, words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2().is_some() {
        // SAFETY: the token proves AVX2.
        return unsafe { x86::sum_256(words) };
    }
    let _ = isa;
    let mut acc = [0u64; 4];
    let chunks = words.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*w);
        }
    }
    acc.iter().chain(rest).fold(0, |s, &a| s.wrapping_add(a))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::ACC;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dpbusd_512(iters: usize) -> i64 {
        let (a, b) = std::hint::black_box((_mm512_set1_epi8(1), _mm512_set1_epi8(2)));
        let mut acc = [_mm512_setzero_si512(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        let s = acc
            .iter()
            .fold(_mm512_setzero_si512(), |s, &x| _mm512_add_epi32(s, x));
        i64::from(_mm512_reduce_add_epi32(s))
    }

    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn dpbusd_256(iters: usize) -> i64 {
        let (a, b) = std::hint::black_box((_mm256_set1_epi8(1), _mm256_set1_epi8(2)));
        let mut acc = [_mm256_setzero_si256(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_dpbusd_epi32(*x, a, b);
            }
        }
        let s = acc
            .iter()
            .fold(_mm256_setzero_si256(), |s, &x| _mm256_add_epi32(s, x));
        i64::from(_mm256_extract_epi32::<0>(s))
    }

    /// `vpmaddubsw` summed in 16 bits (`vpaddw`), as the AVX2 kernels' inner loops do (they widen
    /// to 32 bits once a block). Its inputs do not change from one iteration to the next, so
    /// the compiler would hoist the product out of the loop and time the adds alone (it did:
    /// the roof read 2-3x too high); an empty `asm!` that claims to change `a` before each
    /// product keeps every one in the loop at no cost.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn maddubs_256(iters: usize) -> i64 {
        let (mut a, b) = std::hint::black_box((_mm256_set1_epi8(1), _mm256_set1_epi8(2)));
        let mut acc = [_mm256_setzero_si256(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                std::arch::asm!("/* {0} */", inout(ymm_reg) a, options(nomem, nostack, preserves_flags));
                *x = _mm256_add_epi16(*x, _mm256_maddubs_epi16(a, b));
            }
        }
        let s = acc
            .iter()
            .fold(_mm256_setzero_si256(), |s, &x| _mm256_add_epi16(s, x));
        let s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
        i64::from(_mm256_extract_epi32::<0>(s))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_512(iters: usize) -> i64 {
        let (a, b) = std::hint::black_box((_mm512_set1_ps(1.000_001), _mm512_set1_ps(1e-7)));
        let mut acc = [_mm512_set1_ps(1.0); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let s = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(s) as i64
    }

    /// `vdpbf16ps`: each of 16 lanes adds two bf16 products (here 1 x 1) an instruction.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dpbf16_512(iters: usize) -> i64 {
        let one = std::hint::black_box(_mm512_set1_epi16(0x3f80));
        // SAFETY: both are 64 bytes of plain vector data.
        let one = std::mem::transmute::<__m512i, __m512bh>(one);
        let mut acc = [_mm512_setzero_ps(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, one, one);
            }
        }
        let s = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(s) as i64
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_256(iters: usize) -> i64 {
        let (a, b) = std::hint::black_box((_mm256_set1_ps(1.000_001), _mm256_set1_ps(1e-7)));
        let mut acc = [_mm256_set1_ps(1.0); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let s = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum::<f32>() as i64
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_256(words: &[u64]) -> u64 {
        let mut acc = [_mm256_setzero_si256(); 4];
        let chunks = words.chunks_exact(16);
        let rest = chunks.remainder();
        for c in chunks {
            for (j, a) in acc.iter_mut().enumerate() {
                let v = _mm256_loadu_si256(c.as_ptr().add(4 * j) as *const __m256i);
                *a = _mm256_add_epi64(*a, v);
            }
        }
        let s = acc
            .iter()
            .fold(_mm256_setzero_si256(), |s, &x| _mm256_add_epi64(s, x));
        let mut out = [0u64; 4];
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, s);
        out.iter().chain(rest).fold(0, |s, &w| s.wrapping_add(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_of_two_roofs_takes_each_peak_higher() {
        let a = Roof {
            threads: 2,
            isa: "amx",
            int8_256: 1000.0,
            int8_512: Some(1400.0),
            f32_256: 170.0,
            f32_512: None,
            read_gbs: 42.0,
            amx_bf16: Some(6000.0),
            bf16_512: None,
        };
        let b = Roof {
            int8_256: 900.0,
            int8_512: Some(2000.0),
            f32_256: 250.0,
            f32_512: Some(490.0),
            read_gbs: 31.0,
            amx_bf16: None,
            bf16_512: Some(700.0),
            ..a.clone()
        };
        let want = Roof {
            int8_256: 1000.0,
            int8_512: Some(2000.0),
            f32_256: 250.0,
            f32_512: Some(490.0),
            read_gbs: 42.0,
            amx_bf16: Some(6000.0),
            bf16_512: Some(700.0),
            ..a.clone()
        };
        assert_eq!(a.best_of(&b), want);
        assert_eq!(b.best_of(&a), want);
        assert_eq!(want.int8(), 2000.0);
    }

    #[test]
    fn every_level_sums_the_same_words() {
        let words: Vec<u64> = (0..1003u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let want = words.iter().fold(0u64, |s, &w| s.wrapping_add(w));
        for isa in Isa::available() {
            assert_eq!(sum_words(isa, &words), want, "{}", isa.name());
        }
    }

    #[test]
    fn the_peak_loops_do_the_work_they_count() {
        // 8-bit, 256 bits: each of the ACC accumulators' 32-bit lanes adds four 1 * 2 products an
        // iteration, so lane 0 of their sum is ACC * 8 * iters, whichever instructions do it; at
        // 512 bits the whole vector's sum comes back (16 lanes).
        for isa in Isa::available() {
            let (ops, sink) = run(isa, Width::W256, Kind::Int8, 10);
            if isa.avx2().is_some() {
                assert_eq!(sink, (ACC * 8 * 10) as i64, "{}", isa.name());
                assert_eq!(ops, (ACC * 64 * 10) as f64, "{}", isa.name());
            }
            let (ops512, sink512) = run(isa, Width::W512, Kind::Int8, 10);
            if isa.avx512_vnni().is_some() {
                assert_eq!(sink512, (ACC * 8 * 10 * 16) as i64);
                assert_eq!(ops512, 2.0 * ops);
            }
            // F32: (1 + 1e-7 per step) stays near 1 in each of ACC accumulators.
            let (flops, sum) = run(isa, Width::W256, Kind::F32, 10);
            assert!(flops > 0.0 && sum > 0, "{}", isa.name());
            // bf16: each of 16 lanes adds 1 x 1 + 1 x 1 an iteration in each accumulator.
            if isa.avx512_bf16().is_some() {
                let (flops, sum) = run(isa, Width::W512, Kind::Bf16, 10);
                assert_eq!(sum, (ACC * 16 * 2 * 10) as i64, "{}", isa.name());
                assert_eq!(flops, (ACC * 64 * 10) as f64);
            }
        }
    }
}
