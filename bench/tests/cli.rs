//! The bench binary as its users meet it: spawned with flags that cannot work, it ends at once
//! with the server's exit status rule (2: what was given cannot work) and one line naming what
//! is wrong. (The workloads themselves run a model for minutes: they are benchmarks, not tests.)

use std::process::Command;
use std::time::{Duration, Instant};

/// Runs the bench binary with `args` until it exits (at most a minute): exit code and stderr.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_llama-relay-bench"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "`llama-relay-bench {}` still running",
            args.join(" ")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_model_path_that_does_not_exist_ends_a_workload_with_status_2() {
    for workload in ["throughput", "chat", "overhead", "mixed"] {
        let (code, stderr) = run(&[workload, "--model", "/nonexistent/model.gguf"]);
        assert_eq!(code, Some(2), "{workload}: {stderr}");
        let line = stderr.lines().last().unwrap_or_default();
        assert!(
            line.starts_with("llama-relay-bench: error:")
                && line.contains("model file not found: /nonexistent/model.gguf"),
            "{workload}: {line}"
        );
    }
}

#[test]
fn flags_are_checked_per_workload() {
    // A flag of another workload, a value outside its type, a missing required flag: clap's
    // usage error (status 2), naming the flag.
    for (args, names) in [
        (&["chat", "--long-words", "10"][..], "--long-words"),
        (&["throughput", "--api", "grpc"], "grpc"),
        (&["cluster"], "--url"),
        (&["soak", "--url", "ws://127.0.0.1:1/ws"], "--server-pid"),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
    }
}

#[test]
fn a_value_outside_its_range_is_named_before_anything_starts() {
    for (args, flag) in [
        (&["mixed", "--long-at=-1"][..], "--long-at"),
        (&["typeahead", "--chars-per-s", "0"], "--chars-per-s"),
        (&["paced", "--window", "0"], "--window"),
        (&["paced", "--seconds", "inf"], "--seconds"),
        (&["overhead", "--rounds", "0"], "--rounds"),
        (
            &[
                "soak",
                "--url",
                "ws://x/ws",
                "--server-pid",
                "1",
                "--minutes=-2",
            ],
            "--minutes",
        ),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}
