//! `llama-relay bench`: a load generator that speaks the WebSocket protocol (and, for the
//! throughput workload, OpenAI's streamed chat completions, `--api openai`).
//!
//! N concurrent users (one WebSocket or one HTTP client each) send chat requests one after another
//! until a fixed number of requests is done: prompts of about 100 tokens with unique starts (so no two share a
//! prefix), 64 new tokens (`ignore_eos`), greedy. It measures on the client side: time to first
//! token (send to first `delta`), inter-token latency (gaps between deltas, each spread over the
//! tokens it carried) and aggregate generated tokens per second, and prints p50/p99.
//! Without `--url` it starts the server in this process on a free port.

mod cluster;

pub use cluster::{run_cluster, ClusterBenchConfig, ClusterSummary};

use std::time::{Duration, Instant};

use awc::ws;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};

/// A request's measurements.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub ttft: f64,
    pub itl: Vec<f64>,
    pub tokens: usize,
}

/// Which protocol the throughput workload speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// The WebSocket protocol (`/ws`).
    WebSocket,
    /// `POST /v1/chat/completions` with `stream: true` (Server-Sent Events).
    OpenAi,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::WebSocket => "websocket",
            Api::OpenAi => "openai",
        }
    }
}

/// The HTTP address of the chat completions endpoint of the server at WebSocket `url`.
pub fn completions_url(ws_url: &str) -> String {
    let http = ws_url
        .replacen("wss://", "https://", 1)
        .replacen("ws://", "http://", 1);
    let base = http.split("/ws").next().unwrap_or(&http);
    format!("{}/v1/chat/completions", base.trim_end_matches('/'))
}

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub api: Api,
    /// OpenAI API: the key to send. Each user then names itself in `user`, a cache partition of
    /// its own, as each WebSocket session is (keyless requests share nothing, not even the chat
    /// template's opening).
    pub api_key: Option<String>,
    /// Names this run in the users' cache partitions, so that a run finds nothing an earlier
    /// run cached (a new WebSocket session finds nothing either).
    pub run: u64,
    pub url: String,
    pub users: usize,
    pub requests: usize,
    pub prompt_words: usize,
    pub max_tokens: usize,
}

/// Percentile of sorted values (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// A prompt of about `words` tokens whose start is unique to (user, request).
pub fn prompt(user: usize, req: usize, words: usize) -> String {
    const FILLER: &[&str] = &[
        "please", "explain", "how", "rivers", "shape", "valleys", "over", "long", "periods", "of",
        "time",
    ];
    let mut s = format!("Request {req} from user {user}. ");
    for i in 0..words.saturating_sub(8) {
        s.push_str(FILLER[(i + user + req) % FILLER.len()]);
        s.push(' ');
    }
    s
}

async fn user(
    cfg: BenchConfig,
    user: usize,
    next: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Result<Vec<Sample>, String> {
    let mut ws = connect(&cfg.url).await?;
    let mut out = Vec::new();
    loop {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n >= cfg.requests {
            break;
        }
        let id = format!("u{user}r{n}");
        let frame = json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": prompt(user, n, cfg.prompt_words)}],
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true}});
        let sent = Instant::now();
        send_fresh(&mut ws, &frame).await?;
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        let mut pending_tokens = 0usize;
        loop {
            let f = next_frame(&mut ws).await?;
            match f["type"].as_str() {
                Some("delta") => {
                    let now = Instant::now();
                    match last {
                        None => s.ttft = (now - sent).as_secs_f64(),
                        Some(l) => {
                            // A delta may carry several tokens (multi-byte characters).
                            let k = pending_tokens.max(1);
                            let gap = (now - l).as_secs_f64() / k as f64;
                            s.itl.extend(std::iter::repeat_n(gap, k));
                        }
                    }
                    last = Some(now);
                    pending_tokens = 1;
                }
                Some("done") => {
                    s.tokens = f["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    break;
                }
                Some("error") => return Err(format!("server error: {f}")),
                _ => {}
            }
        }
        out.push(s);
    }
    Ok(out)
}

/// A throughput user over OpenAI's API: the same requests as `user`, streamed as Server-Sent
/// Events; a content chunk counts as a delta.
async fn sse_user(
    cfg: BenchConfig,
    user: usize,
    next: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    model: String,
) -> Result<Vec<Sample>, String> {
    let url = completions_url(&cfg.url);
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(300))
        .finish();
    let mut out = Vec::new();
    loop {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n >= cfg.requests {
            break;
        }
        let body = json!({"model": model, "messages": [{"role": "user", "content": prompt(user, n, cfg.prompt_words)}],
            "temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}, "user": format!("bench-{}-{user}", cfg.run)});
        let sent = Instant::now();
        let mut req = client.post(&url);
        if let Some(k) = &cfg.api_key {
            req = req.bearer_auth(k);
        }
        let mut res = req
            .send_json(&body)
            .await
            .map_err(|e| format!("POST {url}: {e}"))?;
        if !res.status().is_success() {
            let b = res.body().await.unwrap_or_default();
            return Err(format!("{}: {}", res.status(), String::from_utf8_lossy(&b)));
        }
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        let mut buf = String::new();
        'read: while let Some(chunk) = res.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                let Some(data) = event.trim().strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    break 'read;
                }
                let c: SseChunk = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
                if let Some(e) = c.error {
                    return Err(format!("server error: {e}"));
                }
                if let Some(u) = c.usage {
                    s.tokens = u.completion_tokens;
                }
                let text = (c.choices.first())
                    .and_then(|c| c.delta.content.as_deref())
                    .unwrap_or("");
                if text.is_empty() {
                    continue;
                }
                let now = Instant::now();
                match last {
                    None => s.ttft = (now - sent).as_secs_f64(),
                    Some(l) => s.itl.push((now - l).as_secs_f64()),
                }
                last = Some(now);
            }
        }
        out.push(s);
    }
    Ok(out)
}

/// What the benchmark reads of a streamed chunk (as an SDK's typed client would).
#[derive(serde::Deserialize)]
struct SseChunk {
    #[serde(default)]
    choices: Vec<SseChoice>,
    usage: Option<SseUsage>,
    error: Option<Value>,
}

