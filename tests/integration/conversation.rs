//! Conversation frames beyond `chat` (docs/protocol.md): barge-in (`cancel` with `heard_index`),
//! `regenerate` and `edit`, against the real server with the tiny Llama 3 model. Replies are
//! greedy, so a conversation's next reply shows exactly what the conversation holds: a fresh
//! session sent the same messages explicitly must get the same prompt length and text.

use serde_json::{json, Value};

use crate::common::*;

fn run<T>(f: impl std::future::Future<Output = T>) -> T {
    actix_web::rt::System::new().block_on(f)
}

fn greedy(max_tokens: u64) -> Value {
    json!({"temperature": 0, "max_tokens": max_tokens})
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// `started`'s (prompt_tokens, cached_tokens).
fn started(r: &Reply) -> (u64, u64) {
    let s = r.started.as_ref().expect("a started frame");
    (
        s["prompt_tokens"].as_u64().unwrap(),
        s["cached_tokens"].as_u64().unwrap(),
    )
}

/// Reads frames up to the first of type `kind`.
async fn until(c: &mut Client, kind: &str) -> Value {
    loop {
        let f = c.recv().await;
        if f["type"] == kind {
            return f;
        }
    }
}

async fn ask(c: &mut Client, id: &str, text: &str, max_tokens: u64) -> Reply {
    c.chat(id, text, greedy(max_tokens)).await;
    let r = c.reply(id).await;
    assert_eq!(r.done["type"], "done", "{}", r.done);
    r
}

/// A fresh session sends `messages` as one chat: the reply a conversation holding them gets.
async fn explicit(app: &App, messages: Value, max_tokens: u64) -> Reply {
    let mut c = app.connect().await;
    c.send(json!({"type": "chat", "id": "x", "messages": messages, "params": greedy(max_tokens)}))
        .await;
    let r = c.reply("x").await;
    assert_eq!(r.done["type"], "done", "{}", r.done);
    r
}

#[test]
fn regenerate_replaces_the_last_reply_over_the_cached_prompt() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut c = app.connect().await;
        let first = ask(&mut c, "q1", "Hello there, how are you?", 8).await;
        let (p1, _) = started(&first);
        // A sampled reply to the same prompt: everything but the prompt's last token is cached.
        c.send(json!({"type": "regenerate", "id": "q2", "params": {"temperature": 1.0, "seed": 7, "max_tokens": 8}}))
            .await;
        let second = c.reply("q2").await;
        assert_eq!(second.done["type"], "done", "{}", second.done);
        assert_eq!(started(&second), (p1, p1 - 1));
        // Again, greedy: the conversation holds one turn (the sampled reply was replaced, not
        // appended), so the reply is the first one again.
        c.send(json!({"type": "regenerate", "id": "q3", "params": greedy(8)}))
            .await;
        let third = c.reply("q3").await;
        assert_eq!(started(&third), (p1, p1 - 1));
        assert_eq!(third.text, first.text);
        // The next turn sees [user, that reply, user].
        let next = ask(&mut c, "q4", "Tell me more.", 8).await;
        let want = explicit(
            &app,
            json!([user("Hello there, how are you?"), {"role": "assistant", "content": first.text}, user("Tell me more.")]),
            8,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
        // Nothing to regenerate in a new session.
        let mut d = app.connect().await;
        d.send(json!({"type": "regenerate", "id": "r"})).await;
        let e = d.recv().await;
        assert_eq!(
            (e["type"].as_str(), e["error_type"].as_str()),
            (Some("error"), Some("invalid_request")),
            "{e}"
        );
    });
}

