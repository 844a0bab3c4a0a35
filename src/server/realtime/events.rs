//! The client events parsed: each JSON event the SDKs send becomes a `ClientEvent` or an
//! `EventError` naming the field (audio events and modalities refused as such), and the
//! settings they carry become the request seam's `GenerateParams`.

use crate::server::realtime::*;

/// Event types of the audio half of the API, answered with an `error` naming this server's
/// modality.
pub(super) const AUDIO_EVENTS: &[&str] = &[
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
];

/// Items a conversation may hold (each message is a few hundred bytes of bookkeeping even when
/// empty; the characters are bounded by the session).
pub const MAX_ITEMS: usize = 1024;

/// A client event's refusal: the Realtime `error` event's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct EventError {
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
}

pub(super) fn refuse(
    code: &'static str,
    param: Option<&str>,
    message: impl Into<String>,
) -> EventError {
    EventError {
        code,
        message: message.into(),
        param: param.map(str::to_string),
    }
}

pub(super) fn audio_not_served(param: Option<&str>) -> EventError {
    refuse(
        "audio_not_supported",
        param,
        "this server serves text only: audio input and output are not served",
    )
}

/// `max_output_tokens`: a number or "inf" (the server's default and limit).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MaxTokens {
    Count(usize),
    Word(String),
}

impl MaxTokens {
    pub(super) fn limit(&self, param: &str) -> Result<Option<usize>, EventError> {
        match self {
            MaxTokens::Count(n) => Ok(Some(*n)),
            MaxTokens::Word(w) if w == "inf" => Ok(None),
            MaxTokens::Word(w) => Err(refuse(
                "invalid_value",
                Some(param),
                format!("must be a number of tokens or \"inf\", not {w:?}"),
            )),
        }
    }
}

/// The sampling parameters this server takes beyond the Realtime API's (an extension: in
/// `session` and in `response`): the one `SamplingOverrides`.
pub type Sampling = SamplingOverrides;

/// Splits an object's fields into the ones `known` names (kept) and this server's sampling
/// extension; fields the API has that this server ignores are dropped, others refused.
pub(super) fn split_fields(
    mut obj: Map<String, Value>,
    what: &str,
    known: &[&str],
    ignored: &[&str],
) -> Result<(Map<String, Value>, Sampling), EventError> {
    let mut sampling = Map::new();
    let mut kept = Map::new();
    for (k, v) in std::mem::take(&mut obj) {
        if SamplingOverrides::FIELDS.contains(&k.as_str()) {
            sampling.insert(k, v);
        } else if known.contains(&k.as_str()) {
            kept.insert(k, v);
        } else if !ignored.contains(&k.as_str()) {
            return Err(refuse(
                "unknown_parameter",
                Some(&format!("{what}.{k}")),
                format!("`{what}.{k}` is not served by this server (docs/realtime.md)"),
            ));
        }
    }
    let sampling = serde_json::from_value(Value::Object(sampling))
        .map_err(|e| refuse("invalid_value", Some(what), format!("{what}: {e}")))?;
    Ok((kept, sampling))
}

/// What a function item is (`item.function` of the item that holds it).
#[derive(Debug, Clone, PartialEq)]
pub enum Function {
    /// A `function_call` item: the call `call_id` of function `name`; the item's text is its
    /// arguments (JSON text) and its role `assistant` (the model wrote it).
    Call { call_id: String, name: String },
    /// A `function_call_output` item: the result of call `call_id` (of function `name`, looked
    /// up when the item was added); the item's text is the output and its role `user` (what the
    /// model reads it as).
    Output { call_id: String, name: String },
}

/// An item as a client sends it.
#[derive(Debug, Clone, PartialEq)]
pub struct NewItem {
    pub id: Option<String>,
    pub role: String,
    pub text: String,
    /// A function call or a call's output (the output's function name still empty: the
    /// conversation knows it).
    pub function: Option<Function>,
}

/// A string field of an item, required.
fn item_string(obj: &Map<String, Value>, k: &str) -> Result<String, EventError> {
    obj.get(k)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            refuse(
                "missing_required_parameter",
                Some(&format!("item.{k}")),
                format!("`item.{k}` is required (a string)"),
            )
        })
}

