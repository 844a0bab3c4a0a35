//! The chat workload: a shared system prompt (a widget's, or sent by each user), several turns
//! per user with think time between them; TTFT per turn and the KV blocks it took.

use crate::load::*;

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
    /// Leave sampling to the server's `[sampling]` defaults (temperature 0.7, top-p, min-p), as
    /// the chat page and the widget do, instead of asking for greedy replies.
    pub server_sampling: bool,
    /// The seeds' base with `server_sampling`: user u's turn t samples with `seed_base + 10u + t`.
    pub seed_base: u64,
}

/// Results of one chat run.
#[derive(Debug, Clone)]
pub struct ChatSummary {
    /// Per turn: (TTFT p50, TTFT p99) in seconds.
    pub ttft: Vec<(f64, f64)>,
    pub tokens_per_s: f64,
    /// The median reply's decode rate (`ReplyFrames::decode_rate`).
    pub decode_per_s: f64,
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

pub(super) async fn chat_user(
    cfg: ChatBenchConfig,
    user: usize,
    system: String,
) -> Result<Vec<(f64, usize, usize, usize, Option<f64>)>, String> {
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
        let params = if cfg.server_sampling {
            json!({"max_tokens": cfg.max_tokens, "seed": cfg.seed_base + (user * 10 + turn) as u64})
        } else {
            json!({"temperature": 0, "max_tokens": cfg.max_tokens})
        };
        let frame = json!({"type": "chat", "id": id, "messages": messages, "params": params});
        let sent = Instant::now();
        send_json(&mut ws, &frame).await?;
        let r = read_reply(&mut ws).await?;
        out.push((
            r.ttft(sent),
            r.prompt,
            r.cached,
            r.completion,
            r.decode_rate(),
        ));
        actix_web::rt::time::sleep(cfg.think).await;
    }
    Ok(out)
}

/// Polls `/metrics` for the largest `llama_relay_kv_blocks_used` until `stop` is set.
pub(super) async fn peak_blocks(
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
    let mut decode = Vec::new();
    for r in results {
        for (turn, (ttft, p, c, n, d)) in r?.into_iter().enumerate() {
            per_turn[turn].push(ttft);
            prompt += p;
            cached += c;
            tokens += n;
            decode.extend(d);
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
        decode_per_s: {
            decode.sort_by(f64::total_cmp);
            percentile(&decode, 50.0)
        },
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
        "chat [{label}] users {} | {} | {:.1} tok/s aggregate | decode {:.1} tok/s a reply | prefix hit rate {:.1}% | peak KV blocks {}",
        cfg.users,
        turns.join(" | "),
        s.tokens_per_s,
        s.decode_per_s,
        s.hit_rate * 100.0,
        s.peak_blocks
    );
    Ok(s)
}
