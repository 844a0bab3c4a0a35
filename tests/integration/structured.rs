//! Structured outputs end to end: `response_format` over OpenAI's HTTP API (whole, streamed,
//! `n` forks, the official SDK's `parse()`) and `params.response_format` on `/ws`. The tiny model
//! has random weights, so every valid reply here is the server's doing, not the model's.

use llama_relay::settings::Settings;
use serde_json::{json, Value};

use crate::common::*;
use crate::openai::{http, model_id, post, run, sdk_python, sdk_script};

/// A ticket: bounded strings and numbers, so that even a random model ends within the reply's
/// room.
fn ticket_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "state": {"enum": ["open", "pending", "closed"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
            "urgent": {"type": "boolean"},
        },
        "required": ["state", "priority", "tags", "urgent"],
        "additionalProperties": false,
    })
}

fn assert_ticket(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 4, "{text}");
    assert!(
        ["open", "pending", "closed"].contains(&o["state"].as_str().unwrap()),
        "{text}"
    );
    assert!((1..=5).contains(&o["priority"].as_i64().unwrap()), "{text}");
    let tags = o["tags"].as_array().unwrap();
    assert!(tags.len() <= 2, "{text}");
    assert!(
        tags.iter()
            .all(|t| t.as_str().unwrap().chars().count() <= 6),
        "{text}"
    );
    assert!(o["urgent"].is_boolean(), "{text}");
}

fn chat_body(model: &str, format: Value, seed: u64) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "Open a ticket for me."}],
        "max_tokens": 120, "temperature": 1.0, "seed": seed, "response_format": format})
}

/// The content of an SSE chat stream, and its finish reason.
fn streamed(body: &str) -> (String, String) {
    let (mut text, mut finish) = (String::new(), String::new());
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().unwrap() {
            text += c["delta"]["content"].as_str().unwrap_or("");
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.into();
            }
        }
    }
    (text, finish)
}

#[test]
fn replies_follow_the_schema_even_from_a_random_model() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let model = model_id(&app);
    let format = json!({"type": "json_schema",
        "json_schema": {"name": "ticket", "schema": ticket_schema(), "strict": true}});
    for seed in 0..4 {
        let (status, _, r) = post(
            &app,
            "/v1/chat/completions",
            chat_body(&model, format.clone(), seed),
            &[],
        );
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert_ticket(text);
        // Streamed, the same seed: the same reply in chunks.
        let mut body = chat_body(&model, format.clone(), seed);
        body["stream"] = json!(true);
        let (status, _, sse) = http(&app, "POST", "/v1/chat/completions", &[], &body.to_string());
        assert_eq!(status, 200);
        assert_eq!(streamed(&sse), (text.to_string(), "stop".to_string()));
    }
    // Three choices fork from one prefill, each with its own grammar state.
    let mut body = chat_body(&model, format, 9);
    body["n"] = json!(3);
    let (status, _, r) = post(&app, "/v1/chat/completions", body, &[]);
    assert_eq!(status, 200, "{r}");
    let texts: Vec<&str> = (r["choices"].as_array().unwrap().iter())
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 3);
    texts.iter().for_each(|t| assert_ticket(t));
    // Any JSON object, and this server's regex and Lark extensions.
    let (_, _, r) = post(
        &app,
        "/v1/chat/completions",
        chat_body(&model, json!({"type": "json_object"}), 1),
        &[],
    );
    if r["choices"][0]["finish_reason"] == "stop" {
        let v: Value =
            serde_json::from_str(r["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
        assert!(v.is_object(), "{v}");
    } else {
        // A random model may fill its room with one long string: still JSON so far.
        assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
        assert!(r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with('{'));
    }
    let (_, _, r) = post(
        &app,
        "/v1/chat/completions",
        chat_body(
            &model,
            json!({"type": "lark", "lark": "start: \"yes\" | \"no\""}),
            2,
        ),
        &[],
    );
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text == "yes" || text == "no", "{r}");
    run(async {
        app.wait_idle().await;
    });
}

