//! The batched step on a CUDA GPU (`cuda:0`) against transformers' references and the CPU F32
//! path, on the tiny Llama 3 fixture models: weights, the paged KV cache and attention over block
//! tables all on the device. Every test here is named `gpu_*`. Built without the `cuda` feature they
//! are reported as ignored, with the reason. Built with it, on a machine where no GPU answers, each
//! prints `skipped: no CUDA device answers` and returns (CI's cuda build checks that line), unless
//! `LLAMA_RELAY_REQUIRE_GPU` is set: then a missing device fails them. `scripts/gpu-check.sh`
//! sets it and runs them on a GPU machine (`cargo test --release --features cuda gpu_`).

use candle_core::Device;
use llama_relay::engine::Engine;
use llama_relay::generate::{generate, GenerateParams};
use llama_relay::kv_cache::KvDtype;
use llama_relay::model::AttentionImpl;

use crate::common::*;
use crate::tiny_llama3::{batch3, prompt_logits, run_batched};

/// The first CUDA device, or `None` with the reason printed (a panic where
/// `LLAMA_RELAY_REQUIRE_GPU` is set).
fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            // (candle appends a backtrace when RUST_BACKTRACE is set.)
            let e = e.to_string();
            let reason = e.lines().next().unwrap_or_default();
            assert!(
                std::env::var_os("LLAMA_RELAY_REQUIRE_GPU").is_none(),
                "LLAMA_RELAY_REQUIRE_GPU is set and no CUDA device answers: {reason}"
            );
            eprintln!("skipped: no CUDA device answers: {reason}");
            None
        }
    }
}

fn on(device: &Device, which: Tiny, kv: KvDtype) -> Engine {
    which.load_with(16, |o| {
        o.device = device.clone();
        // What `auto` picks on a GPU, named so that a trial of these tests on the CPU takes the
        // same path.
        o.attention = Some(AttentionImpl::Generic);
        o.kv_dtype = kv;
    })
}

/// Prompt logits within 1e-3 of the fp32 reference and of the CPU F32 path, whole and in chunks
/// of 256 (a 1,024-token prompt over four steps reads its earlier blocks from the device cache).
fn check_prompts(which: Tiny) {
    let Some(dev) = gpu() else { return };
    let _g = model_lock();
    let exp = which.expected();
    let mut cpu = which.load(16);
    let mut gpu = on(&dev, which, KvDtype::F32);
    for (name, chunk) in [("prompt24", usize::MAX), ("long1024", 256)] {
        let prompt = ids(&exp[name]["ids"]);
        let (_, want) = read_npy(&which.fixture_dir().join(format!("logits_{name}_last.npy")));
        let got = prompt_logits(&mut gpu, &prompt, chunk);
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-3, "{which:?} {name} on the GPU vs reference: {d}");
        let d = max_abs_diff(&got, &prompt_logits(&mut cpu, &prompt, chunk));
        assert!(d < 1e-3, "{which:?} {name} on the GPU vs the CPU: {d}");
        assert_eq!(gpu.pool.used_count(), 0);
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_tied_prompt_logits_match_reference_and_cpu() {
    check_prompts(Tiny::Tied);
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_untied_prompt_logits_match_reference_and_cpu() {
    check_prompts(Tiny::Untied);
}

/// Three prompts in one step, then eight greedy tokens each (four with the F16 cache, as on the
/// CPU), batched: the reference's logits and each prompt's greedy ids run alone; prefilled in
/// chunks of 7 beside each other, the same. F16 keeps 11 bits of each K/V value: the CPU's
/// F16 test's tolerance.
fn check_batched(which: Tiny, kv: KvDtype) {
    let Some(dev) = gpu() else { return };
    let _g = model_lock();
    let exp = which.expected();
    let mut e = on(&dev, which, kv);
    let prompts = batch3(&exp);
    let (shape, want) = read_npy(&which.fixture_dir().join("logits_batch3_last.npy"));
    let vocab = shape[1];
    // The CPU's F16 and Q8 tests' tolerances (`tiny_llama3::kv_cache_against_f32`).
    let (tol, n) = match kv {
        KvDtype::F32 => (1e-3, 8),
        KvDtype::F16 => (2e-2, 4),
        KvDtype::Q8 => (0.25, 4),
    };
    for chunk in [usize::MAX, 7] {
        for (i, (logits, greedy)) in run_batched(&mut e, &prompts, chunk, n).iter().enumerate() {
            let d = max_abs_diff(logits, &want[i * vocab..(i + 1) * vocab]);
            assert!(d < tol, "{which:?} {kv:?} chunk {chunk} row {i}: {d}");
            assert_eq!(
                greedy[..],
                ids(&exp["batch3"]["greedy_8_each_alone"][i])[..n],
                "{which:?} {kv:?} chunk {chunk} prompt {i}"
            );
        }
        assert_eq!(e.pool.used_count(), 0);
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_batched_step_equals_each_alone() {
    check_batched(Tiny::Tied, KvDtype::F32);
    check_batched(Tiny::Untied, KvDtype::F32);
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_f16_kv_cache_keeps_greedy_ids() {
    check_batched(Tiny::Tied, KvDtype::F16);
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_q8_kv_cache_keeps_greedy_ids() {
    check_batched(Tiny::Tied, KvDtype::Q8);
}

/// The chat template's prompt decoded greedily through `generate` (sampling inputs come back
/// once a step): the reference's ids.
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs --features cuda and a GPU (scripts/gpu-check.sh)"
)]
fn gpu_greedy_chat_matches_reference() {
    let Some(dev) = gpu() else { return };
    let _g = model_lock();
    for which in [Tiny::Tied, Tiny::Untied] {
        let exp = which.expected();
        let mut e = on(&dev, which, KvDtype::F32);
        let params = GenerateParams {
            max_new_tokens: 16,
            stop_at_eos: false,
            ..Default::default()
        };
        let prompt = ids(&exp["chat"]["prompt_ids"]);
        let stats = generate(&mut e, &prompt, &params, |_, _| Ok(())).unwrap();
        assert_eq!(
            stats.generated,
            ids(&exp["chat"]["greedy_new_ids"]),
            "{which:?}"
        );
    }
}
