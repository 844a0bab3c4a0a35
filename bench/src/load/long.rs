//! The long-conversation workload: each user holds one conversation of many turns, far past the
//! context, under the overflow policy `drop_oldest`: every turn must be answered, and the turns
//! that dropped old turns (`started.truncated`) are timed apart from the others.

use crate::load::*;

#[derive(Debug, Clone)]
pub struct LongChatConfig {
    pub url: String,
    pub users: usize,
    pub turns: usize,
    pub max_tokens: usize,
    pub think: Duration,
}

/// One turn as a user saw it.
#[derive(Debug, Clone, Copy)]
struct Turn {
    ttft: f64,
    prompt: usize,
    cached: usize,
    truncated: bool,
}

async fn long_user(cfg: LongChatConfig, user: usize) -> Result<Vec<Turn>, String> {
    let mut ws = connect_from(&cfg.url, None).await?;
    let mut out = Vec::with_capacity(cfg.turns);
    for turn in 0..cfg.turns {
        let q = format!(
            "User {user}, message {turn}: my order {} has not arrived yet; what should I do next?",
            1000 + user * 1000 + turn
        );
        let id = format!("u{user}t{turn}");
        let frame = json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": q}],
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens}});
        let sent = Instant::now();
        send_json(&mut ws, &frame).await?;
        let r = (read_reply(&mut ws).await).map_err(|e| format!("user {user} turn {turn}: {e}"))?;
        out.push(Turn {
            ttft: r.ttft(sent),
            prompt: r.prompt,
            cached: r.cached,
            truncated: r.truncated,
        });
        actix_web::rt::time::sleep(cfg.think).await;
    }
    Ok(out)
}

/// Runs the workload; prints TTFT p50/p99 of normal turns and of the turns that dropped old
/// ones, how many dropped, and the prompt tokens found cached. Fails on any turn's error.
pub async fn run_long_chat(cfg: LongChatConfig, label: &str) -> Result<(), String> {
    let t0 = Instant::now();
    let results =
        futures_util::future::join_all((0..cfg.users).map(|u| long_user(cfg.clone(), u))).await;
    let wall = t0.elapsed().as_secs_f64();
    let (mut normal, mut dropped) = (Vec::new(), Vec::new());
    let (mut prompt, mut cached, mut turns) = (0, 0, 0);
    for r in results {
        for t in r? {
            turns += 1;
            prompt += t.prompt;
            cached += t.cached;
            if t.truncated {
                dropped.push(t.ttft);
            } else {
                normal.push(t.ttft);
            }
        }
    }
    normal.sort_by(f64::total_cmp);
    dropped.sort_by(f64::total_cmp);
    let p = |v: &[f64], q: f64| percentile(v, q) * 1e3;
    // Conversations that never reached the context drop nothing: no figure to print for them.
    let dropping = if dropped.is_empty() {
        "no turn dropped old turns".to_string()
    } else {
        format!(
            "dropping TTFT p50 {:.0} ms p99 {:.0} ms ({:.2}x the normal p50)",
            p(&dropped, 50.0),
            p(&dropped, 99.0),
            percentile(&dropped, 50.0) / percentile(&normal, 50.0)
        )
    };
    println!(
        "long-chat [{label}] users {} turns {} | {turns} turns answered, 0 failed, {} dropped old turns | normal TTFT p50 {:.0} ms p99 {:.0} ms | {dropping} | prefix hit rate {:.1}% | {:.0} s",
        cfg.users,
        cfg.turns,
        dropped.len(),
        p(&normal, 50.0),
        p(&normal, 99.0),
        cached as f64 * 100.0 / prompt.max(1) as f64,
        wall
    );
    Ok(())
}
