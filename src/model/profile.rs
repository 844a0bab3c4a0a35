//! Where a step's time goes, part by part: the roof report's per-part table
//! (`cargo bench --bench engine -- --roof`). A process-wide switch, off unless a benchmark turns
//! it on (then one relaxed atomic load a part), and per-part totals of the wall time the step's
//! thread spent in each. The parts of a layer run one after another on that thread (each
//! parallel inside, its threads' waiting for each other included), so their times add up to the
//! step's, less what no part covers (the step's set-up and glue). `Quantize` runs inside the
//! projections and is also counted in theirs. Hand-written: a tracing span per op would cost more
//! than the small ops it measures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Token embeddings looked up.
    Embed,
    /// RMS norms (two a layer, one before the LM head); on the tile units' path they write the
    /// projections' bf16 input tiles, so the rounding is counted here.
    Norm,
    /// The Q/K/V projection (stacked).
    Qkv,
    /// Rotary embeddings of Q and K.
    Rope,
    /// K and V written into the cache.
    KvWrite,
    /// Attention over the cache.
    Attention,
    /// The attention output projection.
    O,
    /// The gate and up projections (stacked).
    GateUp,
    /// SiLU(gate) * up (on the tile units' path it runs in `GateUp`'s epilogue and counts there).
    Silu,
    /// The down projection.
    Down,
    /// Residual additions (on the tile units' path they run in `O`'s and `Down`'s epilogues and
    /// count there).
    Residual,
    /// The output projection to the vocabulary.
    LmHead,
    /// Activations quantized to 8 bits (inside the projections' time too).
    Quantize,
}

impl Part {
    pub const ALL: [Part; 13] = [
        Part::Embed,
        Part::Norm,
        Part::Qkv,
        Part::Rope,
        Part::KvWrite,
        Part::Attention,
        Part::O,
        Part::GateUp,
        Part::Silu,
        Part::Down,
        Part::Residual,
        Part::LmHead,
        Part::Quantize,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Part::Embed => "embed",
            Part::Norm => "norms",
            Part::Qkv => "qkv",
            Part::Rope => "rope",
            Part::KvWrite => "kv write",
            Part::Attention => "attention",
            Part::O => "o",
            Part::GateUp => "gate_up",
            Part::Silu => "silu",
            Part::Down => "down",
            Part::Residual => "residual",
            Part::LmHead => "lm_head",
            Part::Quantize => "quantize (in projections)",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: [AtomicU64; 13] = [const { AtomicU64::new(0) }; 13];

/// Turns timing on or off and clears the totals.
pub fn enable(on: bool) {
    for t in &TOTALS {
        t.store(0, Ordering::Relaxed);
    }
    ON.store(on, Ordering::Relaxed);
}

/// The totals since `enable`, per part, and clears them.
pub fn take() -> Vec<(Part, Duration)> {
    Part::ALL
        .iter()
        .map(|&p| {
            let ns = TOTALS[p as usize].swap(0, Ordering::Relaxed);
            (p, Duration::from_nanos(ns))
        })
        .collect()
}

/// Runs `f`, adding its wall time to `part` when timing is on.
#[inline]
pub fn time<T>(part: Part, f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    TOTALS[part as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_add_only_while_on() {
        // Only this test turns timing on; other tests' steps may add to it while it is.
        enable(false);
        time(Part::Silu, || std::thread::sleep(Duration::from_millis(2)));
        assert!(take().iter().all(|(_, d)| d.is_zero()));
        enable(true);
        time(Part::Silu, || std::thread::sleep(Duration::from_millis(2)));
        let t = take();
        enable(false);
        let silu = t.iter().find(|(q, _)| *q == Part::Silu).unwrap().1;
        assert!(silu >= Duration::from_millis(2), "{silu:?}");
        for (i, p) in Part::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "ALL in declaration order");
        }
    }
}
