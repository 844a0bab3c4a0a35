//! What the fuzz targets (`fuzz/`, coverage-guided with libFuzzer) run on each input, here so
//! that `cargo test` replays the same functions over the saved corpus and every crash the fuzzer
//! ever found (`tests/integration/fuzz_corpus.rs`). Each harness panics when an invariant breaks:
//! - `client_frame`: any bytes as a WebSocket frame and as an OpenAI request body, parsed and
//!   validated with the shipped limits: an error or a value within the limits, never a panic;
//!   callable tools described in the system turn, held to a grammar, their calls parsed back.
//! - `chat_template`: arbitrary messages rendered with the chat template and tokenized: content
//!   adds no special token (markup in content stays text), the ids decode to the rendered text,
//!   and the length pre-check's lower bound holds.
//! - `detokenizer`: arbitrary token ids and stop strings through `ReplyText` (the incremental
//!   detokenizer and the stop-string scanner): the pieces sent concatenate to what it says it
//!   sent, never contain a stop string, and without stop strings equal decoding all ids at once.
//! - `realtime`: a `/v1/realtime` connection's events, any bytes, interleaved with the frames the
//!   session sends back, through the dialect's dispatch (`Realtime::handle`, what the session
//!   calls) with the shipped limits: the dialect's invariants hold (`Realtime::check`; its item
//!   bound after every event), every event it sends is a typed object with a fresh id, and a response
//!   starts the session on exactly the conversation the items make.
//! - `native`: a `/ws` connection's frames through the native dialect's dispatch
//!   (`ws::dispatch::handle`), interleaved with the session's side of its replies: see `native`.

use serde_json::Value;

use crate::engine::constraint::ResponseFormat;
use crate::server::gate::tenants::Roles;
use crate::server::openai::wire::{ChatRequest, CompletionRequest};
use crate::server::realtime::{Action, Realtime, Rules};
use crate::server::request::reply::ReplyText;
use crate::server::request::reply::{FinishReason, Usage};
use crate::server::request::tools::{parse_reply, MAX_TOOLS};
use crate::server::request::GenerateParams;
use crate::server::ws::protocol::{ClientFrame, ServerFrame};
use crate::server::SessionConfig;
use crate::tokenizer::{Message, TextTokenizer};

/// The shipped session configuration: limits and sampling defaults (config/default.toml).
fn shipped() -> &'static SessionConfig {
    static S: std::sync::OnceLock<SessionConfig> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let s = crate::settings::Settings::load(None).expect("the shipped settings load");
        s.session_config()
    })
}

pub fn client_frame(data: &[u8]) {
    let c = shipped();
    let (limits, sampling, max_tokens) = (&c.limits, &c.sampling, &c.default_max_tokens);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(ClientFrame::Chat {
        id,
        messages,
        params,
    }) = serde_json::from_str::<ClientFrame>(text)
    {
        if let Ok(v) = limits.validate(id, messages, params, sampling, *max_tokens) {
            assert!(v.max_tokens >= 1 && v.max_tokens <= limits.max_tokens);
            assert!(!v.messages.is_empty() && v.messages.len() <= limits.max_messages);
            assert!(v.stop.len() <= limits.max_stop_strings);
        }
    }
    if let Ok(r) = serde_json::from_str::<ChatRequest>(text) {
        // Half the inputs as for a model whose template takes tools (Llama 3.1's call format).
        let native = crate::tokenizer::CallSyntax {
            prefix: "{\"name\": \"".into(),
            middle: "\", \"parameters\": ".into(),
            suffix: "}".into(),
            separator: None,
        };
        let syntax = (text.len() % 2 == 1).then_some(&native);
        if let Ok(v) = r.validate("x".into(), limits, sampling, *max_tokens, syntax) {
            assert!(v.chat.max_tokens >= 1 && v.chat.max_tokens <= limits.max_tokens);
            // Callable tools: described to the model (in a leading system turn, or given to
            // the template), the reply held to a grammar, and a call the model writes parses
            // back into the same call.
            if let Some(t) = &v.chat.tools {
                assert!(t.active() && t.tools.len() <= MAX_TOOLS);
                assert_eq!(t.native, syntax.is_some());
                let mut lowered = v.chat.messages.clone();
                let described = v.chat.described.as_deref();
                let given = crate::server::request::tools::lower(&mut lowered, 0, described);
                assert!(lowered.iter().all(|m| m.calls.is_empty()));
                if t.native {
                    assert!(given.is_some() && !t.parallel);
                } else {
                    assert!(given.is_none());
                    assert_eq!(lowered[0].role, "system");
                    assert!(lowered[0].content.ends_with(&t.system_text()));
                }
                assert!(matches!(v.chat.format, ResponseFormat::Lark { .. }));
                let args = serde_json::json!({"k": "v\"}{"});
                let call = t.call_text(&t.tools[0].name, &args);
                let (text, calls) = parse_reply(t, &call);
                assert!(text.is_empty() && calls.len() == 1, "{call}");
                assert_eq!(calls[0].0, t.tools[0].name);
                let back: Value = serde_json::from_str(&calls[0].1).expect("arguments are JSON");
                assert_eq!(back, args);
            }
        }
    }
    if let Ok(r) = serde_json::from_str::<CompletionRequest>(text) {
        let _ = r.validate("x".into(), limits, sampling);
    }
    let _ = serde_json::from_str::<GenerateParams>(text);
}

