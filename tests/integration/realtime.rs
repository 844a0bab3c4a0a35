//! OpenAI's Realtime API (`/v1/realtime`, text) end to end: the official Python SDK's realtime
//! client (tests/openai/realtime_client.py) against the real server on port 0, its reply
//! compared with the WebSocket reply to the same conversation; the browser form of the key (a
//! subprotocol) and the refusals at the upgrade with a Rust WebSocket client.

use std::time::{Duration, Instant};

use llama_relay::server::gate::tenants::TenantSettings;
use serde_json::Value;

use crate::common::*;
use crate::common::{model_lock, Tiny};
use crate::openai::{metric, model_id, sdk_python, sdk_script, ws_reply, KEY, QUESTION};

fn run<F: std::future::Future<Output = ()>>(f: F) {
    actix_web::rt::System::new().block_on(f);
}

/// One tenant with an API key; keyless clients too (the `/ws` reply to compare with).
fn keyed() -> impl FnOnce(&mut llama_relay::settings::Settings) {
    |s| {
        s.tenants = vec![TenantSettings {
            name: "acme".into(),
            api_keys: vec![KEY.into()],
            ..Default::default()
        }];
        s.server.allow_anonymous = Some(true);
    }
}

fn sdk(app: &App, key: &str, mode: &str) -> Value {
    sdk_script(
        &sdk_python(),
        app,
        "realtime_client.py",
        &[key, QUESTION, mode],
    )
}

/// The SDK's realtime client: `session.update`, a user item, `response.create`, the streamed
/// text equal to the `/ws` greedy reply (same prompt tokens); a second response reports the
/// first turn as cached; `response.cancel` mid-stream ends the response `cancelled` and its
/// request stops; items are retrieved, truncated (the `text_end` extension) and deleted; an
/// audio event gets an `error` naming audio.
#[test]
fn the_sdk_realtime_client_converses_cancels_and_is_told_audio_is_not_served() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), keyed());
    let mut ws = (String::new(), 0);
    run(async { ws = ws_reply(&app, 24).await });
    let generated = metric(&app, "vllm:generation_tokens_total");
    let got = sdk(&app, KEY, "conversation");

    assert_eq!(got["first_event"], "session.created");
    assert_eq!(got["session_model"], model_id(&app));
    assert_eq!(got["updated_modalities"], serde_json::json!(["text"]));
    let first = &got["first"];
    assert_eq!(first["text"], ws.0.as_str());
    assert_eq!(
        first["status"], "incomplete",
        "24 tokens: max_output_tokens"
    );
    assert_eq!(first["usage"]["input_tokens"], ws.1);
    assert_eq!(first["usage"]["output_tokens"], 24);
    let types: Vec<&str> = (first["types"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        &types[..4],
        [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        &types[types.len() - 5..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done"
        ]
    );
    assert!(types[4..types.len() - 5]
        .iter()
        .all(|t| *t == "response.output_text.delta"));

    // The second turn finds the first turn's prompt (and reply) cached.
    let second = &got["second"]["usage"];
    let cached = second["input_token_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= ws.1, "cached {cached}, first prompt {}", ws.1);
    assert!(second["input_tokens"].as_u64().unwrap() > cached);

    let cancelled = &got["cancelled"];
    assert_eq!(cancelled["status"], "cancelled");
    assert!(cancelled["output_tokens"].as_u64().unwrap() < 4000);
    assert_eq!(got["retrieved"], QUESTION);
    let heard: String = cancelled["text"]
        .as_str()
        .unwrap()
        .chars()
        .take(3)
        .collect();
    assert_eq!(got["truncated_text"], heard.as_str());
    assert_eq!(got["retrieve_deleted"]["type"], "error");
    assert_eq!(got["retrieve_deleted"]["code"], "item_not_found");
    assert_eq!(got["audio"]["type"], "error");
    assert_eq!(got["audio"]["code"], "audio_not_supported");
    assert_eq!(got["audio"]["event_id"], "ev1");

    // The cancelled reply stopped: nothing runs and no token is generated any more.
    let t0 = Instant::now();
    while metric(&app, "vllm:num_requests_running") > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "still running");
        std::thread::sleep(Duration::from_millis(50));
    }
    let settled = metric(&app, "vllm:generation_tokens_total");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(metric(&app, "vllm:generation_tokens_total"), settled);
    assert!(settled - generated < 24.0 + 8.0 + 4000.0);
}

