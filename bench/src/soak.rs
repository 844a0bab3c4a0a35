//! The soak: a long, bounded run against a server in another process (loopback only), the way a
//! public deployment is treated for hours. `scripts/soak.sh` starts the server and runs
//! `llama-relay-bench soak`. Not part of `cargo test`: it takes as long as it is told to.
//!
//! Load: `sessions` WebSocket sessions stay open the whole time (answering pings); `active` of
//! them generate back to back, the rest are idle. Every `wave_s` seconds a wave arrives on top:
//! `disconnects` clients that start a reply and drop their socket without a close frame,
//! `cancels` that cancel their reply once it streams, and `non_readers` (raw sockets with a
//! small receive buffer) that ask for a long reply and never read. After each wave the active
//! sessions pause until the server is idle, and the checkpoint reads the server's `/metrics`
//! (KV blocks used against held: they must be equal) and its resident memory
//! (`/proc/PID/status`). At the end: every request ended in `done` or an `error` frame, the KV pool
//! was back at its held level at every checkpoint, RSS drifted at most 5% after the warm-up (the
//! first third of the run, while the KV cache becomes resident),
//! and the server is still up; the process exits non-zero otherwise.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use awc::ws;
use futures_util::SinkExt;
use serde_json::json;

use crate::load::{connect, next_frame, prompt, send_fresh, send_json, Socket};

#[derive(clap::Args)]
pub struct SoakArgs {
    /// The server (ws://127.0.0.1:PORT/ws).
    #[arg(long)]
    url: String,
    /// The server's process id (its resident memory is read from /proc).
    #[arg(long)]
    server_pid: u32,
    #[arg(long, default_value_t = 30.0, value_parser = crate::workloads::above_0)]
    minutes: f64,
    /// Sessions open throughout, and how many of them generate back to back.
    #[arg(long, default_value_t = 1000)]
    sessions: usize,
    #[arg(long, default_value_t = 64)]
    active: usize,
    /// Seconds between waves of abuse.
    #[arg(long, default_value_t = 120)]
    wave_s: u64,
    /// Each wave: clients that drop their socket mid-reply, that cancel, that never read.
    #[arg(long, default_value_t = 500)]
    disconnects: usize,
    #[arg(long, default_value_t = 200)]
    cancels: usize,
    #[arg(long, default_value_t = 50)]
    non_readers: usize,
}

/// Runs the soak; an error when any of its checks failed.
pub fn main(a: SoakArgs) -> anyhow::Result<()> {
    let cfg = SoakConfig {
        url: a.url,
        server_pid: a.server_pid,
        duration: Duration::from_secs_f64(a.minutes * 60.0),
        sessions: a.sessions,
        active: a.active.min(a.sessions),
        wave_every: Duration::from_secs(a.wave_s),
        disconnects: a.disconnects,
        cancels: a.cancels,
        non_readers: a.non_readers,
    };
    let ok = actix_web::rt::System::new()
        .block_on(run(cfg))
        .map_err(|e| anyhow::anyhow!(e))?;
    if !ok {
        anyhow::bail!("the soak failed (see above)");
    }
    Ok(())
}

#[derive(Debug, Clone)]
struct SoakConfig {
    pub url: String,
    /// The server's process id, for its resident memory.
    pub server_pid: u32,
    pub duration: Duration,
    pub sessions: usize,
    pub active: usize,
    pub wave_every: Duration,
    pub disconnects: usize,
    pub cancels: usize,
    pub non_readers: usize,
}

/// How requests ended, by kind: `done:<finish_reason>`, `error:<error_type>`, or `broken:<why>`
/// for anything else (a connection that closed or went silent under a request).
#[derive(Default)]
struct Outcomes(Mutex<BTreeMap<String, u64>>);

impl Outcomes {
    fn add(&self, k: String) {
        *self.0.lock().unwrap().entry(k).or_default() += 1;
    }

    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().unwrap().clone()
    }
}

/// A session, its `ready` frame read.
async fn open(url: &str) -> Result<Socket, String> {
    let mut ws = connect(url).await?;
    let f = next_frame(&mut ws).await?;
    if f["type"] != "ready" {
        return Err(format!("expected ready, got {f}"));
    }
    Ok(ws)
}

/// Reads one reply to its end.
async fn finish_reply(ws: &mut Socket) -> String {
    loop {
        match actix_web::rt::time::timeout(Duration::from_secs(120), next_frame(ws)).await {
            Err(_) => return "broken:silent for 120 s".into(),
            Ok(Err(e)) => return format!("broken:{e}"),
            Ok(Ok(f)) => match f["type"].as_str() {
                Some("done") => {
                    return format!("done:{}", f["finish_reason"].as_str().unwrap_or("?"))
                }
                Some("error") => {
                    return format!("error:{}", f["error_type"].as_str().unwrap_or("?"))
                }
                _ => {}
            },
        }
    }
}