#[derive(serde::Deserialize)]
struct SseChoice {
    delta: SseDelta,
}

#[derive(serde::Deserialize)]
struct SseDelta {
    content: Option<String>,
}

#[derive(serde::Deserialize)]
struct SseUsage {
    completion_tokens: usize,
}

/// The id of the model a server serves (`GET /v1/models`).
async fn served_model(ws_url: &str, key: Option<&str>) -> Result<String, String> {
    let url = completions_url(ws_url).replace("/chat/completions", "/models");
    let mut req = awc::Client::new().get(&url);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let mut res = req.send().await.map_err(|e| format!("GET {url}: {e}"))?;
    let v: Value = res.json().await.map_err(|e| e.to_string())?;
    v["data"][0]["id"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| format!("no model in {v}"))
}

/// A client WebSocket.
pub type Socket = actix_codec::Framed<awc::BoxedSocket, ws::Codec>;

pub(crate) async fn connect(url: &str) -> Result<Socket, String> {
    connect_from(url, None).await
}

/// Connects as a browser page on `origin` would (widgets are accepted only from their origins).
async fn connect_from(url: &str, origin: Option<&str>) -> Result<Socket, String> {
    let mut req = awc::Client::new().ws(url).max_frame_size(1 << 20);
    if let Some(o) = origin {
        req = req.origin(o);
    }
    let (_, ws) = req
        .connect()
        .await
        .map_err(|e| format!("connect {url}: {e}"))?;
    Ok(ws)
}

/// The next JSON text frame; pings are answered on the way (the server closes connections that do
/// not answer its heartbeat).
pub(crate) async fn next_frame(ws: &mut Socket) -> Result<Value, String> {
    loop {
        let f = actix_web::rt::time::timeout(Duration::from_secs(300), ws.next()).await;
        match f {
            Ok(Some(Ok(ws::Frame::Text(t)))) => {
                return serde_json::from_slice::<Value>(&t).map_err(|e| e.to_string())
            }
            Ok(Some(Ok(ws::Frame::Ping(p)))) => ws
                .send(ws::Message::Pong(p))
                .await
                .map_err(|e| e.to_string())?,
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(None) => return Err("connection closed".into()),
            Err(_) => return Err("no frame within 300 s".into()),
        }
    }
}

/// Opens `n` sessions that each finish one short request and stay connected, so that each holds
/// a KV lease; returns their sockets (dropping them closes the sessions).
pub async fn idle_sessions(url: &str, n: usize) -> Result<Vec<Socket>, String> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut ws = connect(url).await?;
        let frame = json!({"type": "chat", "id": "idle", "messages": [{"role": "user", "content": prompt(10_000 + i, 0, 20)}],
            "params": {"temperature": 0, "max_tokens": 1}});
        send_json(&mut ws, &frame).await?;
        until(&mut ws, "done").await?;
        out.push(ws);
    }
    Ok(out)
}

pub(crate) async fn send_json(ws: &mut Socket, v: &Value) -> Result<(), String> {
    ws.send(ws::Message::Text(v.to_string().into()))
        .await
        .map_err(|e| e.to_string())
}

/// Sends `chat` as a fresh conversation: `reset`, then the chat, in one write (as two writes,
/// Nagle's algorithm would hold the chat until the server's delayed ACK of the reset, up to
/// 40 ms).
pub(crate) async fn send_fresh(ws: &mut Socket, chat: &Value) -> Result<(), String> {
    ws.feed(ws::Message::Text(
        json!({"type": "reset"}).to_string().into(),
    ))
    .await
    .map_err(|e| e.to_string())?;
    send_json(ws, chat).await
}

/// Reads frames until one of type `kind`; an `error` frame ends it with the error.
async fn until(ws: &mut Socket, kind: &str) -> Result<Value, String> {
    loop {
        let f = next_frame(ws).await?;
        match f["type"].as_str() {
            Some(k) if k == kind => return Ok(f),
            Some("error") => return Err(format!("server error: {f}")),
            _ => {}
        }
    }
}

/// Runs the load and prints the summary; returns (ttft p50, ttft p99, itl p50, itl p99, tok/s).
pub async fn run(cfg: BenchConfig) -> Result<[f64; 5], String> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let model = match cfg.api {
        Api::OpenAi => served_model(&cfg.url, cfg.api_key.as_deref()).await?,
        Api::WebSocket => String::new(),
    };
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..cfg.users)
        .map(|u| {
            let (cfg, next, model) = (cfg.clone(), next.clone(), model.clone());
            async move {
                match cfg.api {
                    Api::WebSocket => user(cfg, u, next).await,
                    Api::OpenAi => sse_user(cfg, u, next, model).await,
                }
            }
        })
        .collect();
    let results = futures_util::future::join_all(tasks).await;
    let wall = t0.elapsed().as_secs_f64();
    let mut samples = Vec::new();
    for r in results {
        samples.extend(r?);
    }
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl.iter().copied()).collect();
    ttft.sort_by(f64::total_cmp);
    itl.sort_by(f64::total_cmp);
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let r = [
        percentile(&ttft, 50.0),
        percentile(&ttft, 99.0),
        percentile(&itl, 50.0),
        percentile(&itl, 99.0),
        tokens as f64 / wall,
    ];
    println!(
        "{:<9} | users {:>3} | requests {:>4} | TTFT p50 {:>8.1} ms p99 {:>8.1} ms | ITL p50 {:>6.1} ms p99 {:>7.1} ms | {:>6.1} tok/s aggregate ({} tokens in {:.1} s)",
        cfg.api.name(), cfg.users, samples.len(), r[0] * 1e3, r[1] * 1e3, r[2] * 1e3, r[3] * 1e3, r[4], tokens, wall
    );
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn union_length_counts_overlaps_once() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // [0,10] and [5,20] overlap, [30,40] stands alone, [32,35] lies inside it.
        let spans = vec![
            (at(30), at(40)),
            (at(5), at(20)),
            (at(0), at(10)),
            (at(32), at(35)),
        ];
        assert_eq!(union_length(spans), Duration::from_millis(30));
        assert_eq!(union_length(Vec::new()), Duration::ZERO);
    }

    #[test]
    fn the_api_lives_beside_the_socket() {
        assert_eq!(
            completions_url("ws://127.0.0.1:8080/ws"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            completions_url("wss://chat.example.com/ws?x=1"),
            "https://chat.example.com/v1/chat/completions"
        );
    }

    #[test]
    fn prompts_start_uniquely() {
        let a = prompt(1, 2, 100);
        let b = prompt(2, 1, 100);
        assert_ne!(a[..20], b[..20]);
        assert!(a.split_whitespace().count() >= 95);
    }
}