#[test]
fn edit_replaces_a_turn_and_what_follows_reusing_the_kv_before_it() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut c = app.connect().await;
        let a = ask(&mut c, "a", "What is the capital of France?", 8).await;
        ask(&mut c, "b", "And the capital of Germany?", 8).await;
        ask(&mut c, "c", "And of Italy?", 8).await;
        // Turn 1 ("Germany") and everything after it give way to a new question.
        c.send(json!({"type": "edit", "id": "e", "turn": 1, "messages": [user("And the capital of Spain?")], "params": greedy(8)}))
            .await;
        let edited = c.reply("e").await;
        assert_eq!(edited.done["type"], "done", "{}", edited.done);
        let history = json!([user("What is the capital of France?"), {"role": "assistant", "content": a.text}, user("And the capital of Spain?")]);
        let want = explicit(&app, history, 8).await;
        let (prompt, cached) = started(&edited);
        assert_eq!(prompt, started(&want).0);
        assert_eq!(edited.text, want.text);
        // Everything up to where "Germany" and "Spain" part is reused: at least the first turn
        // and the header of the second, and not the whole prompt.
        let (p_a, _) = started(&a);
        eprintln!("edit: cached {cached} of {prompt} (first prompt {p_a})");
        assert!(
            cached > p_a && cached < prompt,
            "cached {cached} of {prompt} (first prompt {p_a})"
        );
        // The next turn follows the edited conversation.
        let next = ask(&mut c, "n", "Thanks.", 8).await;
        let want = explicit(
            &app,
            json!([user("What is the capital of France?"), {"role": "assistant", "content": a.text},
                   user("And the capital of Spain?"), {"role": "assistant", "content": edited.text},
                   user("Thanks.")]),
            8,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
        // A turn that does not exist.
        c.send(json!({"type": "edit", "id": "z", "turn": 5, "messages": [user("?")]}))
            .await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        assert!(e["message"].as_str().unwrap().contains("`turn`"), "{e}");
    });
}

/// Reads a long reply until delta `upto`, then cancels it with `heard`; returns the deltas'
/// texts and the `done`.
async fn cut(c: &mut Client, id: &str, upto: usize, heard: Option<usize>) -> (Vec<String>, Value) {
    c.chat(
        id,
        "Count slowly to a thousand.",
        json!({"temperature": 0, "max_tokens": 1000, "ignore_eos": true}),
    )
    .await;
    let mut deltas = Vec::new();
    loop {
        let f = c.recv().await;
        if f["type"] == "delta" {
            deltas.push(f["text"].as_str().unwrap().to_string());
            if deltas.len() > upto {
                break;
            }
        }
    }
    let mut cancel = json!({"type": "cancel", "id": id});
    if let Some(h) = heard {
        cancel["heard_index"] = json!(h);
    }
    c.send(cancel).await;
    loop {
        let f = c.recv().await;
        match f["type"].as_str().unwrap() {
            "delta" => deltas.push(f["text"].as_str().unwrap().to_string()),
            "done" => return (deltas, f),
            _ => panic!("{f}"),
        }
    }
}

#[test]
fn barge_in_keeps_only_what_was_heard_in_the_conversation_and_the_kv() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 4096;
        s.engine.cache_tokens = 16384;
    });
    run(async {
        // Without heard_index the lease keeps the whole reply so far.
        let mut all = app.connect().await;
        let (_, done) = cut(&mut all, "w", 60, None).await;
        assert_eq!(done["finish_reason"], "cancelled");
        let held_all = app.wait_idle().await.kv_blocks_held;
        drop(all);
        app.wait_idle().await;

        let mut c = app.connect().await;
        let held_before = app.wait_idle().await.kv_blocks_held;
        // heard_index past what was sent: refused, and the reply goes on.
        c.chat(
            "h",
            "Count slowly to a thousand.",
            json!({"temperature": 0, "max_tokens": 1000, "ignore_eos": true}),
        )
        .await;
        until(&mut c, "delta").await;
        c.send(json!({"type": "cancel", "id": "h", "heard_index": 100000}))
            .await;
        let mut more = 0;
        loop {
            let f = c.recv().await;
            if f["type"] == "error" {
                assert_eq!(f["error_type"], "invalid_request", "{f}");
                assert!(
                    f["message"].as_str().unwrap().contains("heard_index"),
                    "{f}"
                );
                break;
            }
        }
        while more < 3 {
            if c.recv().await["type"] == "delta" {
                more += 1;
            }
        }
        c.send(json!({"type": "cancel", "id": "h"})).await;
        until(&mut c, "done").await;
        c.send(json!({"type": "reset"})).await;
        app.wait_idle().await;

        // The user heard deltas 0..=2 of 60.
        let (deltas, done) = cut(&mut c, "q1", 60, Some(2)).await;
        assert_eq!(done["finish_reason"], "cancelled");
        let heard: String = deltas[..3].concat();
        let held_heard = app.wait_idle().await.kv_blocks_held;
        assert!(
            held_heard - held_before < held_all,
            "the lease keeps the heard part only: {held_heard} - {held_before} blocks against {held_all}"
        );
        // The next turn's prompt holds exactly the heard text as the assistant's message.
        let next = ask(&mut c, "q2", "Go on.", 8).await;
        let want = explicit(
            &app,
            json!([user("Count slowly to a thousand."), {"role": "assistant", "content": heard}, user("Go on.")]),
            8,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
        // Its cached part covers the first prompt and what the heard text re-tokenizes to.
        let p1 = done["usage"]["prompt_tokens"].as_u64().unwrap();
        let (prompt, cached) = started(&next);
        eprintln!(
            "barge-in: next turn cached {cached} of {prompt} (first prompt {p1}, heard {heard:?})"
        );
        assert!(
            cached >= p1 && cached < prompt,
            "{cached} of {prompt} (first prompt {p1})"
        );
    });
    // Speculation is on (the default); whether drafts ran depends on this machine's step costs,
    // which the scheduler learns (`tiny_llama3::speculation_leaves_every_reply_as_it_was` pins
    // them).
}

