//! CPU capabilities as values. A token for an instruction set can only be obtained from runtime
//! detection (`Avx2::detect`, `Avx512Vnni::detect`, `Avx512Bf16::detect`, `Amx::detect`, or
//! `Isa::best`, which uses them), and every
//! SIMD kernel entry point takes an `Isa`: the `unsafe` blocks that run `#[target_feature]` code
//! rely on the token, so safe code cannot run AVX2 on a CPU without it, whatever a caller or a test
//! passes. (The pattern of `pulp`'s and `multiversion`'s tokens, written here in a few lines because
//! the kernels need nothing else from those crates.)
//!
//! `Isa::best()` is what the engine runs: the highest level detected, capped by the environment
//! variable `LLAMA_RELAY_ISA` (`scalar`, `avx2`, `avx512vnni`, `avx512bf16`, `amx`) so that one
//! binary can be measured at each level. `avx512bf16` (Zen 4 and later, Cooper Lake, Intel cores
//! whose tile units are hidden) differs from `avx512vnni` only where a kernel may round to bf16: a
//! prompt's attention (`attn_flash`), as the tile units' level does, and there only where the bf16
//! form measures faster (`attn_flash::bf16_pays`).
//!
//! AMX is detected by CPUID and XCR0 rather than `is_x86_feature_detected!` (whose AMX names are
//! unstable in Rust 1.95), and only counts once Linux grants this process the tile data state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): without that grant the first tile instruction faults.

use std::sync::OnceLock;

/// Proof that the CPU has AVX2, FMA and F16C (every AVX2 CPU has the other two, but the kernels
/// use them, so detection checks them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2(());

impl Avx2 {
    /// The token, when this CPU has the features.
    pub fn detect() -> Option<Avx2> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        });
        has.then_some(Avx2(()))
    }
}

/// Proof that the CPU has everything `Avx2` stands for plus AVX-512 F, BW, VL and VNNI (the 8-bit
/// dot product `vpdpbusd`, used here on 256-bit vectors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Vnni(());

impl Avx512Vnni {
    /// The token, when this CPU has the features.
    pub fn detect() -> Option<Avx512Vnni> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                Avx2::detect().is_some()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        });
        has.then_some(Avx512Vnni(()))
    }

    /// The AVX2 token this one implies.
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

/// Proof that the CPU has everything `Avx512Vnni` stands for plus AVX-512 BF16 (`vdpbf16ps`: pairs
/// of bf16 products summed into F32 lanes, twice the F32 FMA's products an instruction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Bf16(());

impl Avx512Bf16 {
    /// The token, when this CPU has the features.
    pub fn detect() -> Option<Avx512Bf16> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                Avx512Vnni::detect().is_some() && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        });
        has.then_some(Avx512Bf16(()))
    }

    /// The AVX-512 VNNI token this one implies.
    pub fn vnni(self) -> Avx512Vnni {
        Avx512Vnni(())
    }
}

/// Proof that the CPU has everything `Avx512Vnni` stands for plus AVX-512 BF16, AMX-TILE,
/// AMX-BF16 and AMX-INT8 (Intel Sapphire Rapids and later), the OS saves the tile state, and this
/// process may use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amx(());

impl Amx {
    /// The token, when this CPU and kernel let this process run tile instructions.
    pub fn detect() -> Option<Amx> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            let bf16 = std::arch::is_x86_feature_detected!("avx512bf16");
            #[cfg(not(target_arch = "x86_64"))]
            let bf16 = false;
            Avx512Vnni::detect().is_some() && bf16 && amx_granted()
        });
        has.then_some(Amx(()))
    }

    /// The AVX-512 VNNI token this one implies.
    pub fn vnni(self) -> Avx512Vnni {
        Avx512Vnni(())
    }

    /// The AVX-512 BF16 token this one implies (`detect` checks the feature).
    pub fn bf16(self) -> Avx512Bf16 {
        Avx512Bf16(())
    }
}

