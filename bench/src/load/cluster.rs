//! The cluster workload (`llama-relay-bench cluster`): conversations through a load balancer
//! in front of several replicas (docs/deploy.md), the way the chat page and the widget behave there. Each user is
//! one conversation with its own routing key (`/ws?conversation=ID`) that opens a new
//! connection for every turn (a page reload, a phone waking up), so that where a turn lands is
//! the balancer's choice: it `resume`s the session its last connection left (its KV blocks are
//! there when the balancer sends it back to the same replica), and when the token means nothing
//! there it `restore`s the transcript it kept, each reply with its seal. A connection lost before
//! the reply's `done` (a replica killed, or closed by a draining one with 1012), or a reply a
//! draining replica cut at the end of its grace (`finish_reason` `shutdown`), is opened again
//! and the question asked again where it lands.
//!
//! It prints what a cluster's operator needs to know: conversations completed and failed, the
//! prefix hit rate of the turns after the first (the routing's whole point), resumes and
//! restores, upgrades refused on the way (a replica gone or draining before the balancer's check
//! took it out), and for the replies asked again how long their users waited from the loss to the
//! new reply's first token. `deploy/local-cluster.sh` runs it against three replicas.

use std::time::{Duration, Instant};

use awc::ws;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};

use super::{connect_from, percentile, send_json, Socket};

/// One run of the cluster workload.
#[derive(Debug, Clone)]
pub struct ClusterBenchConfig {
    /// The balancer's WebSocket URL (`ws://HOST:PORT/ws`).
    pub url: String,
    /// Connect as visitors of this widget (id, page origin), as the support widget does.
    pub widget: Option<(String, String)>,
    pub users: usize,
    pub turns: usize,
    /// Words in each user's first message (its own context: an order history pasted in).
    pub context_words: usize,
    pub max_tokens: usize,
    pub think: Duration,
    /// How long one turn may take, reconnects included, before its conversation counts as failed.
    pub turn_deadline: Duration,
}

/// What one turn took.
#[derive(Debug, Clone, Default)]
struct Turn {
    prompt: usize,
    cached: usize,
    /// Send to first delta on the connection that completed the reply.
    ttft: f64,
    resumed: bool,
    restored: bool,
    /// Upgrades that failed before one was accepted (refused, or no replica reachable).
    retries: usize,
    /// Replies a draining replica ended: connections closed with 1012, and replies it cut at the
    /// end of its grace (`finish_reason` `shutdown`), during this turn.
    restarts: usize,
    /// The reply was lost before its `done` and asked again: from the loss to the first delta
    /// of the reply that completed, whether the lost one had shown text, and whether the loss
    /// was a draining replica's (1012, or a reply cut at its grace) rather than a connection cut.
    regenerated: Option<(f64, bool, bool)>,
}

/// The run's figures.
#[derive(Debug, Clone, Default)]
pub struct ClusterSummary {
    pub conversations: usize,
    pub completed: usize,
    pub failures: Vec<String>,
    /// Prompt tokens found cached / prompt tokens, over turns 2 and later.
    pub later_hit_rate: f64,
    pub resumed: usize,
    pub restored: usize,
    pub retries: usize,
    pub restarts: usize,
    /// Replies asked again after a draining replica ended them (1012, or cut at its grace) and
    /// after a cut connection (a dead replica), and how many of those had shown text before the loss.
    pub regenerated_drained: usize,
    pub regenerated_cut: usize,
    pub regenerated_shown: usize,
    /// Loss to the new reply's first token, seconds, sorted.
    pub regenerated_wait: Vec<f64>,
    /// TTFT of the first turns and of the later ones that were not interrupted, seconds, sorted.
    pub first_ttft: Vec<f64>,
    pub later_ttft: Vec<f64>,
}

enum Read {
    Frame(Value),
    /// The connection ended: the close code if a close frame came.
    Closed(Option<u16>),
}

