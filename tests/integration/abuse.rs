//! Hostile and broken clients against the real server: a client that stops reading (its reply
//! cancelled, its socket reset), and what one client's abuse costs the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;
use crate::gateway::{metrics_text, spawn_app, App};

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

/// The value of `llama_relay_slow_readers_total{action=...}`.
async fn slow_readers(app: &App, action: &str) -> u64 {
    let text = metrics_text(app).await;
    let prefix = format!("llama_relay_slow_readers_total{{action=\"{action}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
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
