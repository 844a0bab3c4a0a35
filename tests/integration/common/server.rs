//! The test harness every scenario shares: the real server on port 0 (in this process, or as a
//! spawned binary) and a WebSocket client (awc) that reads frames and whole replies.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use actix_web::web;
use awc::ws;
use futures_util::{SinkExt, StreamExt};
use llama_relay::server::batcher::{BatcherStatus, GetStatus};
use llama_relay::server::state::AppState;
use llama_relay::settings::Settings;
use serde_json::{json, Value};

pub struct App {
    pub addr: SocketAddr,
    /// The admin listener (`server.admin_port`), when configured.
    pub admin: Option<SocketAddr>,
    pub state: web::Data<AppState>,
}

/// Starts the server on its own thread and actix System; returns once the model is loaded.
pub fn spawn_app(model: &Path, tweak: impl FnOnce(&mut Settings)) -> App {
    let mut s = Settings::load(None).unwrap();
    s.model.path = model.display().to_string();
    s.server.port = 0;
    s.engine.cache_tokens = 8192;
    s.engine.max_context = 2048;
    s.sampling.knobs.temperature = Some(0.0);
    tweak(&mut s);
    s.validate_server().unwrap();
    let opts = s.engine_options().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let running = llama_relay::server::build(&s, opts).unwrap();
            tx.send((running.addr, running.admin_addr, running.state.clone()))
                .unwrap();
            let _ = running.server.await;
        })
    });
    let (addr, admin, state) = rx.recv().unwrap();
    let t0 = Instant::now();
    while state.ready().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "model did not load");
        std::thread::sleep(Duration::from_millis(20));
    }
    App { addr, admin, state }
}

/// The server binary on `model` as its own process (port 0, `RUST_LOG=info`, and `env`):
/// the child, where it listens (from its log), and the rest of its log, read on a thread so
/// that the child never blocks on a full pipe.
pub fn spawn_process(
    model: &Path,
    env: &[(&str, &str)],
) -> (
    std::process::Child,
    SocketAddr,
    std::thread::JoinHandle<Vec<String>>,
) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_llama-relay"))
        .arg("--model")
        .arg(model)
        .env("LLAMA_RELAY__SERVER__PORT", "0")
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
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
    (child, addr, log)
}

/// A session on the server at `addr` once its model has loaded (it retries meanwhile), its
/// `ready` read.
pub async fn connect_when_ready(addr: SocketAddr) -> Client {
    let t0 = Instant::now();
    loop {
        match awc::Client::new()
            .ws(format!("ws://{addr}/ws"))
            .connect()
            .await
        {
            Ok((_, framed)) => {
                let mut c = Client::from_framed(framed);
                assert_eq!(c.recv().await["type"], "ready");
                return c;
            }
            Err(_) => {
                assert!(t0.elapsed() < Duration::from_secs(60), "never ready");
                actix_web::rt::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

impl App {
    pub async fn status(&self) -> BatcherStatus {
        self.state
            .ready()
            .unwrap()
            .batcher
            .send(GetStatus)
            .await
            .unwrap()
    }

    /// Waits until nothing runs and the only KV blocks in use are held ones (session leases,
    /// pinned prefixes).
    pub async fn wait_idle(&self) -> BatcherStatus {
        let t0 = Instant::now();
        loop {
            let s = self.status().await;
            if s.running == 0 && s.waiting == 0 && s.kv_blocks_used == s.kv_blocks_held {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never idle: {s:?}");
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A WebSocket upgrade of `path` with extra headers: the client, or the refusal's status.
    pub async fn connect_with(&self, path: &str, headers: &[(&str, &str)]) -> Result<Client, u16> {
        self.connect_ready(path, headers).await.map(|(c, _)| c)
    }

    /// `connect_with`, also returning the `ready` frame.
    pub async fn connect_ready(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(Client, serde_json::Value), u16> {
        let mut req = awc::Client::new()
            .ws(format!("ws://{}{path}", self.addr))
            .max_frame_size(1 << 20);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        match req.connect().await {
            Ok((_, framed)) => {
                let mut c = Client::from_framed(framed);
                let ready = c.recv().await;
                assert_eq!(ready["type"], "ready", "{ready}");
                Ok((c, ready))
            }
            Err(awc::error::WsClientError::InvalidResponseStatus(s)) => Err(s.as_u16()),
            Err(e) => panic!("{e}"),
        }
    }

    pub async fn connect(&self) -> Client {
        let (_, framed) = awc::Client::new()
            .ws(format!("ws://{}/ws", self.addr))
            .max_frame_size(1 << 20)
            .connect()
            .await
            .unwrap();
        let mut c = Client { framed };
        let ready = c.recv().await;
        assert_eq!(ready["type"], "ready", "{ready}");
        c
    }
}

pub struct Client {
    framed: actix_codec::Framed<awc::BoxedSocket, ws::Codec>,
}

/// The frames of one reply.
#[derive(Debug, Default)]
pub struct Reply {
    pub text: String,
    pub deltas: usize,
    pub started: Option<Value>,
    pub done: Value,
    pub frames: Vec<Value>,
}

impl Client {
    pub fn from_framed(framed: actix_codec::Framed<awc::BoxedSocket, ws::Codec>) -> Self {
        Client { framed }
    }

    pub async fn send(&mut self, v: Value) {
        self.framed
            .send(ws::Message::Text(v.to_string().into()))
            .await
            .unwrap();
    }

    pub async fn send_raw(&mut self, s: &str) {
        self.framed
            .send(ws::Message::Text(s.to_string().into()))
            .await
            .unwrap();
    }

    /// The next JSON frame (pings answered, pongs skipped).
    pub async fn recv(&mut self) -> Value {
        loop {
            let f = actix_web::rt::time::timeout(Duration::from_secs(60), self.framed.next())
                .await
                .expect("a frame within 60 s")
                .expect("the connection is open")
                .unwrap();
            match f {
                ws::Frame::Text(t) => return serde_json::from_slice(&t).unwrap(),
                ws::Frame::Close(r) => {
                    return json!({"type": "closed", "code": r.map(|r| u16::from(r.code))})
                }
                ws::Frame::Ping(p) => self.framed.send(ws::Message::Pong(p)).await.unwrap(),
                _ => continue,
            }
        }
    }

    pub async fn chat(&mut self, id: &str, content: &str, params: Value) {
        self.send(json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": content}], "params": params})).await;
    }

    /// Reads frames until `done` (or `error`) for `id`.
    pub async fn reply(&mut self, id: &str) -> Reply {
        let mut r = Reply::default();
        loop {
            let f = self.recv().await;
            r.frames.push(f.clone());
            match f["type"].as_str().unwrap() {
                "started" => r.started = Some(f),
                "delta" => {
                    assert_eq!(f["id"], id);
                    assert_eq!(
                        f["index"].as_u64().unwrap() as usize,
                        r.deltas,
                        "delta indexes count up"
                    );
                    r.text.push_str(f["text"].as_str().unwrap());
                    r.deltas += 1;
                }
                "done" | "error" => {
                    r.done = f;
                    return r;
                }
                "queued" => {}
                other => panic!("unexpected frame {other}: {f}"),
            }
        }
    }
}

pub async fn metrics_text(app: &App) -> String {
    let mut r = awc::Client::new()
        .get(format!("http://{}/metrics", app.addr))
        .send()
        .await
        .unwrap();
    String::from_utf8(r.body().await.unwrap().to_vec()).unwrap()
}