#[test]
fn the_websocket_takes_the_same_formats() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |s: &mut Settings| {
        s.limits.max_schema_bytes = 512;
    });
    run(async {
        let mut c = app.connect().await;
        let regex = json!({"type": "regex", "regex": "[A-Z]{3}-[0-9]{4}"});
        for (i, seed) in (0..3).enumerate() {
            let id = format!("r{i}");
            c.chat(&id, "Your order number?", json!({"temperature": 1.0, "seed": seed, "max_tokens": 40, "response_format": regex})).await;
            let r = c.reply(&id).await;
            assert_eq!(r.done["type"], "done", "{}", r.done);
            let t: Vec<char> = r.text.chars().collect();
            assert!(
                t.len() == 8
                    && t[..3].iter().all(char::is_ascii_uppercase)
                    && t[3] == '-'
                    && t[4..].iter().all(char::is_ascii_digit),
                "{:?}",
                r.text
            );
            assert_eq!(r.done["finish_reason"], "stop", "{}", r.done);
        }
        // A regex that does not compile, an unknown type, and one over the limit: each named.
        for (format, says) in [
            (json!({"type": "regex", "regex": "(unclosed"}), ""),
            // Compiles, then exhausts the grammar engine's fuel: that reply alone ends.
            (json!({"type": "regex", "regex": "(a{1000}){1000}"}), ""),
            (json!({"type": "yaml"}), "unknown variant"),
            (
                json!({"type": "regex", "regex": "a".repeat(600)}),
                "limits.max_schema_bytes",
            ),
        ] {
            c.chat("bad", "hi", json!({"response_format": format}))
                .await;
            let r = c.reply("bad").await;
            assert_eq!(r.done["type"], "error", "{}", r.done);
            let m = r.done["message"].as_str().unwrap();
            assert!(
                m.contains("params.response_format") && m.contains(says),
                "{m}"
            );
        }
        // The session goes on.
        c.chat("ok", "hi", json!({"max_tokens": 2})).await;
        assert_eq!(c.reply("ok").await.done["type"], "done");
        app.wait_idle().await;
    });
}

#[test]
fn openai_errors_name_response_format() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let model = model_id(&app);
    for (format, says) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}),
            "missing",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}),
            "json_schema.name",
        ),
        (json!({"type": "xml"}), "unknown variant"),
        (json!({"type": "lark", "lark": "start: nowhere"}), "nowhere"),
    ] {
        let (status, _, r) = post(
            &app,
            "/v1/chat/completions",
            chat_body(&model, format, 0),
            &[],
        );
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], "response_format", "{r}");
        assert!(
            r["error"]["message"].as_str().unwrap().contains(says),
            "{r}"
        );
    }
}

/// The official SDK's `parse()` with a Pydantic model gets a parsed object back.
#[test]
fn the_python_sdk_parses_structured_replies() {
    let python = sdk_python();
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let got = sdk_script(&python, &app, "sdk_parse.py", &[]);
    let parsed = got["parsed"].as_array().unwrap();
    assert_eq!(parsed.len(), 3, "{got}");
    for p in parsed {
        assert_ticket(&p.to_string());
    }
}

/// 32 varied schemas through the official SDK, every reply checked by a JSON-Schema validator.
#[test]
fn every_constrained_reply_validates_against_its_schema() {
    let python = sdk_python();
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let got = sdk_script(&python, &app, "structured_validity.py", &[]);
    assert!(got["checked"].as_u64().unwrap() >= 30, "{got}");
    assert_eq!(got["failures"], json!([]), "{got:#}");
}

/// Tools through the official SDK: forced and named calls validate against their schemas, the
/// streamed calls are the whole ones, a tool result continues the conversation, and mistakes are
/// refused naming the field.
#[test]
fn the_python_sdk_calls_tools() {
    let python = sdk_python();
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let got = sdk_script(&python, &app, "sdk_tools.py", &[]);
    for w in got["whole"].as_array().unwrap() {
        assert_eq!(w["finish"], "tool_calls", "{w}");
        assert_eq!(w["stream_finish"], "tool_calls", "{w}");
        assert_eq!(w["content"], Value::Null, "{w}");
        assert_eq!(
            w["calls"].as_array().unwrap().len(),
            1,
            "no parallel calls: {w}"
        );
        assert_eq!(w["streamed"], w["calls"], "{w}");
        assert_eq!(w["streamed_ids"], true, "{w}");
    }
    let named = got["named"].as_array().unwrap();
    assert!(
        !named.is_empty() && named.iter().all(|c| c["name"] == "handover"),
        "{got}"
    );
    assert_eq!(got["round_trip"]["calls"], Value::Null, "{got}");
    assert_eq!(got["round_trip"]["finish"], "length", "{got}");
    assert_eq!(
        got["errors"],
        json!([
            {"undeclared_choice": {"status": 400, "param": "tool_choice.function.name"}},
            {"bad_name": {"status": 400, "param": "tools[0].function.name"}},
            {"unknown_call_id": {"status": 400, "param": "messages[1].tool_call_id"}},
        ]),
        "{got}"
    );
}

