//! The gateway end to end: the real server on port 0, real WebSocket clients (awc).

use std::time::{Duration, Instant};

use awc::ws;
use futures_util::StreamExt;
use llama_relay::generate::{generate, GenerateParams};
use llama_relay::server::batcher::BatcherStatus;
use llama_relay::tokenizer::Message;
use serde_json::{json, Value};

use crate::common::*;

/// Each prompt alone (one after another), then all at once in separate sessions: the texts alone
/// and the replies together.
async fn alone_then_together(
    app: &App,
    prompts: &[String],
    max_tokens: usize,
) -> (Vec<String>, Vec<Reply>) {
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut c = app.connect().await;
        c.chat(&format!("a{i}"), p, greedy(max_tokens)).await;
        alone.push(c.reply(&format!("a{i}")).await.text);
    }
    let mut clients = Vec::new();
    for _ in prompts {
        clients.push(app.connect().await);
    }
    for (i, (c, p)) in clients.iter_mut().zip(prompts).enumerate() {
        c.chat(&format!("b{i}"), p, greedy(max_tokens)).await;
    }
    let replies = futures_util::future::join_all(
        clients
            .iter_mut()
            .enumerate()
            .map(|(i, c)| async move { c.reply(&format!("b{i}")).await }),
    )
    .await;
    (alone, replies)
}

fn run<F: std::future::Future<Output = ()>>(f: F) {
    actix_web::rt::System::new().block_on(f);
}

fn greedy(max_tokens: usize) -> Value {
    json!({"temperature": 0, "max_tokens": max_tokens})
}

#[test]
fn greedy_deltas_equal_generate_and_turn_two_sees_turn_one() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    // The reference: the same prompt through `generate`.
    let mut e = Tiny::Tied.load_as_served(16);
    let (_, ids) = e
        .tokenizer
        .encode_chat(&[Message::new("user", "Tell me about llamas.")], true)
        .unwrap();
    let params = GenerateParams {
        max_new_tokens: 24,
        ..Default::default()
    };
    let stats = generate(&mut e, &ids, &params, |_, _| Ok(())).unwrap();
    let expected = e.tokenizer.decode(&stats.generated, true).unwrap();
    run(async {
        let mut c = app.connect().await;
        c.chat("t1", "Tell me about llamas.", greedy(24)).await;
        let r = c.reply("t1").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        assert_eq!(r.text, expected);
        assert!(r.deltas > 3, "streamed in pieces");
        assert_eq!(
            r.done["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            ids.len()
        );
        assert_eq!(
            r.started.unwrap()["prompt_tokens"].as_u64().unwrap() as usize,
            ids.len()
        );
        assert!(r.done["timings"]["ttft_ms"].as_f64().unwrap() > 0.0);
        // Turn 2: the prompt is the whole conversation.
        c.chat("t2", "And alpacas?", greedy(8)).await;
        let r2 = c.reply("t2").await;
        let conv = vec![
            Message::new("user", "Tell me about llamas."),
            Message::new("assistant", &r.text),
            Message::new("user", "And alpacas?"),
        ];
        let (_, ids2) = e.tokenizer.encode_chat(&conv, true).unwrap();
        assert_eq!(
            r2.done["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            ids2.len()
        );
        // Reset starts over.
        c.send(json!({"type": "reset"})).await;
        c.chat("t3", "Tell me about llamas.", greedy(24)).await;
        assert_eq!(c.reply("t3").await.text, expected);
        app.wait_idle().await;
    });
}

#[test]
fn eight_sessions_at_once_match_each_alone() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| s.scheduler.step_tokens = 64);
    run(async {
        let prompts: Vec<String> = (0..8)
            .map(|i| format!("Question number {i}: {}", "why? ".repeat(i * 7 + 1)))
            .collect();
        let (alone, replies) = alone_then_together(&app, &prompts, 12).await;
        for (i, r) in replies.iter().enumerate() {
            assert_eq!(r.done["finish_reason"], "length", "{:?}", r.done);
            assert_eq!(r.text, alone[i], "session {i}: batching changed the result");
        }
        app.wait_idle().await;
    });
}