/// A session that generates back to back (pausing while `pause` is set) until `stop`.
async fn active_session(
    url: String,
    n: usize,
    pause: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    outcomes: Arc<Outcomes>,
) -> Result<(), String> {
    let mut ws = open(&url).await?;
    let mut k = 0usize;
    while !stop.load(Ordering::Relaxed) {
        if pause.load(Ordering::Relaxed) {
            idle_for(&mut ws, Duration::from_millis(200)).await?;
            continue;
        }
        let max_tokens = 16 + (n * 7919 + k * 104_729) % 240;
        let frame = json!({"type": "chat", "id": format!("a{n}r{k}"), "messages": [{"role": "user", "content": prompt(n, k, 30)}],
            "params": {"temperature": 0.7, "seed": k, "max_tokens": max_tokens}});
        k += 1;
        let sent = send_fresh(&mut ws, &frame).await;
        let end = match sent {
            Ok(()) => finish_reply(&mut ws).await,
            Err(e) => format!("broken:{e}"),
        };
        let broken = end.starts_with("broken");
        let refused = end == "error:overloaded";
        outcomes.add(end);
        if refused {
            // The queue is full: back off, as a real client does.
            idle_for(&mut ws, Duration::from_millis(500)).await?;
        }
        if broken {
            // Reconnect: a broken session is counted, and the soak goes on.
            ws = open(&url).await?;
        }
        // Stay under the session's frame budget.
        idle_for(&mut ws, Duration::from_millis(150)).await?;
    }
    Ok(())
}

/// Reads (answering pings) for `d`; a text frame here is unexpected.
async fn idle_for(ws: &mut Socket, d: Duration) -> Result<(), String> {
    match actix_web::rt::time::timeout(d, next_frame(ws)).await {
        Err(_) => Ok(()),
        Ok(Ok(f)) => Err(format!("unexpected frame while idle: {f}")),
        Ok(Err(e)) => Err(e),
    }
}

/// An idle session: answers pings until `stop`; an error if it did not stay open.
async fn idle_session(url: String, stop: Arc<AtomicBool>) -> Result<(), String> {
    let mut ws = open(&url).await?;
    while !stop.load(Ordering::Relaxed) {
        idle_for(&mut ws, Duration::from_secs(1)).await?;
    }
    let _ = ws.send(ws::Message::Close(None)).await;
    Ok(())
}

/// A client that starts a reply and drops its socket once it streams (or is queued, or refused).
async fn disconnecter(url: String, n: usize, outcomes: Arc<Outcomes>) {
    let Ok(mut ws) = connect(&url).await else {
        return outcomes.add("broken:connect".into());
    };
    let frame = json!({"type": "chat", "id": "x", "messages": [{"role": "user", "content": prompt(50_000 + n, 0, 30)}],
        "params": {"max_tokens": 200}});
    for attempt in 0.. {
        if send_json(&mut ws, &frame).await.is_err() {
            return outcomes.add("broken:send".into());
        }
        let end = loop {
            match next_frame(&mut ws).await {
                Ok(f) if f["type"] == "delta" => break "dropped mid-reply".to_string(),
                Ok(f) if f["type"] == "error" => {
                    break format!("error:{}", f["error_type"].as_str().unwrap_or("?"))
                }
                Ok(_) => continue,
                Err(e) => break format!("broken:{e}"),
            }
        };
        if end == "error:overloaded" && attempt < RETRIES {
            backoff(n, attempt).await;
            continue;
        }
        // Returning drops the socket without a close frame.
        return outcomes.add(end);
    }
}

/// A client that cancels its reply once it streams.
async fn canceller(url: String, n: usize, outcomes: Arc<Outcomes>) {
    let Ok(mut ws) = connect(&url).await else {
        return outcomes.add("broken:connect".into());
    };
    let frame = json!({"type": "chat", "id": "c", "messages": [{"role": "user", "content": prompt(60_000 + n, 0, 30)}],
        "params": {"max_tokens": 400}});
    let mut attempt = 0;
    let end = loop {
        if send_json(&mut ws, &frame).await.is_err() {
            break "broken:send".to_string();
        }
        let end = cancel_once_streaming(&mut ws).await;
        if end == "error:overloaded" && attempt < RETRIES {
            backoff(n, attempt).await;
            attempt += 1;
            continue;
        }
        break end;
    };
    outcomes.add(end);
    let _ = ws.send(ws::Message::Close(None)).await;
}

/// Refused `overloaded` (the queue is full), a wave client tries again after a pause, up to this
/// many times, as a real client with backoff does.
const RETRIES: usize = 60;

async fn backoff(n: usize, attempt: usize) {
    let ms = 200 + (n * 37 + attempt * 101) % 800;
    actix_web::rt::time::sleep(Duration::from_millis(ms as u64)).await;
}