/// The multi-turn chat workload: every user shares one long system prompt and asks `turns` short
/// questions in one conversation, with a think time between turns.
#[derive(Debug, Clone)]
pub struct ChatBenchConfig {
    pub url: String,
    /// Connect as visitors of this widget (id, page origin): the system prompt is the widget's,
    /// configured on the server; otherwise each user sends it as its first message.
    pub widget: Option<(String, String)>,
    pub users: usize,
    pub turns: usize,
    pub system_words: usize,
    pub max_tokens: usize,
    pub think: Duration,
}

/// Results of one chat run.
#[derive(Debug, Clone)]
pub struct ChatSummary {
    /// Per turn: (TTFT p50, TTFT p99) in seconds.
    pub ttft: Vec<(f64, f64)>,
    pub tokens_per_s: f64,
    /// Prompt tokens found in the prefix cache / prompt tokens.
    pub hit_rate: f64,
    pub peak_blocks: u64,
}

/// A support-desk system prompt of about `words` tokens.
pub fn system_prompt(words: usize) -> String {
    const W: &[&str] = &[
        "Always",
        "answer",
        "customers",
        "politely",
        "and",
        "check",
        "the",
        "order",
        "number",
        "before",
        "giving",
        "any",
        "refund",
        "details.",
    ];
    let mut s = String::from("You are the support assistant of Example Shop. ");
    for i in 0..words.saturating_sub(9) {
        s.push_str(W[i % W.len()]);
        s.push(' ');
    }
    s
}

async fn chat_user(
    cfg: ChatBenchConfig,
    user: usize,
    system: String,
) -> Result<Vec<(f64, usize, usize, usize)>, String> {
    let (url, origin) = match &cfg.widget {
        Some((id, origin)) => {
            let sep = if cfg.url.contains('?') { '&' } else { '?' };
            (
                format!("{}{sep}widget={id}", cfg.url),
                Some(origin.as_str()),
            )
        }
        None => (cfg.url.clone(), None),
    };
    let mut ws = connect_from(&url, origin).await?;
    let mut out = Vec::new();
    for turn in 0..cfg.turns {
        let q = format!(
            "User {user}, question {turn}: when will order {} arrive?",
            1000 + user * 10 + turn
        );
        let messages = if turn == 0 && cfg.widget.is_none() {
            json!([{"role": "system", "content": system}, {"role": "user", "content": q}])
        } else {
            json!([{"role": "user", "content": q}])
        };
        let id = format!("u{user}t{turn}");
        // Replies end at the model's end of turn (or max_tokens), as in a real conversation: the
        // next turn re-renders them, and a reply cut inside special tokens would not re-render.
        let frame = json!({"type": "chat", "id": id, "messages": messages,
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens}});
        let sent = Instant::now();
        send_json(&mut ws, &frame).await?;
        let mut ttft = None;
        let (mut prompt, mut cached) = (0, 0);
        loop {
            let f = next_frame(&mut ws).await?;
            match f["type"].as_str() {
                Some("started") => {
                    prompt = f["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                    cached = f["cached_tokens"].as_u64().unwrap_or(0) as usize;
                }
                Some("delta") if ttft.is_none() => ttft = Some(sent.elapsed().as_secs_f64()),
                Some("done") => {
                    let n = f["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    out.push((ttft.unwrap_or(f64::NAN), prompt, cached, n));
                    break;
                }
                Some("error") => return Err(format!("server error: {f}")),
                _ => {}
            }
        }
        actix_web::rt::time::sleep(cfg.think).await;
    }
    Ok(out)
}

/// Polls `/metrics` for the largest `llama_relay_kv_blocks_used` until `stop` is set.
async fn peak_blocks(
    metrics_url: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> u64 {
    let client = awc::Client::new();
    let mut peak = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(mut r) = client.get(&metrics_url).send().await {
            if let Ok(body) = r.body().await {
                let text = String::from_utf8_lossy(&body);
                if let Some(v) = text
                    .lines()
                    .find(|l| l.starts_with("llama_relay_kv_blocks_used "))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<f64>().ok())
                {
                    peak = peak.max(v as u64);
                }
            }
        }
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    peak
}

/// Runs the chat workload and prints per-turn TTFT, throughput, hit rate and peak KV blocks.
pub async fn run_chat(cfg: ChatBenchConfig, label: &str) -> Result<ChatSummary, String> {
    let system = system_prompt(cfg.system_words);
    let metrics_url = cfg
        .url
        .replacen("ws://", "http://", 1)
        .replace("/ws", "/metrics");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = actix_web::rt::spawn(peak_blocks(metrics_url, stop.clone()));
    let t0 = Instant::now();
    let results = futures_util::future::join_all(
        (0..cfg.users).map(|u| chat_user(cfg.clone(), u, system.clone())),
    )
    .await;
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = poller.await.unwrap_or(0);
    let mut per_turn: Vec<Vec<f64>> = vec![Vec::new(); cfg.turns];
    let (mut prompt, mut cached, mut tokens) = (0usize, 0usize, 0usize);
    for r in results {
        for (turn, (ttft, p, c, n)) in r?.into_iter().enumerate() {
            per_turn[turn].push(ttft);
            prompt += p;
            cached += c;
            tokens += n;
        }
    }
    let ttft: Vec<(f64, f64)> = per_turn
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            (percentile(v, 50.0), percentile(v, 99.0))
        })
        .collect();
    let s = ChatSummary {
        ttft,
        tokens_per_s: tokens as f64 / wall,
        hit_rate: cached as f64 / prompt.max(1) as f64,
        peak_blocks: peak,
    };
    let turns: Vec<String> = s
        .ttft
        .iter()
        .enumerate()
        .map(|(i, (a, b))| {
            format!(
                "turn {} TTFT p50 {:.0} ms p99 {:.0} ms",
                i + 1,
                a * 1e3,
                b * 1e3
            )
        })
        .collect();
    println!(
        "chat [{label}] users {} | {} | {:.1} tok/s aggregate | prefix hit rate {:.1}% | peak KV blocks {}",
        cfg.users,
        turns.join(" | "),
        s.tokens_per_s,
        s.hit_rate * 100.0,
        s.peak_blocks
    );
    Ok(s)
}