#[test]
fn cancel_and_disconnects_free_the_kv_cache() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.scheduler.step_tokens = 16;
        s.scheduler.max_running = 4;
        // A closed session's lease goes at once (the default keeps it for a reconnect).
        s.cache.lease_grace_s = 0;
        // Dropped sessions end at once (resuming is tested in `conversation`).
        s.server.resume_grace_s = 0;
    });
    run(async {
        // Cancel mid-decode.
        let mut c = app.connect().await;
        c.chat("c1", "Count to a thousand.", greedy(2000)).await;
        loop {
            let f = c.recv().await;
            if f["type"] == "delta" {
                break;
            }
        }
        c.send(json!({"type": "cancel", "id": "c1"})).await;
        let done = loop {
            let f = c.recv().await;
            if f["type"] == "done" {
                break f;
            }
            assert_eq!(f["type"], "delta", "{f}");
        };
        assert_eq!(done["finish_reason"], "cancelled", "{done}");
        app.wait_idle().await;
        // The connection is still usable.
        c.chat("c2", "Hi", greedy(2)).await;
        assert_eq!(c.reply("c2").await.done["type"], "done");
        // Drop mid-prefill: a long prompt in chunks of 16 tokens.
        let mut d = app.connect().await;
        d.chat("d1", &"many words ".repeat(300), greedy(4)).await;
        loop {
            let f = d.recv().await;
            if f["type"] == "started" {
                break;
            }
        }
        assert!(app.status().await.kv_blocks_used > 0);
        drop(d);
        app.wait_idle().await;
        // Drop mid-decode.
        let mut d = app.connect().await;
        d.chat("d2", "Go on forever.", greedy(2000)).await;
        loop {
            if d.recv().await["type"] == "delta" {
                break;
            }
        }
        drop(d);
        let s = app.wait_idle().await;
        // Only the open session's lease (its conversation) is held.
        assert!(
            s.kv_blocks_held > 0 && s.kv_blocks_used == s.kv_blocks_held,
            "{s:?}"
        );
        // Closing it releases that too.
        drop(c);
        let t0 = Instant::now();
        while app.status().await.kv_blocks_used > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{:?}",
                app.status().await
            );
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

#[test]
fn an_idle_server_releases_expired_leases_without_a_new_request() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.cache.lease_grace_s = 1;
        s.server.resume_grace_s = 0;
    });
    run(async {
        for i in 0..3 {
            let mut c = app.connect().await;
            c.chat(&format!("t{i}"), "Say something about the sea.", greedy(4))
                .await;
            assert_eq!(c.reply(&format!("t{i}")).await.done["type"], "done");
            drop(c);
        }
        let held = app.wait_idle().await.kv_blocks_held;
        assert!(
            held > 0,
            "the closed sessions' leases are kept for their grace"
        );
        // No request comes: the leases still go once their grace is over, and the gauge says so.
        let t0 = Instant::now();
        loop {
            let s = app.status().await;
            let gauge = app.state.metrics.kv_blocks_held.get();
            if s.kv_blocks_held == 0 && gauge == 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "still held after 30 s on an idle server: {s:?}, gauge {gauge}"
            );
            actix_web::rt::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

#[test]
fn bad_input_gets_errors_and_the_connection_survives() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.limits.max_frame_bytes = 4096;
        s.engine.max_context = 256;
    });
    run(async {
        let mut c = app.connect().await;
        c.send_raw("{not json").await;
        let f = c.recv().await;
        assert_eq!(
            (f["type"].as_str(), f["error_type"].as_str()),
            (Some("error"), Some("invalid_request")),
            "{f}"
        );
        c.send(json!({"type": "dance"})).await;
        assert_eq!(c.recv().await["error_type"], "invalid_request");
        c.chat("p1", "hi", json!({"max_tokens": 100000})).await;
        let f = c.recv().await;
        assert_eq!(f["error_type"], "invalid_request");
        assert!(
            f["message"].as_str().unwrap().contains("params.max_tokens"),
            "{f}"
        );
        assert_eq!(f["id"], "p1");
        c.chat("p2", "hi", json!({"temprature": 1})).await;
        assert_eq!(c.recv().await["error_type"], "invalid_request");
        // Longer than the context (256 tokens) but within the frame limit.
        c.chat("p3", &"word ".repeat(600), greedy(4)).await;
        let f = c.recv().await;
        assert_eq!(f["error_type"], "prompt_too_long", "{f}");
        assert!(f["message"].as_str().unwrap().contains("256"), "{f}");
        // Busy: a second chat while one runs.
        c.chat("q1", "Talk.", greedy(200)).await;
        c.chat("q2", "Talk more.", greedy(4)).await;
        let mut saw_busy = false;
        loop {
            let f = c.recv().await;
            if f["type"] == "error" {
                assert_eq!(f["error_type"], "busy");
                assert_eq!(f["id"], "q2");
                saw_busy = true;
            }
            if f["type"] == "done" {
                assert_eq!(f["id"], "q1");
                break;
            }
        }
        assert!(saw_busy);
        // Still usable after all that.
        c.chat("ok", "Hello", greedy(3)).await;
        assert_eq!(c.reply("ok").await.done["finish_reason"], "length");
        // An oversized frame closes with 1009; other sessions are unaffected.
        let mut other = app.connect().await;
        c.send_raw(&format!("{{\"type\":\"chat\",\"id\":\"big\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}", "x".repeat(5000))).await;
        let f = c.recv().await;
        assert_eq!(f["type"], "closed");
        assert_eq!(f["code"], 1009);
        other.chat("o", "Still there?", greedy(3)).await;
        assert_eq!(other.reply("o").await.done["type"], "done");
        app.wait_idle().await;
    });
}