/// Waits for the reply to stream, cancels it, and reads it to its end.
async fn cancel_once_streaming(ws: &mut Socket) -> String {
    loop {
        match next_frame(ws).await {
            Ok(f) if f["type"] == "delta" => {
                if send_json(ws, &json!({"type": "cancel", "id": "c"}))
                    .await
                    .is_err()
                {
                    break "broken:send".to_string();
                }
                break finish_reply(ws).await;
            }
            Ok(f) if f["type"] == "error" => {
                break format!("error:{}", f["error_type"].as_str().unwrap_or("?"))
            }
            Ok(f) if f["type"] == "done" => {
                break format!("done:{}", f["finish_reason"].as_str().unwrap_or("?"))
            }
            Ok(_) => continue,
            Err(e) => break format!("broken:{e}"),
        }
    }
}

/// A raw client with a 4 KiB receive buffer that asks for a long reply and never reads; returns
/// its socket (kept open until the wave is checked).
fn non_reader(addr: std::net::SocketAddr, n: usize) -> std::io::Result<std::net::TcpStream> {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: a fresh socket whose descriptor moves into the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is ours and open; the stream owns and closes it.
    let mut s = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let size: libc::c_int = 4096;
    // SAFETY: setsockopt reads an int.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let std::net::SocketAddr::V4(v4) = addr else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect reads a sockaddr_in of the given length.
    let rc = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    write!(
        s,
        "GET /ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )?;
    let chat = json!({"type": "chat", "id": "n", "messages": [{"role": "user", "content": prompt(70_000 + n, 0, 20)}],
        "params": {"max_tokens": 4000, "ignore_eos": true}})
    .to_string()
    .into_bytes();
    let mut f = vec![0x81u8, 0x80 | 126];
    f.extend_from_slice(&(chat.len() as u16).to_be_bytes());
    f.extend_from_slice(&[1, 2, 3, 4]);
    f.extend(
        chat.iter()
            .enumerate()
            .map(|(i, b)| b ^ [1u8, 2, 3, 4][i % 4]),
    );
    s.write_all(&f)?;
    Ok(s)
}

/// The server's `/metrics` as name (with labels) -> value.
async fn metrics(url: &str) -> Result<BTreeMap<String, f64>, String> {
    let http = crate::load::completions_url(url).replace("/v1/chat/completions", "/metrics");
    let mut res = awc::Client::new()
        .get(&http)
        .send()
        .await
        .map_err(|e| format!("GET {http}: {e}"))?;
    let body = res.body().limit(1 << 22).await.map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect())
}

fn rss_mib(pid: u32) -> Result<f64, String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("the server (pid {pid}) is gone: {e}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .ok_or_else(|| "no VmRSS".into())
}

/// One checkpoint: the server idle, its KV blocks used and held, its RSS.
struct Checkpoint {
    at: Duration,
    used: f64,
    held: f64,
    rss: f64,
}