/// The mixed workload: streaming users, and long prompts arriving while they stream.
#[derive(Debug, Clone)]
pub struct MixedBenchConfig {
    pub url: String,
    /// Users streaming replies back to back.
    pub users: usize,
    /// Words in each long prompt (about one token each).
    pub long_words: usize,
    /// When each long prompt is sent, after the streams start.
    pub long_at: Vec<Duration>,
    /// Tokens per streamed reply.
    pub max_tokens: usize,
}

/// Gaps between one stream's deltas, each with the instant its delta arrived.
async fn stream_user(
    url: String,
    user: usize,
    max_tokens: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<(Vec<(Instant, f64)>, Vec<(Instant, f64, (f64, f64))>), String> {
    let mut ws = connect(&url).await?;
    let mut gaps = Vec::new();
    // (sent, TTFT, the server's queue time and TTFT), seconds.
    let mut ttfts = Vec::new();
    let mut n = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let frame = json!({"type": "chat", "id": format!("s{user}r{n}"), "messages": [{"role": "user", "content": prompt(user, n, 40)}],
            "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}});
        n += 1;
        let sent = Instant::now();
        send_fresh(&mut ws, &frame).await?;
        let mut last: Option<Instant> = None;
        let mut ttft = f64::NAN;
        loop {
            let f = next_frame(&mut ws).await?;
            match f["type"].as_str() {
                Some("delta") => {
                    let now = Instant::now();
                    match last {
                        Some(l) => gaps.push((now, (now - l).as_secs_f64())),
                        None => ttft = (now - sent).as_secs_f64(),
                    }
                    last = Some(now);
                }
                Some("done") => {
                    let ms = |k: &str| f["timings"][k].as_f64().unwrap_or(f64::NAN) / 1e3;
                    ttfts.push((sent, ttft, (ms("queue_ms"), ms("ttft_ms"))));
                    break;
                }
                Some("error") => return Err(format!("server error: {f}")),
                _ => {}
            }
        }
    }
    Ok((gaps, ttfts))
}

/// Sends one long prompt (`max_tokens` 1) and returns (sent, first token) instants.
async fn long_prompt(url: &str, n: usize, words: usize) -> Result<(Instant, Instant), String> {
    let mut ws = connect(url).await?;
    let frame = json!({"type": "chat", "id": format!("long{n}"), "messages": [{"role": "user", "content": prompt(900 + n, n, words)}],
        "params": {"temperature": 0, "max_tokens": 1}});
    let sent = Instant::now();
    send_json(&mut ws, &frame).await?;
    until(&mut ws, "delta").await?;
    Ok((sent, Instant::now()))
}

fn gap_line(label: &str, gaps: &[f64]) -> String {
    let mut g = gaps.to_vec();
    g.sort_by(f64::total_cmp);
    if g.is_empty() {
        return format!("{label}: no deltas");
    }
    format!(
        "{label}: gap p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} gaps)",
        percentile(&g, 50.0) * 1e3,
        percentile(&g, 99.0) * 1e3,
        g[g.len() - 1] * 1e3,
        g.len()
    )
}

/// Runs the mixed workload and prints the streams' gaps before, during and after the long
/// prefills, and each long prompt's TTFT against the same length alone (measured first, on the
/// idle server). Returns (during-gap p99, worst TTFT ratio).
pub async fn run_mixed(cfg: MixedBenchConfig) -> Result<(f64, f64), String> {
    // Alone first: a long prompt of the same length on the idle server.
    let (s, f) = long_prompt(&cfg.url, 99, cfg.long_words).await?;
    let alone = (f - s).as_secs_f64();
    println!("long prompt alone: TTFT {:.0} ms", alone * 1e3);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t0 = Instant::now();
    let streams: Vec<_> = (0..cfg.users)
        .map(|u| {
            actix_web::rt::spawn(stream_user(
                cfg.url.clone(),
                u,
                cfg.max_tokens,
                stop.clone(),
            ))
        })
        .collect();
    let longs: Vec<_> = cfg
        .long_at
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let (url, words, at) = (cfg.url.clone(), cfg.long_words, *at);
            actix_web::rt::spawn(async move {
                actix_web::rt::time::sleep(at).await;
                long_prompt(&url, i, words).await
            })
        })
        .collect();
    let mut windows = Vec::new();
    for l in longs {
        windows.push(l.await.map_err(|e| e.to_string())??);
    }
    let first_sent = windows.iter().map(|w| w.0).min().unwrap_or(t0);
    let last_ttft = windows.iter().map(|w| w.1).max().unwrap_or(t0);
    // As long after the prefills as before them, then stop the streams.
    let before = first_sent - t0;
    actix_web::rt::time::sleep(before).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut gaps, mut ttfts) = (Vec::new(), Vec::new());
    for s in streams {
        let (g, t) = s.await.map_err(|e| e.to_string())??;
        gaps.extend(g);
        ttfts.extend(t);
    }
    // A stream's first request starts with its prefill: skip the first second.
    let warm = t0 + Duration::from_secs(1);
    let pick = |from: Instant, to: Instant| -> Vec<f64> {
        gaps.iter()
            .filter(|(t, _)| *t > from && *t <= to)
            .map(|(_, g)| *g)
            .collect()
    };
    println!(
        "{} streams | {}",
        cfg.users,
        gap_line("before", &pick(warm, first_sent))
    );
    let during = pick(first_sent, last_ttft);
    println!("{} streams | {}", cfg.users, gap_line("during", &during));
    // A stream's next turn sent while the long prompts prefill waits for its first token: a
    // stall too, which the gaps inside replies do not show.
    let mut turns: Vec<(f64, (f64, f64))> = (ttfts.iter())
        .filter(|(t, _, _)| *t > first_sent && *t <= last_ttft)
        .map(|(_, d, q)| (*d, *q))
        .collect();
    turns.sort_by(|a, b| a.0.total_cmp(&b.0));
    let ttft: Vec<f64> = turns.iter().map(|t| t.0).collect();
    let (max, (queued, first)) =
        (turns.last().copied()).unwrap_or((f64::NAN, (f64::NAN, f64::NAN)));
    println!(
        "{} streams | during: new turns' TTFT p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (server: queued {:.1} ms, first token {:.1} ms) ({} turns)",
        cfg.users,
        percentile(&ttft, 50.0) * 1e3,
        percentile(&ttft, 99.0) * 1e3,
        max * 1e3,
        queued * 1e3,
        first * 1e3,
        turns.len()
    );
    println!(
        "{} streams | {}",
        cfg.users,
        gap_line("after", &pick(last_ttft, last_ttft + before))
    );
    let mut worst = 0f64;
    for (i, (s, f)) in windows.iter().enumerate() {
        let ttft = (*f - *s).as_secs_f64();
        worst = worst.max(ttft / alone);
        println!(
            "long prompt {i} ({} words): TTFT {:.0} ms, {:.2}x alone",
            cfg.long_words,
            ttft * 1e3,
            ttft / alone
        );
    }
    let mut d = during;
    d.sort_by(f64::total_cmp);
    Ok((percentile(&d, 99.0), worst))
}