/// A WebSocket client and its `ready` frame.
async fn connect_ready(app: &App) -> (Client, Value) {
    let (_, framed) = awc::Client::new()
        .ws(format!("ws://{}/ws", app.addr))
        .max_frame_size(1 << 20)
        .connect()
        .await
        .unwrap();
    let mut c = Client::from_framed(framed);
    let ready = c.recv().await;
    assert_eq!(ready["type"], "ready", "{ready}");
    (c, ready)
}

/// Sends `resume` on a new connection; returns it once its `ready` says resumed.
async fn resume(app: &App, token: &str, id: &str, after: Option<usize>) -> (Client, Value) {
    let (mut c, _) = connect_ready(app).await;
    let mut frame = json!({"type": "resume", "token": token, "id": id});
    if let Some(a) = after {
        frame["after_index"] = json!(a);
    }
    c.send(frame).await;
    let ready = c.recv().await;
    assert_eq!(
        (ready["type"].as_str(), ready["resumed"].as_bool()),
        (Some("ready"), Some(true)),
        "{ready}"
    );
    (c, ready)
}

/// Deltas (index, text) and the end frame of reply `id`.
async fn rest_of(c: &mut Client, id: &str) -> (Vec<(u64, String)>, Value) {
    let mut deltas = Vec::new();
    loop {
        let f = c.recv().await;
        match f["type"].as_str().unwrap() {
            "delta" => {
                assert_eq!(f["id"], id);
                deltas.push((
                    f["index"].as_u64().unwrap(),
                    f["text"].as_str().unwrap().to_string(),
                ));
            }
            "done" | "error" => return (deltas, f),
            "started" | "queued" => {}
            _ => panic!("{f}"),
        }
    }
}

const LONG: &str = "Count slowly to a thousand.";

fn long(max_tokens: u64) -> Value {
    json!({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true})
}

#[test]
fn a_dropped_connection_resumes_its_reply_without_loss_or_duplicates() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        // The reply as it streams without interruption, and the next turn after it.
        let mut control = app.connect().await;
        control.chat("q", LONG, long(200)).await;
        let whole = control.reply("q").await;
        let control_next = ask(&mut control, "n", "Go on.", 8).await;
        app.wait_idle().await;

        let (mut c, ready) = connect_ready(&app).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        assert!(token.len() >= 60, "{ready}");
        c.chat("q", LONG, long(200)).await;
        let mut got = Vec::new();
        while got.len() < 20 {
            let f = c.recv().await;
            if f["type"] == "delta" {
                got.push(f["text"].as_str().unwrap().to_string());
            }
        }
        // The connection drops without a close frame (a phone leaving Wi-Fi).
        drop(c);
        let (mut c, ready) = resume(&app, &token, "q", Some(19)).await;
        let new_token = ready["resume_token"].as_str().unwrap().to_string();
        assert_ne!(new_token, token, "a resume hands out a fresh token");
        let (rest, done) = rest_of(&mut c, "q").await;
        assert_eq!(done["type"], "done", "{done}");
        let indexes: Vec<u64> = rest.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            indexes,
            (20..20 + rest.len() as u64).collect::<Vec<_>>(),
            "contiguous after 19"
        );
        let text = got.concat() + &rest.iter().map(|(_, t)| t.as_str()).collect::<String>();
        assert_eq!(text, whole.text);
        assert_eq!(got.len() + rest.len(), whole.deltas);
        // The conversation and its KV carried over: the next turn follows the reply.
        let next = ask(&mut c, "n", "Go on.", 8).await;
        let want = explicit(
            &app,
            json!([user(LONG), {"role": "assistant", "content": whole.text}, user("Go on.")]),
            8,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
        assert_eq!(
            started(&next),
            started(&control_next),
            "the lease carried over"
        );
        // The old token is spent.
        let (mut d, _) = connect_ready(&app).await;
        d.send(json!({"type": "resume", "token": token})).await;
        let e = d.recv().await;
        assert_eq!(e["error_type"], "resume_failed", "{e}");
    });
    // Speculation is on (the default); whether drafts ran depends on this machine's step costs,
    // as in the barge-in test above.
}