/// Reads `item` (`conversation.item.create`): a message whose parts are all text, a
/// `function_call` (its arguments a JSON object) or a `function_call_output`.
pub(super) fn parse_item(item: &Value) -> Result<NewItem, EventError> {
    let Some(obj) = item.as_object() else {
        return Err(refuse("invalid_value", Some("item"), "must be an object"));
    };
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if crate::server::gate::tenants::valid_id(s) => Some(s.clone()),
        Some(_) => {
            return Err(refuse(
                "invalid_value",
                Some("item.id"),
                "must be 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`",
            ))
        }
    };
    let call_id = || {
        let c = item_string(obj, "call_id")?;
        if crate::server::gate::tenants::valid_id(&c) {
            Ok(c)
        } else {
            Err(refuse(
                "invalid_value",
                Some("item.call_id"),
                "must be 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`",
            ))
        }
    };
    match obj.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {}
        "function_call" => {
            let call_id = call_id()?;
            let name = item_string(obj, "name")?;
            if !crate::server::request::tools::valid_name(&name) {
                return Err(refuse(
                    "invalid_value",
                    Some("item.name"),
                    format!("must be a function name (1 to 64 characters of a-z, A-Z, 0-9, _ and -). Given: {name:?}"),
                ));
            }
            let arguments = item_string(obj, "arguments")?;
            if !serde_json::from_str::<Value>(&arguments).is_ok_and(|a| a.is_object()) {
                return Err(refuse(
                    "invalid_value",
                    Some("item.arguments"),
                    "must be a JSON object, as text",
                ));
            }
            return Ok(NewItem {
                id,
                role: "assistant".into(),
                text: arguments,
                function: Some(Function::Call { call_id, name }),
            });
        }
        "function_call_output" => {
            let call_id = call_id()?;
            let output = item_string(obj, "output")?;
            return Ok(NewItem {
                id,
                role: "user".into(),
                text: output,
                function: Some(Function::Output {
                    call_id,
                    name: String::new(),
                }),
            });
        }
        kind => {
            return Err(refuse(
                "invalid_value",
                Some("item.type"),
                format!("must be message, function_call or function_call_output, not {kind:?}"),
            ))
        }
    }
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r.to_string(),
        other => {
            return Err(refuse(
                "invalid_value",
                Some("item.role"),
                format!("must be user, assistant or system, not {other:?}"),
            ))
        }
    };
    let mut text = String::new();
    let parts = obj.get("content").and_then(Value::as_array);
    for (i, part) in parts.into_iter().flatten().enumerate() {
        let param = format!("item.content[{i}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "text" | "output_text") => {
                text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default())
            }
            Some("input_audio" | "audio" | "output_audio") => {
                return Err(audio_not_served(Some(&param)))
            }
            other => {
                return Err(refuse(
                    "invalid_value",
                    Some(&param),
                    format!(
                        "content parts must be text (input_text, text, output_text), not {other:?}"
                    ),
                ))
            }
        }
    }
    Ok(NewItem {
        id,
        role,
        text,
        function: None,
    })
}

/// The text-only output modality check (`output_modalities`, or the older `modalities`).
pub(super) fn check_modalities(v: &Value, param: &str) -> Result<(), EventError> {
    let ok = v
        .as_array()
        .is_some_and(|m| m.iter().all(|x| x == "text") && !m.is_empty());
    if ok {
        Ok(())
    } else {
        Err(audio_not_served(Some(param)))
    }
}

/// What a `session.update` or a `response.create` asks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    pub instructions: Option<String>,
    pub max_output_tokens: Option<MaxTokens>,
    pub sampling: Sampling,
    /// Function tools as the client wrote them (checked by `Rules::check_settings`, parsed into
    /// `Tools` for each response).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `session.truncation` as the client wrote it (`truncation` parses it): what the
    /// conversation does when it outgrows the context.
    pub truncation: Option<Value>,
}

/// `truncation`'s value as the overflow policy's parameters (`GenerateParams::overflow`,
/// `retention_ratio`): `"auto"` drops the oldest turns (the server's retention ratio),
/// `"disabled"` refuses, `{"type": "retention_ratio", "retention_ratio": R}` drops keeping R.
pub fn truncation_of(v: &Value, what: &str) -> Result<(String, Option<f32>), EventError> {
    let param = format!("{what}.truncation");
    let bad = |m: &str| refuse("invalid_value", Some(&param), m);
    match v {
        Value::String(s) if s == "auto" => Ok(("drop_oldest".into(), None)),
        Value::String(s) if s == "disabled" => Ok(("error".into(), None)),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("retention_ratio") => {
            if o.get("token_limits").is_some_and(|t| !t.is_null()) {
                return Err(refuse(
                    "invalid_value",
                    Some(&format!("{param}.token_limits")),
                    "is not served: the limit is the model's context less the reply's room",
                ));
            }
            let r = o.get("retention_ratio").and_then(Value::as_f64).ok_or_else(|| {
                refuse(
                    "invalid_value",
                    Some(&format!("{param}.retention_ratio")),
                    "must be a number above 0 and at most 1",
                )
            })?;
            Ok(("drop_oldest".into(), Some(r as f32)))
        }
        _ => Err(bad(
            "must be \"auto\", \"disabled\" or {\"type\": \"retention_ratio\", \"retention_ratio\": R}",
        )),
    }
}

