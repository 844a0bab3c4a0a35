//! Bad model files give one clear error that names the file and the tensor, never a panic.

use std::path::{Path, PathBuf};

use llama_relay::engine::{Engine, EngineOptions};
use llama_relay::EngineError;

use crate::common::*;

fn scratch(name: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
    ] {
        std::fs::copy(Tiny::Tied.dir().join(f), d.join(f)).unwrap();
    }
    d
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut c = read_json(&dir.join("config.json"));
    f(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
}

fn load_err(path: &Path) -> EngineError {
    match Engine::load(&EngineOptions::for_model(path)) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_model_names_the_path() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(matches!(e, EngineError::ModelNotFound { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/model.gguf"));
}

#[test]
fn unsupported_architecture() {
    let d = scratch("arch");
    edit_config(&d, |c| {
        c["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
        c["model_type"] = serde_json::json!("mixtral");
    });
    let e = load_err(&d);
    assert_eq!(e.error_type(), "model_load");
    assert!(e.to_string().contains("MixtralForCausalLM"), "{e}");
}

#[test]
fn wrong_shape_names_the_tensor_and_both_shapes() {
    let d = scratch("shape");
    edit_config(&d, |c| c["intermediate_size"] = serde_json::json!(100));
    let e = load_err(&d).to_string();
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("[192, 64]")
            && e.contains("[100, 64]"),
        "{e}"
    );
}

#[test]
fn untied_config_without_lm_head_is_an_error_not_silently_tied() {
    let d = scratch("nohead");
    edit_config(&d, |c| c["tie_word_embeddings"] = serde_json::json!(false));
    let e = load_err(&d).to_string();
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");
}

#[test]
fn a_file_that_is_not_gguf_is_named() {
    let d = scratch("notgguf");
    let f = d.join("model.gguf");
    std::fs::write(&f, b"GGUF but not really").unwrap();
    let e = load_err(&f).to_string();
    assert!(e.contains("model.gguf") && e.contains("GGUF"), "{e}");
    let f = d.join("weights.bin");
    std::fs::write(&f, b"hello").unwrap();
    let e = load_err(&f).to_string();
    assert!(
        e.contains("does not start with `GGUF`") && e.contains("expected a GGUF file"),
        "{e}"
    );
}

#[test]
fn missing_shard_is_named() {
    let d = scratch("shard");
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = load_err(&d).to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}