/// The flood workload: one API-key user of one tenant asking short questions, alone and then
/// while keyless clients (another tenant) keep the server full of long replies.
#[derive(Debug, Clone)]
pub struct FloodBenchConfig {
    pub url: String,
    /// The measured user's key.
    pub api_key: String,
    /// Keyless clients sending long replies back to back.
    pub flood_users: usize,
    /// Tokens per flood reply.
    pub flood_tokens: usize,
    /// Requests the measured user sends in each phase.
    pub requests: usize,
}

/// One keyless flood client: long replies back to back until `stop`. An `overloaded` refusal
/// (its tenant's share of the queue is full) is waited out. Returns the replies it was refused
/// and the tokens it received while `counting`.
async fn flood_user(
    url: String,
    user: usize,
    max_tokens: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    counting: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<(usize, usize), String> {
    let mut ws = connect(&url).await?;
    let (mut n, mut refused, mut tokens) = (0, 0, 0);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let frame = json!({"type": "chat", "id": format!("f{user}r{n}"), "messages": [{"role": "user", "content": prompt(user, n, 40)}],
            "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}});
        n += 1;
        send_fresh(&mut ws, &frame).await?;
        loop {
            let f = next_frame(&mut ws).await?;
            match (f["type"].as_str(), f["error_type"].as_str()) {
                (Some("delta"), _) if counting.load(std::sync::atomic::Ordering::Relaxed) => {
                    tokens += 1
                }
                (Some("done"), _) => break,
                (Some("error"), Some("overloaded")) => {
                    refused += 1;
                    actix_web::rt::time::sleep(Duration::from_millis(500)).await;
                    break;
                }
                (Some("error"), _) => return Err(format!("server error: {f}")),
                _ => {}
            }
        }
    }
    Ok((refused, tokens))
}

/// The measured user's TTFTs (seconds, sorted): `requests` short chats one after another, each
/// a new conversation.
async fn keyed_ttfts(url: &str, key: &str, requests: usize, tag: &str) -> Result<Vec<f64>, String> {
    let (_, mut ws) = awc::Client::new()
        .ws(url)
        .max_frame_size(1 << 20)
        .bearer_auth(key)
        .connect()
        .await
        .map_err(|e| format!("connect {url}: {e}"))?;
    let mut ttfts = Vec::new();
    for i in 0..requests {
        let frame = json!({"type": "chat", "id": format!("{tag}{i}"), "messages": [{"role": "user", "content": prompt(700, i, 20)}],
            "params": {"temperature": 0, "max_tokens": 8, "ignore_eos": true}});
        let sent = Instant::now();
        send_fresh(&mut ws, &frame).await?;
        until(&mut ws, "delta").await?;
        ttfts.push((Instant::now() - sent).as_secs_f64());
        until(&mut ws, "done").await?;
        // A pause between questions, as a person makes (and within the session's frame budget).
        actix_web::rt::time::sleep(Duration::from_millis(300)).await;
    }
    ttfts.sort_by(f64::total_cmp);
    Ok(ttfts)
}

/// Runs the flood workload and prints the measured user's TTFT alone and during the flood.
/// Returns (p99 alone, p99 during) in seconds.
pub async fn run_flood(cfg: FloodBenchConfig) -> Result<(f64, f64), String> {
    let line = |label: &str, t: &[f64]| {
        println!(
            "API-key user, {label}: TTFT p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} requests)",
            percentile(t, 50.0) * 1e3,
            percentile(t, 99.0) * 1e3,
            t[t.len() - 1] * 1e3,
            t.len()
        )
    };
    // One question first, unmeasured: the first request of a process pays one-time costs.
    keyed_ttfts(&cfg.url, &cfg.api_key, 1, "w").await?;
    let alone = keyed_ttfts(&cfg.url, &cfg.api_key, cfg.requests, "a").await?;
    line("alone", &alone);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counting = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..cfg.flood_users)
        .map(|u| {
            actix_web::rt::spawn(flood_user(
                cfg.url.clone(),
                u,
                cfg.flood_tokens,
                stop.clone(),
                counting.clone(),
            ))
        })
        .collect();
    // Let the flood fill the running set and the queue.
    actix_web::rt::time::sleep(Duration::from_secs(3)).await;
    counting.store(true, std::sync::atomic::Ordering::Relaxed);
    let t0 = Instant::now();
    let during = keyed_ttfts(&cfg.url, &cfg.api_key, cfg.requests, "d").await;
    counting.store(false, std::sync::atomic::Ordering::Relaxed);
    let measured = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut refused, mut flood_tokens) = (0, 0);
    for f in flood {
        let (r, t) = f.await.map_err(|e| e.to_string())??;
        refused += r;
        flood_tokens += t;
    }
    let during = during?;
    line(
        &format!("during a flood of {} keyless users", cfg.flood_users),
        &during,
    );
    let (a, d) = (percentile(&alone, 99.0), percentile(&during, 99.0));
    println!(
        "TTFT p99 during / alone: {:.2}x; flood requests refused overloaded: {refused}; the flood's replies while measured: {:.1} tok/s",
        d / a,
        flood_tokens as f64 / measured
    );
    Ok((a, d))
}

