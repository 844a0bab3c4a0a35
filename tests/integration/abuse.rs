//! Hostile and broken clients against the real server: a client that stops reading (its reply
//! cancelled, its socket reset), and what one client's abuse costs the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;

/// A WebSocket client on a raw socket with a small receive buffer, so that not reading stalls
/// the server quickly, and whose reads the test controls.
struct RawWs {
    s: TcpStream,
}

impl RawWs {
    fn connect(addr: SocketAddr) -> RawWs {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(&addr.into()).unwrap();
        let mut s: TcpStream = sock.into();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "GET /ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut b).unwrap();
            head.push(b[0]);
        }
        let head = String::from_utf8(head).unwrap();
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        RawWs { s }
    }

    /// Sends a masked text frame.
    fn send(&mut self, v: Value) {
        let payload = v.to_string().into_bytes();
        let mut f = vec![0x81u8];
        match payload.len() {
            n if n < 126 => f.push(0x80 | n as u8),
            n => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        let mask = [0x37u8, 0xfa, 0x21, 0x3d];
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.s.write_all(&f).unwrap();
    }

    /// The next text frame as JSON (pings and other control frames skipped), or the error that
    /// ended the connection.
    fn recv(&mut self) -> std::io::Result<Value> {
        loop {
            let mut h = [0u8; 2];
            self.s.read_exact(&mut h)?;
            let len = match h[1] & 0x7f {
                126 => {
                    let mut l = [0u8; 2];
                    self.s.read_exact(&mut l)?;
                    u16::from_be_bytes(l) as usize
                }
                127 => {
                    let mut l = [0u8; 8];
                    self.s.read_exact(&mut l)?;
                    u64::from_be_bytes(l) as usize
                }
                n => n as usize,
            };
            let mut payload = vec![0u8; len];
            self.s.read_exact(&mut payload)?;
            match h[0] & 0x0f {
                0x1 => return Ok(serde_json::from_slice(&payload).unwrap()),
                0x8 => return Ok(json!({"type": "closed"})),
                _ => continue,
            }
        }
    }
}

fn run<F: std::future::Future<Output = ()>>(f: F) {
    actix_web::rt::System::new().block_on(f);
}

/// A metric's value (0 while it has never been set), `name` with its labels.
async fn metric(app: &App, name: &str) -> u64 {
    let text = metrics_text(app).await;
    let prefix = format!("{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// The value of `llama_relay_slow_readers_total{action=...}`.
async fn slow_readers(app: &App, action: &str) -> u64 {
    metric(
        app,
        &format!("llama_relay_slow_readers_total{{action=\"{action}\"}}"),
    )
    .await
}

/// Waits until `slow_readers(action)` reaches `n` and no KV block is in use beyond the held ones;
/// returns how long that took.
async fn wait_for_slow_reader(app: &App, action: &str, n: u64, limit: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let s = app.status().await;
        if slow_readers(app, action).await >= n
            && s.running == 0
            && s.kv_blocks_used == s.kv_blocks_held
        {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "no {action} within {limit:?}: {s:?}");
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
}

fn long_reply() -> Value {
    json!({"type": "chat", "id": "r1", "messages": [{"role": "user", "content": "Talk for a long time."}],
           "params": {"temperature": 0, "max_tokens": 4000, "ignore_eos": true}})
}

/// A client that sends a chat and then reads nothing: once nothing has left its socket for
/// `write_timeout_s`, the server resets the connection, and the reply's KV goes with it.
#[test]
fn a_client_that_reads_nothing_is_reset_after_the_write_timeout() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 8192;
        s.engine.cache_tokens = 16384;
        s.server.heartbeat_s = 1;
        s.server.client_timeout_s = 30;
        s.server.write_timeout_s = 2;
        // Only the write timeout acts here.
        s.server.max_queued_frames = 1 << 20;
        s.server.send_buffer_kib = 16;
    });
    run(async {
        let mut c = RawWs::connect(app.addr);
        c.send(long_reply());
        let took =
            wait_for_slow_reader(&app, "connection_closed", 1, Duration::from_secs(10)).await;
        eprintln!("reset and KV freed {took:?} after the chat");
        assert_eq!(slow_readers(&app, "reply_cancelled").await, 0);
        // The socket was reset: what was buffered may still be read, then the connection ends.
        let t0 = Instant::now();
        loop {
            match c.recv() {
                Ok(f) if f["type"] == "closed" => panic!("a close frame, not a reset"),
                Ok(_) => assert!(t0.elapsed() < Duration::from_secs(10), "still open"),
                Err(_) => break,
            }
        }
        // Another client is served as before.
        let mut d = app.connect().await;
        d.chat("ok", "Hi", json!({"temperature": 0, "max_tokens": 4}))
            .await;
        assert_eq!(d.reply("ok").await.done["type"], "done");
    });
}