/// The same from Rust (async-openai): a forced call whose arguments follow the schema, whole and
/// streamed alike.
#[test]
fn a_rust_openai_client_gets_tool_calls() {
    use async_openai::config::OpenAIConfig;
    use async_openai::types::chat::{
        ChatCompletionMessageToolCalls, ChatCompletionRequestMessage,
        ChatCompletionRequestUserMessage, ChatCompletionTool, ChatCompletionToolChoiceOption,
        ChatCompletionTools, CreateChatCompletionRequestArgs, FunctionObject, ToolChoiceOptions,
    };
    use futures_util::StreamExt;
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let model = model_id(&app);
    run(async {
        let client = async_openai::Client::with_config(
            OpenAIConfig::new()
                .with_api_base(format!("http://{}/v1", app.addr))
                .with_api_key("unused"),
        );
        let msg: ChatCompletionRequestMessage =
            ChatCompletionRequestUserMessage::from("Is order 12345 open?").into();
        let tool = ChatCompletionTools::Function(ChatCompletionTool {
            function: FunctionObject {
                name: "set_state".into(),
                description: Some("Sets a ticket's state.".into()),
                parameters: Some(json!({"type": "object",
                    "properties": {"state": {"enum": ["open", "closed"]}, "level": {"type": "integer", "minimum": 1, "maximum": 3}},
                    "required": ["state", "level"], "additionalProperties": false})),
                strict: Some(true),
            },
        });
        let req = CreateChatCompletionRequestArgs::default()
            .model(&model)
            .messages(vec![msg])
            .tools(vec![tool])
            .tool_choice(ChatCompletionToolChoiceOption::Mode(
                ToolChoiceOptions::Required,
            ))
            .parallel_tool_calls(false)
            .max_completion_tokens(60u32)
            .temperature(1.0)
            .seed(4)
            .build()
            .unwrap();
        let whole = client.chat().create(req.clone()).await.unwrap();
        let calls = whole.choices[0].message.tool_calls.clone().unwrap();
        assert_eq!(calls.len(), 1);
        let ChatCompletionMessageToolCalls::Function(call) = &calls[0] else {
            panic!("a function call: {calls:?}")
        };
        assert_eq!(call.function.name, "set_state");
        let args: Value = serde_json::from_str(&call.function.arguments).unwrap();
        assert!(
            ["open", "closed"].contains(&args["state"].as_str().unwrap()),
            "{args}"
        );
        assert!((1..=3).contains(&args["level"].as_i64().unwrap()), "{args}");
        let mut stream = client.chat().create_stream(req).await.unwrap();
        let (mut name, mut arguments) = (String::new(), String::new());
        while let Some(chunk) = stream.next().await {
            for c in chunk.unwrap().choices {
                for t in c.delta.tool_calls.unwrap_or_default() {
                    if let Some(f) = t.function {
                        name += f.name.as_deref().unwrap_or("");
                        arguments += f.arguments.as_deref().unwrap_or("");
                    }
                }
            }
        }
        assert_eq!(
            (name.as_str(), arguments.as_str()),
            ("set_state", call.function.arguments.as_str())
        );
        app.wait_idle().await;
    });
}

const WIDGET_ORIGIN: &str = "http://shop.acme.test";

/// A widget whose page runs `order_status`: every reply starts with a call (`required`), one
/// call a turn, a short timeout.
fn widget_with_tools(s: &mut Settings) {
    use llama_relay::server::gate::tenants::{TenantSettings, WidgetSettings};
    use llama_relay::settings::ToolSettings;
    s.tenants = vec![TenantSettings {
        name: "acme".into(),
        widgets: vec![WidgetSettings {
            id: "acme-help".into(),
            origins: vec![WIDGET_ORIGIN.into()],
            system_prompt: "You help Acme's customers with their orders.".into(),
            tools: vec![ToolSettings {
                name: "order_status".into(),
                description: "Looks up an order by its number.".into(),
                parameters: Some(json!({
                    "type": "object",
                    "properties": {"order": {"type": "string", "maxLength": 8}},
                    "required": ["order"],
                    "additionalProperties": false,
                })),
            }],
            tool_choice: Some("required".into()),
            ..Default::default()
        }],
        ..Default::default()
    }];
    s.limits.max_tool_calls = 1;
    s.limits.tool_timeout_s = 2;
}