/// The next JSON frame or the end of the connection; pings are answered on the way.
async fn read(ws: &mut Socket) -> Read {
    let mut code = None;
    loop {
        match actix_web::rt::time::timeout(Duration::from_secs(120), ws.next()).await {
            Ok(Some(Ok(ws::Frame::Text(t)))) => match serde_json::from_slice(&t) {
                Ok(v) => return Read::Frame(v),
                Err(_) => return Read::Closed(code),
            },
            Ok(Some(Ok(ws::Frame::Ping(p)))) => {
                if ws.send(ws::Message::Pong(p)).await.is_err() {
                    return Read::Closed(code);
                }
            }
            Ok(Some(Ok(ws::Frame::Close(reason)))) => {
                code = reason.map(|r| u16::from(r.code));
                // Answer it so the server's side closes cleanly; the stream then ends.
                let _ = ws.send(ws::Message::Close(None)).await;
            }
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(_))) | Ok(None) | Err(_) => return Read::Closed(code),
        }
    }
}

/// A user's first message: an order history of about `words` tokens that no other user shares.
fn context(user: usize, words: usize, run: u64) -> String {
    let mut s = format!("Ticket {run:x}-{user}. My orders this year, for reference:");
    let mut i = 0;
    while s.split_whitespace().count() < words {
        s.push_str(&format!(
            " order {} of {} items shipped {};",
            7_000 + user * 131 + i * 17,
            1 + (user + i) % 9,
            ["Monday", "Tuesday", "Friday", "late"][(user * 3 + i) % 4]
        ));
        i += 1;
    }
    s.push_str(" Which of them has not arrived yet?");
    s
}

