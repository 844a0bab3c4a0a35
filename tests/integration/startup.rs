//! Start-up as a newcomer meets it: the real binary, spawned. A model path, config file, setting
//! or port that cannot work ends the process at once with its exit status (2: what was given
//! cannot work; 1: the machine failed) and one line naming what it looked for; a model is warmed
//! up before the server reports ready.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// What a finished run of the binary left: its exit status and stderr.
struct Exit {
    code: Option<i32>,
    stderr: String,
}

/// Runs the binary with `args` (and `env`) until it exits; fails the test past `limit`.
fn run_cli(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Exit {
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_llama-relay"))
        .args(args)
        .env("LLAMA_RELAY__SERVER__PORT", "0")
        .env_remove("RUST_BACKTRACE")
        // The shipped log filter, whatever the test's environment says.
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            s.push_str(&l);
            s.push('\n');
        }
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`llama-relay {}` still running after {limit:?}: {}",
                args.join(" "),
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Exit {
        code: status.code(),
        stderr: reader.join().unwrap(),
    }
}

/// The binary's last stderr line: the error it ended with.
fn last_line(e: &Exit) -> &str {
    e.stderr.lines().last().unwrap_or_default()
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("startup-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// How long a failure may take: it comes before anything loads (well under a second here), and
/// the margin keeps a loaded CI machine from failing the test.
const FAST: Duration = Duration::from_secs(20);

#[test]
fn a_model_path_that_does_not_exist_ends_every_command_with_status_2() {
    for cmd in [&["serve"][..], &["generate", "-n", "1"]] {
        let mut args = cmd.to_vec();
        args.extend(["--model", "/nonexistent/model.gguf"]);
        let e = run_cli(&args, &[], FAST);
        assert_eq!(e.code, Some(2), "{cmd:?}: {}", e.stderr);
        let line = last_line(&e);
        assert!(
            line.starts_with("llama-relay: error:")
                && line.contains("model file not found: /nonexistent/model.gguf"),
            "{cmd:?}: {line}"
        );
        assert!(!e.stderr.contains("Caused by") && !e.stderr.contains("stack backtrace"));
    }
}

/// `--draft-model`: a path that is not there ends the server at start like `--model` (status 2,
/// naming it); the commands that do not speculate refuse the flag, naming it.
#[test]
fn a_draft_model_that_cannot_work_ends_the_program_with_status_2() {
    let e = run_cli(
        &["serve", "--draft-model", "/nonexistent/draft.gguf"],
        &[],
        FAST,
    );
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("model file not found: /nonexistent/draft.gguf"),
        "{line}"
    );
    let e = run_cli(
        &[
            "generate",
            "-n",
            "1",
            "--draft-model",
            "/nonexistent/draft.gguf",
        ],
        &[],
        FAST,
    );
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("--draft-model") && line.contains("only when serving"),
        "{line}"
    );
}

#[test]
fn a_file_or_folder_that_is_not_a_model_is_named_with_what_was_expected() {
    let d = scratch("not-a-model");
    let text = d.join("notes.txt");
    std::fs::write(&text, "not a model at all").unwrap();
    let short = d.join("short.gguf");
    std::fs::write(&short, "GG").unwrap();
    let empty_dir = d.join("folder");
    std::fs::create_dir_all(&empty_dir).unwrap();
    for (path, want) in [
        (&text, "does not start with `GGUF`"),
        (&short, "too short to be a model"),
        (&empty_dir, "a folder without config.json"),
    ] {
        let e = run_cli(&["serve", "--model", path.to_str().unwrap()], &[], FAST);
        assert_eq!(e.code, Some(2), "{}", e.stderr);
        let line = last_line(&e);
        assert!(
            line.contains(path.to_str().unwrap()) && line.contains(want),
            "{path:?}: {line}"
        );
        assert!(
            line.contains("expected a GGUF file") || line.contains("config.json"),
            "{line}"
        );
    }
}

#[test]
fn an_unsupported_architecture_is_refused_before_the_server_starts() {
    let d = scratch("arch");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ] {
        std::fs::copy(Tiny::Tied.dir().join(f), d.join(f)).unwrap();
    }
    let mut c = read_json(&d.join("config.json"));
    c["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    c["model_type"] = serde_json::json!("mixtral");
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let e = run_cli(&["serve", "--model", d.to_str().unwrap()], &[], FAST);
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    assert!(last_line(&e).contains("MixtralForCausalLM"), "{}", e.stderr);
    assert!(
        !e.stderr.contains("listening"),
        "nothing was bound: {}",
        e.stderr
    );
}