/// Frames of reply `id` up to its `tool_call` (asserting no delta came before it).
async fn until_tool_call(c: &mut Client, id: &str) -> Value {
    loop {
        let f = c.recv().await;
        match f["type"].as_str().unwrap() {
            "tool_call" => {
                assert_eq!(f["id"], id);
                return f;
            }
            "queued" | "started" => {}
            _ => panic!("before the tool call: {f}"),
        }
    }
}

/// Operator-declared widget tools over `/ws`: the reply calls the function (a `tool_call` frame
/// with arguments valid for its schema, no delta of the call's text); a `tool_result` for
/// another call, and a `chat` while the call waits, are refused; the right result makes the
/// reply go on under the same id with everything before it cached; a call left unanswered
/// times out into the model's next turn; a call can be cancelled.
#[test]
fn a_widget_calls_a_function_of_its_page_and_goes_on_from_the_result() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), widget_with_tools);
    run(async {
        let mut c = app
            .connect_with("/ws?widget=acme-help", &[("Origin", WIDGET_ORIGIN)])
            .await
            .expect("the widget connects");
        let params = json!({"temperature": 0, "max_tokens": 48});
        c.chat("q1", "Where is my order A-1?", params.clone()).await;
        let call = until_tool_call(&mut c, "q1").await;
        assert_eq!(call["name"], "order_status");
        let order = call["arguments"]["order"].as_str().expect("a string");
        assert!(order.chars().count() <= 8, "{call}");
        assert_eq!(call["arguments"].as_object().unwrap().len(), 1, "{call}");
        let call_id = call["call_id"].as_str().unwrap().to_string();

        c.send(json!({"type": "tool_result", "call_id": "call_other", "content": "x"}))
            .await;
        let e = c.recv().await;
        assert_eq!(e["error_type"], "invalid_request", "{e}");
        assert!(e["message"].as_str().unwrap().contains("call_id"), "{e}");
        c.chat("q2", "Hello?", params.clone()).await;
        let e = c.recv().await;
        assert_eq!(
            (&e["error_type"], &e["id"]),
            (&json!("busy"), &json!("q2")),
            "{e}"
        );

        c.send(json!({"type": "tool_result", "call_id": call_id,
            "content": {"status": "shipped", "eta": "Friday"}}))
            .await;
        let r = c.reply("q1").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        assert!(r.done["seal"].is_string());
        let started = r.started.expect("the reply goes on");
        let (prompt, cached) = (
            started["prompt_tokens"].as_u64().unwrap(),
            started["cached_tokens"].as_u64().unwrap(),
        );
        assert!(cached + 40 > prompt && cached > 0, "{started}");

        // Unanswered: after `limits.tool_timeout_s` the model is told so and the reply goes on.
        c.chat("q3", "And order B-2?", params.clone()).await;
        until_tool_call(&mut c, "q3").await;
        let t0 = std::time::Instant::now();
        let r = c.reply("q3").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        assert!(t0.elapsed() >= std::time::Duration::from_millis(1500));

        // Cancelled while it waits.
        c.chat("q4", "One more?", params).await;
        until_tool_call(&mut c, "q4").await;
        c.send(json!({"type": "cancel", "id": "q4"})).await;
        let done = c.recv().await;
        assert_eq!(
            (&done["type"], &done["finish_reason"]),
            (&json!("done"), &json!("cancelled")),
            "{done}"
        );
    });
}

/// A tenant's named prefix with functions: the API-key client that selects it (`/ws?prefix=`)
/// gets `tool_call` frames and goes on from its `tool_result`, as a widget does.
#[test]
fn a_prefix_gives_its_api_key_clients_the_same_tools() {
    use llama_relay::server::gate::tenants::{PrefixSettings, TenantSettings, ToolSettings};
    let _g = model_lock();
    let key = "acme-key-0123456789";
    let app = spawn_app(Tiny::Tied.dir(), |s| {
        s.tenants = vec![TenantSettings {
            name: "acme".into(),
            api_keys: vec![key.into()],
            prefixes: vec![PrefixSettings {
                name: "orders".into(),
                system_prompt: "You answer order questions.".into(),
                tools: vec![ToolSettings {
                    name: "order_status".into(),
                    description: "Looks up an order.".into(),
                    parameters: Some(json!({"type": "object",
                        "properties": {"order": {"type": "string", "maxLength": 8}},
                        "required": ["order"], "additionalProperties": false})),
                }],
                tool_choice: Some("required".into()),
            }],
            ..Default::default()
        }];
        s.limits.max_tool_calls = 1;
    });
    run(async {
        let auth = format!("Bearer {key}");
        let mut c = app
            .connect_with("/ws?prefix=orders", &[("Authorization", auth.as_str())])
            .await
            .expect("the key connects");
        c.chat(
            "q1",
            "Where is A-1?",
            json!({"temperature": 0, "max_tokens": 48}),
        )
        .await;
        let call = until_tool_call(&mut c, "q1").await;
        assert_eq!(call["name"], "order_status");
        c.send(json!({"type": "tool_result", "call_id": call["call_id"], "content": "shipped"}))
            .await;
        let r = c.reply("q1").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
        // Without the prefix, no tools: the reply is text.
        let mut plain = app
            .connect_with("/ws", &[("Authorization", auth.as_str())])
            .await
            .expect("the key connects");
        plain
            .chat(
                "p1",
                "Where is A-1?",
                json!({"temperature": 0, "max_tokens": 8}),
            )
            .await;
        let r = plain.reply("p1").await;
        assert_eq!(r.done["type"], "done", "{:?}", r.done);
    });
}