#[test]
fn queue_overflow_is_overloaded_at_once_and_the_others_finish() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.scheduler.max_running = 1;
        s.scheduler.max_waiting = 1;
    });
    run(async {
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(app.connect().await);
        }
        let long = json!({"temperature": 0, "max_tokens": 600, "ignore_eos": true});
        // One request runs, one waits; the two after them find the queue full.
        clients[0]
            .chat("r0", "Write a long answer.", long.clone())
            .await;
        wait_for(&app, |s| s.running == 1).await;
        clients[1]
            .chat("r1", "Write a long answer.", long.clone())
            .await;
        wait_for(&app, |s| s.waiting == 1).await;
        for (i, c) in clients.iter_mut().enumerate().skip(2) {
            c.chat(&format!("r{i}"), "Write a long answer.", long.clone())
                .await;
        }
        let replies = futures_util::future::join_all(
            clients
                .iter_mut()
                .enumerate()
                .map(|(i, c)| async move { c.reply(&format!("r{i}")).await }),
        )
        .await;
        let ends: Vec<&Value> = replies.iter().map(|r| &r.done).collect();
        for r in &replies[..2] {
            assert_eq!(r.done["type"], "done", "{ends:?}");
            assert_eq!(r.done["finish_reason"], "length", "{ends:?}");
        }
        for r in &replies[2..] {
            assert_eq!(r.done["error_type"], "overloaded", "{ends:?}");
        }
        let m = metrics_text(&app).await;
        assert!(
            m.contains("llama_relay_errors_total{error_type=\"overloaded\"} 2"),
            "{m}"
        );
        app.wait_idle().await;
    });
}

/// Waits (up to 10 s) until the batcher's status satisfies `f`.
async fn wait_for(app: &App, f: impl Fn(&BatcherStatus) -> bool) {
    let t0 = Instant::now();
    loop {
        let s = app.status().await;
        if f(&s) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{s:?}");
        actix_web::rt::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn health_and_metrics() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut r = awc::Client::new()
            .get(format!("http://{}/health", app.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = serde_json::from_slice(&r.body().await.unwrap()).unwrap();
        assert_eq!(v["status"], "ready");
        let mut c = app.connect().await;
        c.chat("m", "Hi", greedy(5)).await;
        c.reply("m").await;
        let m = metrics_text(&app).await;
        for name in [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_per_output_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total 5",
            "vllm:num_preemptions_total",
            "llama_relay_kv_blocks_used",
            "llama_relay_kv_blocks_total",
            "llama_relay_websocket_sessions 1",
        ] {
            assert!(m.contains(name), "missing {name} in\n{m}");
        }
    });
}

/// The default model end to end: a real answer. (Not "What is the capital of France?": there the
/// fp32 model's top two first tokens, "The" and "L", are 0.08 apart, and a quantized kernel's
/// rounding picks either.)
#[test]
fn default_model_answers_over_the_websocket() {
    let _g = model_lock();
    let app = spawn_app(
        &llama_relay::default_model::ensure_default_model().unwrap(),
        |_| {},
    );
    run(async {
        let mut c = app.connect().await;
        c.chat("paris", "Name the capital of France.", greedy(32))
            .await;
        let r = c.reply("paris").await;
        assert_eq!(r.done["finish_reason"], "stop", "{:?}", r.done);
        assert!(r.text.contains("Paris"), "{}", r.text);
        app.wait_idle().await;
    });
}

#[test]
fn stop_strings_end_the_reply_before_the_match() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut c = app.connect().await;
        c.chat("full", "Say something.", greedy(40)).await;
        let full = c.reply("full").await.text;
        // A stop string taken from the middle of the greedy reply.
        let chars: Vec<char> = full.chars().collect();
        assert!(chars.len() > 12, "{full:?}");
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
        let expected = &full[..full.find(&stop).unwrap()];
        c.send(json!({"type": "reset"})).await;
        c.chat(
            "cut",
            "Say something.",
            json!({"temperature": 0, "max_tokens": 40, "stop": [stop]}),
        )
        .await;
        let r = c.reply("cut").await;
        assert_eq!(r.done["finish_reason"], "stop", "{:?}", r.done);
        assert_eq!(r.text, expected);
        app.wait_idle().await;
    });
}

