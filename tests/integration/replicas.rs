//! Running as one replica of several behind a load balancer (#17): the drain on shutdown
//! (readiness, refused upgrades, 1012 closes) in process and through a real SIGTERM.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{model_lock, Tiny};
use crate::gateway::{spawn_app, Client};

fn run<F: std::future::Future<Output = ()>>(f: F) {
    actix_web::rt::System::new().block_on(f);
}

async fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    let mut r = awc::Client::new()
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// The frames up to the connection's close, then the close code.
async fn until_closed(c: &mut Client) -> (Vec<Value>, Option<u64>) {
    let mut frames = Vec::new();
    loop {
        let f = c.recv().await;
        if f["type"] == "closed" {
            return (frames, f["code"].as_u64());
        }
        frames.push(f);
    }
}

/// A long greedy reply that is still running when the drain begins.
fn long() -> Value {
    json!({"temperature": 0, "max_tokens": 1500, "ignore_eos": true})
}

/// A drain: readiness turns 503 `draining` (liveness stays 200), new upgrades get 503 with
/// `Retry-After`, an idle session closes with 1012 at once, a running reply goes on until the
/// grace ends (`done` `shutdown`) and its session closes with 1012 right after.
#[test]
fn a_drain_flips_readiness_refuses_upgrades_and_closes_sessions_with_1012() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        assert_eq!(get(app.addr, "/health/ready").await.0, 200);
        assert_eq!(get(app.addr, "/health/live").await.0, 200);
        let mut idle = app.connect().await;
        let mut busy = app.connect().await;
        busy.chat("q1", "Go on and on.", long()).await;
        loop {
            if busy.recv().await["type"] == "delta" {
                break;
            }
        }
        let state = app.state.clone();
        let drained = actix_web::rt::spawn(async move {
            llama_relay::server::shutdown(&state, Duration::from_millis(500)).await;
        });
        // The idle session goes at once.
        let t0 = Instant::now();
        let (frames, code) = until_closed(&mut idle).await;
        assert_eq!(code, Some(1012), "{frames:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        let (status, body) = get(app.addr, "/health/ready").await;
        assert_eq!((status, body["status"].as_str()), (503, Some("draining")));
        assert_eq!(get(app.addr, "/health").await.0, 503);
        assert_eq!(get(app.addr, "/health/live").await.0, 200);
        let refused = awc::Client::new()
            .ws(format!("ws://{}/ws", app.addr))
            .connect()
            .await;
        match refused {
            Err(awc::error::WsClientError::InvalidResponseStatus(s)) => assert_eq!(s, 503),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a new session was let in while draining"),
        }
        // The running reply goes on, then ends at the grace and its session closes.
        let (frames, code) = until_closed(&mut busy).await;
        let deltas = frames.iter().filter(|f| f["type"] == "delta").count();
        let done = frames.iter().find(|f| f["type"] == "done").expect("done");
        assert_eq!(done["finish_reason"], "shutdown", "{done}");
        assert!(deltas > 0, "the reply stopped when the drain began");
        assert_eq!(code, Some(1012));
        drained.await.unwrap();
    });
}

/// The process on SIGTERM: readiness 503 while a reply finishes, that reply's `done`, 1012, and
/// the process exits 0 within the grace.
#[test]
fn sigterm_drains_the_process_and_it_exits_within_the_grace() {
    use std::io::BufRead;
    let _g = model_lock();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_llama-relay"))
        .arg("--model")
        .arg(Tiny::Tied.dir())
        .env("LLAMA_RELAY__SERVER__PORT", "0")
        .env("LLAMA_RELAY__SERVER__SHUTDOWN_GRACE_S", "3")
        .env("LLAMA_RELAY__ENGINE__CACHE_TOKENS", "8192")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("the server logs where it listens")
            .unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
    };
    let log = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let pid = child.id() as libc::pid_t;
    let signalled = run_and_signal(addr, pid);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = log.join().unwrap();
    assert!(status.success(), "{status}\n{}", log.join("\n"));
    // Exited within the grace (3 s) and the last frames' margin, counted from the signal.
    assert!(
        signalled.elapsed() < Duration::from_secs(6),
        "{:?}",
        signalled.elapsed()
    );
}

/// Starts a reply, sends SIGTERM, checks the drain from the outside; returns when the signal
/// went.
fn run_and_signal(addr: SocketAddr, pid: libc::pid_t) -> Instant {
    let mut signalled = Instant::now();
    run(async {
        let t0 = Instant::now();
        let mut c = loop {
            match awc::Client::new()
                .ws(format!("ws://{addr}/ws"))
                .connect()
                .await
            {
                Ok((_, framed)) => {
                    let mut c = Client::from_framed(framed);
                    assert_eq!(c.recv().await["type"], "ready");
                    break c;
                }
                Err(_) => {
                    assert!(t0.elapsed() < Duration::from_secs(60), "never ready");
                    actix_web::rt::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        c.chat("q1", "Go on and on.", long()).await;
        loop {
            if c.recv().await["type"] == "delta" {
                break;
            }
        }
        signalled = Instant::now();
        // SAFETY: a signal to the child this test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let t0 = Instant::now();
        loop {
            let (status, body) = get(addr, "/health/ready").await;
            if status == 503 {
                assert_eq!(body["status"], "draining", "{body}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(2), "still ready");
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(get(addr, "/health/live").await.0, 200);
        let (frames, code) = until_closed(&mut c).await;
        assert!(
            frames.iter().any(|f| f["type"] == "done"),
            "the reply ended without done: {frames:?}"
        );
        assert_eq!(code, Some(1012));
    });
    signalled
}

/// `?conversation=ID`, the load balancer's routing key, is checked at the upgrade: a valid one
/// is served like any session, a malformed one is refused 400 naming the field.
#[test]
fn the_conversation_routing_key_is_checked_at_the_upgrade() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        // (`connect_with` reads the `ready`.)
        let served = app.connect_with("/ws?conversation=3f2a_b-9", &[]).await;
        assert!(served.is_ok(), "a valid id is served");
        let long_id = "a".repeat(65);
        for bad in ["", "two%20words", "%3Cscript%3E", long_id.as_str()] {
            let path = format!("/ws?conversation={bad}");
            assert_eq!(app.connect_with(&path, &[]).await.err(), Some(400), "{bad}");
        }
        let mut r = awc::Client::new()
            .get(format!("http://{}/ws?conversation=two%20words", app.addr))
            .insert_header(("Connection", "Upgrade"))
            .insert_header(("Upgrade", "websocket"))
            .insert_header(("Sec-WebSocket-Version", "13"))
            .insert_header(("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400);
        let body: Value = r.json().await.unwrap();
        assert!(
            body["message"].as_str().unwrap().contains("`conversation`"),
            "{body}"
        );
    });
}