/// Splits fuzz bytes into messages: each starts with a role byte (user, assistant, system) and
/// runs to the next 0xFF byte; content is the bytes as (lossy) UTF-8.
pub fn messages_of(data: &[u8]) -> Vec<Message> {
    data.split(|&b| b == 0xFF)
        .filter_map(|m| {
            let (&r, rest) = m.split_first()?;
            let role = ["user", "assistant", "system"][r as usize % 3];
            Some(Message::new(role, &String::from_utf8_lossy(rest)))
        })
        .take(16)
        .collect()
}

pub fn chat_template(tok: &TextTokenizer, data: &[u8]) {
    let messages = messages_of(data);
    if messages.is_empty() {
        return;
    }
    for m in &messages {
        // The length pre-check never refuses what would fit.
        if let (Some(least), Ok(ids)) = (
            tok.min_content_tokens(&m.content),
            tok.encode_text(&m.content),
        ) {
            assert!(
                ids.len() >= least,
                "{} tokens, but at least {least} by length",
                ids.len()
            );
        }
    }
    let Ok((text, ids)) = tok.encode_chat(&messages, true) else {
        return;
    };
    // The same conversation with every content empty: the template's own special tokens.
    let empty: Vec<Message> = (messages.iter())
        .map(|m| Message::new(&m.role, ""))
        .collect();
    let (_, template_ids) = tok.encode_chat(&empty, true).expect("the template renders");
    let specials = |ids: &[u32]| {
        let added = tok.inner().get_added_vocabulary();
        ids.iter()
            .filter(|&&id| added.simple_id_to_token(id).is_some())
            .count()
    };
    assert_eq!(
        specials(&ids),
        specials(&template_ids),
        "content added special tokens: {messages:?}"
    );
    let decoded = tok.decode(&ids, false).expect("ids decode");
    assert_eq!(decoded, text, "the ids do not decode to the rendered text");
}

/// Fuzz bytes as token ids (little-endian u32, reduced into the vocabulary) after up to two stop
/// strings (a length byte, then that many bytes each, lossy UTF-8).
pub fn detokenizer(tok: &TextTokenizer, data: &[u8]) {
    let mut rest = data;
    let mut stop = Vec::new();
    if let Some((&n, r)) = rest.split_first() {
        rest = r;
        for _ in 0..(n % 3) {
            let Some((&len, r)) = rest.split_first() else {
                break;
            };
            let len = (len as usize % 8).min(r.len());
            let s = String::from_utf8_lossy(&r[..len]).into_owned();
            rest = &r[len..];
            if !s.is_empty() {
                stop.push(s);
            }
        }
    }
    let vocab = tok.vocab_size().max(1) as u32;
    let ids: Vec<u32> = rest
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % vocab)
        .take(256)
        .collect();
    let mut reply = ReplyText::new(stop.clone());
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&reply.push(tok, id));
    }
    out.push_str(&reply.finish(tok));
    assert_eq!(out, reply.sent(), "sent pieces differ from the record");
    for s in &stop {
        assert!(
            !out.contains(s.as_str()),
            "stop string {s:?} was sent: {out:?}"
        );
    }
    if stop.is_empty() {
        let all = tok.decode(&ids, true).expect("ids decode");
        assert_eq!(
            out, all,
            "incremental text differs from decoding all at once"
        );
    }
}