/// Connects through the balancer until an upgrade is accepted and `ready` arrives.
async fn connect_ready(
    url: &str,
    origin: Option<&str>,
    deadline: Instant,
    retries: &mut usize,
) -> Result<(Socket, Value), String> {
    loop {
        let attempt = async {
            let mut ws = connect_from(url, origin).await?;
            match read(&mut ws).await {
                Read::Frame(f) if f["type"] == "ready" => Ok((ws, f)),
                Read::Frame(f) => Err(format!("expected ready, got {f}")),
                Read::Closed(c) => Err(format!("closed before ready ({c:?})")),
            }
        };
        match attempt.await {
            Ok(r) => return Ok(r),
            Err(e) if Instant::now() >= deadline => return Err(format!("no replica took it: {e}")),
            Err(_) => {
                *retries += 1;
                actix_web::rt::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// One conversation as its client keeps it.
struct Conversation {
    url: String,
    origin: Option<String>,
    token: Option<String>,
    /// Every message so far, each reply with its seal.
    transcript: Vec<Value>,
}

impl Conversation {
    /// Sends `question` and reads its reply to `done`, across as many connections as it takes.
    async fn turn(
        &mut self,
        id: &str,
        question: &str,
        cfg: &ClusterBenchConfig,
    ) -> Result<Turn, String> {
        let deadline = Instant::now() + cfg.turn_deadline;
        let chat = json!({"type": "chat", "id": id, "messages": [{"role": "user", "content": question}],
            "params": {"temperature": 0, "max_tokens": cfg.max_tokens}});
        let mut t = Turn::default();
        // When the reply was lost, whether it had shown text, whether a draining replica ended it.
        let mut lost: Option<(Instant, bool, bool)> = None;
        loop {
            let (mut ws, ready) =
                connect_ready(&self.url, self.origin.as_deref(), deadline, &mut t.retries).await?;
            let fresh = ready["resume_token"].as_str().map(str::to_string);
            // Carry the conversation on: resume where it was, else restore the transcript. The
            // token kept is always that of a session holding the whole conversation.
            let mut resumed = false;
            match (self.token.clone(), self.transcript.is_empty()) {
                (Some(old), false) => {
                    let mut resume = json!({"type": "resume", "token": old});
                    if lost.is_some() {
                        // The reply may still be running there: replay it from its start.
                        resume["id"] = json!(id);
                    }
                    send_json(&mut ws, &resume).await?;
                    match read(&mut ws).await {
                        Read::Frame(f) if f["type"] == "ready" && f["resumed"] == true => {
                            self.token = f["resume_token"].as_str().map(str::to_string);
                            resumed = true;
                        }
                        Read::Frame(f) if f["error_type"] == "resume_failed" => {}
                        Read::Frame(f) => return Err(format!("resume: unexpected {f}")),
                        Read::Closed(c) => {
                            t.restarts += usize::from(c == Some(1012));
                            continue;
                        }
                    }
                    if !resumed {
                        let restore = json!({"type": "restore", "messages": self.transcript});
                        send_json(&mut ws, &restore).await?;
                        match read(&mut ws).await {
                            Read::Frame(f) if f["type"] == "restored" => {
                                t.restored = true;
                                self.token = fresh;
                            }
                            Read::Frame(f) => return Err(format!("restore: {f}")),
                            Read::Closed(c) => {
                                t.restarts += usize::from(c == Some(1012));
                                continue;
                            }
                        }
                    }
                }
                _ => self.token = fresh,
            }
            t.resumed |= resumed;
            // After a resume with a lost reply, the server replays it (or says it never ran).
            let mut sent = Instant::now();
            if !(resumed && lost.is_some()) {
                send_json(&mut ws, &chat).await?;
            }
            let mut text = String::new();
            let mut first = None;
            loop {
                match read(&mut ws).await {
                    Read::Frame(f) => match f["type"].as_str() {
                        Some("started") => {
                            t.prompt = f["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                            t.cached = f["cached_tokens"].as_u64().unwrap_or(0) as usize;
                            text.clear();
                        }
                        Some("delta") => {
                            first.get_or_insert_with(Instant::now);
                            text.push_str(f["text"].as_str().unwrap_or_default());
                        }
                        Some("done") if f["finish_reason"] == "shutdown" => {
                            // Cut short by a draining replica's grace: not an answer; ask it
                            // again where the conversation lands next.
                            t.restarts += 1;
                            let shown = first.is_some() || lost.is_some_and(|(_, s, _)| s);
                            lost.get_or_insert((Instant::now(), shown, true)).1 = shown;
                            break;
                        }
                        Some("done") => {
                            let first = first.unwrap_or_else(Instant::now);
                            t.ttft = (first - sent).as_secs_f64();
                            if let Some((at, shown, drained)) = lost {
                                t.regenerated = Some(((first - at).as_secs_f64(), shown, drained));
                            }
                            self.transcript
                                .push(json!({"role": "user", "content": question}));
                            let mut reply = json!({"role": "assistant", "content": text});
                            if let Some(seal) = f["seal"].as_str() {
                                reply["seal"] = json!(seal);
                            }
                            self.transcript.push(reply);
                            let _ = ws
                                .send(ws::Message::Close(Some(ws::CloseCode::Normal.into())))
                                .await;
                            return Ok(t);
                        }
                        Some("error") if f["error_type"] == "resume_failed" && f["id"] == id => {
                            // It never ran there: ask it now.
                            sent = Instant::now();
                            send_json(&mut ws, &chat).await?;
                        }
                        Some("error") => return Err(format!("server error: {f}")),
                        _ => {}
                    },
                    Read::Closed(code) => {
                        t.restarts += usize::from(code == Some(1012));
                        let shown = first.is_some() || lost.is_some_and(|(_, s, _)| s);
                        let l = lost.get_or_insert((Instant::now(), shown, code == Some(1012)));
                        l.1 = shown;
                        break;
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("{id}: no reply within {:?}", cfg.turn_deadline));
            }
        }
    }
}

async fn user(cfg: ClusterBenchConfig, user: usize, run: u64) -> Result<Vec<Turn>, String> {
    let sep = if cfg.url.contains('?') { '&' } else { '?' };
    let mut url = format!("{}{sep}conversation=c{run:x}-{user}", cfg.url);
    if let Some((w, _)) = &cfg.widget {
        url.push_str(&format!("&widget={w}"));
    }
    let mut c = Conversation {
        url,
        origin: cfg.widget.as_ref().map(|(_, o)| o.clone()),
        token: None,
        transcript: Vec::new(),
    };
    let mut out = Vec::new();
    for turn in 0..cfg.turns {
        let q = if turn == 0 {
            context(user, cfg.context_words, run)
        } else {
            format!(
                "And order {}: when will it arrive?",
                7_000 + user * 131 + turn * 17
            )
        };
        out.push(c.turn(&format!("u{user}t{turn}"), &q, &cfg).await?);
        actix_web::rt::time::sleep(cfg.think).await;
    }
    Ok(out)
}

/// Runs the cluster workload and prints its figures.
pub async fn run_cluster(cfg: ClusterBenchConfig, label: &str) -> Result<ClusterSummary, String> {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    // Users start spread over a second, as visitors do.
    let results = futures_util::future::join_all((0..cfg.users).map(|u| {
        let cfg = cfg.clone();
        async move {
            let stagger = Duration::from_millis((u * 1000 / cfg.users.max(1)) as u64);
            actix_web::rt::time::sleep(stagger).await;
            user(cfg, u, run).await
        }
    }))
    .await;
    let mut s = ClusterSummary {
        conversations: cfg.users,
        ..Default::default()
    };
    let (mut prompt, mut cached) = (0usize, 0usize);
    for (u, r) in results.into_iter().enumerate() {
        let turns = match r {
            Ok(t) => t,
            Err(e) => {
                s.failures.push(format!("user {u}: {e}"));
                continue;
            }
        };
        s.completed += 1;
        for (i, t) in turns.iter().enumerate() {
            if i > 0 {
                prompt += t.prompt;
                cached += t.cached;
            }
            s.resumed += usize::from(t.resumed);
            s.restored += usize::from(t.restored);
            s.retries += t.retries;
            s.restarts += t.restarts;
            match t.regenerated {
                Some((wait, shown, drained)) => {
                    if drained {
                        s.regenerated_drained += 1;
                    } else {
                        s.regenerated_cut += 1;
                    }
                    s.regenerated_shown += usize::from(shown);
                    s.regenerated_wait.push(wait);
                }
                None if i == 0 => s.first_ttft.push(t.ttft),
                None => s.later_ttft.push(t.ttft),
            }
        }
    }
    s.later_hit_rate = cached as f64 / prompt.max(1) as f64;
    s.regenerated_wait.sort_by(f64::total_cmp);
    s.first_ttft.sort_by(f64::total_cmp);
    s.later_ttft.sort_by(f64::total_cmp);
    let ms = |v: &[f64], p| percentile(v, p) * 1e3;
    let mut line = format!(
        "cluster [{label}] | conversations {} x {} turns: completed {}, failed {} | turns 2+ prefix hit rate {:.1}% | resumed {}, restored {} | upgrades retried {} | closed by a drain {} | turn 1 TTFT p50 {:.0} ms p99 {:.0} ms | turns 2+ TTFT p50 {:.0} ms p99 {:.0} ms",
        s.conversations,
        cfg.turns,
        s.completed,
        s.failures.len(),
        s.later_hit_rate * 100.0,
        s.resumed,
        s.restored,
        s.retries,
        s.restarts,
        ms(&s.first_ttft, 50.0),
        ms(&s.first_ttft, 99.0),
        ms(&s.later_ttft, 50.0),
        ms(&s.later_ttft, 99.0),
    );
    if !s.regenerated_wait.is_empty() {
        line.push_str(&format!(
            " | replies asked again after a drain {}, after a cut connection {} ({} had shown text): loss to first token p50 {:.0} ms, max {:.0} ms",
            s.regenerated_drained,
            s.regenerated_cut,
            s.regenerated_shown,
            ms(&s.regenerated_wait, 50.0),
            ms(&s.regenerated_wait, 100.0),
        ));
    }
    println!("{line}");
    for f in &s.failures {
        println!("  failed: {f}");
    }
    Ok(s)
}
