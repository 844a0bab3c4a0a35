//! The load generator behind the workloads (`crate::workloads` runs it): it speaks the
//! WebSocket protocol (and, for the throughput workload, OpenAI's streamed chat completions,
//! `--api openai`), a file per workload family; here the throughput workload and the client
//! helpers they share.
//!
//! N concurrent users (one WebSocket or one HTTP client each) send chat requests one after another
//! until a fixed number of requests is done: prompts of about 100 tokens with unique starts (so no two share a
//! prefix), 64 new tokens (`ignore_eos`), greedy. It measures on the client side: time to first
//! token (send to first `delta`), inter-token latency (gaps between deltas, each spread over the
//! tokens it carried) and aggregate generated tokens per second, and prints p50/p99.

mod chat;
mod cluster;
mod long;
mod mixed;
mod resume;
mod typeahead;

pub use chat::*;
pub use cluster::{run_cluster, ClusterBenchConfig};
pub use long::{run_long_chat, LongChatConfig};
pub use mixed::*;
pub use resume::*;
pub use typeahead::*;

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
    /// Each request's `response_format` (none: free text).
    pub response_format: Option<Value>,
    /// Prompts that ask for a quotation of text they hold (`quote_prompt`) instead of filler.
    pub quote: bool,
    /// Pause between a user's reply and its next request (WebSocket users).
    pub think: Duration,
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

/// A support question whose answer quotes its context: a policy (its opening unique to (user,
/// request)) and the request to repeat it word for word, as a support reply quotes what it was
/// given.
pub fn quote_prompt(user: usize, req: usize) -> String {
    format!(
        "Copy the following text exactly, word for word:\n\nPolicy {req}-{user}. Returns: \
         unused items may be returned within 30 days of delivery with the original receipt for a \
         full refund to the original payment method. Opened items may be exchanged for store \
         credit within 14 days. Shipping costs are refunded only when the item arrived damaged or \
         was not what was ordered. Refunds are issued within five business days after the \
         returned item reaches our warehouse in Portland, Oregon."
    )
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
        if n >= cfg.users && !cfg.think.is_zero() {
            actix_web::rt::time::sleep(cfg.think).await;
        }
        let id = format!("u{user}r{n}");
        let content = if cfg.quote {
            quote_prompt(user, n)
        } else {
            prompt(user, n, cfg.prompt_words)
        };
        let mut frame = json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": content}],
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true}});
        if let Some(f) = &cfg.response_format {
            frame["params"]["response_format"] = f.clone();
        }
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
        let mut body = json!({"model": model, "messages": [{"role": "user", "content": prompt(user, n, cfg.prompt_words)}],
            "temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}, "user": format!("bench-{}-{user}", cfg.run)});
        if let Some(f) = &cfg.response_format {
            body["response_format"] = f.clone();
        }
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

/// What a reply's frames said, read up to its `done`.
pub(crate) struct ReplyFrames {
    /// When the first and the last delta arrived, and how many did.
    pub first: Option<Instant>,
    pub last: Option<Instant>,
    pub deltas: usize,
    /// `started`'s prompt and cached tokens, and whether it dropped old turns.
    pub prompt: usize,
    pub cached: usize,
    pub truncated: bool,
    /// `done`'s completion tokens.
    pub completion: usize,
}

impl ReplyFrames {
    /// Seconds from `sent` to the first delta (NaN without one).
    pub fn ttft(&self, sent: Instant) -> f64 {
        self.first.map_or(f64::NAN, |f| (f - sent).as_secs_f64())
    }

    /// Tokens after the first over the time from the first delta to the last (None for a reply
    /// of one token).
    pub fn decode_rate(&self) -> Option<f64> {
        let span = (self.last? - self.first?).as_secs_f64();
        (self.completion > 1 && span > 0.0).then(|| (self.completion - 1) as f64 / span)
    }
}

/// Reads one reply's frames up to its `done`; an `error` frame ends it with the error.
pub(crate) async fn read_reply(ws: &mut Socket) -> Result<ReplyFrames, String> {
    let mut r = ReplyFrames {
        first: None,
        last: None,
        deltas: 0,
        prompt: 0,
        cached: 0,
        truncated: false,
        completion: 0,
    };
    loop {
        let f = next_frame(ws).await?;
        match f["type"].as_str() {
            Some("started") => {
                r.prompt = f["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                r.cached = f["cached_tokens"].as_u64().unwrap_or(0) as usize;
                r.truncated = f.get("truncated").is_some();
            }
            Some("delta") => {
                let now = Instant::now();
                r.first.get_or_insert(now);
                r.last = Some(now);
                r.deltas += 1;
            }
            Some("done") => {
                r.completion = f["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                return Ok(r);
            }
            Some("error") => return Err(format!("server error: {f}")),
            _ => {}
        }
    }
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

/// Runs the load and prints the summary; returns (ttft p50, ttft p99, itl p50, itl p99, tok/s
/// aggregate, decode tok/s: a reply's tokens after its first over the time from its first to its
/// last, the median of the replies).
pub async fn run(cfg: BenchConfig) -> Result<[f64; 6], String> {
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
    let mut decode: Vec<f64> = samples
        .iter()
        .filter(|s| s.tokens > 1 && !s.itl.is_empty())
        .map(|s| (s.tokens - 1) as f64 / s.itl.iter().sum::<f64>())
        .collect();
    decode.sort_by(f64::total_cmp);
    let r = [
        percentile(&ttft, 50.0),
        percentile(&ttft, 99.0),
        percentile(&itl, 50.0),
        percentile(&itl, 99.0),
        tokens as f64 / wall,
        percentile(&decode, 50.0),
    ];
    println!(
        "{:<9} | users {:>3} | requests {:>4} | TTFT p50 {:>8.1} ms p99 {:>8.1} ms | ITL p50 {:>6.1} ms p99 {:>7.1} ms | {:>6.1} tok/s aggregate ({} tokens in {:.1} s) | decode {:>6.1} tok/s a reply",
        cfg.api.name(), cfg.users, samples.len(), r[0] * 1e3, r[1] * 1e3, r[2] * 1e3, r[3] * 1e3, r[4], tokens, wall, r[5]
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