/// Fuzz bytes as a Realtime connection: the first byte picks the client's roles (odd: all, as
/// an API key; even: user only, as the widget) and the most items the conversation may hold (1
/// to 16, so that few events reach the bound), the rest splits at 0xFF bytes into up to 256
/// pieces. A piece that starts with a byte below 8 is something only the server knows: a frame
/// of the session for the response in flight (0 started, 1 delta with the rest as text, 2 done
/// (the finish reason from the next byte), 3 error) or an event naming a real item (4 truncate,
/// 5 delete, 6 retrieve the item the next byte picks; 7 create after it), or, from 8 to 10, a
/// function tool event (8 `session.update` with a tool and the choice the next byte picks, 9 a
/// `function_call` item and 10 a `function_call_output` item, the call id from the next byte);
/// any other piece is a client event's text (lossy UTF-8).
pub fn realtime(data: &[u8]) {
    let Some((&who, rest)) = data.split_first() else {
        return;
    };
    let roles = if who % 2 == 1 {
        Roles::ALL
    } else {
        Roles::parse(&["user".into()]).expect("a role")
    };
    let rules = Rules {
        session: shipped(),
        roles,
        syntax: None,
    };
    let max_items = 1 + usize::from(who / 2 % 16);
    let mut rt = Realtime::with_max_items("m".into(), max_items);
    let mut events = EventIds::default();
    events.check(&[rt.created()]);
    // What the session holds: its conversation, and the response it is generating.
    let mut conversation: Vec<Message> = Vec::new();
    let mut flight: Option<(String, String)> = None;
    for piece in rest.split(|&b| b == 0xFF).take(256) {
        let sent = match piece.split_first() {
            Some((&kind @ 0..=3, body)) => {
                let id = flight.as_ref().map_or("resp_gone", |f| f.0.as_str());
                let id = id.to_string();
                let text = String::from_utf8_lossy(body).into_owned();
                let frame = match kind {
                    0 => ServerFrame::Started {
                        id,
                        prompt_tokens: body.len(),
                        cached_tokens: 0,
                        // Turns dropped from anywhere, even past the conversation's end.
                        truncated: body.first().filter(|b| *b & 1 == 1).map(|b| {
                            crate::server::ws::protocol::Truncated {
                                dropped_turns: 1,
                                first_kept_turn: 1,
                                from: usize::from(b >> 6),
                                messages: usize::from((b >> 1) & 7),
                            }
                        }),
                    },
                    1 => ServerFrame::Delta {
                        id,
                        index: 0,
                        text: text.clone(),
                    },
                    2 => ServerFrame::Done {
                        id,
                        finish_reason: [
                            FinishReason::Stop,
                            FinishReason::Length,
                            FinishReason::Cancelled,
                            FinishReason::Shutdown,
                        ][body.first().map_or(0, |&b| b as usize % 4)],
                        usage: Usage::default(),
                        timings: Default::default(),
                        seal: None,
                    },
                    _ => ServerFrame::Error {
                        id: Some(id),
                        error_type: text,
                        message: "fuzz".into(),
                    },
                };
                let sent = rt.on_frame(&frame);
                // The session's side of the same frames.
                match (&frame, flight.as_mut()) {
                    (ServerFrame::Delta { text, .. }, Some(f)) => f.1.push_str(text),
                    (ServerFrame::Done { .. }, Some(_)) => {
                        let (_, reply) = flight.take().expect("in flight");
                        conversation.push(Message::new("assistant", &reply));
                    }
                    (ServerFrame::Error { .. }, Some(_)) => flight = None,
                    _ => {}
                }
                sent
            }
            Some((&kind @ 4..=7, body)) => {
                let items = rt.items();
                let pick = body.first().map_or(0, |&b| b as usize);
                let id = items
                    .get(pick % items.len().max(1))
                    .map_or("none", |i| &i.id);
                let text = match kind {
                    4 => format!(
                        r#"{{"type":"conversation.item.truncate","item_id":"{id}","content_index":0,"text_end":{}}}"#,
                        body.get(1).copied().unwrap_or(0)
                    ),
                    5 => format!(r#"{{"type":"conversation.item.delete","item_id":"{id}"}}"#),
                    6 => format!(r#"{{"type":"conversation.item.retrieve","item_id":"{id}"}}"#),
                    _ => format!(
                        r#"{{"type":"conversation.item.create","previous_item_id":"{id}","item":{{"type":"message","role":"user","content":[{{"type":"input_text","text":"x"}}]}}}}"#
                    ),
                };
                client_event(&mut rt, &rules, &text, &mut conversation, &mut flight)
            }
            Some((&kind @ 8..=10, body)) => {
                let b = body.first().copied().unwrap_or(0);
                let text = match kind {
                    8 => format!(
                        r#"{{"type":"session.update","session":{{"tools":[{{"type":"function","name":"f","parameters":{{"type":"object"}}}}],"tool_choice":"{}"}}}}"#,
                        ["auto", "required", "none"][b as usize % 3]
                    ),
                    9 => format!(
                        r#"{{"type":"conversation.item.create","item":{{"type":"function_call","call_id":"c{}","name":"f","arguments":"{{}}"}}}}"#,
                        b % 4
                    ),
                    _ => format!(
                        r#"{{"type":"conversation.item.create","item":{{"type":"function_call_output","call_id":"c{}","output":"ok"}}}}"#,
                        b % 4
                    ),
                };
                client_event(&mut rt, &rules, &text, &mut conversation, &mut flight)
            }
            _ => {
                let text = String::from_utf8_lossy(piece);
                client_event(&mut rt, &rules, &text, &mut conversation, &mut flight)
            }
        };
        events.check(&sent);
        // The bound after every event; the whole check (linear in the items) at the end.
        assert!(
            rt.held() <= max_items,
            "{} items held, at most {max_items}",
            rt.held()
        );
        assert_eq!(
            rt.active().is_some(),
            flight.is_some(),
            "a response in flight on one side only"
        );
    }
    if let Err(e) = rt.check() {
        panic!("realtime invariant: {e}");
    }
}

/// One client event through the dispatch, and the session's side of what it asks for; the
/// events sent.
fn client_event(
    rt: &mut Realtime,
    rules: &Rules,
    text: &str,
    conversation: &mut Vec<Message>,
    flight: &mut Option<(String, String)>,
) -> Vec<Value> {
    let before = conversation.len();
    match rt.handle(text, rules, conversation, flight.is_some()) {
        Ok(Action::Send(sent)) => sent,
        Ok(Action::Start {
            id,
            from,
            messages,
            params,
            tools,
            created,
        }) => {
            assert!(tools
                .as_ref()
                .is_none_or(|t| !t.tools.is_empty() && !t.parallel));
            assert!(
                flight.is_none(),
                "a response started while one is in flight"
            );
            assert!(from <= before && !messages.is_empty(), "{from} of {before}");
            let limits = &rules.session.limits;
            assert!(params.max_tokens.is_none_or(|m| m <= limits.max_tokens));
            conversation.truncate(from);
            conversation.extend(messages);
            // The session now holds what the items make, after the instructions if any.
            let items = rt.messages(&crate::server::request::tools::generic_syntax());
            let head = conversation.len() - items.len().min(conversation.len());
            assert_eq!(&conversation[head..], &items[..], "conversation != items");
            assert!(head == 0 || (head == 1 && conversation[0].role == "system"));
            if !rules.roles.allows("system") {
                assert!(conversation
                    .iter()
                    .all(|m| rules.roles.allows(&m.role) || m.role == "assistant"));
            }
            *flight = Some((id, String::new()));
            vec![created]
        }
        Ok(Action::Cancel(id)) => {
            assert_eq!(Some(&id), flight.as_ref().map(|f| &f.0));
            Vec::new()
        }
        Err(e) => {
            assert!(!e.code.is_empty() && !e.message.is_empty());
            vec![rt.error(&e)]
        }
    }
}

/// Every event the dialect sends is an object with a type and an id not used before.
#[derive(Default)]
struct EventIds(std::collections::HashSet<String>);

impl EventIds {
    fn check(&mut self, sent: &[Value]) {
        for e in sent {
            assert!(e["type"].as_str().is_some_and(|t| !t.is_empty()), "{e}");
            let id = e["event_id"].as_str().expect("an event id").to_string();
            assert!(self.0.insert(id), "event id repeated: {e}");
        }
    }
}

/// The session's side of the native dialect, as the fuzz harness models it.
struct NativeSession {
    conversation: Vec<Message>,
    /// The reply in flight: its id, deltas sent, paced, where it replaces the conversation and
    /// the messages that go before it.
    running: Option<(String, usize, bool, usize, Vec<Message>)>,
    last_reply: Option<String>,
    preparing: bool,
    /// The transcript the client keeps (what `done` frames gave it, seals included).
    kept: Vec<(Message, Option<String>)>,
    /// Every reply text the server sealed.
    sealed: std::collections::HashSet<String>,
}

/// A `/ws` connection's frames, any bytes, interleaved with the session's side (deltas and ends
/// of the reply in flight, turns being prepared) and with frames naming what the session holds
/// (its reply, a delta index, a user turn, the client's kept transcript with its seals, forged
/// or not), through the native dialect's dispatch (`ws::dispatch::handle`, what the session
/// calls), as an API key or a widget, with the shipped limits. Checks: a `cancel`/`ack` only for
/// the reply in flight and a delta it sent; a turn replaces the conversation from a place it
/// has (a `chat` at its end, an `edit` at a user message, a `regenerate` from the turn its last
/// reply answered); `restore` and `reset` never while a reply runs, `restore` only on an empty
/// conversation; a widget's restored conversation holds only user messages and assistant
/// messages whose very text the server sealed; refusals carry a message.
pub fn native(data: &[u8]) {
    use crate::server::ws::dispatch::{handle, parse, Action, Running, View};
    use crate::server::ws::seal::Sealer;
    let Some((&who, rest)) = data.split_first() else {
        return;
    };
    let widget = who % 2 == 0;
    let roles = if widget {
        Roles::parse(&["user".into()]).expect("a role")
    } else {
        Roles::ALL
    };
    let config = shipped();
    let limits = &config.limits;
    let sealer = Sealer::new("fuzz secret");
    let verifies = |content: &str, seal: &str| sealer.verify("scope", content, seal);
    let mut s = NativeSession {
        conversation: Vec::new(),
        running: None,
        last_reply: None,
        preparing: false,
        kept: Vec::new(),
        sealed: Default::default(),
    };
    let mut next_id = 0u32;
    for piece in rest.split(|&b| b == 0xFF).take(256) {
        let (kind, body) = piece
            .split_first()
            .map_or((0xFE, &[][..]), |(&k, b)| (k, b));
        let pick = body.first().map_or(0, |&b| usize::from(b));
        let running_id = s.running.as_ref().map_or("none".into(), |r| r.0.clone());
        let text = match kind {
            // The session's side: a delta, the reply's end, its failure, a turn being prepared.
            0 => {
                if let Some(r) = &mut s.running {
                    r.1 += 1;
                }
                continue;
            }
            1 | 2 => {
                if let Some((id, _, _, from, messages)) = s.running.take() {
                    if kind == 1 {
                        let reply =
                            String::from_utf8_lossy(&body[body.len().min(1)..]).into_owned();
                        s.conversation.truncate(from);
                        s.conversation.extend(messages.iter().cloned());
                        s.conversation.push(Message::new("assistant", &reply));
                        s.kept.truncate(from.min(s.kept.len()));
                        s.kept.extend(messages.into_iter().map(|m| (m, None)));
                        let seal = sealer.seal("scope", &reply);
                        s.kept.push((Message::new("assistant", &reply), Some(seal)));
                        s.sealed.insert(reply);
                    }
                    s.last_reply = Some(id);
                }
                continue;
            }
            3 => {
                s.preparing = !s.preparing && s.running.is_none();
                continue;
            }
            // Frames naming what the session holds.
            4 => format!(r#"{{"type":"cancel","id":"{running_id}","heard_index":{pick}}}"#),
            5 => format!(r#"{{"type":"ack","id":"{running_id}","index":{pick}}}"#),
            6 => format!(
                r#"{{"type":"edit","id":"e{next_id}","turn":{},"messages":[{{"role":"user","content":"x"}}],"params":{{"window":{}}}}}"#,
                pick % 4,
                1 + pick % 3
            ),
            7 => format!(r#"{{"type":"regenerate","id":"g{next_id}"}}"#),
            8 => {
                // The kept transcript, a message's text changed when the byte says so.
                let forge = body.get(1).map(|&b| usize::from(b));
                let messages: Vec<Value> = (s.kept.iter().enumerate())
                    .map(|(i, (m, seal))| {
                        let mut content = m.content.clone();
                        if forge == Some(i) {
                            content.push('!');
                        }
                        serde_json::json!({"role": m.role, "content": content, "seal": seal})
                    })
                    .collect();
                if pick % 2 == 0 {
                    // Sent on a new connection whose session holds nothing yet.
                    s.conversation.clear();
                    s.running = None;
                    s.preparing = false;
                }
                serde_json::json!({"type": "restore", "messages": messages}).to_string()
            }
            9 => format!(
                r#"{{"type":"chat","id":"c{next_id}","messages":[{{"role":"user","content":"hi"}}],"params":{{"window":{}}}}}"#,
                pick % 3
            ),
            _ => String::from_utf8_lossy(piece).into_owned(),
        };
        next_id += 1;
        let Ok(frame) = parse(&text) else {
            continue;
        };
        let view = View {
            limits,
            roles,
            seal_verifies: &verifies,
            conversation: &s.conversation,
            running: s.running.as_ref().map(|r| Running {
                id: &r.0,
                deltas: r.1,
                paced: r.2,
            }),
            last_reply: s.last_reply.as_deref(),
            preparing: s.preparing,
            tool_call: None,
            dropped_turns: (next_id % 3) as usize,
        };
        let action = match handle(frame.clone(), &view) {
            Ok(a) => a,
            Err(r) => {
                assert!(!r.error.to_string().is_empty());
                continue;
            }
        };
        let busy = s.running.is_some() || s.preparing;
        match action {
            Action::Resume { .. } => assert!(matches!(frame, ClientFrame::Resume { .. })),
            Action::Draft(_) => assert!(!busy),
            Action::DraftLater(_) => assert!(busy),
            Action::Ack(i) => {
                let r = s.running.as_ref().expect("an ack of a reply in flight");
                assert!(r.2 && i < r.1, "ack {i} of {} deltas", r.1);
            }
            Action::Cancel { heard } => {
                let r = s.running.as_ref().expect("a cancel of a reply in flight");
                assert!(
                    heard.is_none_or(|h| h < r.1),
                    "heard {heard:?} of {} deltas",
                    r.1
                );
            }
            Action::Nothing => assert!(matches!(frame, ClientFrame::Ack { .. })),
            Action::ToolResult(_) => panic!("a tool result with no call waiting"),
            Action::Reset => {
                assert!(s.running.is_none());
                s.conversation.clear();
                s.kept.clear();
            }
            Action::Restore(messages) => {
                assert!(s.running.is_none() && !s.preparing && s.conversation.is_empty());
                if widget {
                    for m in &messages {
                        assert!(
                            m.role == "user"
                                || (m.role == "assistant" && s.sealed.contains(&m.content)),
                            "a widget restored {m:?}"
                        );
                    }
                }
                s.conversation = messages;
            }
            Action::Turn {
                id,
                messages,
                params,
                replace_from,
                ends_draft,
            } => {
                let len = s.conversation.len();
                assert!(replace_from <= len, "{replace_from} of {len}");
                match &frame {
                    ClientFrame::Chat { .. } => assert!(ends_draft && replace_from == len),
                    ClientFrame::Edit { .. } => {
                        assert_eq!(s.conversation[replace_from].role, "user")
                    }
                    ClientFrame::Regenerate { .. } => {
                        let next = &s.conversation[replace_from + messages.len()];
                        assert_eq!(next.role, "assistant");
                        assert!(messages.iter().all(|m| m.role != "assistant"));
                    }
                    f => panic!("a turn from {f:?}"),
                }
                // What the session does next: the seam's validation, then the turn starts
                // unless a reply runs or is being prepared.
                let valid = limits.validate(
                    id.clone(),
                    messages,
                    *params,
                    &config.sampling,
                    config.default_max_tokens,
                );
                if let (Ok(v), false) = (valid, busy) {
                    let paced = v.window.is_some();
                    s.running = Some((id, 0, paced, replace_from, v.messages));
                }
            }
        }
    }
}
