//! The fuzz targets' corpus as regression tests: every saved input (the inputs that reached new
//! coverage, and any crash once fixed) runs through the same harness as under libFuzzer
//! (`llama_relay::fuzz_harness`). `scripts/fuzz.sh` grows the corpus.

use std::path::{Path, PathBuf};

use llama_relay::fuzz_harness;
use llama_relay::tokenizer::TextTokenizer;

use crate::common::*;

/// The inputs of one target: its corpus and its seeds.
fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut out = Vec::new();
    for dir in ["corpus", "seeds"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            out.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no inputs for {target}");
    out
}

/// Runs `f` on each input; a panic names the input that caused it.
fn replay(target: &str, f: impl Fn(&[u8])) {
    let all = inputs(target);
    for (path, data) in &all {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(data))).is_err() {
            panic!("fuzz input {} fails", path.display());
        }
    }
    eprintln!("{target}: {} inputs replayed", all.len());
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_hf_dir(Tiny::Tied.dir(), &[]).unwrap()
}

#[test]
fn client_frame_corpus() {
    replay("client_frame", fuzz_harness::client_frame);
}

#[test]
fn chat_template_corpus() {
    let tok = tokenizer();
    replay("chat_template", |d| fuzz_harness::chat_template(&tok, d));
}

#[test]
fn detokenizer_corpus() {
    let tok = tokenizer();
    replay("detokenizer", |d| fuzz_harness::detokenizer(&tok, d));
}

#[test]
fn realtime_corpus() {
    replay("realtime", fuzz_harness::realtime);
}

#[test]
fn native_corpus() {
    replay("native", fuzz_harness::native);
}
