//! `llama-relay perplexity`: every scored position's log-likelihood equals what the model's
//! last-token logits give for that prefix, fed one token a step (another path through the
//! engine: decode steps instead of one chunk with `Logits::All`); and the command as an operator
//! runs it: a reference saved, the same run against it (KL 0, every top token the same), another
//! kernel level against it, and a reference that scored something else refused.

use std::process::Command;

use llama_relay::engine::{Logits, SeqChunk, StepBatch};
use llama_relay::perplexity::{log_softmax, prepare, run};

use crate::common::*;

/// A text a package here ships (Debian's base-files), long enough for a few chunks.
const TEXT: &str = "/usr/share/common-licenses/GPL-3";

#[test]
fn scored_positions_equal_the_last_token_logits_of_each_prefix() {
    let _lock = model_lock();
    let mut e = Tiny::Tied.load(16);
    let text = std::fs::read_to_string(TEXT).unwrap();
    let ids = e.tokenizer.encode_text(&text[..2000]).unwrap();
    let ctx = 40;
    let mut seen = Vec::new();
    let text = prepare(&e, &ids, ctx, Some(2)).unwrap();
    let r = run(&mut e, &text, None, |_, s, _| seen.push(s.nll)).unwrap();
    assert_eq!(r.chunks, 2);
    // Scored: positions ctx/2 .. ctx-2 of each chunk, predicting the next token.
    assert_eq!(r.scored.len(), 2 * (ctx - 1 - ctx / 2));
    assert_eq!(seen, r.scored.iter().map(|s| s.nll).collect::<Vec<_>>());
    let prefix = e.tokenizer.encode_prompt("").unwrap();
    let bs = e.cache.block_size();
    let mut k = 0;
    for c in 0..2 {
        let body = ctx - prefix.len();
        let chunk = [&prefix[..], &ids[c * body..(c + 1) * body]].concat();
        let mut table = Vec::new();
        assert!(e.pool.ensure_capacity(&mut table, ctx, bs));
        for pos in 0..ctx - 1 {
            let logits = e
                .model
                .forward(
                    &StepBatch {
                        seqs: vec![SeqChunk {
                            tokens: vec![chunk[pos]],
                            start_pos: pos,
                            block_table: table.clone(),
                            logits: Logits::Last,
                        }],
                    },
                    &e.cache,
                )
                .unwrap()
                .unwrap();
            if pos >= ctx / 2 {
                let lp = log_softmax(&rows(&logits)[0]);
                let want = -lp[chunk[pos + 1] as usize];
                let got = r.scored[k].nll;
                assert!(
                    (got - want).abs() < 1e-3 * (1.0 + want.abs()),
                    "chunk {c} position {pos}: {got} against {want} one token a step"
                );
                k += 1;
            }
        }
        e.pool.release(&table);
    }
    assert_eq!(k, r.scored.len());
}

/// The binary on the tiny model: (exit status, stdout, stderr).
fn perplexity_cli(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_llama-relay"))
        .arg("--model")
        .arg(Tiny::Tied.dir())
        .arg("perplexity")
        .arg(TEXT)
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The number after `label` in the command's report.
fn figure(out: &str, label: &str) -> f64 {
    let at = out
        .find(label)
        .unwrap_or_else(|| panic!("no `{label}` in {out}"))
        + label.len();
    out[at..]
        .trim_start()
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("`{label}` is not followed by a number in {out}"))
}

#[test]
fn a_saved_reference_compares_runs_and_refuses_another_text() {
    let _lock = model_lock();
    let dir = tempfile_dir("ppl");
    let reference = dir.join("ref.bin");
    let r = reference.to_str().unwrap();
    let (code, out, err) = perplexity_cli(
        &["--ctx", "64", "--chunks", "3", "--save-reference", r],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    let ppl = figure(&out, "perplexity");
    assert!(ppl > 1.0 && ppl.is_finite(), "{out}");
    // The same run against itself: nothing moved.
    let (code, out, err) = perplexity_cli(&["--ctx", "64", "--chunks", "3", "--reference", r], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(figure(&out, "KL divergence mean"), 0.0, "{out}");
    assert_eq!(figure(&out, "same top token"), 100.0, "{out}");
    // The scalar kernels against the default level: the tiny model's weights are F32 (no
    // quantized kernels), so what differs is attention and the elementwise kernels.
    let (code, out, err) = perplexity_cli(
        &["--ctx", "64", "--chunks", "3", "--reference", r],
        &[("LLAMA_RELAY_ISA", "scalar")],
    );
    assert_eq!(code, Some(0), "{err}");
    let kl = figure(&out, "KL divergence mean");
    assert!(kl < 1e-4, "{out}");
    // The context shift against it: the same positions scored, their context moved back over
    // 24 dropped tokens; it moves the predictions (deeper layers saw the dropped text), a
    // little when the chunk's head stays. A shift past the chunk is refused naming the flag.
    let shifted = |keep: &str| {
        let (code, out, err) = perplexity_cli(
            &[
                "--ctx",
                "64",
                "--chunks",
                "3",
                "--reference",
                r,
                "--shift",
                "24",
                "--shift-keep",
                keep,
            ],
            &[],
        );
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("3 chunks of 64, 93 scored"), "{out}");
        figure(&out, "KL divergence mean")
    };
    let (kept, lost) = (shifted("8"), shifted("0"));
    assert!(kept > 0.0 && kept.is_finite(), "{kept}");
    assert!(lost > kept, "keeping the head: {kept}, not: {lost}");
    let (code, _, err) = perplexity_cli(&["--ctx", "64", "--shift", "65"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--shift"), "{err}");
    // Another cut of the text: refused before the run, naming why, with the usage status.
    let (code, _, err) = perplexity_cli(&["--ctx", "32", "--chunks", "3", "--reference", r], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("use the reference's --ctx and --chunks"),
        "{err}"
    );
    // A context past the model's: refused before any work, naming the flag.
    let (code, _, err) = perplexity_cli(&["--ctx", "1000000"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--ctx"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
