//! The resume workload: forced disconnects of greedy replies, each resumed on a new connection
//! and compared with the uninterrupted reply.

use crate::load::*;

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
pub(super) async fn deltas_until_done(ws: &mut Socket) -> Result<Vec<(u64, String)>, String> {
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