#[test]
fn a_model_that_fails_while_loading_ends_the_server_instead_of_a_503_forever() {
    // The header and config are fine (the quick check passes); a tensor's shape is not.
    let d = scratch("shape");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ] {
        std::fs::copy(Tiny::Tied.dir().join(f), d.join(f)).unwrap();
    }
    let mut c = read_json(&d.join("config.json"));
    let inter = c["intermediate_size"].as_u64().unwrap();
    c["intermediate_size"] = serde_json::json!(inter * 2);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let _g = model_lock();
    let e = run_cli(
        &["serve", "--model", d.to_str().unwrap()],
        &[],
        Duration::from_secs(60),
    );
    assert!(
        e.stderr.contains("listening"),
        "it served while loading: {}",
        e.stderr
    );
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("the model failed to load") && line.contains("shape"),
        "{line}"
    );
}

#[test]
fn config_file_errors_name_the_config_file() {
    let e = run_cli(&["serve", "--config", "/nonexistent.toml"], &[], FAST);
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("config file /nonexistent.toml: not found") && !line.contains("model"),
        "{line}"
    );
    let d = scratch("config");
    let bad = d.join("bad.toml");
    std::fs::write(&bad, "[server\nport = 1").unwrap();
    let e = run_cli(&["serve", "--config", bad.to_str().unwrap()], &[], FAST);
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains(&format!("config file {}: not valid TOML", bad.display())),
        "{line}"
    );
    let unknown = d.join("unknown.toml");
    std::fs::write(&unknown, "[engine]\nthreeds = 2\n").unwrap();
    let e = run_cli(&["serve", "--config", unknown.to_str().unwrap()], &[], FAST);
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    assert!(last_line(&e).contains("threeds"), "{}", e.stderr);
}

#[test]
fn a_setting_out_of_range_names_key_value_and_rule_with_status_2() {
    let e = run_cli(
        &["serve", "--model", Tiny::Tied.dir().to_str().unwrap()],
        &[("LLAMA_RELAY__ENGINE__BLOCK_SIZE", "0")],
        FAST,
    );
    assert_eq!(e.code, Some(2), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("engine.block_size") && line.contains("= 0"),
        "{line}"
    );
}

#[test]
fn a_port_in_use_is_named_with_the_fix_and_status_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let model = Tiny::Tied.dir().to_str().unwrap();
    let e = run_cli(&["serve", "--model", model, "--port", &port], &[], FAST);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains(&format!("cannot listen on 127.0.0.1:{port}"))
            && line.contains("another process"),
        "{line}"
    );
}

#[test]
fn a_default_model_that_cannot_be_fetched_ends_the_server_with_status_1_and_the_way_out() {
    // A cache folder that cannot be made (it would sit under a file).
    let d = scratch("cache");
    let file = d.join("a-file");
    std::fs::write(&file, "").unwrap();
    let cache = file.join("cache");
    let e = run_cli(
        &["serve"],
        &[("LLAMA_RELAY_CACHE", cache.to_str().unwrap())],
        Duration::from_secs(60),
    );
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains(&format!(
            "the cache folder {} cannot be written",
            cache.display()
        )) && line.contains("LLAMA_RELAY_CACHE")
            && line.contains("--model PATH"),
        "{line}"
    );
    // No pip to fetch with: an empty cache folder and a PATH without python.
    let empty = scratch("cache-empty");
    let e = run_cli(
        &["generate"],
        &[
            ("LLAMA_RELAY_CACHE", empty.to_str().unwrap()),
            ("PATH", "/nonexistent"),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    let line = last_line(&e);
    assert!(
        line.contains("pip") && line.contains("--model PATH"),
        "{line}"
    );
}

#[test]
fn the_model_is_warmed_up_before_the_server_reports_ready() {
    let _g = model_lock();
    let (mut child, addr, log) = spawn_process(Tiny::Tied.dir(), &[]);
    // Ready only after the warm-up's log line.
    let t0 = Instant::now();
    loop {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET /health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut head = String::new();
        std::io::Read::read_to_string(&mut s, &mut head).unwrap();
        if head.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "never ready: {head}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let lines = log.join().unwrap();
    let at = |what: &str| lines.iter().position(|l| l.contains(what));
    let warmed = at("warmed up").expect("a warm-up log line");
    let ready = at("ready").expect("a ready log line");
    assert!(warmed < ready, "{lines:#?}");
}

#[test]
fn the_warm_up_leaves_no_block_and_no_cache_entry_behind() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| s.engine.warm_up = true);
    actix_web::rt::System::new().block_on(async {
        let s = app.status().await;
        assert_eq!((s.running, s.waiting, s.kv_blocks_used), (0, 0, 0), "{s:?}");
        // The warm-up's text, sent as a prompt: nothing of it is cached.
        let mut c = app.connect().await;
        let text = "The quick brown fox jumps over the lazy dog while the support team answers. "
            .repeat(4);
        c.chat(
            "w",
            &text,
            serde_json::json!({"max_tokens": 2, "temperature": 0}),
        )
        .await;
        let started = c.reply("w").await.started.expect("a started frame");
        assert_eq!(started["cached_tokens"], 0, "{started}");
    });
}
