//! A Llama 3 style K-quant GGUF end to end: Q4_K projections with Q6_K v_proj, down_proj and
//! output (the mix a Q4_K_M file has), a Q4_K token table. No such model ships here, so the test
//! writes one: SmolLM2's tokenizer metadata, two layers of random weights (hidden 256, 4 heads
//! of 64, 2 KV heads, MLP 512) quantized by candle. It checks that every projection runs on our
//! repacked kernels (the CPU layer path, mixed types included), that this path equals the
//! candle-op path to the bit, and that the logits match the same file dequantized to F32 within
//! 8-bit activation rounding.

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use llama_relay::default_model::ensure_default_model;
use llama_relay::engine::{Engine, EngineOptions};
use llama_relay::model::loader::{read_gguf, WeightMode};

use crate::common::*;

const HIDDEN: usize = 256;
const INTER: usize = 512;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const LAYERS: usize = 2;

/// `rows x cols` values uniform in `[-scale, scale)` from a seeded LCG.
fn random(seed: u64, rows: usize, cols: usize, scale: f32) -> Tensor {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

/// Writes the test model; returns its path.
fn write_kquant_gguf() -> PathBuf {
    let (base, _) = read_gguf(&ensure_default_model().unwrap()).unwrap();
    let vocab = match base.metadata.get("tokenizer.ggml.tokens") {
        Some(gguf_file::Value::Array(t)) => t.len(),
        _ => panic!("the default model has no token list"),
    };
    let dims = [
        ("llama.embedding_length", HIDDEN),
        ("llama.feed_forward_length", INTER),
        ("llama.attention.head_count", HEADS),
        ("llama.attention.head_count_kv", KV_HEADS),
        ("llama.block_count", LAYERS),
        ("llama.rope.dimension_count", HEAD_DIM),
    ]
    .map(|(k, v)| (k, gguf_file::Value::U32(v as u32)));
    let mut metadata: Vec<(&str, &gguf_file::Value)> = base
        .metadata
        .iter()
        .filter(|(k, _)| !dims.iter().any(|(d, _)| d == k))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.extend(dims.iter().map(|(k, v)| (*k, v)));
    let q = |seed, rows, cols, scale, dtype| {
        QTensor::quantize(&random(seed, rows, cols, scale), dtype).unwrap()
    };
    let ones = || {
        QTensor::quantize(
            &Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap()
    };
    let (kv, w) = (KV_HEADS * HEAD_DIM, 0.1);
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            q(1, vocab, HIDDEN, 1.0, GgmlDType::Q4K),
        ),
        (
            "output.weight".into(),
            q(2, vocab, HIDDEN, w, GgmlDType::Q6K),
        ),
        ("output_norm.weight".into(), ones()),
    ];
    for l in 0..LAYERS {
        let s = 100 * (l as u64 + 1);
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        tensors.extend([
            (b("attn_norm"), ones()),
            (b("ffn_norm"), ones()),
            (b("attn_q"), q(s + 1, HIDDEN, HIDDEN, w, GgmlDType::Q4K)),
            (b("attn_k"), q(s + 2, kv, HIDDEN, w, GgmlDType::Q4K)),
            (b("attn_v"), q(s + 3, kv, HIDDEN, w, GgmlDType::Q6K)),
            (
                b("attn_output"),
                q(s + 4, HIDDEN, HIDDEN, w, GgmlDType::Q4K),
            ),
            (b("ffn_gate"), q(s + 5, INTER, HIDDEN, w, GgmlDType::Q4K)),
            (b("ffn_up"), q(s + 6, INTER, HIDDEN, w, GgmlDType::Q4K)),
            (b("ffn_down"), q(s + 7, HIDDEN, INTER, w, GgmlDType::Q6K)),
        ]);
    }
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = std::env::temp_dir().join(format!(
        "llama-relay-kquant-test-{}.gguf",
        std::process::id()
    ));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    gguf_file::write(&mut f, &metadata, &refs).unwrap();
    path
}

fn load(path: &Path, weights: WeightMode) -> Engine {
    let mut o = EngineOptions::for_model(path.to_path_buf());
    o.weights = weights;
    Engine::load(&o).unwrap()
}

/// The shared two-sequence run, decoding fixed ids (random weights: no argmax to follow).
fn run(e: &mut Engine) -> Vec<Vec<f32>> {
    two_sequence_run(e, |s, _| [3000 + s as u32, 4000 + s as u32])
}

#[test]
fn q4_k_m_style_gguf_runs_repacked_and_matches_its_f32_dequantization() {
    let _g = model_lock();
    let path = write_kquant_gguf();
    let mut e = load(&path, WeightMode::Auto);
    assert!(
        e.model.cpu_layers(),
        "Q4_K and Q6_K projections (mixed within a layer) all run repacked"
    );
    let rows_path = run(&mut e);
    assert!(!e.model.set_cpu_layers(false));
    let ops_path = run(&mut e);
    for (i, (a, b)) in rows_path.iter().zip(&ops_path).enumerate() {
        assert_eq!(max_abs_diff(a, b), 0.0, "row {i}: the layer paths differ");
    }
    drop(e);
    let reference = run(&mut load(&path, WeightMode::F32));
    std::fs::remove_file(&path).unwrap();
    for (i, (got, want)) in rows_path.iter().zip(&reference).enumerate() {
        let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (max, mean) = (max_abs_diff(got, want), mean_abs_diff(got, want));
        println!("row {i}: logits up to {spread:.3}, max-abs-diff {max:.4}, mean {mean:.4}");
        assert!(spread > 0.5, "row {i}: degenerate logits ({spread})");
        assert!(
            max <= 0.05 * spread,
            "row {i}: max-abs-diff {max} for logits up to {spread}"
        );
        assert!(
            mean <= 0.01 * spread,
            "row {i}: mean-abs-diff {mean} for logits up to {spread}"
        );
    }
}