#[test]
fn a_reply_that_ends_while_disconnected_is_replayed_whole_on_resume() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut whole = app.connect().await;
        whole.chat("q", LONG, long(40)).await;
        let whole = whole.reply("q").await;
        app.wait_idle().await;

        let (mut c, ready) = connect_ready(&app).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        c.chat("q", LONG, long(40)).await;
        until(&mut c, "started").await;
        drop(c);
        // The reply finishes while nobody is connected; then the client comes back, having
        // seen no delta.
        app.wait_idle().await;
        let (mut c, ready) = resume(&app, &token, "q", None).await;
        let (deltas, done) = rest_of(&mut c, "q").await;
        assert_eq!(done["type"], "done", "{done}");
        assert_eq!(
            deltas.iter().map(|(_, t)| t.as_str()).collect::<String>(),
            whole.text
        );
        // A drop after a reply ended but before its `done` was read: resuming with the last
        // index seen gives the rest of that reply as it was sent, just `done` here.
        let token = ready["resume_token"].as_str().unwrap().to_string();
        let r = ask(&mut c, "q2", "Go on.", 8).await;
        drop(c);
        let (mut c, _) = resume(&app, &token, "q2", Some(r.deltas - 1)).await;
        let (deltas, done) = rest_of(&mut c, "q2").await;
        assert!(deltas.is_empty(), "{deltas:?}");
        assert_eq!(done, r.done);
    });
}

#[test]
fn resume_refuses_unknown_tokens_late_frames_and_expired_sessions() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| s.server.resume_grace_s = 1);
    run(async {
        // An unknown token: an error, and the connection works as a fresh session.
        let (mut c, _) = connect_ready(&app).await;
        c.send(json!({"type": "resume", "token": "nope", "id": "q"}))
            .await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "resume_failed", "{e}");
        ask(&mut c, "a", "Hi", 4).await;
        // Not as the first frame.
        c.send(json!({"type": "resume", "token": "nope"})).await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("first frame"),
            "{e}"
        );
        // Past the grace: the parked reply is cancelled (its KV freed) and the token is dead.
        let (mut c, ready) = connect_ready(&app).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        c.chat("q", LONG, long(4000)).await;
        until(&mut c, "delta").await;
        drop(c);
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(app.status().await.running, 1, "the parked reply goes on");
        let idle = app.wait_idle().await;
        assert_eq!(idle.running, 0);
        let (mut c, _) = connect_ready(&app).await;
        c.send(json!({"type": "resume", "token": token, "id": "q"}))
            .await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "resume_failed", "{e}");
    });
}

/// A cancel with `heard_index`, then the connection drops before `done`: the resumed session
/// records what the old one would have (the heard text only), and the reply ends `cancelled`.
#[test]
fn a_barge_in_survives_a_dropped_connection() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = 4096;
        s.engine.cache_tokens = 16384;
    });
    run(async {
        let (mut c, ready) = connect_ready(&app).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        c.chat("q", LONG, long(1000)).await;
        let mut deltas = Vec::new();
        while deltas.len() < 10 {
            let f = c.recv().await;
            if f["type"] == "delta" {
                deltas.push(f["text"].as_str().unwrap().to_string());
            }
        }
        c.send(json!({"type": "cancel", "id": "q", "heard_index": 3}))
            .await;
        // The server takes the cancel; its `done` is lost with the connection.
        actix_web::rt::time::sleep(std::time::Duration::from_millis(300)).await;
        drop(c);
        app.wait_idle().await;
        let (mut c, _) = resume(&app, &token, "q", Some(9)).await;
        let (rest, done) = rest_of(&mut c, "q").await;
        assert_eq!(done["finish_reason"], "cancelled", "{done}");
        // What the old connection sent before the cancel took effect, then nothing more.
        let indexes: Vec<u64> = rest.iter().map(|(i, _)| *i).collect();
        assert_eq!(indexes, (10..10 + rest.len() as u64).collect::<Vec<_>>());
        let heard: String = deltas[..4].concat();
        let next = ask(&mut c, "n", "Go on.", 8).await;
        let want = explicit(
            &app,
            json!([user(LONG), {"role": "assistant", "content": heard}, user("Go on.")]),
            8,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
    });
}