/// What `run_resume` found.
#[derive(Debug, Default)]
pub struct ResumeSummary {
    pub disconnects: usize,
    /// Reassembled replies equal to the uninterrupted one.
    pub equal: usize,
    /// Delta indexes missing after the resume, and sent twice.
    pub lost: usize,
    pub duplicated: usize,
    /// Chats the server never read before the drop, sent again after the resume.
    pub resent: usize,
    /// From the new connection's upgrade to its resumed `ready`, seconds, sorted.
    pub resume_s: Vec<f64>,
}

/// Deltas (index, text) up to the reply's end.
async fn deltas_until_done(ws: &mut Socket) -> Result<Vec<(u64, String)>, String> {
    let mut out = Vec::new();
    loop {
        let f = next_frame(ws).await?;
        match f["type"].as_str() {
            Some("delta") => out.push((
                f["index"].as_u64().unwrap_or(u64::MAX),
                f["text"].as_str().unwrap_or_default().to_string(),
            )),
            Some("done") => return Ok(out),
            Some("error") => return Err(format!("server error: {f}")),
            _ => {}
        }
    }
}

/// Forced disconnects: for each of `disconnects` greedy replies, the reply uninterrupted, then
/// the same request on a connection dropped after a pseudo-random number of deltas (no close
/// frame) and resumed on a new one; the reassembled reply must equal the uninterrupted one, each
/// delta index arriving exactly once.
pub async fn run_resume(
    url: &str,
    disconnects: usize,
    max_tokens: usize,
) -> Result<ResumeSummary, String> {
    let mut s = ResumeSummary::default();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..disconnects {
        let chat = json!({"type": "chat", "id": "r", "messages": [{"role": "user", "content": prompt(i, 0, 30)}],
            "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}});
        let mut ws = connect(url).await?;
        until(&mut ws, "ready").await?;
        send_json(&mut ws, &chat).await?;
        let whole = deltas_until_done(&mut ws).await?;
        drop(ws);

        let mut ws = connect(url).await?;
        let ready = until(&mut ws, "ready").await?;
        let token = ready["resume_token"]
            .as_str()
            .ok_or("the server hands out no resume_token (server.resume_grace_s is 0)")?
            .to_string();
        send_json(&mut ws, &chat).await?;
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let cut = (seed >> 33) as usize % whole.len().max(1);
        let mut got = Vec::new();
        while got.len() < cut {
            let f = next_frame(&mut ws).await?;
            if f["type"] == "delta" {
                got.push((
                    f["index"].as_u64().unwrap_or(u64::MAX),
                    f["text"].as_str().unwrap_or_default().to_string(),
                ));
            }
        }
        // Gone without a close frame.
        drop(ws);
        let t0 = Instant::now();
        let mut ws = connect(url).await?;
        until(&mut ws, "ready").await?;
        let mut resume = json!({"type": "resume", "token": token, "id": "r"});
        if cut > 0 {
            resume["after_index"] = json!(cut - 1);
        }
        send_json(&mut ws, &resume).await?;
        let again = until(&mut ws, "ready").await?;
        if again["resumed"] != true {
            return Err(format!("not resumed: {again}"));
        }
        s.resume_s.push(t0.elapsed().as_secs_f64());
        // A chat sent just before the drop may never have been read: the server says so and
        // the client sends it again (as the page does).
        match deltas_until_done(&mut ws).await {
            Ok(rest) => got.extend(rest),
            Err(e) if got.is_empty() && e.contains("was not running") => {
                s.resent += 1;
                send_json(&mut ws, &chat).await?;
                got.extend(deltas_until_done(&mut ws).await?);
            }
            Err(e) => return Err(e),
        }
        s.disconnects += 1;
        let mut seen = std::collections::HashSet::new();
        for (i, _) in &got {
            if !seen.insert(*i) {
                s.duplicated += 1;
            }
        }
        s.lost += (0..whole.len() as u64)
            .filter(|i| !seen.contains(i))
            .count();
        let text: String = got.iter().map(|(_, t)| t.as_str()).collect();
        let want: String = whole.iter().map(|(_, t)| t.as_str()).collect();
        if text == want {
            s.equal += 1;
        }
    }
    s.resume_s.sort_by(f64::total_cmp);
    println!(
        "resume | {} forced disconnects | reassembled replies equal to the uninterrupted ones: {} | deltas lost {}, duplicated {} | chats never read before the drop, sent again: {} | new connection to resumed ready p50 {:.1} ms, p99 {:.1} ms",
        s.disconnects,
        s.equal,
        s.lost,
        s.duplicated,
        s.resent,
        percentile(&s.resume_s, 50.0) * 1e3,
        percentile(&s.resume_s, 99.0) * 1e3,
    );
    Ok(s)
}

/// The type-ahead workload: each user types a message at `chars_per_s` (sending what the input
/// holds as a `draft` every 500 ms, as the page does, when `drafts` is on), sends it and reads
/// the reply. Users start spread over one typing time, so some type while others read.
#[derive(Debug, Clone)]
pub struct TypeaheadBenchConfig {
    pub url: String,
    pub users: usize,
    /// Words in each typed message (about one token each).
    pub message_words: usize,
    pub chars_per_s: f64,
    pub max_tokens: usize,
    pub drafts: bool,
    /// Print the run's line (not for a warm-up).
    pub print: bool,
}

/// Results of one type-ahead run.
#[derive(Debug, Clone)]
pub struct TypeaheadSummary {
    /// Send to first delta, seconds, sorted.
    pub ttft: Vec<f64>,
    /// Each reply's decode rate (tokens after the first over the time after the first delta),
    /// sorted.
    pub decode_tok_s: Vec<f64>,
    /// Cached / prompt tokens over all the messages.
    pub cached_fraction: f64,
    pub prompt_tokens: f64,
    /// Reply tokens over the time some reply was being waited for or generated (the union of
    /// the users' send-to-done intervals): the server's generation throughput while it had
    /// replies to give, which drafts would lower if they took from the streams.
    pub aggregate_tok_s: f64,
}

/// One typist's reply.
struct TypedReply {
    ttft: f64,
    decode_tok_s: f64,
    prompt: usize,
    cached: usize,
    tokens: usize,
    sent: Instant,
    done: Instant,
}

/// The total length of the union of intervals.
fn union_length(mut spans: Vec<(Instant, Instant)>) -> Duration {
    spans.sort();
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for (a, b) in spans {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(Duration::ZERO, |(s, e)| e - s)
}

/// A message of about `words` tokens, unique to `user`.
pub fn typed_message(user: usize, words: usize) -> String {
    const W: &[&str] = &[
        "the", "river", "runs", "past", "our", "house", "and", "every", "spring", "it", "floods",
        "a", "little", "field", "where", "we", "grow", "beans",
    ];
    let mut s = format!("Message from user {user}: ");
    for i in 0..words.saturating_sub(6) {
        s.push_str(W[(i * 7 + user) % W.len()]);
        s.push(if i % 12 == 11 { '.' } else { ' ' });
        if i % 12 == 11 {
            s.push(' ');
        }
    }
    s.trim_end().to_string()
}

/// Waits `d` while answering the server's pings (a session that answers none is closed after
/// `server.client_timeout_s`).
async fn idle(ws: &mut Socket, d: Duration) -> Result<(), String> {
    let end = Instant::now() + d;
    while let Ok(f) = actix_web::rt::time::timeout(
        end.saturating_duration_since(Instant::now()),
        next_frame(ws),
    )
    .await
    {
        f?;
    }
    Ok(())
}

async fn typist(
    cfg: TypeaheadBenchConfig,
    user: usize,
    delay: Duration,
) -> Result<TypedReply, String> {
    let mut ws = connect(&cfg.url).await?;
    let message = typed_message(user, cfg.message_words);
    let chars: Vec<char> = message.chars().collect();
    idle(&mut ws, delay).await?;
    let start = Instant::now();
    let typing = Duration::from_secs_f64(chars.len() as f64 / cfg.chars_per_s);
    let mut sent_draft = 0;
    loop {
        idle(&mut ws, Duration::from_millis(500)).await?;
        let elapsed = start.elapsed();
        if elapsed >= typing {
            break;
        }
        let n = (elapsed.as_secs_f64() * cfg.chars_per_s) as usize;
        if cfg.drafts && n > sent_draft {
            sent_draft = n;
            let text: String = chars[..n].iter().collect();
            send_json(&mut ws, &json!({"type": "draft", "text": text})).await?;
        }
    }
    idle(&mut ws, typing.saturating_sub(start.elapsed())).await?;
    let frame = json!({"type": "chat", "id": "m", "messages": [{"role": "user", "content": message}],
        "params": {"temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true}});
    let sent = Instant::now();
    send_json(&mut ws, &frame).await?;
    let (mut first, mut last, mut deltas) = (None, sent, 0usize);
    let (mut prompt, mut cached) = (0, 0);
    loop {
        let f = next_frame(&mut ws).await?;
        match f["type"].as_str() {
            Some("started") => {
                prompt = f["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                cached = f["cached_tokens"].as_u64().unwrap_or(0) as usize;
            }
            Some("delta") => {
                last = Instant::now();
                first.get_or_insert(last);
                deltas += 1;
            }
            Some("done") => {
                let tokens = f["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                let first = first.ok_or("a reply without deltas")?;
                let decode = (last - first).as_secs_f64();
                let rate = if decode > 0.0 && deltas > 1 {
                    (tokens as f64 - 1.0) / decode
                } else {
                    f64::NAN
                };
                return Ok(TypedReply {
                    ttft: (first - sent).as_secs_f64(),
                    decode_tok_s: rate,
                    prompt,
                    cached,
                    tokens,
                    sent,
                    done: Instant::now(),
                });
            }
            Some("error") => return Err(format!("server error: {f}")),
            _ => {}
        }
    }
}

/// Runs the type-ahead workload once and prints its TTFT, decode rates and cache share.
pub async fn run_typeahead(cfg: TypeaheadBenchConfig) -> Result<TypeaheadSummary, String> {
    let typing_s = typed_message(0, cfg.message_words).chars().count() as f64 / cfg.chars_per_s;
    let results = futures_util::future::join_all((0..cfg.users).map(|u| {
        let spread = typing_s * u as f64 / cfg.users as f64;
        typist(cfg.clone(), u, Duration::from_secs_f64(spread))
    }))
    .await;
    let (mut ttft, mut rates, mut prompt, mut cached) = (Vec::new(), Vec::new(), 0, 0);
    let (mut tokens, mut spans) = (0, Vec::new());
    for r in results {
        let r = r?;
        ttft.push(r.ttft);
        if r.decode_tok_s.is_finite() {
            rates.push(r.decode_tok_s);
        }
        prompt += r.prompt;
        cached += r.cached;
        tokens += r.tokens;
        spans.push((r.sent, r.done));
    }
    ttft.sort_by(f64::total_cmp);
    rates.sort_by(f64::total_cmp);
    let s = TypeaheadSummary {
        ttft,
        decode_tok_s: rates,
        cached_fraction: cached as f64 / prompt.max(1) as f64,
        prompt_tokens: prompt as f64 / cfg.users.max(1) as f64,
        aggregate_tok_s: tokens as f64 / union_length(spans).as_secs_f64().max(1e-9),
    };
    if !cfg.print {
        return Ok(s);
    }
    println!(
        "typeahead [drafts {}] users {} | message {:.0} tokens typed at {} chars/s ({:.0} s) | TTFT p50 {:.1} ms p99 {:.1} ms | reply decode p50 {:.1} tok/s (sum over users {:.1}) | aggregate {:.1} tok/s | cached {:.1}% of prompt tokens",
        if cfg.drafts { "on" } else { "off" },
        cfg.users,
        s.prompt_tokens,
        cfg.chars_per_s,
        typing_s,
        percentile(&s.ttft, 50.0) * 1e3,
        percentile(&s.ttft, 99.0) * 1e3,
        percentile(&s.decode_tok_s, 50.0),
        s.decode_tok_s.iter().sum::<f64>(),
        s.aggregate_tok_s,
        s.cached_fraction * 100.0
    );
    Ok(s)
}

/// The paced workload: `users` ordinary users streaming replies back to back, and as many paced
/// clients that consume their replies at `acks_per_s` deltas a second (a voice client; with a
/// window they ack every other delta), with or without `params.window`, for `seconds`.
#[derive(Debug, Clone)]
pub struct PacedBenchConfig {
    pub url: String,
    pub users: usize,
    pub max_tokens: usize,
    pub acks_per_s: f64,
    pub window: Option<usize>,
    pub seconds: f64,
}

/// Results of one paced run.
#[derive(Debug, Clone)]
pub struct PacedSummary {
    /// The ordinary users' generated tokens a second, all together.
    pub others_tok_s: f64,
    /// Over every consumption tick of every paced client: deltas received and not yet consumed,
    /// sorted.
    pub ahead: Vec<usize>,
}

/// An ordinary user: replies back to back until `end`; returns the tokens generated.
async fn streaming_user(
    url: String,
    user: usize,
    max_tokens: usize,
    end: Instant,
) -> Result<usize, String> {
    let mut ws = connect(&url).await?;
    let mut tokens = 0;
    let mut n = 0;
    while Instant::now() < end {
        let frame = json!({"type": "chat", "id": format!("s{user}r{n}"), "messages": [{"role": "user", "content": prompt(user, n, 40)}],
            "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}});
        n += 1;
        send_fresh(&mut ws, &frame).await?;
        loop {
            let f = next_frame(&mut ws).await?;
            match f["type"].as_str() {
                // Only what was generated within the run counts.
                Some("delta") if Instant::now() < end => tokens += 1,
                Some("done") => break,
                Some("error") => return Err(format!("server error: {f}")),
                _ => {}
            }
        }
    }
    Ok(tokens)
}

/// A paced client: replies consumed one delta per tick until `end`; returns how far ahead of
/// the consumption the received deltas were at each tick.
async fn paced_client(
    cfg: PacedBenchConfig,
    user: usize,
    end: Instant,
) -> Result<Vec<usize>, String> {
    let mut ws = connect(&cfg.url).await?;
    let tick = Duration::from_secs_f64(1.0 / cfg.acks_per_s);
    let mut ahead = Vec::new();
    let mut n = 0;
    while Instant::now() < end {
        let mut params =
            json!({"temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true});
        if let Some(w) = cfg.window {
            params["window"] = json!(w);
        }
        let id = format!("p{user}r{n}");
        n += 1;
        send_fresh(&mut ws, &json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": prompt(900 + user, n, 40)}], "params": params})).await?;
        let (mut received, mut consumed, mut done) = (0usize, 0usize, false);
        let mut next_tick = Instant::now() + tick;
        while !(done && consumed == received) && Instant::now() < end {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match actix_web::rt::time::timeout(wait, next_frame(&mut ws)).await {
                Ok(f) => {
                    let f = f?;
                    match f["type"].as_str() {
                        Some("delta") => received += 1,
                        Some("done") => done = true,
                        Some("error") => return Err(format!("server error: {f}")),
                        _ => {}
                    }
                }
                Err(_) => {
                    next_tick += tick;
                    ahead.push(received - consumed);
                    if consumed < received {
                        consumed += 1;
                        // Every other delta: 5 acks a second stay well within the session's
                        // frame budget (limits.frames_per_s).
                        if cfg.window.is_some() && !done && consumed % 2 == 0 {
                            send_json(
                                &mut ws,
                                &json!({"type": "ack", "id": id, "index": consumed - 1}),
                            )
                            .await?;
                        }
                    }
                }
            }
        }
        if !done {
            send_json(&mut ws, &json!({"type": "cancel", "id": id})).await?;
            loop {
                let f = next_frame(&mut ws).await?;
                if f["type"] == "done" || f["type"] == "error" {
                    break;
                }
            }
        }
    }
    Ok(ahead)
}

/// Runs the paced workload once and prints the ordinary users' aggregate and how far ahead of
/// the paced clients their replies ran.
pub async fn run_paced(cfg: PacedBenchConfig) -> Result<PacedSummary, String> {
    let end = Instant::now() + Duration::from_secs_f64(cfg.seconds);
    let t0 = Instant::now();
    let others =
        (0..cfg.users).map(|u| actix_web::rt::spawn(streaming_user(cfg.url.clone(), u, 64, end)));
    let paced = (0..cfg.users).map(|u| actix_web::rt::spawn(paced_client(cfg.clone(), u, end)));
    let (others, paced): (Vec<_>, Vec<_>) = (others.collect(), paced.collect());
    let mut tokens = 0;
    for o in others {
        tokens += o.await.map_err(|e| e.to_string())??;
    }
    let mut ahead = Vec::new();
    for p in paced {
        ahead.extend(p.await.map_err(|e| e.to_string())??);
    }
    let wall = cfg.seconds.min(t0.elapsed().as_secs_f64());
    ahead.sort_unstable();
    let s = PacedSummary {
        others_tok_s: tokens as f64 / wall,
        ahead,
    };
    let pct = |p: f64| {
        let v: Vec<f64> = s.ahead.iter().map(|&a| a as f64).collect();
        percentile(&v, p)
    };
    println!(
        "paced [window {}] {} users + {} paced clients at {} deltas/s | others {:.1} tok/s aggregate | paced replies ahead of consumption: p50 {:.0}, p99 {:.0}, max {} deltas",
        cfg.window.map_or("none".to_string(), |w| w.to_string()),
        cfg.users,
        cfg.users,
        cfg.acks_per_s,
        s.others_tok_s,
        pct(50.0),
        pct(99.0),
        s.ahead.last().copied().unwrap_or(0)
    );
    Ok(s)
}