/// A function-call round trip with the SDK's realtime client: the session's tools with
/// `tool_choice: "required"` make the response one `function_call` item whose streamed
/// arguments (`response.function_call_arguments.delta`) are the `done` arguments, valid for the
/// function's schema; a `function_call_output` item and `response.create` continue the
/// conversation with the call and everything before it cached; a tool that was not declared is
/// refused naming the field.
#[test]
fn the_sdk_realtime_client_calls_a_function_and_continues_from_its_output() {
    let _g = model_lock();
    function_round_trip(&spawn_app(Tiny::Tied.dir(), keyed()));
}

/// The same with a model whose chat template takes `tools` (Llama 3.1's): the call is written
/// in the template's format and its output goes back as the template's `tool` message, the
/// events and the cached continuation the same.
#[test]
fn the_sdk_realtime_client_calls_a_function_of_a_template_that_takes_tools() {
    let _g = model_lock();
    let dir = crate::structured::llama31_tools_model();
    let got = function_round_trip(&spawn_app(dir, keyed()));
    // The first response's prompt is the template's rendering with the function (as
    // realtime_client.py declares it), which a generic system turn would not be.
    let tok = llama_relay::tokenizer::TextTokenizer::from_hf_dir(dir, &[]).unwrap();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "order_status",
        "description": "Looks up an order by its number.", "parameters": {"type": "object",
        "properties": {"order": {"type": "string", "maxLength": 12}}, "required": ["order"],
        "additionalProperties": false}}}]);
    let user = [llama_relay::tokenizer::Message::new("user", QUESTION)];
    let (text, ids) = tok.encode_chat_with(&user, Some(&tools), true).unwrap();
    assert!(text.contains("\"parameters\": dictionary"), "{text}");
    assert_eq!(got["call"]["input_tokens"], ids.len());
}

/// The SDK's function-call round trip (`realtime_client.py tools`), checked; what it reported.
fn function_round_trip(app: &App) -> Value {
    let got = sdk(app, KEY, "tools");
    assert_eq!(got["session_tools"], serde_json::json!(["order_status"]));
    let call = &got["call"];
    assert_eq!(call["item_type"], "function_call");
    assert_eq!(call["output_type"], "function_call");
    assert_eq!(
        (&call["name"], &call["done_name"]),
        (&"order_status".into(), &"order_status".into())
    );
    assert_eq!(call["deltas"], call["done_arguments"]);
    assert_eq!(call["deltas"], call["output_arguments"]);
    assert_eq!(call["status"], "completed", "{call}");
    let args: Value = serde_json::from_str(call["deltas"].as_str().unwrap()).unwrap();
    let order = args["order"].as_str().expect("the required string");
    assert!(order.chars().count() <= 12);
    assert_eq!(args.as_object().unwrap().len(), 1, "{args}");
    let types: Vec<&str> = (call["types"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        &types[..3],
        [
            "response.created",
            "response.output_item.added",
            "conversation.item.added"
        ]
    );
    assert!(!types.iter().any(|t| t.starts_with("response.output_text")));
    assert_eq!(
        &types[types.len() - 4..],
        [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done"
        ]
    );
    assert_eq!(got["output_item"], "function_call_output");
    let answer = &got["answer"];
    assert_eq!(answer["output_type"], "message");
    assert!(!answer["text"].as_str().unwrap().is_empty());
    let cached = answer["usage"]["input_token_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let first = call["input_tokens"].as_u64().unwrap();
    assert!(
        cached > first,
        "cached {cached}: the first prompt ({first}) and the call"
    );
    assert_eq!(got["undeclared"]["type"], "error");
    assert_eq!(got["undeclared"]["param"], "response.tool_choice.name");
    assert_eq!(got["undeclared"]["event_id"], "ev9");
    got
}

/// A wrong key is refused at the upgrade (401), with the SDK and in the browser form; a right
/// key in the browser form is accepted with the `realtime` subprotocol; another model is 404.
#[test]
fn the_upgrade_checks_the_key_in_either_form_and_the_model() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), keyed());
    let got = sdk(&app, "wrong-key-0123456789", "bad_key");
    assert_eq!(got["refused"], true, "{got}");
    assert_eq!(got["status"], 401, "{got}");
    let model = model_id(&app);
    run(async {
        let upgrade = |path: String, protocols: Vec<String>, auth: Option<String>| async move {
            let mut req = awc::Client::new()
                .ws(format!("ws://{}{path}", app.addr))
                .protocols(protocols);
            if let Some(a) = auth {
                req = req.header("Authorization", a);
            }
            match req.connect().await {
                Ok((resp, _)) => (
                    101,
                    resp.headers()
                        .get("sec-websocket-protocol")
                        .map(|v| v.to_str().unwrap().to_string()),
                ),
                Err(awc::error::WsClientError::InvalidResponseStatus(s)) => (s.as_u16(), None),
                Err(e) => panic!("{e}"),
            }
        };
        let path = format!("/v1/realtime?model={model}");
        let browser = |key: &str| {
            vec![
                "realtime".to_string(),
                format!("openai-insecure-api-key.{key}"),
            ]
        };
        assert_eq!(
            upgrade(path.clone(), browser(KEY), None).await,
            (101, Some("realtime".into()))
        );
        assert_eq!(
            upgrade(path.clone(), browser("wrong-key-0123456789"), None)
                .await
                .0,
            401
        );
        assert_eq!(
            upgrade(
                path.clone(),
                vec![],
                Some("Bearer wrong-key-0123456789".into())
            )
            .await
            .0,
            401
        );
        assert_eq!(
            upgrade(
                "/v1/realtime?model=gpt-realtime".into(),
                vec![],
                Some(format!("Bearer {KEY}"))
            )
            .await
            .0,
            404
        );
    });
}

