//! The mixed and flood workloads: streams while long prompts arrive (the streams' gaps and the
//! long prompts' time against alone), and an API-key user's TTFT while keyless clients flood.

use crate::load::*;

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

/// Gaps between one stream's deltas, each with the instant its delta arrived and whether its
/// reply had tokens whose text the server held back (fewer deltas than tokens: an incomplete
/// character or a possible stop string), so that a long gap there may be several tokens' steps.
pub(super) async fn stream_user(
    url: String,
    user: usize,
    max_tokens: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<(Vec<(Instant, f64, bool)>, Vec<(Instant, f64, (f64, f64))>), String> {
    let mut ws = connect(&url).await?;
    let mut gaps = Vec::new();
    // (sent, TTFT, the server's queue time and TTFT), seconds.
    let mut ttfts = Vec::new();
    let mut n = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        // A reply ends at its end-of-turn token, as a visitor's does: past it (`ignore_eos`) the
        // model writes chat markup whose special tokens have no text, so the gap over them would
        // be several steps with nothing to show, not a late step.
        let frame = json!({"type": "chat", "id": format!("s{user}r{n}"), "messages": [{"role": "user", "content": prompt(user, n, 40)}],
            "params": {"temperature": 0, "max_tokens": max_tokens}});
        n += 1;
        let sent = Instant::now();
        send_fresh(&mut ws, &frame).await?;
        let mut last: Option<Instant> = None;
        let mut ttft = f64::NAN;
        let (first_gap, mut deltas) = (gaps.len(), 0u64);
        loop {
            let f = next_frame(&mut ws).await?;
            match f["type"].as_str() {
                Some("delta") => {
                    let now = Instant::now();
                    deltas += 1;
                    match last {
                        Some(l) => gaps.push((now, (now - l).as_secs_f64(), false)),
                        None => ttft = (now - sent).as_secs_f64(),
                    }
                    last = Some(now);
                }
                Some("done") => {
                    // An end-of-turn token ends the reply with no text of its own.
                    let tokens = (f["usage"]["completion_tokens"].as_u64().unwrap_or(0))
                        .saturating_sub(u64::from(f["finish_reason"] == "stop"));
                    for g in &mut gaps[first_gap..] {
                        g.2 = tokens > deltas;
                    }
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
pub(super) async fn long_prompt(
    url: &str,
    n: usize,
    words: usize,
) -> Result<(Instant, Instant), String> {
    let mut ws = connect(url).await?;
    let frame = json!({"type": "chat", "id": format!("long{n}"), "messages": [{"role": "user", "content": prompt(900 + n, n, words)}],
        "params": {"temperature": 0, "max_tokens": 1}});
    let sent = Instant::now();
    send_json(&mut ws, &frame).await?;
    until(&mut ws, "delta").await?;
    Ok((sent, Instant::now()))
}

pub(super) fn gap_line(label: &str, gaps: &[f64]) -> String {
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
            .filter(|(t, _, _)| *t > from && *t <= to)
            .map(|(_, g, _)| *g)
            .collect()
    };
    println!(
        "{} streams | {}",
        cfg.users,
        gap_line("before", &pick(warm, first_sent))
    );
    let during = pick(first_sent, last_ttft);
    println!("{} streams | {}", cfg.users, gap_line("during", &during));
    // The gaps over 100 ms (the streams' target) and how many lie in replies whose text the
    // server held back for some tokens: those may span several steps without a slow step.
    let phase: Vec<(f64, bool)> = (gaps.iter())
        .filter(|(t, _, _)| *t > first_sent && *t <= last_ttft)
        .map(|(_, g, held)| (*g, *held))
        .collect();
    let long: Vec<bool> = (phase.iter())
        .filter(|(g, _)| *g > 0.1)
        .map(|p| p.1)
        .collect();
    let held = phase.iter().filter(|p| p.1).count();
    println!(
        "{} streams | during: {} gaps over 100 ms, {} of them in replies with text held back \
         (which hold {held} of the phase's {} gaps)",
        cfg.users,
        long.len(),
        long.iter().filter(|h| **h).count(),
        phase.len()
    );
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
pub(super) async fn flood_user(
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
pub(super) async fn keyed_ttfts(
    url: &str,
    key: &str,
    requests: usize,
    tag: &str,
) -> Result<Vec<f64>, String> {
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