/// The same when the server's send buffer holds the whole reply (so actix keeps polling the body
/// and the first rule never fires): the client acknowledges nothing once its small receive window
/// is full, and that is caught after `write_timeout_s` too.
#[test]
fn a_client_that_reads_nothing_is_reset_even_when_the_send_buffer_holds_its_reply() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 8192;
        s.engine.cache_tokens = 16384;
        s.server.heartbeat_s = 1;
        s.server.client_timeout_s = 60;
        s.server.write_timeout_s = 2;
        s.server.max_queued_frames = 1 << 20;
        // 16 MiB (32 with the kernel's doubling): far more than a 4,000-token reply's frames.
        s.server.send_buffer_kib = 16384;
    });
    run(async {
        let mut c = RawWs::connect(app.addr);
        c.send(long_reply());
        let took =
            wait_for_slow_reader(&app, "connection_closed", 1, Duration::from_secs(60)).await;
        eprintln!("reset and KV freed {took:?} after the chat");
        let t0 = Instant::now();
        loop {
            match c.recv() {
                Ok(f) if f["type"] == "closed" => panic!("a close frame, not a reset"),
                Ok(_) => assert!(t0.elapsed() < Duration::from_secs(30), "still open"),
                Err(_) => break,
            }
        }
    });
}

/// A client that stops reading while its reply streams: once `max_queued_frames` events wait
/// untaken, the reply is cancelled and its KV freed, long before the write timeout; when the
/// client reads again it finds the deltas, then `error` slow_reader, and the session still works.
#[test]
fn a_reply_nobody_reads_is_cancelled_at_the_queue_limit() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 8192;
        s.engine.cache_tokens = 16384;
        s.server.write_timeout_s = 600;
        s.server.max_queued_frames = 64;
        s.server.send_buffer_kib = 16;
    });
    run(async {
        let mut c = RawWs::connect(app.addr);
        c.send(long_reply());
        let took = wait_for_slow_reader(&app, "reply_cancelled", 1, Duration::from_secs(20)).await;
        eprintln!("reply cancelled and KV freed {took:?} after the chat");
        assert_eq!(slow_readers(&app, "connection_closed").await, 0);
        let (mut deltas, mut end) = (0, Value::Null);
        while end.is_null() {
            let f = c.recv().unwrap();
            match f["type"].as_str().unwrap() {
                "delta" => deltas += 1,
                "error" | "done" => end = f,
                _ => {}
            }
        }
        assert_eq!(end["type"], "error", "{end}");
        assert_eq!(end["error_type"], "slow_reader", "{end}");
        assert!(
            deltas < 4000,
            "the reply did not run to its end: {deltas} deltas"
        );
        // The session goes on.
        c.send(
            json!({"type": "chat", "id": "r2", "messages": [{"role": "user", "content": "Hi"}],
                      "params": {"temperature": 0, "max_tokens": 3}}),
        );
        loop {
            let f = c.recv().unwrap();
            if f["type"] == "done" {
                assert_eq!(f["id"], "r2");
                break;
            }
            assert_ne!(f["type"], "error", "{f}");
        }
    });
}

/// The same for an OpenAI API stream: a client that posts a streamed completion and reads
/// nothing has its connection reset after the write timeout, and the reply's KV freed.
#[test]
fn an_api_stream_nobody_reads_is_reset_after_the_write_timeout() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 8192;
        s.engine.cache_tokens = 16384;
        s.server.write_timeout_s = 2;
        s.server.heartbeat_s = 1;
        s.server.max_queued_frames = 1 << 20;
        s.server.send_buffer_kib = 16;
    });
    run(async {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(&app.addr.into()).unwrap();
        let mut s: TcpStream = sock.into();
        let model = app.state.ready().unwrap().model;
        let body = json!({"model": model, "stream": true, "max_tokens": 4000, "temperature": 0,
                          "ignore_eos": true, "messages": [{"role": "user", "content": "Talk."}]})
        .to_string();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            app.addr,
            body.len()
        )
        .unwrap();
        let took =
            wait_for_slow_reader(&app, "connection_closed", 1, Duration::from_secs(10)).await;
        eprintln!("API stream reset and KV freed {took:?} after the request");
    });
}