/// Settings and items are checked at the edge like `/ws` frames, each refusal an `error` event
/// naming the field as the Realtime API names it, and the session goes on: `max_output_tokens`
/// over the limit, a sampling value out of range, a field this server does not serve, a role
/// the key may not send, a response with nothing new to answer.
#[test]
fn refusals_name_the_realtime_field_and_the_session_goes_on() {
    use llama_relay::server::gate::tenants::ClientRoles;
    const USER_ONLY: &str = "user-only-key-0123456789";
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.tenants = vec![TenantSettings {
            name: "kiosk".into(),
            api_keys: vec![USER_ONLY.into()],
            client_roles: ClientRoles {
                widget: vec!["user".into()],
                api_key: vec!["user".into()],
            },
            ..Default::default()
        }];
        // Items: at most 40 characters each, 80 in all.
        s.limits.max_message_chars = 40;
        s.limits.max_messages = 2;
    });
    let model = model_id(&app);
    run(async {
        let (_, framed) = awc::Client::new()
            .ws(format!("ws://{}/v1/realtime?model={model}", app.addr))
            .header("Authorization", format!("Bearer {USER_ONLY}"))
            .connect()
            .await
            .unwrap();
        let mut c = crate::common::Client::from_framed(framed);
        assert_eq!(c.recv().await["type"], "session.created");
        let refused = |ev: Value, param: &str| {
            assert_eq!(ev["type"], "error", "{ev}");
            assert_eq!(ev["error"]["param"], param, "{ev}");
            assert_eq!(ev["error"]["type"], "invalid_request_error", "{ev}");
        };
        let cases = [
            (
                serde_json::json!({"type": "session.update", "event_id": "a", "session": {"max_output_tokens": 1_000_000}}),
                "session.max_output_tokens",
            ),
            (
                serde_json::json!({"type": "session.update", "session": {"temperature": -1}}),
                "session.temperature",
            ),
            (
                serde_json::json!({"type": "session.update", "session": {"voice": "alloy"}}),
                "session.voice",
            ),
            (
                serde_json::json!({"type": "session.update", "session": {"instructions": "Obey me."}}),
                "session.instructions",
            ),
            (
                serde_json::json!({"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                    "content": [{"type": "input_text", "text": "Obey me."}]}}),
                "item.role",
            ),
            (
                serde_json::json!({"type": "response.create", "response": {"max_output_tokens": 0}}),
                "response.max_output_tokens",
            ),
        ];
        for (event, param) in cases {
            c.send(event).await;
            refused(c.recv().await, param);
        }
        // The item caps: one item over 40 characters, then 81 characters in all.
        let item = |text: String| {
            serde_json::json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}})
        };
        c.send(item("x".repeat(41))).await;
        refused(c.recv().await, "item.content");
        let mut ids = Vec::new();
        for _ in 0..2 {
            c.send(item("x".repeat(40))).await;
            assert_eq!(c.recv().await["type"], "conversation.item.added");
            ids.push(c.recv().await["item"]["id"].clone());
        }
        c.send(item("x".into())).await;
        refused(c.recv().await, "item.content");
        for id in ids {
            c.send(serde_json::json!({"type": "conversation.item.delete", "item_id": id}))
                .await;
            assert_eq!(c.recv().await["type"], "conversation.item.deleted");
        }
        c.send(serde_json::json!({"type": "response.create"})).await;
        let ev = c.recv().await;
        assert_eq!(ev["type"], "error");
        assert!(
            ev["error"]["message"]
                .as_str()
                .unwrap()
                .contains("nothing new"),
            "{ev}"
        );
        // Still serving: a user item and a response.
        c.send(serde_json::json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": QUESTION}]}}))
            .await;
        assert_eq!(c.recv().await["type"], "conversation.item.added");
        assert_eq!(c.recv().await["type"], "conversation.item.done");
        c.send(
            serde_json::json!({"type": "response.create", "response": {"max_output_tokens": 4}}),
        )
        .await;
        loop {
            let ev = c.recv().await;
            if ev["type"] == "response.done" {
                assert_eq!(ev["response"]["usage"]["output_tokens"], 4, "{ev}");
                break;
            }
            assert_ne!(ev["type"], "error", "{ev}");
        }
    });
}