/// CPUID leaf 7 says AMX-TILE, AMX-BF16 and AMX-INT8, XCR0 has the tile config and data bits
/// set, and Linux grants the permission to use the tile data (asked once per process).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_granted() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only when the CPU reports it.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    const AMX_INT8: u32 = 1 << 25;
    let all = AMX_BF16 | AMX_TILE | AMX_INT8;
    if leaf7.edx & all != all {
        return false;
    }
    // OSXSAVE (leaf 1, ECX bit 27) says XGETBV may run.
    if __cpuid(1).ecx & (1 << 27) == 0 {
        return false;
    }
    // SAFETY: OSXSAVE is set, so XGETBV is enabled; it reads XCR0 and has no other effect.
    let xcr0 = unsafe { xgetbv0() };
    const XTILE: u64 = (1 << 17) | (1 << 18);
    if xcr0 & XTILE != XTILE {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes which XSAVE states this process
    // may use; it reads no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_granted() -> bool {
    false
}

/// The instruction-set level a kernel call runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// The portable reference code.
    Scalar,
    Avx2(Avx2),
    Avx512Vnni(Avx512Vnni),
    /// AVX-512 VNNI plus BF16: a prompt's attention on bf16 dot products (`attn_flash`).
    Avx512Bf16(Avx512Bf16),
    /// AVX-512 VNNI and BF16 plus the tile units: the VNNI kernels for small steps, bf16 tiles for big ones.
    Amx(Amx),
}

impl Isa {
    /// The highest level this CPU has, capped by `LLAMA_RELAY_ISA` when set; decided once per
    /// process (an unknown value is reported on stderr and ignored).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let all = Isa::available();
            let top = *all.last().expect("scalar is always available");
            match std::env::var("LLAMA_RELAY_ISA") {
                Ok(cap) => match all.iter().find(|i| i.name() == cap.trim()) {
                    Some(&i) => i,
                    None => {
                        eprintln!(
                            "LLAMA_RELAY_ISA={cap:?} is not one of this CPU's levels ({}); using {}",
                            all.iter().map(|i| i.name()).collect::<Vec<_>>().join(", "),
                            top.name()
                        );
                        top
                    }
                },
                Err(_) => top,
            }
        })
    }

    /// Every level this CPU has, lowest first: tests compare each with the scalar reference.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        v.extend(Avx2::detect().map(Isa::Avx2));
        v.extend(Avx512Vnni::detect().map(Isa::Avx512Vnni));
        v.extend(Avx512Bf16::detect().map(Isa::Avx512Bf16));
        v.extend(Amx::detect().map(Isa::Amx));
        v
    }

    /// The levels above scalar that this CPU has; when there are none, says on stderr that the
    /// calling test compares nothing (so a run on such a CPU shows what it skipped).
    #[cfg(test)]
    pub(crate) fn simd_levels_for_test(test: &str) -> Vec<Isa> {
        let v: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|i| *i != Isa::Scalar)
            .collect();
        if v.is_empty() {
            eprintln!("{test}: skipped, this CPU has no SIMD level (AVX2 + FMA + F16C) to compare");
        }
        v
    }

    /// The AVX2 token, when this level includes AVX2.
    pub fn avx2(self) -> Option<Avx2> {
        match self {
            Isa::Scalar => None,
            Isa::Avx2(t) => Some(t),
            Isa::Avx512Vnni(t) => Some(t.avx2()),
            Isa::Avx512Bf16(t) => Some(t.vnni().avx2()),
            Isa::Amx(t) => Some(t.vnni().avx2()),
        }
    }

    /// The AVX-512 VNNI token, when this level includes it.
    pub fn avx512_vnni(self) -> Option<Avx512Vnni> {
        match self {
            Isa::Avx512Vnni(t) => Some(t),
            Isa::Avx512Bf16(t) => Some(t.vnni()),
            Isa::Amx(t) => Some(t.vnni()),
            _ => None,
        }
    }

    /// The AVX-512 BF16 token, when this level includes it.
    pub fn avx512_bf16(self) -> Option<Avx512Bf16> {
        match self {
            Isa::Avx512Bf16(t) => Some(t),
            Isa::Amx(t) => Some(t.bf16()),
            _ => None,
        }
    }

    /// The AMX token, when this level includes it.
    pub fn amx(self) -> Option<Amx> {
        match self {
            Isa::Amx(t) => Some(t),
            _ => None,
        }
    }

    /// The level's name, as `LLAMA_RELAY_ISA` and the logs spell it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2(_) => "avx2",
            Isa::Avx512Vnni(_) => "avx512vnni",
            Isa::Avx512Bf16(_) => "avx512bf16",
            Isa::Amx(_) => "amx",
        }
    }
}