/// Opens a WebSocket; the upgrade's status when it is refused.
async fn try_connect(app: &App) -> Result<(Client, Value), u16> {
    match awc::Client::new()
        .ws(format!("ws://{}/ws", app.addr))
        .max_frame_size(1 << 20)
        .connect()
        .await
    {
        Ok((_, framed)) => {
            let mut c = Client::from_framed(framed);
            let ready = c.recv().await;
            assert_eq!(ready["type"], "ready", "{ready}");
            Ok((c, ready))
        }
        Err(awc::error::WsClientError::InvalidResponseStatus(s)) => Err(s.as_u16()),
        Err(e) => panic!("{e}"),
    }
}

/// Waits until `n` sessions are parked.
async fn parked(app: &App, n: usize) {
    for _ in 0..400 {
        if app.state.parked.len() == n {
            return;
        }
        actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} sessions parked, not {n}", app.state.parked.len());
}

#[test]
fn a_parked_running_reply_keeps_its_place_and_only_its_client_takes_it_back() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.server.max_connections_per_address = 1;
    });
    run(async {
        let (mut c, ready) = connect_ready(&app).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        c.chat("q", LONG, long(600)).await;
        until(&mut c, "delta").await;
        // While it is connected, its address has no other place.
        assert_eq!(try_connect(&app).await.err(), Some(503));
        drop(c);
        parked(&app, 1).await;
        // Parked with its reply running, it still holds the address's one place: a connection
        // past the cap is let in only to resume, and one that does anything else is told so
        // and closed (1013) without becoming a session.
        let (mut other, _) = try_connect(&app).await.expect("let in to resume");
        other.chat("x", "Hello", greedy(4)).await;
        let e = other.recv().await;
        assert_eq!(
            (e["type"].as_str(), e["error_type"].as_str()),
            (Some("error"), Some("overloaded")),
            "{e}"
        );
        assert_eq!(app.state.parked.len(), 1, "the parked session is untouched");
        drop(other);
        // Its own client comes back through the same cap and carries on.
        let (mut c, ready) = resume(&app, &token, "q", Some(0)).await;
        let token = ready["resume_token"].as_str().unwrap().to_string();
        assert_eq!(app.state.parked.len(), 0);
        until(&mut c, "delta").await;
        assert_eq!(app.state.admission.held(), 1, "one place, taken over");
        app.state.admission.check().unwrap();
        assert_eq!(try_connect(&app).await.err(), Some(503));
        // Cancelled, the reply ends; dropped now, the idle session gives its place back.
        c.send(json!({"type": "cancel", "id": "q"})).await;
        until(&mut c, "done").await;
        drop(c);
        parked(&app, 1).await;
        let (mut d, _) = try_connect(&app).await.expect("the place came back");
        let r = ask(&mut d, "y", "Hello", 4).await;
        assert_eq!(r.done["type"], "done");
        drop(d);
        // The idle parked session resumes like any other.
        for _ in 0..100 {
            if app.state.admission.held() == 0 {
                break;
            }
            actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let (mut c, _) = resume(&app, &token, "q", None).await;
        // (The cancelled reply's end, replayed: the client said it saw none of it.)
        assert_eq!(until(&mut c, "done").await["id"], "q");
        let next = ask(&mut c, "n", "Go on.", 4).await;
        assert!(started(&next).1 > 0, "the conversation's KV carried over");
        app.state.admission.check().unwrap();
    });
}

/// Drafts that ended `outcome` so far.
fn drafts(app: &App, outcome: &str) -> u64 {
    app.state.metrics.drafts.with_label_values(&[outcome]).get()
}

/// Waits until `n` drafts have ended `outcome`.
async fn drafts_reach(app: &App, outcome: &str, n: u64) {
    for _ in 0..1000 {
        if drafts(app, outcome) >= n {
            return;
        }
        actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} drafts {outcome}, not {n}", drafts(app, outcome));
}

const TYPED: &str = "I would like to know how the tides work, why there are two of them every day, and what the moon and the sun each have to do with it.";