async fn health(app: &App) -> (u16, Value) {
    let mut r = awc::Client::new()
        .get(format!("http://{}/health", app.addr))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// The first `error` or `done` frame for `id`, skipping deltas.
async fn end_of(c: &mut crate::common::Client, id: &str) -> Value {
    loop {
        let f = c.recv().await;
        if matches!(f["type"].as_str(), Some("error" | "done")) {
            assert_eq!(f["id"], id, "{f}");
            return f;
        }
    }
}

/// A panic inside the batcher's step: every running request ends with `internal`, new ones are
/// refused with the reason, `/health` turns 503 `failed`, and the failure is counted.
#[test]
fn an_engine_panic_ends_every_request_and_turns_health_red() {
    use llama_relay::server::batcher::{Fault, InjectFault};
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut a = app.connect().await;
        let mut b = app.connect().await;
        for (c, id) in [(&mut a, "a1"), (&mut b, "b1")] {
            c.chat(
                id,
                "Go on and on.",
                json!({"temperature": 0, "max_tokens": 1500, "ignore_eos": true}),
            )
            .await;
            while c.recv().await["type"] != "delta" {}
        }
        assert_eq!(health(&app).await.0, 200);
        let batcher = app.state.ready().unwrap().batcher;
        batcher.send(InjectFault(Fault::PanicInStep)).await.unwrap();
        for (c, id) in [(&mut a, "a1"), (&mut b, "b1")] {
            let end = end_of(c, id).await;
            assert_eq!(end["type"], "error", "{end}");
            assert_eq!(end["error_type"], "internal", "{end}");
            assert!(
                end["message"].as_str().unwrap().contains("panicked"),
                "{end}"
            );
        }
        let (status, body) = health(&app).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["status"], "failed", "{body}");
        let reason = body["reason"].as_str().unwrap();
        assert!(reason.contains("panicked"), "{body}");
        // The panic's own text stays in the log: it could hold another request's content.
        assert!(!reason.contains("injected panic"), "{body}");
        assert_eq!(metric(&app, "llama_relay_engine_failures_total").await, 1);
        // New requests on an open session, and new sessions, are refused with the reason.
        a.chat("a2", "Hi", json!({"max_tokens": 2})).await;
        let end = end_of(&mut a, "a2").await;
        assert_eq!(end["error_type"], "internal", "{end}");
        assert!(
            end["message"].as_str().unwrap().contains("restarting"),
            "{end}"
        );
        assert_eq!(app.connect_with("/ws", &[]).await.err(), Some(503));
    });
}

/// Steps that keep failing: each fails its requests; after `MAX_FAILED_STEPS` in a row the
/// engine is failed for good, as after a panic.
#[test]
fn steps_that_keep_failing_fail_the_engine() {
    use llama_relay::server::batcher::{Fault, InjectFault, MAX_FAILED_STEPS};
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut a = app.connect().await;
        let batcher = app.state.ready().unwrap().batcher;
        batcher.send(InjectFault(Fault::FailSteps)).await.unwrap();
        for i in 0..MAX_FAILED_STEPS {
            assert_eq!(health(&app).await.0, 200, "after {i} failed steps");
            let id = format!("q{i}");
            a.chat(&id, "Hi", json!({"max_tokens": 4})).await;
            let end = end_of(&mut a, &id).await;
            assert_eq!(end["error_type"], "internal", "{end}");
            assert!(
                end["message"].as_str().unwrap().contains("step failed"),
                "{end}"
            );
        }
        let (status, body) = health(&app).await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body["reason"].as_str().unwrap().contains("in a row"),
            "{body}"
        );
        assert_eq!(metric(&app, "llama_relay_engine_failures_total").await, 1);
    });
}