/// Whether a 512-bit kernel runs faster here than the 256-bit one it would replace
/// (`second_pays` with the forms named `256` and `512`). Measured, never assumed: a 512-bit op
/// takes one issue slot for two 256-bit ones but has the same peak on Zen 4, and on other cores
/// 512-bit code may lower the clock.
pub(crate) fn wide_pays(
    what: &str,
    env: &str,
    reps: usize,
    narrow: impl FnMut(),
    wide: impl FnMut(),
) -> bool {
    second_pays(what, env, ["256", "512"], reps, narrow, wide)
}

/// Whether the second of two forms of a kernel runs faster here than the first: the environment
/// variable `env` when it names one of `names` (the first's, then the second's), else timed:
/// `first` and `second` (each `reps` passes over the same cache-resident data) alternating, best
/// of 7 rounds each; the second must win by 5%. For choices whose answer differs between machine
/// classes (a 512-bit op's rate and clock; `vdpbf16ps`, twice the F32 FMA's products on Zen 4 and
/// half its rate on Intel cores without tile units), so the class is measured, not guessed from
/// its feature flags. Logs both times (`what`, per pass) at info. Callers keep the answer (a
/// `OnceLock`).
pub(crate) fn second_pays(
    what: &str,
    env: &str,
    names: [&str; 2],
    reps: usize,
    mut first: impl FnMut(),
    mut second: impl FnMut(),
) -> bool {
    if let Ok(v) = std::env::var(env) {
        match names.iter().position(|n| *n == v.as_str()) {
            Some(i) => return i == 1,
            None => tracing::warn!("{env}={v:?} is not {} or {}; measuring", names[0], names[1]),
        }
    }
    let time = |f: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        for _ in 0..reps {
            f();
        }
        start.elapsed()
    };
    let (mut a, mut b) = (std::time::Duration::MAX, std::time::Duration::MAX);
    for _ in 0..7 {
        a = a.min(time(&mut first));
        b = b.min(time(&mut second));
    }
    let pick = b.as_secs_f64() < 0.95 * a.as_secs_f64();
    let per_pass = |d: std::time::Duration| d.as_secs_f64() * 1e6 / reps as f64;
    tracing::info!(
        "{what}: {} {:.1} us, {} {:.1} us a pass; using {}",
        names[1],
        per_pass(b),
        names[0],
        per_pass(a),
        names[usize::from(pick)]
    );
    pick
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_imply_each_other() {
        let all = Isa::available();
        assert_eq!(all[0], Isa::Scalar);
        for i in &all {
            if i.avx512_vnni().is_some() {
                assert!(i.avx2().is_some(), "VNNI implies AVX2");
            }
            if i.avx512_bf16().is_some() {
                assert!(i.avx512_vnni().is_some(), "BF16 implies VNNI");
            }
            if i.amx().is_some() {
                assert!(i.avx512_bf16().is_some(), "AMX implies BF16");
            }
        }
        assert!(all.contains(&Isa::best()));
        assert_eq!(Isa::Scalar.avx2(), None);
    }

    /// The timed choice takes the form that runs faster, whichever comes second, and needs it to
    /// win (here by a millisecond a pass against none).
    #[test]
    fn second_pays_picks_the_faster_form() {
        let slow = || std::thread::sleep(std::time::Duration::from_millis(1));
        let names = ["first", "second"];
        let unset = "LLAMA_RELAY_TEST_UNSET_CHOICE";
        assert!(second_pays("test", unset, names, 1, slow, || ()));
        assert!(!second_pays("test", unset, names, 1, || (), slow));
    }
}