#[test]
fn a_draft_is_prefilled_and_the_chat_that_follows_finds_it_computed() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        // Without drafts: the reply, and how little of its prompt is cached.
        let mut control = app.connect().await;
        let first_control = ask(&mut control, "a", "Hello!", 6).await;
        let without = ask(&mut control, "b", TYPED, 8).await;
        let (prompt, cached_without) = started(&without);

        let mut c = app.connect().await;
        let first = ask(&mut c, "a", "Hello!", 6).await;
        assert_eq!(first.text, first_control.text);
        // The user types: drafts of the message so far, the last one whole.
        let words: Vec<&str> = TYPED.split(' ').collect();
        for (k, n) in [5, 12, words.len()].into_iter().enumerate() {
            c.send(json!({"type": "draft", "text": words[..n].join(" ")}))
                .await;
            drafts_reach(&app, "prefilled", k as u64 + 1).await;
        }
        let with = ask(&mut c, "b", TYPED, 8).await;
        let (prompt_with, cached_with) = started(&with);
        eprintln!(
            "type-ahead: cached {cached_with} of {prompt_with} with drafts, {cached_without} without"
        );
        assert_eq!(prompt_with, prompt);
        assert_eq!(
            with.text, without.text,
            "the same reply from the draft's KV"
        );
        // All but the message's last token or two and the template's end of turn.
        assert!(
            cached_with + 8 >= prompt && cached_with > cached_without + 20,
            "{cached_with} of {prompt} (without drafts {cached_without})"
        );
        // The next turn still continues the conversation as a fresh session sees it.
        let next = ask(&mut c, "c", "Thanks.", 6).await;
        let want = explicit(
            &app,
            json!([user("Hello!"), {"role": "assistant", "content": first.text}, user(TYPED), {"role": "assistant", "content": with.text}, user("Thanks.")]),
            6,
        )
        .await;
        assert_eq!(started(&next).0, started(&want).0);
        assert_eq!(next.text, want.text);
    });
}

#[test]
fn a_draft_typed_during_a_reply_waits_for_it_and_bad_drafts_are_refused() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut c = app.connect().await;
        c.chat("q", LONG, long(60)).await;
        until(&mut c, "delta").await;
        // Typed while the reply streams: nothing to prefill on yet (the reply is not in the
        // conversation); it is prefilled once the reply ends.
        c.send(json!({"type": "draft", "text": TYPED})).await;
        let (_, done) = rest_of(&mut c, "q").await;
        assert_eq!(done["type"], "done");
        drafts_reach(&app, "prefilled", 1).await;
        let next = ask(&mut c, "n", TYPED, 4).await;
        let (prompt, cached) = started(&next);
        assert!(cached + 8 >= prompt, "{cached} of {prompt}");
        assert_eq!(drafts(&app, "prefilled"), 1);
        // A draft the server refuses, by its field; the session goes on.
        let limit = app.state.session.limits.max_message_chars;
        c.send(json!({"type": "draft", "text": "x".repeat(limit + 1)}))
            .await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .starts_with("`text` must be at most"),
            "{e}"
        );
        c.send(json!({"type": "draft", "text": 5})).await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        // A newer draft replaces an older one; a chat ends the one still running.
        c.send(json!({"type": "draft", "text": "Tell me"})).await;
        c.send(json!({"type": "draft", "text": "Tell me about the sea"}))
            .await;
        let r = ask(&mut c, "m", "Tell me about the sea and the tides.", 4).await;
        assert_eq!(r.done["type"], "done");
        app.wait_idle().await;
        let ended: u64 = ["prefilled", "replaced", "used"]
            .iter()
            .map(|o| drafts(&app, o))
            .sum();
        assert_eq!(ended, 3, "every draft ends once");
        let st = app.wait_idle().await;
        assert_eq!(st.kv_blocks_used, st.kv_blocks_held, "{st:?}");
    });
}

/// Nothing arrives on `c` for `ms` milliseconds.
async fn quiet(c: &mut Client, ms: u64) -> bool {
    actix_web::rt::time::timeout(std::time::Duration::from_millis(ms), c.recv())
        .await
        .is_err()
}

/// The indexes of the deltas that arrive until none has for 400 ms.
async fn deltas_until_quiet(c: &mut Client) -> Vec<u64> {
    let mut out = Vec::new();
    while let Ok(f) =
        actix_web::rt::time::timeout(std::time::Duration::from_millis(400), c.recv()).await
    {
        if f["type"] == "delta" {
            out.push(f["index"].as_u64().unwrap());
        }
    }
    out
}