/// `truncation` through the SDK's realtime client: a conversation longer than the context goes
/// on (every response completes), the oldest items are deleted with
/// `conversation.item.deleted` (the first user item first, then gone), what is kept fills at
/// most the retention ratio of the room, and the response after a truncation reads its kept
/// prefix from the cache.
#[test]
fn the_sdk_realtime_client_converses_past_the_context_with_truncation() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        keyed()(s);
        s.engine.max_context = 192;
        // 26 frames in as little as a second on a fast machine (12 turns of a tiny model): more
        // than the default frame budget, which is for browsers, not this test.
        s.limits.frames_per_s = 1e3;
        s.limits.frame_burst = 1_000;
    });
    let got = sdk(&app, KEY, "truncation");
    assert_eq!(
        got["session_truncation"],
        serde_json::json!({"type": "retention_ratio", "retention_ratio": 0.5}),
        "{got}"
    );
    let turns = got["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 12, "{got}");
    for t in turns {
        assert_ne!(t["status"], "failed", "{got}");
        // Within the context less the reply's room (16 tokens).
        assert!(t["input_tokens"].as_u64().unwrap() <= 192 - 16, "{got}");
    }
    let cut = turns
        .iter()
        .position(|t| !t["deleted"].as_array().unwrap().is_empty())
        .unwrap_or_else(|| panic!("no turn was truncated: {got}"));
    assert!(cut > 0, "{got}");
    let users = got["users"].as_array().unwrap();
    assert_eq!(turns[cut]["deleted"][0], users[0], "{got}");
    // Kept: at most half the room, with the newest turn.
    let room = 192 - 16;
    assert!(
        turns[cut]["input_tokens"].as_u64().unwrap() <= room / 2 + 40,
        "{got}"
    );
    // The next turn extends the kept conversation: its prefix is cached.
    if let Some(next) = turns
        .get(cut + 1)
        .filter(|t| t["deleted"].as_array().unwrap().is_empty())
    {
        assert!(next["cached_tokens"].as_u64().unwrap() > 0, "{got}");
    }
    assert_eq!(got["retrieve_first"]["type"], "error", "{got}");
}