/// Waits (up to 120 s) until nothing runs or waits, then reads a checkpoint.
async fn checkpoint(cfg: &SoakConfig, t0: Instant) -> Result<Checkpoint, String> {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let m = metrics(&cfg.url).await?;
        let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        if get("vllm:num_requests_running") == 0.0 && get("vllm:num_requests_waiting") == 0.0 {
            // The gauges follow the step after the last change: read them once more.
            actix_web::rt::time::sleep(Duration::from_millis(300)).await;
            let m = metrics(&cfg.url).await?;
            let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
            return Ok(Checkpoint {
                at: t0.elapsed(),
                used: get("llama_relay_kv_blocks_used"),
                held: get("llama_relay_kv_blocks_held"),
                rss: rss_mib(cfg.server_pid)?,
            });
        }
        if Instant::now() > until {
            return Err("the server did not become idle within 120 s of a wave".into());
        }
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs the soak; returns whether every check held.
async fn run(cfg: SoakConfig) -> Result<bool, String> {
    let addr: std::net::SocketAddr = cfg
        .url
        .trim_start_matches("ws://")
        .split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .ok_or("--url must be ws://IP:PORT/ws (loopback)")?;
    if !addr.ip().is_loopback() {
        return Err("the soak runs against a loopback server only".into());
    }
    let t0 = Instant::now();
    let (pause, stop) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let outcomes = Arc::new(Outcomes::default());
    let mut tasks = Vec::new();
    for n in 0..cfg.sessions {
        let task = if n < cfg.active {
            actix_web::rt::spawn(active_session(
                cfg.url.clone(),
                n,
                pause.clone(),
                stop.clone(),
                outcomes.clone(),
            ))
        } else {
            actix_web::rt::spawn(idle_session(cfg.url.clone(), stop.clone()))
        };
        tasks.push(task);
        if n % 100 == 99 {
            actix_web::rt::time::sleep(Duration::from_millis(50)).await;
        }
    }
    println!(
        "soak: {} sessions ({} generating), a wave every {} s of {} disconnects, {} cancels, {} non-readers, for {} s",
        cfg.sessions,
        cfg.active,
        cfg.wave_every.as_secs(),
        cfg.disconnects,
        cfg.cancels,
        cfg.non_readers,
        cfg.duration.as_secs()
    );
    let mut checkpoints = Vec::new();
    let mut wave = 0;
    let mut ok = true;
    while t0.elapsed() + cfg.wave_every <= cfg.duration {
        actix_web::rt::time::sleep(cfg.wave_every).await;
        wave += 1;
        let waves = Arc::new(Outcomes::default());
        let mut clients = Vec::new();
        for n in 0..cfg.disconnects {
            clients.push(actix_web::rt::spawn(disconnecter(
                cfg.url.clone(),
                wave * 10_000 + n,
                waves.clone(),
            )));
        }
        for n in 0..cfg.cancels {
            clients.push(actix_web::rt::spawn(canceller(
                cfg.url.clone(),
                wave * 10_000 + n,
                waves.clone(),
            )));
        }
        let mut silent = Vec::new();
        for n in 0..cfg.non_readers {
            match non_reader(addr, wave * 10_000 + n) {
                Ok(s) => silent.push(s),
                Err(e) => waves.add(format!("broken:non-reader connect: {e}")),
            }
        }
        for c in clients {
            let _ = c.await;
        }
        // The non-readers are reset by the server (write timeout) or lose their reply (queue
        // limit); their sockets close with the checkpoint.
        pause.store(true, Ordering::Relaxed);
        let c = checkpoint(&cfg, t0).await?;
        drop(silent);
        pause.store(false, Ordering::Relaxed);
        let m = metrics(&cfg.url).await?;
        let slow = |a: &str| {
            m.get(&format!("llama_relay_slow_readers_total{{action=\"{a}\"}}"))
                .copied()
                .unwrap_or(0.0)
        };
        let w = waves.snapshot();
        let broken: u64 = (w.iter())
            .filter(|(k, _)| k.starts_with("broken"))
            .map(|(_, v)| v)
            .sum();
        let kv_ok = c.used == c.held;
        ok &= kv_ok && broken == 0;
        println!(
            "wave {wave} at {:.0} s: {w:?} | KV used {} held {}{} | RSS {:.0} MiB | slow readers: {} cancelled, {} reset",
            c.at.as_secs_f64(),
            c.used,
            c.held,
            if kv_ok { "" } else { " (NOT back at its held level)" },
            c.rss,
            slow("reply_cancelled"),
            slow("connection_closed"),
        );
        checkpoints.push(c);
    }
    stop.store(true, Ordering::Relaxed);
    let mut session_errors = Vec::new();
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => session_errors.push(e),
            Err(e) => session_errors.push(e.to_string()),
        }
    }
    let all = outcomes.snapshot();
    let requests: u64 = all.values().sum();
    let broken: u64 = (all.iter())
        .filter(|(k, _)| k.starts_with("broken"))
        .map(|(_, v)| v)
        .sum();
    println!("steady sessions: {requests} requests: {all:?}");
    if !session_errors.is_empty() {
        ok = false;
        println!(
            "{} sessions ended with an error, e.g. {:?}",
            session_errors.len(),
            &session_errors[..session_errors.len().min(3)]
        );
    }
    ok &= broken == 0;
    // Warm-up: the first third of the run. The KV cache becomes resident as its blocks are
    // first used, and the pool hands out never-used blocks first, so RSS climbs until the whole
    // cache has been touched; drift is measured after that.
    let warm = checkpoints
        .iter()
        .find(|c| c.at >= cfg.duration / 3)
        .or(checkpoints.last());
    if let (Some(first), Some(last)) = (warm, checkpoints.last()) {
        let after: Vec<f64> = (checkpoints.iter())
            .filter(|c| c.at >= first.at)
            .map(|c| c.rss)
            .collect();
        let max = after.iter().copied().fold(0.0, f64::max);
        let drift = (last.rss - first.rss) / first.rss * 100.0;
        let peak = (max - first.rss) / first.rss * 100.0;
        println!(
            "RSS after warm-up ({:.0} s) {:.0} MiB, at the end {:.0} MiB: drift {drift:+.1}% (peak {peak:+.1}%)",
            first.at.as_secs_f64(),
            first.rss,
            last.rss
        );
        ok &= drift.abs() <= 5.0;
    }
    ok &= rss_mib(cfg.server_pid).is_ok();
    println!(
        "soak {}: {} waves in {:.0} s",
        if ok { "passed" } else { "FAILED" },
        checkpoints.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ok)
}