impl Settings {
    /// These settings with what `s` sets replacing them.
    pub(super) fn updated(self, s: Settings) -> Settings {
        Settings {
            instructions: s.instructions.or(self.instructions),
            max_output_tokens: s.max_output_tokens.or(self.max_output_tokens),
            sampling: self.sampling.under(&s.sampling),
            tools: s.tools.or(self.tools),
            tool_choice: s.tool_choice.or(self.tool_choice),
            truncation: s.truncation.or(self.truncation),
        }
    }
}

pub(super) fn parse_settings(
    obj: Map<String, Value>,
    what: &str,
    extra_known: &[&str],
    ignored: &[&str],
) -> Result<(Settings, Map<String, Value>), EventError> {
    let mut known = vec![
        "instructions",
        "max_output_tokens",
        "output_modalities",
        "modalities",
        "tools",
        "tool_choice",
    ];
    known.extend_from_slice(extra_known);
    let (mut kept, sampling) = split_fields(obj, what, &known, ignored)?;
    for m in ["output_modalities", "modalities"] {
        if let Some(v) = kept.remove(m) {
            check_modalities(&v, &format!("{what}.{m}"))?;
        }
    }
    let instructions = match kept.remove("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(refuse(
                "invalid_value",
                Some(&format!("{what}.instructions")),
                "must be a string",
            ))
        }
    };
    let max_output_tokens = match kept.remove("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(serde_json::from_value(v).map_err(|_| {
            refuse(
                "invalid_value",
                Some(&format!("{what}.max_output_tokens")),
                "must be a number of tokens or \"inf\"",
            )
        })?),
    };
    let tools = match kept.remove("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(t),
        Some(_) => {
            return Err(refuse(
                "invalid_value",
                Some(&format!("{what}.tools")),
                "must be a list of function tools",
            ))
        }
    };
    let tool_choice = kept.remove("tool_choice").filter(|c| !c.is_null());
    let truncation = kept.remove("truncation").filter(|t| !t.is_null());
    if let Some(t) = &truncation {
        truncation_of(t, what)?;
    }
    Ok((
        Settings {
            instructions,
            max_output_tokens,
            sampling,
            tools,
            tool_choice,
            truncation,
        },
        kept,
    ))
}

/// A client event, parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    SessionUpdate(Settings),
    ItemCreate {
        previous_item_id: Option<String>,
        item: NewItem,
    },
    ItemDelete {
        item_id: String,
    },
    ItemRetrieve {
        item_id: String,
    },
    /// Keep the first `text_end` characters of an assistant item (an extension; the API's
    /// `audio_end_ms` is for audio).
    ItemTruncate {
        item_id: String,
        text_end: usize,
    },
    ResponseCreate(Settings),
    ResponseCancel {
        response_id: Option<String>,
    },
}

pub(super) fn string_field(obj: &Map<String, Value>, k: &str) -> Result<String, EventError> {
    obj.get(k)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            refuse(
                "missing_required_parameter",
                Some(k),
                format!("`{k}` is required"),
            )
        })
}

/// Parses one text frame: the event and its `event_id` (for errors), or the refusal.
pub fn parse(text: &str) -> (Option<String>, Result<ClientEvent, EventError>) {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return (
                None,
                Err(refuse(
                    "invalid_json",
                    None,
                    format!("malformed event: {e}"),
                )),
            )
        }
    };
    let Value::Object(mut obj) = v else {
        return (
            None,
            Err(refuse("invalid_json", None, "an event is a JSON object")),
        );
    };
    let event_id = obj
        .get("event_id")
        .and_then(Value::as_str)
        .map(str::to_string);
    obj.remove("event_id");
    let kind = obj
        .remove("type")
        .and_then(|t| t.as_str().map(str::to_string))
        .unwrap_or_default();
    (event_id, parse_event(&kind, obj))
}