/// The process itself: after an engine failure it tells its clients, then exits non-zero (so a
/// supervisor restarts it).
#[test]
fn the_server_process_exits_non_zero_after_an_engine_failure() {
    let _g = model_lock();
    let (mut child, addr, log) = spawn_process(
        Tiny::Tied.dir(),
        &[
            ("LLAMA_RELAY__ENGINE__CACHE_TOKENS", "4096"),
            ("LLAMA_RELAY_INJECT_FAULT", "panic_in_step"),
        ],
    );
    run(async move {
        let mut c = connect_when_ready(addr).await;
        c.chat("q1", "Hi", json!({"max_tokens": 8})).await;
        let end = end_of(&mut c, "q1").await;
        assert_eq!(end["error_type"], "internal", "{end}");
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = log.join().unwrap();
    assert!(!status.success(), "{status}");
    assert!(
        log.iter().any(|l| l.contains("the engine failed")),
        "{}",
        log.join("\n")
    );
}

/// One tenant floods the queue (anonymous sessions, each with a long reply); an API-key client
/// of another tenant asks after them and runs at once (it takes a running slot from the flood),
/// not after the whole flood. The anonymous clients' own cap (`scheduler.anonymous_max_waiting`) refuses
/// the rest of the flood with `overloaded`.
#[test]
fn a_tenant_flood_does_not_hold_another_tenants_request_in_the_queue() {
    use llama_relay::server::gate::tenants::TenantSettings;
    const KEY: &str = "acme-key-0123456789";
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.tenants = vec![TenantSettings {
            name: "acme".into(),
            api_keys: vec![KEY.into()],
            ..Default::default()
        }];
        s.server.allow_anonymous = Some(true);
        s.scheduler.max_running = 2;
        s.scheduler.max_waiting = 64;
        s.scheduler.anonymous_max_waiting = 8;
    });
    run(async {
        let long = json!({"temperature": 0, "max_tokens": 200, "ignore_eos": true});
        let mut flood = Vec::new();
        for i in 0..12 {
            let mut c = app.connect().await;
            c.chat(&format!("f{i}"), "Go on.", long.clone()).await;
            flood.push(c);
        }
        // Two run, eight wait (the anonymous share of the queue), two are refused at once.
        let mut refused = 0;
        let mut waiting = Vec::new();
        for (i, mut c) in flood.into_iter().enumerate() {
            let f = c.recv().await;
            match f["type"].as_str().unwrap() {
                "error" => {
                    assert_eq!(f["error_type"], "overloaded", "{f}");
                    assert!(f["message"].as_str().unwrap().contains("tenant"), "{f}");
                    refused += 1;
                }
                "queued" | "started" => waiting.push((i, c)),
                _ => panic!("{f}"),
            }
        }
        // 12 sent: 8 may wait; 0 to 2 were admitted before the rest arrived.
        assert!((2..=4).contains(&refused), "{refused} refused");
        let key_header = format!("Bearer {KEY}");
        let mut k = app
            .connect_with("/ws", &[("Authorization", key_header.as_str())])
            .await
            .unwrap();
        k.chat(
            "k1",
            "Hello there.",
            json!({"temperature": 0, "max_tokens": 8}),
        )
        .await;
        let t_key = Instant::now();
        let others = futures_util::future::join_all(
            waiting
                .iter_mut()
                .map(|(i, c)| finished_at(c, format!("f{i}"))),
        );
        let (key_at, others) = futures_util::join!(finished_at(&mut k, "k1".into()), others);
        let finished_before_key = others.iter().filter(|&&t| t < key_at).count();
        eprintln!(
            "key request done {:?} after sending; {finished_before_key} of {} flood replies finished before it",
            key_at - t_key,
            others.len()
        );
        // Without turns it would wait for every flood request queued before it (the two running
        // and six queued at least) to be admitted; with turns it runs at once.
        assert!(
            finished_before_key <= 3,
            "{finished_before_key} flood replies finished first"
        );
    });
}

/// When `id`'s reply ended (with `done`).
async fn finished_at(c: &mut crate::common::Client, id: String) -> Instant {
    let r = c.reply(&id).await;
    assert_eq!(r.done["type"], "done", "{}", r.done);
    Instant::now()
}

/// A message that cannot fit the context by its length alone is refused before it is rendered
/// or tokenized (the refusal says so), and one that might fit still goes through the tokenizer.
#[test]
fn what_cannot_fit_by_length_is_refused_before_tokenizing() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 64;
        s.limits.max_message_chars = 60_000;
        s.limits.max_frame_bytes = 1 << 20;
    });
    run(async {
        let mut c = app.connect().await;
        let huge = "a".repeat(50_000);
        c.chat("big", &huge, json!({"max_tokens": 1})).await;
        let end = end_of(&mut c, "big").await;
        assert_eq!(end["error_type"], "prompt_too_long", "{end}");
        assert!(
            end["message"]
                .as_str()
                .unwrap()
                .contains("by its length alone"),
            "{end}"
        );
        // Short enough in bytes to maybe fit: tokenized, then refused by its token count.
        let longish = "word ".repeat(80);
        c.chat("mid", &longish, json!({"max_tokens": 1})).await;
        let end = end_of(&mut c, "mid").await;
        assert_eq!(end["error_type"], "prompt_too_long", "{end}");
        assert!(
            !end["message"].as_str().unwrap().contains("by its length"),
            "{end}"
        );
    });
}