/// The tiny model with Llama 3.1's chat template, which takes `tools`: unpacked once.
pub(crate) fn llama31_tools_model() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let from = Tiny::Tied.dir();
        let dir = from.with_file_name("llama31-tools");
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
        let template = fixtures().join("llama31-tools/chat_template.jinja");
        let mut cfg = read_json(&dir.join("tokenizer_config.json"));
        cfg["chat_template"] = Value::String(std::fs::read_to_string(template).unwrap());
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        dir
    })
}

/// A case of `llama31-tools/conversations.json` as the gateway holds it (calls on their
/// assistant message, results as `tool` messages), its functions for the model's template, and
/// the text transformers renders for it (`expected.json`).
fn llama31_case(
    tok: &llama_relay::tokenizer::TextTokenizer,
    i: usize,
) -> (Value, Vec<llama_relay::tokenizer::Message>, String) {
    use llama_relay::server::request::tools::{lower, spaced, Shape, Tools};
    use llama_relay::tokenizer::Message;
    let cases = read_json(&fixtures().join("llama31-tools/conversations.json"));
    let expected = read_json(&fixtures().join("llama31-tools/expected.json"));
    let case = &cases[i];
    let mut messages: Vec<Message> = (case["messages"].as_array().unwrap().iter())
        .map(|m| {
            let (role, content) = (m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
            match (role, m.get("tool_calls")) {
                ("tool", _) => Tools::result_message(m["name"].as_str().unwrap(), content),
                (_, Some(calls)) => Message {
                    calls: (calls.as_array().unwrap().iter())
                        .map(|c| {
                            let f = &c["function"];
                            (f["name"].as_str().unwrap().into(), spaced(&f["arguments"]))
                        })
                        .collect(),
                    ..Message::new(role, content)
                },
                _ => Message::new(role, content),
            }
        })
        .collect();
    let tools = Tools::parse(
        case["tools"].as_array().map(Vec::as_slice),
        None,
        None,
        1 << 20,
        Shape::Nested,
    )
    .unwrap()
    .unwrap()
    .for_template(tok.call_syntax());
    assert!(tools.native && !tools.parallel);
    let given = lower(&mut messages, 0, Some(&tools)).expect("the template's tools");
    let text = expected[i]["text"].as_str().unwrap().to_string();
    (given, messages, text)
}

/// A model whose chat template takes `tools` (Llama 3.1's) is given them through it: the
/// conversation, calls and results included, renders as transformers renders it, and the
/// special tokens are only those the template writes.
#[test]
fn a_template_that_takes_tools_renders_them_as_transformers_does() {
    let tok =
        llama_relay::tokenizer::TextTokenizer::from_hf_dir(llama31_tools_model(), &[]).unwrap();
    let syntax = tok.call_syntax().expect("Llama 3.1's template takes tools");
    assert_eq!(syntax.middle, "\", \"parameters\": ");
    for i in 0..2 {
        let (given, messages, expected) = llama31_case(&tok, i);
        let (text, ids) = tok.encode_chat_with(&messages, Some(&given), true).unwrap();
        assert_eq!(text, expected, "case {i}");
        assert_eq!(tok.decode(&ids, false).unwrap(), expected, "case {i}");
        assert_eq!(ids, tok.encode_raw(&expected).unwrap(), "case {i}");
    }
}

/// The same over OpenAI's HTTP API: the prompt is the one transformers renders (its token count
/// in `usage`), a forced call comes back in the template's format as a valid `tool_calls` entry,
/// and the conversation that sends it back with its result is the reference's too.
#[test]
fn an_openai_client_calls_functions_in_the_templates_own_format() {
    let _g = model_lock();
    let dir = llama31_tools_model();
    let tok = llama_relay::tokenizer::TextTokenizer::from_hf_dir(dir, &[]).unwrap();
    let app = spawn_app(dir, |_| {});
    let model = model_id(&app);
    let cases = read_json(&fixtures().join("llama31-tools/conversations.json"));
    for seed in 0..3 {
        let (given, messages, _) = llama31_case(&tok, 1);
        let want = tok
            .encode_chat_with(&messages, Some(&given), true)
            .unwrap()
            .1;
        let body = json!({"model": model, "messages": cases[1]["messages"],
            "tools": cases[1]["tools"], "tool_choice": "required", "max_tokens": 40,
            "temperature": 1.0, "seed": seed});
        let (status, _, r) = post(&app, "/v1/chat/completions", body, &[]);
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["usage"]["prompt_tokens"], want.len(), "{r}");
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{r}");
        assert_eq!(calls[0]["function"]["name"], "handover", "{r}");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({}), "{r}");
    }
    // A conversation with a call and its result: arguments as OpenAI sends them (JSON text).
    let (given, messages, _) = llama31_case(&tok, 0);
    let want = tok
        .encode_chat_with(&messages, Some(&given), true)
        .unwrap()
        .1;
    let mut sent = cases[0]["messages"].clone();
    for m in sent.as_array_mut().unwrap() {
        if let Some(calls) = m.get_mut("tool_calls") {
            for c in calls.as_array_mut().unwrap() {
                let args = c["function"]["arguments"].to_string();
                c["function"]["arguments"] = Value::String(args);
            }
        }
        if m["role"] == "tool" {
            m.as_object_mut().unwrap().remove("name");
        }
    }
    let body = json!({"model": model, "messages": sent, "tools": cases[0]["tools"],
        "max_tokens": 8, "temperature": 0});
    let (status, _, r) = post(&app, "/v1/chat/completions", body, &[]);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], want.len(), "{r}");
}