pub(super) fn parse_event(
    kind: &str,
    mut obj: Map<String, Value>,
) -> Result<ClientEvent, EventError> {
    if AUDIO_EVENTS.contains(&kind) {
        return Err(audio_not_served(Some("type")));
    }
    match kind {
        "session.update" => {
            let session = match obj.remove("session") {
                Some(Value::Object(s)) => s,
                _ => {
                    return Err(refuse(
                        "missing_required_parameter",
                        Some("session"),
                        "`session` is required",
                    ))
                }
            };
            if session.get("audio").is_some_and(|a| !a.is_null()) {
                return Err(audio_not_served(Some("session.audio")));
            }
            let (settings, _) = parse_settings(
                session,
                "session",
                &["truncation"],
                &["type", "model", "audio", "tracing", "include"],
            )?;
            Ok(ClientEvent::SessionUpdate(settings))
        }
        "conversation.item.create" => {
            let item = obj.remove("item").unwrap_or(Value::Null);
            let previous_item_id = obj
                .get("previous_item_id")
                .and_then(Value::as_str)
                .map(str::to_string);
            Ok(ClientEvent::ItemCreate {
                previous_item_id,
                item: parse_item(&item)?,
            })
        }
        "conversation.item.delete" => Ok(ClientEvent::ItemDelete {
            item_id: string_field(&obj, "item_id")?,
        }),
        "conversation.item.retrieve" => Ok(ClientEvent::ItemRetrieve {
            item_id: string_field(&obj, "item_id")?,
        }),
        "conversation.item.truncate" => {
            let item_id = string_field(&obj, "item_id")?;
            match obj.get("content_index").and_then(Value::as_u64) {
                Some(0) | None => {}
                Some(_) => {
                    return Err(refuse(
                        "invalid_value",
                        Some("content_index"),
                        "items of this server have one content part (index 0)",
                    ))
                }
            }
            match obj.get("text_end").and_then(Value::as_u64) {
                Some(n) => Ok(ClientEvent::ItemTruncate {
                    item_id,
                    text_end: n as usize,
                }),
                None if obj.get("audio_end_ms").is_some_and(|a| !a.is_null()) => {
                    Err(audio_not_served(Some("audio_end_ms")))
                }
                None => Err(refuse(
                    "missing_required_parameter",
                    Some("text_end"),
                    "`text_end` (characters of the item's text to keep) is required: this server truncates text",
                )),
            }
        }
        "response.create" => {
            let response = match obj.remove("response") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(r)) => r,
                Some(_) => {
                    return Err(refuse(
                        "invalid_value",
                        Some("response"),
                        "must be an object",
                    ))
                }
            };
            if response.get("audio").is_some_and(|a| !a.is_null()) {
                return Err(audio_not_served(Some("response.audio")));
            }
            match response.get("conversation").and_then(Value::as_str) {
                None | Some("auto") => {}
                Some(_) => return Err(refuse(
                    "invalid_value",
                    Some("response.conversation"),
                    "only \"auto\" is served: every response is part of the session's conversation",
                )),
            }
            if response.get("input").is_some_and(|i| !i.is_null()) {
                return Err(refuse(
                    "unknown_parameter",
                    Some("response.input"),
                    "`input` is not served: add items with conversation.item.create",
                ));
            }
            let (settings, _) = parse_settings(
                response,
                "response",
                &[],
                &["conversation", "metadata", "audio", "input"],
            )?;
            Ok(ClientEvent::ResponseCreate(settings))
        }
        "response.cancel" => Ok(ClientEvent::ResponseCancel {
            response_id: obj
                .get("response_id")
                .and_then(Value::as_str)
                .map(str::to_string),
        }),
        "" => Err(refuse(
            "missing_required_parameter",
            Some("type"),
            "`type` is required",
        )),
        other => Err(refuse(
            "invalid_value",
            Some("type"),
            format!("unknown or unserved event type {other:?} (docs/realtime.md)"),
        )),
    }
}

pub fn chat_params(s: &Settings) -> Result<GenerateParams, EventError> {
    let max_tokens = match &s.max_output_tokens {
        Some(m) => m.limit("max_output_tokens")?,
        None => None,
    };
    let (overflow, retention_ratio) = match &s.truncation {
        Some(t) => {
            let (o, r) = truncation_of(t, "session")?;
            (Some(o), r)
        }
        None => (None, None),
    };
    Ok(GenerateParams {
        max_tokens,
        overflow,
        retention_ratio,
        ..sampling_params(&s.sampling)
    })
}

pub(super) fn sampling_params(s: &Sampling) -> GenerateParams {
    GenerateParams {
        sampling: s.clone(),
        ..GenerateParams::default()
    }
}
