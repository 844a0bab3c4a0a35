//! Tells the tests whether this machine has Intel's tile units: the AMX kernels' unit tests are
//! then reported as ignored, with the reason, on machines without them, rather than passing
//! without comparing anything (the kernels themselves choose by runtime detection, `cpu::Amx`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(amx_tiles)");
    println!("cargo::rerun-if-changed=build.rs");
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    if has("amx_tile") && has("amx_bf16") && has("amx_int8") {
        println!("cargo::rustc-cfg=amx_tiles");
    }
}