/// A reply held to a JSON Schema speculates too: the drafts it runs are only those the grammar
/// allows, each row is masked as the grammar stands after the drafts before it, and the reply
/// is the one it is without speculation (greedy and seeded), on the default model copying a
/// policy into a field, with drafts kept.
#[test]
fn a_reply_held_to_a_schema_speculates_and_stays_the_same() {
    let _g = model_lock();
    let model = llama_relay::default_model::ensure_default_model().unwrap();
    let text = "Copy the policy below into the JSON field \"policy\", word for word.\n\nPolicy: \
        unused items may be returned within 30 days of delivery with the original receipt for \
        a full refund.";
    let format = json!({"type": "json_schema", "json_schema": {"name": "copy", "strict": true,
        "schema": {"type": "object", "properties": {"policy": {"type": "string", "maxLength": 200}},
        "required": ["policy"], "additionalProperties": false}}});
    let replies = |mode: &str| {
        let app = spawn_app(&model, |s: &mut Settings| {
            s.scheduler.speculation = mode.into()
        });
        let mut out = Vec::new();
        run(async {
            let mut c = app.connect().await;
            for (i, sampling) in [
                json!({"temperature": 0}),
                json!({"temperature": 0.8, "seed": 7}),
            ]
            .into_iter()
            .enumerate()
            {
                let mut params = sampling;
                params["max_tokens"] = json!(80);
                params["response_format"] = format.clone();
                let id = format!("q{i}");
                c.chat(&id, text, params).await;
                let r = c.reply(&id).await;
                assert_eq!(r.done["type"], "done", "{}", r.done);
                let v: Value =
                    serde_json::from_str(&r.text).unwrap_or_else(|e| panic!("{e}: {}", r.text));
                assert!(v["policy"].is_string(), "{v}");
                out.push((r.text, r.done["usage"]["accepted_tokens"].as_u64().unwrap()));
                c.send(json!({"type": "reset"})).await;
            }
            app.wait_idle().await;
        });
        out
    };
    let plain = replies("off");
    let fast = replies("auto");
    for ((p, _), (f, _)) in plain.iter().zip(&fast) {
        assert_eq!(f, p);
    }
    assert!(plain[0].0.contains("30 days"), "{}", plain[0].0);
    assert!(fast[0].1 > 0, "drafts kept in the greedy reply: {fast:?}");
}
