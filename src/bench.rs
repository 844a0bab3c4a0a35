//! `llama-relay bench`: a load generator that speaks the WebSocket protocol.
//!
//! N concurrent users (one WebSocket each) send chat requests one after another until a fixed
//! number of requests is done: prompts of about 100 tokens with unique starts (so no two share a
//! prefix), 64 new tokens (`ignore_eos`), greedy. It measures on the client side: time to first
//! token (send to first `delta`), inter-token latency (gaps between deltas, each spread over the
//! tokens it carried) and aggregate generated tokens per second, and prints p50/p99.
//! Without `--url` it starts the server in this process on a free port.

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

#[derive(Debug, Clone)]
pub struct BenchConfig {
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
    let (_, mut ws) = awc::Client::new()
        .ws(&cfg.url)
        .max_frame_size(1 << 20)
        .connect()
        .await
        .map_err(|e| format!("connect {}: {e}", cfg.url))?;
    let mut out = Vec::new();
    loop {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n >= cfg.requests {
            break;
        }
        let id = format!("u{user}r{n}");
        let frame = json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": prompt(user, n, cfg.prompt_words)}],
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens, "ignore_eos": true}});
        // Each request is a fresh conversation.
        ws.send(ws::Message::Text(
            json!({"type": "reset"}).to_string().into(),
        ))
        .await
        .map_err(|e| e.to_string())?;
        let sent = Instant::now();
        ws.send(ws::Message::Text(frame.to_string().into()))
            .await
            .map_err(|e| e.to_string())?;
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        let mut pending_tokens = 0usize;
        loop {
            let f = match tokio_timeout(ws.next()).await {
                Some(Some(Ok(ws::Frame::Text(t)))) => {
                    serde_json::from_slice::<Value>(&t).map_err(|e| e.to_string())?
                }
                Some(Some(Ok(ws::Frame::Ping(p)))) => {
                    // The server closes connections that do not answer its heartbeat.
                    ws.send(ws::Message::Pong(p))
                        .await
                        .map_err(|e| e.to_string())?;
                    continue;
                }
                Some(Some(Ok(_))) => continue,
                Some(Some(Err(e))) => return Err(e.to_string()),
                Some(None) => return Err("connection closed".into()),
                None => return Err("no frame within 300 s".into()),
            };
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

async fn tokio_timeout<F: std::future::Future>(f: F) -> Option<F::Output> {
    actix_web::rt::time::timeout(Duration::from_secs(300), f)
        .await
        .ok()
}

/// Runs the load and prints the summary; returns (ttft p50, ttft p99, itl p50, itl p99, tok/s).
pub async fn run(cfg: BenchConfig) -> Result<[f64; 5], String> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..cfg.users)
        .map(|u| user(cfg.clone(), u, next.clone()))
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
        "users {:>3} | requests {:>4} | TTFT p50 {:>8.1} ms p99 {:>8.1} ms | ITL p50 {:>6.1} ms p99 {:>7.1} ms | {:>6.1} tok/s aggregate ({} tokens in {:.1} s)",
        cfg.users, samples.len(), r[0] * 1e3, r[1] * 1e3, r[2] * 1e3, r[3] * 1e3, r[4], tokens, wall
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
    fn prompts_start_uniquely() {
        let a = prompt(1, 2, 100);
        let b = prompt(2, 1, 100);
        assert_ne!(a[..20], b[..20]);
        assert!(a.split_whitespace().count() >= 95);
    }
}