#[test]
fn preemption_under_kv_pressure_keeps_results_identical() {
    let _g = model_lock();
    // 24 blocks of 16 tokens for 4 sequences that each grow to ~110 tokens: they cannot all fit.
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.cache_tokens = 24 * 16;
        s.engine.max_context = 256;
    });
    run(async {
        let prompts: Vec<String> = (0..4)
            .map(|i| format!("Story {i}: {}", "once upon a time ".repeat(i + 2)))
            .collect();
        let (alone, replies) = alone_then_together(&app, &prompts, 90).await;
        for (i, r) in replies.iter().enumerate() {
            assert_eq!(r.done["type"], "done", "{:?}", r.done);
            assert_eq!(r.text, alone[i], "sequence {i} changed by preemption");
        }
        let m = metrics_text(&app).await;
        let pre: f64 = m
            .lines()
            .find(|l| l.starts_with("vllm:num_preemptions_total"))
            .unwrap()
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            pre >= 1.0,
            "the cache was small enough to force a preemption\n{m}"
        );
        app.wait_idle().await;
    });
}

#[test]
fn graceful_shutdown_ends_running_generations_with_shutdown() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut c = app.connect().await;
        c.chat("long", "Go on and on.", greedy(4000)).await;
        loop {
            if c.recv().await["type"] == "delta" {
                break;
            }
        }
        llama_relay::server::shutdown(&app.state, Duration::from_millis(200)).await;
        let done = loop {
            let f = c.recv().await;
            if f["type"] == "done" {
                break f;
            }
        };
        assert_eq!(done["finish_reason"], "shutdown", "{done}");
        // With no reply running, the session closes with 1012 (service restart).
        let f = c.recv().await;
        assert_eq!(
            (f["type"].as_str(), f["code"].as_u64()),
            (Some("closed"), Some(1012)),
            "{f}"
        );
    });
}

#[test]
fn a_client_that_never_answers_pings_is_closed() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.server.heartbeat_s = 1;
        s.server.client_timeout_s = 2;
    });
    run(async {
        let (_, mut framed) = awc::Client::new()
            .ws(format!("ws://{}/ws", app.addr))
            .connect()
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            match actix_web::rt::time::timeout(Duration::from_secs(10), framed.next()).await {
                Ok(Some(Ok(ws::Frame::Close(_)))) | Ok(None) | Ok(Some(Err(_))) => break,
                Ok(Some(Ok(_))) => continue, // ready, pings: never answered
                Err(_) => panic!("not closed within 10 s"),
            }
        }
        let waited = t0.elapsed();
        assert!(
            // Not before client_timeout_s (2 s); the upper bound is wide, for a loaded machine.
            waited >= Duration::from_secs(2) && waited < Duration::from_secs(15),
            "{waited:?}"
        );
    });
}