#[test]
fn a_paced_reply_stops_at_its_window_until_the_client_acks() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    run(async {
        let mut control = app.connect().await;
        control.chat("q", LONG, long(60)).await;
        let whole = control.reply("q").await;

        let mut c = app.connect().await;
        let mut params = long(60);
        params["window"] = json!(4);
        c.chat("q", LONG, params).await;
        // Without acks: at most the window's deltas (fewer when one holds several tokens),
        // then nothing; the reply waits, its KV kept.
        let got = deltas_until_quiet(&mut c).await;
        assert!(!got.is_empty() && got.len() <= 4, "{got:?}");
        let st = app.status().await;
        assert_eq!(st.running, 1, "{st:?}");
        // Two acked: at most two more.
        c.send(json!({"type": "ack", "id": "q", "index": 1})).await;
        let more = deltas_until_quiet(&mut c).await;
        assert!(!more.is_empty() && more.iter().all(|&i| i <= 5), "{more:?}");
        let last = *more.last().unwrap();
        // An older ack changes nothing; one past what was sent is refused, naming the field.
        c.send(json!({"type": "ack", "id": "q", "index": 0})).await;
        assert!(quiet(&mut c, 300).await);
        c.send(json!({"type": "ack", "id": "q", "index": 99})).await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        assert!(e["message"].as_str().unwrap().starts_with("`index`"), "{e}");
        // Acking every third delta (acks are frames within the session's frame budget, so a
        // client acks in batches): the reply ends, the same as unpaced.
        c.send(json!({"type": "ack", "id": "q", "index": last}))
            .await;
        let mut text = String::new();
        let (mut n, mut acked) = (last + 1, last);
        let done = loop {
            let f = c.recv().await;
            match f["type"].as_str().unwrap() {
                "delta" => {
                    assert_eq!(f["index"], n);
                    text.push_str(f["text"].as_str().unwrap());
                    if n >= acked + 3 {
                        acked = n;
                        c.send(json!({"type": "ack", "id": "q", "index": n})).await;
                    }
                    n += 1;
                }
                "error" => panic!("{f}"),
                "done" => break f,
                _ => {}
            }
        };
        assert_eq!(done["usage"]["completion_tokens"], 60);
        assert!(!text.is_empty() && whole.text.ends_with(&text), "{text:?}");
        assert_eq!(n as usize, whole.deltas);
        // An ack that crossed the end is not an error; `ack` without a window is.
        c.send(json!({"type": "ack", "id": "q", "index": 3})).await;
        assert!(quiet(&mut c, 200).await);
        c.chat("r", "Hi", long(1000)).await;
        until(&mut c, "delta").await;
        c.send(json!({"type": "ack", "id": "r", "index": 0})).await;
        let e = loop {
            let f = c.recv().await;
            if f["type"] == "error" || f["type"] == "done" {
                break f;
            }
        };
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        c.send(json!({"type": "cancel", "id": "r"})).await;
        until(&mut c, "done").await;
    });
}

#[test]
fn a_waiting_request_hears_when_its_queue_position_changes_with_an_estimate() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| s.scheduler.max_running = 1);
    run(async {
        let mut a = app.connect().await;
        a.chat("a", LONG, long(400)).await;
        until(&mut a, "delta").await;
        let mut b = app.connect().await;
        b.chat("b", LONG, long(400)).await;
        let q = until(&mut b, "queued").await;
        assert_eq!(q["position"], 0, "{q}");
        let mut c = app.connect().await;
        c.chat("c", LONG, long(4)).await;
        let q = until(&mut c, "queued").await;
        assert_eq!(q["position"], 1, "{q}");
        // The running reply ends: b starts, and c moves up, told with an estimate (two starts
        // have been seen).
        a.send(json!({"type": "cancel", "id": "a"})).await;
        until(&mut b, "started").await;
        let q = c.recv().await;
        assert_eq!(q["type"], "queued", "{q}");
        assert_eq!(q["position"], 0, "{q}");
        assert!(q["eta_ms"].as_u64().is_some(), "{q}");
        b.send(json!({"type": "cancel", "id": "b"})).await;
        let f = c.recv().await;
        assert_eq!(f["type"], "started", "{f}");
    });
}

#[test]
fn paced_replies_that_are_never_acked_cannot_hold_the_running_slots() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| s.scheduler.max_running = 1);
    run(async {
        // The one running slot goes to a paced reply whose client never acks.
        let mut idle = app.connect().await;
        let mut params = long(200);
        params["window"] = json!(2);
        idle.chat("p", LONG, params).await;
        deltas_until_quiet(&mut idle).await;
        // Another client is served all the same: the paused reply gives its slot up.
        let mut c = app.connect().await;
        let r = ask(&mut c, "q", "Hello", 6).await;
        assert_eq!(r.done["type"], "done");
        // Acked, the paced reply comes back and goes on.
        idle.send(json!({"type": "ack", "id": "p", "index": 1}))
            .await;
        let more = deltas_until_quiet(&mut idle).await;
        assert!(!more.is_empty() && more.iter().all(|&i| i <= 3), "{more:?}");
    });
}

