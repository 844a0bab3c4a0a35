//! The typeahead and paced workloads: users typing with and without drafts, and paced clients
//! consuming replies at a set rate beside streaming users.

use crate::load::*;

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
pub(super) struct TypedReply {
    ttft: f64,
    decode_tok_s: f64,
    prompt: usize,
    cached: usize,
    tokens: usize,
    sent: Instant,
    done: Instant,
}

/// The total length of the union of intervals.
pub(super) fn union_length(mut spans: Vec<(Instant, Instant)>) -> Duration {
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
pub(super) async fn idle(ws: &mut Socket, d: Duration) -> Result<(), String> {
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

pub(super) async fn typist(
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
    let r = read_reply(&mut ws).await?;
    let (first, last) = r.first.zip(r.last).ok_or("a reply without deltas")?;
    let decode = (last - first).as_secs_f64();
    let rate = if decode > 0.0 && r.deltas > 1 {
        (r.completion as f64 - 1.0) / decode
    } else {
        f64::NAN
    };
    Ok(TypedReply {
        ttft: (first - sent).as_secs_f64(),
        decode_tok_s: rate,
        prompt: r.prompt,
        cached: r.cached,
        tokens: r.completion,
        sent,
        done: Instant::now(),
    })
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
pub(super) async fn streaming_user(
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
pub(super) async fn paced_client(
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