/// A chat turn sent while someone's long prompt is prefilling starts at once, ahead of the long
/// prompt's remaining chunks (before, it waited for the whole prefill): its reply is done before
/// the long prompt's first token.
#[test]
fn a_chat_turn_starts_while_a_long_prompt_is_still_prefilling() {
    let _g = model_lock();
    // 16-token steps: the turn (13 prompt tokens) fits one, the long prompt (~4,000 tokens) takes
    // ~250 (~0.45 s here). Both sockets are open before the long prompt is sent, so the turn
    // follows its `started` frame within a message's round trip, far less than that prefill.
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.scheduler.step_tokens = 16;
        s.scheduler.max_running = 16;
        s.engine.max_context = 8192;
        s.limits.max_message_chars = 100_000;
        s.limits.max_frame_bytes = 1 << 20;
    });
    run(async {
        let mut long = app.connect().await;
        let mut turn = app.connect().await;
        long.chat("l", &"word ".repeat(4000), json!({"max_tokens": 1}))
            .await;
        loop {
            let f = long.recv().await;
            match f["type"].as_str().unwrap() {
                "started" => break,
                "error" | "done" => panic!("the long prompt did not start: {f}"),
                _ => {}
            }
        }
        // The long prompt's frames, with their arrival, read by a task of their own.
        let reader = actix_web::rt::spawn(async move {
            loop {
                let f = long.recv().await;
                match f["type"].as_str().unwrap() {
                    "delta" => return (Instant::now(), f),
                    "done" | "error" => return (Instant::now(), f),
                    _ => {}
                }
            }
        });
        turn.chat("t", "Hi there.", greedy(1)).await;
        let r = turn.reply("t").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        assert_eq!(r.done["usage"]["prompt_tokens"], 13);
        let turn_first = Instant::now();
        let (long_first, f) = reader.await.unwrap();
        assert_eq!(f["type"], "delta", "{f}");
        assert!(
            long_first > turn_first,
            "the turn waited for the long prompt's prefill"
        );
        app.wait_idle().await;
    });
}

/// With a step-time target, a long prompt is prefilled over many steps and a streaming reply
/// gets a token in each of them (with the target off, the whole prompt would be one step and the
/// stream would wait for it).
#[test]
fn a_stream_keeps_receiving_deltas_while_a_long_prompt_prefills() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.scheduler.itl_target_ms = 2;
        s.scheduler.step_tokens = 512;
        s.limits.max_message_chars = 100_000;
        s.limits.max_frame_bytes = 1 << 20;
    });
    run(async {
        let mut stream = app.connect().await;
        stream
            .chat(
                "s",
                "Tell me a long story.",
                json!({"temperature": 0, "max_tokens": 1500, "ignore_eos": true}),
            )
            .await;
        // The stream's deltas, with their arrival, read by a task of their own.
        let reader = actix_web::rt::spawn(async move {
            let mut at = Vec::new();
            loop {
                let f = stream.recv().await;
                match f["type"].as_str().unwrap() {
                    "delta" => at.push(Instant::now()),
                    "done" | "error" => return (at, f),
                    _ => {}
                }
            }
        });
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
        let mut long = app.connect().await;
        let sent = Instant::now();
        long.chat("l", &"word ".repeat(1500), json!({"max_tokens": 1}))
            .await;
        let r = long.reply("l").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        let first = r
            .frames
            .iter()
            .position(|f| f["type"] == "delta")
            .expect("the long prompt's token");
        assert_eq!(first, r.frames.len() - 2, "one delta, then done");
        let prompt_tokens = r.done["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 1500, "{prompt_tokens}");
        let done_at = Instant::now();
        let (at, end) = reader.await.unwrap();
        assert_eq!(end["type"], "done", "{end}");
        let during = at.iter().filter(|t| **t > sent && **t < done_at).count();
        assert!(
            during >= 20,
            "the stream got {during} deltas while {prompt_tokens} prompt tokens prefilled"
        );
        app.wait_idle().await;
    });
}