/// Inter-delta gaps (ms) of one greedy reply of `n` tokens, read as they arrive.
async fn stream_gaps(c: &mut crate::common::Client, id: &str, n: u64) -> Vec<f64> {
    c.chat(
        id,
        "Count on.",
        json!({"temperature": 0, "max_tokens": n, "ignore_eos": true}),
    )
    .await;
    let mut last: Option<Instant> = None;
    let mut gaps = Vec::new();
    loop {
        let f = c.recv().await;
        match f["type"].as_str().unwrap() {
            "delta" => {
                let now = Instant::now();
                if let Some(t) = last {
                    gaps.push((now - t).as_secs_f64() * 1e3);
                }
                last = Some(now);
            }
            "done" => return gaps,
            "started" | "queued" => {}
            _ => panic!("{f}"),
        }
    }
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One client sends a chat and then 3,000 cancels of it, over and over (its frame budget raised
/// so that only the cancel path limits it): repeats of a cancel never reach the batcher, and the
/// gauges follow once a step, so another session's stream keeps its pace. The cache has as many
/// blocks as the default 1 GiB gives this model (262,144), so work per cancel that grows with
/// the cache would show. Measured on 2 cores (the flooding client shares them): gap p50 1.9 ->
/// 2.2 ms, max 5 -> 15-26 ms; the bound leaves room for a loaded machine.
#[test]
fn a_cancel_flood_does_not_slow_another_stream() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.cache_tokens = 1 << 22;
        s.limits.frames_per_s = 1e9;
        s.limits.frame_burst = u32::MAX;
        s.limits.rejected_frames_per_s = 1e9;
        s.limits.rejected_frame_burst = u32::MAX;
    });
    let app = std::rc::Rc::new(app);
    run(async {
        let mut a = app.connect().await;
        stream_gaps(&mut a, "warm", 100).await;
        let alone = stream_gaps(&mut a, "alone", 400).await;
        let stop = std::rc::Rc::new(std::cell::Cell::new(false));
        let flooder = {
            let (app, stop) = (app.clone(), stop.clone());
            actix_web::rt::spawn(async move {
                let mut b = app.connect().await;
                let mut cancels = 0u64;
                let mut round = 0;
                while !stop.get() {
                    let id = format!("b{round}");
                    b.chat(
                        &id,
                        "Go on.",
                        json!({"max_tokens": 500, "ignore_eos": true}),
                    )
                    .await;
                    for _ in 0..3000 {
                        b.send(json!({"type": "cancel", "id": id})).await;
                    }
                    cancels += 3000;
                    // Read up to an answer to a marker sent after the flood.
                    let marker = format!("m{round}");
                    b.send(json!({"type": "cancel", "id": marker})).await;
                    loop {
                        let f = b.recv().await;
                        if f["type"] == "error" && f["id"] == marker.as_str() {
                            break;
                        }
                        assert_ne!(f["type"], "closed", "{f}");
                    }
                    round += 1;
                }
                cancels
            })
        };
        // Let the flood start.
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
        let flooded = stream_gaps(&mut a, "flooded", 400).await;
        stop.set(true);
        let cancels = flooder.await.unwrap();
        let q = |v: &[f64]| (quantile(v, 0.5), quantile(v, 0.99), quantile(v, 1.0));
        let ((p50a, p99a, maxa), (p50f, p99f, maxf)) = (q(&alone), q(&flooded));
        eprintln!(
            "gap ms alone p50 {p50a:.2} p99 {p99a:.2} max {maxa:.2}; \
             with {cancels} cancels p50 {p50f:.2} p99 {p99f:.2} max {maxf:.2}"
        );
        assert!(cancels >= 3000, "the flood ran: {cancels} cancels");
        assert!(
            p50f <= 2.0 * p50a + 5.0,
            "gap p50 {p50a:.2} -> {p50f:.2} ms"
        );
        assert!(maxf <= maxa + 100.0, "worst gap {maxa:.2} -> {maxf:.2} ms");
    });
}