/// A conversation that outgrows the context (`limits.overflow = "drop_oldest"`) goes on: the
/// turn that would not fit drops whole oldest turns (`started.truncated` names them), keeps at
/// most the retention ratio of the room, and its prompt is exactly that of a fresh session sent
/// the kept turns; re-prefilled (`cache.context_shift` off), so is its reply; with the context
/// shift, the kept turns' K/V come from the session's cache (all but the new turn is cached).
/// The next turn finds that prefix cached and drops nothing; an edit of a dropped turn is refused
/// naming `turn`, one of a kept turn (numbered as before) works; a retention ratio without the
/// policy is refused naming it.
#[test]
fn a_conversation_past_the_context_drops_its_oldest_turns_and_goes_on() {
    let _g = model_lock();
    let prefilled = dropping_conversation(false);
    let shifted = dropping_conversation(true);
    assert_eq!(prefilled.0, shifted.0, "the same turns were dropped");
    let (prompt, cached) = shifted.1;
    assert!(
        cached + 32 >= prompt && cached > prefilled.1 .1 + 24,
        "shifted: {cached} of {prompt} cached; re-prefilled: {:?}",
        prefilled.1
    );
}

/// The conversation of `a_conversation_past_the_context_drops_its_oldest_turns_and_goes_on`;
/// returns the turn that dropped the oldest with what it dropped, and its (prompt, cached)
/// tokens.
fn dropping_conversation(shift: bool) -> ((usize, Value), (u64, u64)) {
    const CONTEXT: u64 = 192;
    const MAX: u64 = 16;
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.engine.max_context = CONTEXT as usize;
        s.limits.overflow = "drop_oldest".into();
        s.limits.overflow_retention = 0.5;
        s.cache.context_shift = shift;
    });
    run(async {
        let mut c = app.connect().await;
        let (mut users, mut replies) = (Vec::new(), Vec::new());
        let mut cut = None;
        for turn in 0..12 {
            let text = format!("Turn {turn}: tell me about llamas and their wool.");
            let r = ask(&mut c, &format!("t{turn}"), &text, MAX).await;
            assert_eq!(r.done["type"], "done", "turn {turn}: {}", r.done);
            let s = r.started.clone().unwrap();
            assert!(s["prompt_tokens"].as_u64().unwrap() + MAX <= CONTEXT, "{s}");
            users.push(text);
            replies.push(r.text.clone());
            match &cut {
                None => {
                    if let Some(t) = s.get("truncated") {
                        cut = Some((turn, t.clone(), r));
                    }
                }
                Some(_) => {
                    // The kept conversation plus this turn fits: nothing dropped, its prefix
                    // cached.
                    assert!(s.get("truncated").is_none(), "{s}");
                    assert!(s["cached_tokens"].as_u64().unwrap() > 0, "{s}");
                    break;
                }
            }
        }
        let (at, truncated, r) = cut.expect("a turn dropped the oldest");
        let first = truncated["first_kept_turn"].as_u64().unwrap() as usize;
        assert_eq!(truncated["dropped_turns"].as_u64().unwrap() as usize, first);
        assert!(first >= 1 && first <= at, "{truncated}");
        let (prompt, _) = started(&r);
        assert!(prompt <= (CONTEXT - MAX) / 2 + 40, "kept {prompt} tokens");
        // A fresh session sent the kept turns gets the same prompt and reply.
        let mut kept = Vec::new();
        for t in first..at {
            kept.push(user(&users[t]));
            kept.push(json!({"role": "assistant", "content": replies[t]}));
        }
        kept.push(user(&users[at]));
        let fresh = explicit(&app, Value::Array(kept), MAX).await;
        assert_eq!(started(&fresh).0, prompt);
        if !shift {
            assert_eq!(fresh.text, r.text);
        }
        let cut_at = (at, truncated.clone(), started(&r));

        // Edits count turns from the session's first.
        let edit = |turn: usize, id: &str| json!({"type": "edit", "id": id, "turn": turn, "messages": [user("Turn again.")], "params": greedy(4)});
        c.send(edit(0, "e0")).await;
        let e = until(&mut c, "error").await;
        assert_eq!(e["id"], "e0");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("`turn`") && msg.contains("dropped"), "{e}");
        c.send(edit(first, "e1")).await;
        let r = c.reply("e1").await;
        assert_eq!(r.done["type"], "done", "{}", r.done);

        c.chat("bad", "hi", json!({"retention_ratio": 0.5})).await;
        let e = until(&mut c, "error").await;
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("`params.retention_ratio`"),
            "{e}"
        );
        app.wait_idle().await;
        ((cut_at.0, cut_at.1), cut_at.2)
    })
}