/// Speculative decoding through the server on the default model: a reply that copies its
/// prompt's text is the same with n-gram drafts as without (greedy, stop strings honoured the
/// same), most drafts are kept (SmolLM2 copies nearly word for word) on an idle server where the
/// cost model lets them run, the counters and the reply's `usage` say so, and a request that
/// opts out (`speculate: false`) runs none.
#[test]
fn speculation_gives_the_same_reply_and_keeps_most_drafts_of_a_quotation() {
    use crate::openai::metric;
    let _g = model_lock();
    let model = llama_relay::default_model::ensure_default_model().unwrap();
    let text = "Copy the following text exactly, word for word:\n\nReturns: unused items may be \
        returned within 30 days of delivery with the original receipt for a full refund. Opened \
        items may be exchanged for store credit within 14 days.";
    let reply = |mode: &str| {
        let app = spawn_app(&model, |s| s.scheduler.speculation = mode.into());
        let mut out = (String::new(), String::new());
        let mut usage = Vec::new();
        run(async {
            let mut c = app.connect().await;
            c.chat("q", text, greedy(60)).await;
            let full = c.reply("q").await;
            c.send(json!({"type": "reset"})).await;
            let params = json!({"temperature": 0, "max_tokens": 60, "stop": ["store credit"]});
            c.chat("cut", text, params).await;
            let cut = c.reply("cut").await;
            c.send(json!({"type": "reset"})).await;
            let params = json!({"temperature": 0, "max_tokens": 60, "speculate": false});
            c.chat("plain", text, params).await;
            let plain = c.reply("plain").await;
            assert_eq!(plain.text, full.text, "opting out changes no token");
            for r in [&full, &cut, &plain] {
                let u = &r.done["usage"];
                usage.push((
                    u["drafted_tokens"].as_u64().unwrap(),
                    u["accepted_tokens"].as_u64().unwrap(),
                ));
            }
            out = (full.text, cut.text);
            app.wait_idle().await;
        });
        let drafted = metric(&app, "vllm:spec_decode_num_draft_tokens_total");
        let kept = metric(&app, "vllm:spec_decode_num_accepted_tokens_total");
        // Kept drafts by position: every kept draft's earlier positions were kept too.
        let by_pos = |p: usize| {
            let name = format!("vllm:spec_decode_num_accepted_tokens_per_pos{{position=\"{p}\"}}");
            (kept > 0.0).then(|| metric(&app, &name))
        };
        if let (Some(first), Some(second)) = (by_pos(0), by_pos(1)) {
            assert!(first >= second && second > 0.0, "{first} >= {second}");
        }
        (out, drafted, kept, usage)
    };
    let (plain, drafted, _, usage) = reply("off");
    assert_eq!(drafted, 0.0);
    assert_eq!(usage, vec![(0, 0); 3]);
    let (fast, drafted, kept, usage) = reply("auto");
    assert_eq!(fast, plain);
    assert!(plain.0.contains("30 days of delivery"), "{}", plain.0);
    assert!(!plain.1.contains("store credit"), "{}", plain.1);
    assert!(
        drafted > 0.0 && kept > drafted / 2.0,
        "{kept} of {drafted} drafts kept"
    );
    let (d, k) = usage.iter().fold((0, 0), |(d, k), u| (d + u.0, k + u.1));
    assert_eq!(
        (d as f64, k as f64),
        (drafted, kept),
        "usage counts what the metrics count"
    );
    assert_eq!(usage[2], (0, 0), "the request that opted out ran no drafts");
}

/// A draft model through the server (`model.draft`, `scheduler.draft_source = "model"`; the
/// default model drafting for itself, as no smaller model with its tokenizer is here): the
/// reply is the one without speculation, and the drafts that ran (the cost model decides) were
/// the model's own greedy picks, so most were kept.
#[test]
fn a_draft_model_gives_the_same_reply() {
    use crate::openai::metric;
    let _g = model_lock();
    let model = llama_relay::default_model::ensure_default_model().unwrap();
    let text = "Copy the following text exactly, word for word:\n\nReturns: unused items may be \
        returned within 30 days of delivery with the original receipt for a full refund.";
    let reply = |draft: bool| {
        let app = spawn_app(&model, |s| {
            if draft {
                s.model.draft = model.display().to_string();
                s.scheduler.draft_source = "model".into();
            } else {
                s.scheduler.speculation = "off".into();
            }
        });
        let mut text_out = String::new();
        run(async {
            let mut c = app.connect().await;
            c.chat("q", text, greedy(48)).await;
            text_out = c.reply("q").await.text;
            app.wait_idle().await;
        });
        let drafted = metric(&app, "vllm:spec_decode_num_draft_tokens_total");
        let kept = metric(&app, "vllm:spec_decode_num_accepted_tokens_total");
        (text_out, drafted, kept)
    };
    let (plain, ..) = reply(false);
    let (drafted_reply, drafted, kept) = reply(true);
    assert_eq!(drafted_reply, plain);
    // (Not all: the draft model's rows run in other step shapes than the model's own, whose
    // kernels round differently, so a near tie may go the other way.)
    assert!(kept >= drafted / 2.0, "{kept} of {drafted} drafts kept");
}
