//! OpenAI's Realtime API (text) on a WebSocket session: `/v1/realtime` (docs/realtime.md).
//!
//! A Realtime connection is a session like `/ws`'s (the same actor, principal and tenant rules,
//! KV lease, limits, rate limits and metrics); this module is the dialect at its edge. It parses
//! the client events the official SDKs send (`session.update`, `conversation.item.*`,
//! `response.create`, `response.cancel`) into what the session does, keeps the conversation as
//! the client sees it (items with ids), and turns the session's replies (`started`, `delta`,
//! `done`, `error`) into the Realtime server events (`response.created`, the output item and
//! content part events, `response.output_text.delta`, `response.done` with usage). Audio is not
//! served: its events and modalities get an `error` that says so.
//!
//! The items are the conversation; the session's conversation (what its KV holds) follows them.
//! At `response.create` the messages the items make (the instructions as a system message first)
//! are compared with the session's: the reply replaces the session's conversation from the first
//! message that differs, so deleting or truncating an item costs a prefill from there, and
//! everything before it stays cached. Written by hand: no Rust crate serves this protocol.
//!
//! This file holds the conversation's items and the client events; `events` parses them, and
//! `response` streams a response's events.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::sampler::SamplingOverrides;
use crate::server::gate::tenants::Roles;
use crate::server::request::reply::Usage;
use crate::server::request::tools::{write_call, CallParser, Shape, Tools};
use crate::server::request::{Dialect, Field, GenerateParams, RequestError};
use crate::server::state::SessionConfig;
use crate::tokenizer::{CallSyntax, Message};

mod events;
mod response;

pub use events::*;

/// A conversation item as the client sees it: a message, or with `function` a function call
/// (`text` its arguments) or a call's output (`text` the output).
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub id: String,
    pub role: String,
    pub text: String,
    pub function: Option<Function>,
}

impl Item {
    /// The item as a chat message: a call as the text a model that writes calls as `syntax`
    /// writes it, an output as the function's result (`Tools::result_message`).
    pub fn message(&self, syntax: &CallSyntax) -> Message {
        match &self.function {
            None => Message::new(&self.role, &self.text),
            Some(Function::Call { name, .. }) => {
                Message::new("assistant", &write_call(syntax, name, &self.text))
            }
            Some(Function::Output { name, .. }) => Tools::result_message(name, &self.text),
        }
    }

    fn to_json(&self, status: &str) -> Value {
        match &self.function {
            Some(Function::Call { call_id, name }) => {
                return json!({"id": self.id, "object": "realtime.item", "type": "function_call",
                    "status": status, "call_id": call_id, "name": name, "arguments": self.text})
            }
            Some(Function::Output { call_id, .. }) => {
                return json!({"id": self.id, "object": "realtime.item",
                    "type": "function_call_output", "status": status, "call_id": call_id,
                    "output": self.text})
            }
            None => {}
        }
        let part = if self.role == "assistant" {
            json!({"type": "output_text", "text": self.text})
        } else {
            json!({"type": "input_text", "text": self.text})
        };
        json!({"id": self.id, "object": "realtime.item", "type": "message", "status": status,
            "role": self.role, "content": [part]})
    }
}

/// The response being generated.
#[derive(Debug, Clone)]
struct InFlight {
    id: String,
    item_id: String,
    /// The item it follows, for `previous_item_id`.
    previous: Option<String>,
    /// The message's text or the call's arguments.
    text: String,
    /// The output item announced (`response.output_item.added`): `None` before the first
    /// token, or with tools before the reply shows whether it is text or a call.
    output: Option<Option<Function>>,
    /// With tools the reply may call: its text split into text and a call as it streams.
    calls: Option<CallParser>,
    max_output_tokens: Value,
    /// The items its prompt was built from, each with the index of the message it made there
    /// (after the instructions): the overflow policy names dropped turns by message.
    item_messages: Vec<(String, usize)>,
    /// Its conversation began with the instructions' system message.
    instructions: bool,
}

/// What a session allows its client, as the Realtime checks need it: the limits and sampling
/// defaults of every session, and the roles this client may send.
pub struct Rules<'a> {
    pub session: &'a SessionConfig,
    pub roles: Roles,
    /// How the model's template writes a function call (`None`: the generic format).
    pub syntax: Option<&'a crate::tokenizer::CallSyntax>,
}

impl Rules<'_> {
    /// An item the client may add to a conversation whose items hold `chars_held` characters: a
    /// role it may send, within the message limit, all items within what one `/ws` chat frame
    /// may carry.
    fn check_item(&self, item: &NewItem, chars_held: usize) -> Result<(), EventError> {
        let limits = &self.session.limits;
        let chars = item.text.chars().count();
        let total = chars_held + chars;
        let cap = limits.max_message_chars * limits.max_messages;
        self.roles
            .check(0, &item.role)
            .map_err(|e| invalid_value("item.role", e))?;
        (limits)
            .check_message_chars(Field::Wire("item.content".into()), &item.text)
            .map_err(|e| invalid_value("item.content", e))?;
        if total > cap {
            return Err(refuse(
                "invalid_value",
                Some("item.content"),
                format!("the conversation's items would hold {total} characters; at most {cap} (limits.max_message_chars x limits.max_messages): delete older items"),
            ));
        }
        Ok(())
    }

    /// The sampling parameters and `max_output_tokens` are checked by the request seam's rules
    /// (`Limits::settings`, the field named as the Realtime API names it); instructions are a
    /// system message: the client must be allowed to send one, within the message limit.
    fn check_settings(&self, s: &Settings, what: &str) -> Result<(), EventError> {
        let cfg = self.session;
        let params = chat_params(s)?;
        let checked = (cfg.limits)
            .settings(&params, &cfg.sampling, cfg.default_max_tokens)
            .and_then(|_| {
                (cfg.limits).overflow(params.overflow.as_deref(), params.retention_ratio)
            });
        if let Err(e) = checked {
            let param = match &e {
                RequestError::InvalidParam { field, .. } => field.name(Dialect::Realtime(what)),
                _ => what.to_string(),
            };
            return Err(invalid_value(&param, e));
        }
        let Some(i) = &s.instructions else {
            return Ok(());
        };
        let param = format!("{what}.instructions");
        if !self.roles.allows("system") {
            return Err(refuse(
                "invalid_value",
                Some(&param),
                format!(
                    "instructions are a system message, which this client may not send (allowed: {})",
                    self.roles.names()
                ),
            ));
        }
        (cfg.limits)
            .check_message_chars(Field::Wire(param.clone()), i)
            .map_err(|e| invalid_value(&param, e))
    }

    /// The function tools of `s` (`what` the event's object), checked as every dialect's are
    /// (`Tools::parse`); one call per response (a response is one output item).
    fn tools(&self, s: &Settings, what: &str) -> Result<Option<Tools>, EventError> {
        Tools::parse(
            s.tools.as_deref(),
            s.tool_choice.as_ref(),
            Some(false),
            self.session.limits.max_schema_bytes,
            Shape::Flat,
        )
        .map(|t| t.map(|t| t.for_template(self.syntax)))
        .map_err(|e| {
            let param = match &e {
                RequestError::InvalidParam { field, .. } => {
                    format!("{what}.{}", field.name(Dialect::OpenAi))
                }
                _ => format!("{what}.tools"),
            };
            invalid_value(&param, e)
        })
    }
}

/// What the session does for a client event.
#[derive(Debug)]
pub enum Action {
    /// Send these events.
    Send(Vec<Value>),
    /// Send `created`, then start the turn: `messages` replace the session's conversation from
    /// message `from`; the response id is the turn's id; `tools` the functions declared (which
    /// it may call unless their choice is `none`).
    Start {
        id: String,
        from: usize,
        messages: Vec<Message>,
        params: Box<GenerateParams>,
        tools: Option<std::sync::Arc<Tools>>,
        created: Value,
    },
    /// Cancel the response in flight, this one (`response.done` follows when its reply ends).
    Cancel(String),
}

/// The Realtime dialect's state in a session.
#[derive(Debug)]
pub struct Realtime {
    session_id: String,
    model: String,
    settings: Settings,
    items: Vec<Item>,
    /// `MAX_ITEMS` but in tests, which try the bound with a few items.
    max_items: usize,
    response: Option<InFlight>,
    /// The `event_id` of the client event being handled, for the `error` it may cause.
    client_event: Option<String>,
    next_id: u64,
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// The `usage` of a `response.done`.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "input_token_details": {
            "text_tokens": u.prompt_tokens,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": u.cached_tokens,
            "cached_tokens_details": {"text_tokens": u.cached_tokens, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": 0},
    })
}

impl Realtime {
    pub fn new(model: String) -> Self {
        Realtime {
            session_id: new_id("sess"),
            model,
            settings: Settings::default(),
            items: Vec::new(),
            max_items: MAX_ITEMS,
            response: None,
            client_event: None,
            next_id: 0,
        }
    }

    /// A conversation of at most `max_items` items (the fuzz harness reaches the bound with few
    /// events).
    pub fn with_max_items(model: String, max_items: usize) -> Self {
        Realtime {
            max_items,
            ..Realtime::new(model)
        }
    }

    fn event(&mut self, kind: &str, mut body: Value) -> Value {
        self.next_id += 1;
        body["type"] = json!(kind);
        body["event_id"] = json!(format!(
            "event_{}_{}",
            &self.session_id[5..13],
            self.next_id
        ));
        body
    }

    /// One client event (a text frame), checked against `rules`, on a session whose KV holds
    /// `conversation` and which is `busy` with a reply (in flight or being prepared). What the
    /// session does, or the refusal to send as an `error` event (`error`).
    pub fn handle(
        &mut self,
        text: &str,
        rules: &Rules,
        conversation: &[Message],
        busy: bool,
    ) -> Result<Action, EventError> {
        let (event_id, parsed) = parse(text);
        self.client_event = event_id;
        match parsed? {
            ClientEvent::SessionUpdate(s) => {
                rules.check_settings(&s, "session")?;
                // The tools as they will be (a `tool_choice` may name a tool sent before).
                rules.tools(&self.settings.clone().updated(s.clone()), "session")?;
                Ok(Action::Send(vec![self.update(s)]))
            }
            ClientEvent::ItemCreate {
                previous_item_id,
                item,
            } => {
                rules.check_item(&item, self.total_chars())?;
                self.create_item(previous_item_id, item).map(Action::Send)
            }
            ClientEvent::ItemDelete { item_id } => {
                Ok(Action::Send(vec![self.delete_item(&item_id)?]))
            }
            ClientEvent::ItemRetrieve { item_id } => {
                Ok(Action::Send(vec![self.retrieve_item(&item_id)?]))
            }
            ClientEvent::ItemTruncate { item_id, text_end } => {
                Ok(Action::Send(vec![self.truncate_item(&item_id, text_end)?]))
            }
            ClientEvent::ResponseCreate(r) => {
                rules.check_settings(&r, "response")?;
                if busy {
                    return Err(refuse(
                        "conversation_already_has_active_response",
                        None,
                        format!(
                            "response {} is still in progress",
                            self.active().unwrap_or_default()
                        ),
                    ));
                }
                let settings = self.for_response(&r);
                let params = chat_params(&settings)?;
                let tools = rules.tools(&settings, "response")?;
                let active = tools.as_ref().filter(|t| t.active());
                let (id, from, messages, created) =
                    self.begin_response(&settings, conversation, active)?;
                Ok(Action::Start {
                    id,
                    from,
                    messages,
                    params: Box::new(params),
                    tools: tools.map(std::sync::Arc::new),
                    created,
                })
            }
            ClientEvent::ResponseCancel { response_id } => match (self.active(), response_id) {
                (None, _) => Err(refuse(
                    "response_cancel_not_active",
                    None,
                    "no response is in progress",
                )),
                (Some(a), Some(r)) if a != r => Err(refuse(
                    "invalid_value",
                    Some("response_id"),
                    format!("response {r:?} is not in progress ({a} is)"),
                )),
                (Some(a), _) => Ok(Action::Cancel(a.to_string())),
            },
        }
    }

    /// An `error` event for the client event being handled.
    pub fn error(&mut self, e: &EventError) -> Value {
        let kind = match e.code {
            "server_error" => "server_error",
            _ => "invalid_request_error",
        };
        let error = json!({"type": kind, "code": e.code, "message": e.message,
            "param": e.param, "event_id": self.client_event});
        self.event("error", json!({ "error": error }))
    }

    fn session_json(&self) -> Value {
        let s = &self.settings;
        let max = match &s.max_output_tokens {
            Some(MaxTokens::Count(n)) => json!(n),
            _ => json!("inf"),
        };
        let mut v = json!({
            "type": "realtime", "object": "realtime.session", "id": self.session_id,
            "model": self.model, "output_modalities": ["text"],
            "instructions": s.instructions.clone().unwrap_or_default(),
            "max_output_tokens": max, "tools": s.tools.clone().unwrap_or_default(),
            "tool_choice": s.tool_choice.clone().unwrap_or(json!("auto")),
        });
        if let (Some(v), Some(t)) = (v.as_object_mut(), &s.truncation) {
            v.insert("truncation".into(), t.clone());
        }
        let extras = serde_json::to_value(&s.sampling).unwrap_or_default();
        if let (Some(v), Value::Object(extras)) = (v.as_object_mut(), extras) {
            for (k, x) in extras {
                if !x.is_null() {
                    v.insert(k, x);
                }
            }
        }
        v
    }

    /// `session.created`, the connection's first event.
    pub fn created(&mut self) -> Value {
        let session = self.session_json();
        self.event("session.created", json!({ "session": session }))
    }

    /// `session.update`: validated against the server's limits by the caller.
    fn update(&mut self, s: Settings) -> Value {
        self.settings = std::mem::take(&mut self.settings).updated(s);
        let session = self.session_json();
        self.event("session.updated", json!({ "session": session }))
    }

    /// The settings in force for a response asking for `r`.
    fn for_response(&self, r: &Settings) -> Settings {
        self.settings.clone().updated(r.clone())
    }

    fn position(&self, id: &str) -> Result<usize, EventError> {
        self.items.iter().position(|i| i.id == id).ok_or_else(|| {
            refuse(
                "item_not_found",
                Some("item_id"),
                format!("no item {id:?} in the conversation"),
            )
        })
    }

    /// `conversation.item.create`: the item goes after `previous_item_id` (the end without it;
    /// "root" for the start). The events to send.
    fn create_item(
        &mut self,
        previous: Option<String>,
        item: NewItem,
    ) -> Result<Vec<Value>, EventError> {
        let at = match previous.as_deref() {
            None => self.items.len(),
            Some("root") => 0,
            Some(p) => {
                self.position(p).map_err(|mut e| {
                    e.param = Some("previous_item_id".into());
                    e
                })? + 1
            }
        };
        self.check_room()?;
        let id = item.id.unwrap_or_else(|| new_id("item"));
        if self.items.iter().any(|i| i.id == id) {
            return Err(refuse(
                "invalid_value",
                Some("item.id"),
                format!("an item {id:?} is already in the conversation"),
            ));
        }
        let function = match item.function {
            // An output answers a call of the conversation: the model reads it with the
            // function's name.
            Some(Function::Output { call_id, .. }) => {
                let name = self.items.iter().find_map(|i| match &i.function {
                    Some(Function::Call { call_id: c, name }) if *c == call_id => Some(name),
                    _ => None,
                });
                let Some(name) = name.cloned() else {
                    return Err(refuse(
                        "invalid_value",
                        Some("item.call_id"),
                        format!(
                            "no function_call item with call_id {call_id:?} in the conversation"
                        ),
                    ));
                };
                Some(Function::Output { call_id, name })
            }
            f => f,
        };
        let new = Item {
            id,
            role: item.role,
            text: item.text,
            function,
        };
        let prev = at.checked_sub(1).map(|p| self.items[p].id.clone());
        let json = new.to_json("completed");
        self.items.insert(at, new);
        Ok(vec![
            self.event(
                "conversation.item.added",
                json!({"previous_item_id": prev, "item": json}),
            ),
            self.event(
                "conversation.item.done",
                json!({"previous_item_id": prev, "item": json}),
            ),
        ])
    }

    fn delete_item(&mut self, id: &str) -> Result<Value, EventError> {
        self.check_not_generating(id)?;
        let at = self.position(id)?;
        self.items.remove(at);
        Ok(self.event("conversation.item.deleted", json!({ "item_id": id })))
    }

    fn retrieve_item(&mut self, id: &str) -> Result<Value, EventError> {
        let at = self.position(id)?;
        let item = self.items[at].to_json("completed");
        Ok(self.event("conversation.item.retrieved", json!({ "item": item })))
    }

    /// Keeps the first `text_end` characters of assistant item `id` (what the user heard).
    fn truncate_item(&mut self, id: &str, text_end: usize) -> Result<Value, EventError> {
        self.check_not_generating(id)?;
        let at = self.position(id)?;
        let item = &mut self.items[at];
        if item.role != "assistant" || item.function.is_some() {
            return Err(refuse(
                "invalid_value",
                Some("item_id"),
                "only assistant messages can be truncated",
            ));
        }
        let chars = item.text.chars().count();
        if text_end > chars {
            return Err(refuse(
                "invalid_value",
                Some("text_end"),
                format!("is {text_end}; the item has {chars} characters"),
            ));
        }
        item.text = item.text.chars().take(text_end).collect();
        Ok(self.event(
            "conversation.item.truncated",
            json!({"item_id": id, "content_index": 0, "audio_end_ms": 0, "text_end": text_end}),
        ))
    }

    /// Refuses a new item when the conversation is full; a response in flight holds the place
    /// its item will take.
    fn check_room(&self) -> Result<(), EventError> {
        if self.held() >= self.max_items {
            return Err(refuse(
                "invalid_value",
                Some("item"),
                format!(
                    "the conversation holds {} items, the most it may (a response in progress counts as one): delete older items",
                    self.max_items
                ),
            ));
        }
        Ok(())
    }

    fn check_not_generating(&self, id: &str) -> Result<(), EventError> {
        if self.response.as_ref().is_some_and(|r| r.item_id == id) {
            return Err(refuse(
                "conversation_already_has_active_response",
                Some("item_id"),
                "the item is being generated: cancel the response first (response.cancel)",
            ));
        }
        Ok(())
    }

    /// The conversation as the client sees it.
    pub fn items(&self) -> &[Item] {
        &self.items
    }

    /// Each item's id and the index of the message it makes in `messages` (calls in a row
    /// share one).
    fn item_messages(&self) -> Vec<(String, usize)> {
        let mut out = Vec::with_capacity(self.items.len());
        let (mut next, mut calls) = (0, false);
        for i in &self.items {
            let call = matches!(i.function, Some(Function::Call { .. }));
            if !(call && calls) {
                next += 1;
            }
            out.push((i.id.clone(), next - 1));
            calls = call;
        }
        out
    }

    /// The turns a response's prompt left out (`started.truncated`: `messages` from message
    /// `from` of its conversation, the instructions first): their items leave the conversation,
    /// each with `conversation.item.deleted`.
    fn drop_items(&mut self, from: usize, messages: usize) -> Vec<Value> {
        let Some(r) = &self.response else {
            return Vec::new();
        };
        let lead = usize::from(r.instructions);
        let range = from.saturating_sub(lead)..(from + messages).saturating_sub(lead);
        let gone: std::collections::HashSet<String> = (r.item_messages.iter())
            .filter(|(_, m)| range.contains(m))
            .map(|(id, _)| id.clone())
            .collect();
        let mut events = Vec::new();
        for id in self
            .items
            .iter()
            .map(|i| &i.id)
            .filter(|id| gone.contains(*id))
        {
            events.push(id.clone());
        }
        self.items.retain(|i| !gone.contains(&i.id));
        events
            .into_iter()
            .map(|id| self.event("conversation.item.deleted", json!({ "item_id": id })))
            .collect()
    }

    /// The chat messages the items make: each item a message, but calls in a row one assistant
    /// message (joined as a model that writes calls as `syntax` writes several).
    pub fn messages(&self, syntax: &CallSyntax) -> Vec<Message> {
        let mut out: Vec<Message> = Vec::new();
        let mut calls = false;
        for i in &self.items {
            let m = i.message(syntax);
            let call = matches!(i.function, Some(Function::Call { .. }));
            match out.last_mut() {
                Some(last) if call && calls => {
                    last.content
                        .push_str(syntax.separator.as_deref().unwrap_or("\n"));
                    last.content.push_str(&m.content);
                }
                _ => out.push(m),
            }
            calls = call;
        }
        out
    }

    /// Items, counting the one a response in flight will add.
    pub fn held(&self) -> usize {
        self.items.len() + usize::from(self.response.is_some())
    }

    /// The invariants (for tests and the fuzz harness): at most `max_items` items counting the
    /// one a response in flight will add, each with a valid id of its own and a role the API
    /// has, and the response's item not among them yet.
    pub fn check(&self) -> Result<(), String> {
        if self.held() > self.max_items {
            return Err(format!(
                "{} items held, at most {}",
                self.held(),
                self.max_items
            ));
        }
        let mut ids = std::collections::HashSet::new();
        for i in &self.items {
            if !crate::server::gate::tenants::valid_id(&i.id) || !ids.insert(i.id.as_str()) {
                return Err(format!("item id {:?} invalid or repeated", i.id));
            }
            if !["user", "assistant", "system"].contains(&i.role.as_str()) {
                return Err(format!("item {:?} has role {:?}", i.id, i.role));
            }
        }
        if let Some(r) = &self.response {
            if ids.contains(r.item_id.as_str()) {
                return Err(format!("response item {:?} already an item", r.item_id));
            }
        }
        Ok(())
    }

    /// Characters in all items (bounded by the session).
    fn total_chars(&self) -> usize {
        self.items.iter().map(|i| i.text.chars().count()).sum()
    }

    /// The response in flight's id.
    pub fn active(&self) -> Option<&str> {
        self.response.as_ref().map(|r| r.id.as_str())
    }
}

/// A seam error as an `invalid_value` event naming `param`: the rule alone, the field being
/// named by `param`.
fn invalid_value(param: &str, e: RequestError) -> EventError {
    let message = match e {
        RequestError::InvalidParam { reason, .. } => reason,
        other => other.to_string(),
    };
    refuse("invalid_value", Some(param), message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::request::reply::FinishReason;
    use crate::server::request::tools::ToolChoice;
    use crate::server::ws::protocol::ServerFrame;

    fn user(rt: &mut Realtime, text: &str) -> String {
        let ev = rt
            .create_item(
                None,
                NewItem {
                    id: None,
                    role: "user".into(),
                    text: text.into(),
                    function: None,
                },
            )
            .unwrap();
        ev[1]["item"]["id"].as_str().unwrap().to_string()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    /// Runs a response through the frames the session would send, keeping `conversation` as the
    /// session would; the events.
    fn respond(rt: &mut Realtime, conversation: &mut Vec<Message>, reply: &[&str]) -> Vec<Value> {
        let settings = rt.for_response(&Settings::default());
        let (id, from, new, created) = rt.begin_response(&settings, conversation, None).unwrap();
        conversation.truncate(from);
        conversation.extend(new);
        let mut out = vec![created];
        out.extend(rt.on_frame(&ServerFrame::Started {
            id: id.clone(),
            prompt_tokens: 30,
            cached_tokens: 12,
            truncated: None,
        }));
        for (i, t) in reply.iter().enumerate() {
            out.extend(rt.on_frame(&ServerFrame::Delta {
                id: id.clone(),
                index: i,
                text: t.to_string(),
            }));
        }
        out.extend(rt.on_frame(&ServerFrame::Done {
            id,
            finish_reason: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 30,
                completion_tokens: reply.len(),
                cached_tokens: 12,
                ..Usage::default()
            },
            timings: Default::default(),
            seal: None,
        }));
        conversation.push(Message::new("assistant", &reply.concat()));
        out
    }

    #[test]
    fn a_response_streams_the_spec_events_in_order_and_its_item_joins_the_conversation() {
        let mut rt = Realtime::new("m".into());
        let mut conv = Vec::new();
        user(&mut rt, "Hi");
        let ev = respond(&mut rt, &mut conv, &["Hel", "lo"]);
        assert_eq!(
            types(&ev),
            [
                "response.created",
                "response.output_item.added",
                "conversation.item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "conversation.item.done",
                "response.done",
            ]
        );
        let done = &ev[10]["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["usage"]["input_token_details"]["cached_tokens"], 12);
        assert_eq!(done["usage"]["total_tokens"], 32);
        assert_eq!(ev[6]["text"], "Hello");
        // Every event has its own id.
        let ids: std::collections::HashSet<_> = ev.iter().map(|e| e["event_id"].clone()).collect();
        assert_eq!(ids.len(), ev.len());
        assert_eq!(rt.items.len(), 2);
        assert_eq!(rt.items[1].text, "Hello");
        assert!(rt.active().is_none());
    }

    #[test]
    fn a_response_replaces_the_session_conversation_from_the_first_item_that_differs() {
        let mut rt = Realtime::new("m".into());
        let mut conv = Vec::new();
        rt.update(Settings {
            instructions: Some("Be brief.".into()),
            ..Default::default()
        });
        let first = user(&mut rt, "One");
        respond(&mut rt, &mut conv, &["A"]);
        user(&mut rt, "Two");
        // Only the new item is sent; the rest is the session's already.
        let s = rt.for_response(&Settings::default());
        let (id, from, new, _) = rt.begin_response(&s, &conv, None).unwrap();
        assert_eq!(from, 3);
        assert_eq!(new, vec![Message::new("user", "Two")]);
        rt.on_frame(&ServerFrame::Error {
            id: Some(id),
            error_type: "overloaded".into(),
            message: "full".into(),
        });
        // Deleting the first item replaces from it.
        rt.delete_item(&first).unwrap();
        let (_, from, new, _) = rt.begin_response(&s, &conv, None).unwrap();
        assert_eq!(from, 1);
        assert_eq!(
            new,
            vec![Message::new("assistant", "A"), Message::new("user", "Two")]
        );
    }

    #[test]
    fn per_response_instructions_replace_the_system_message_and_nothing_new_is_refused() {
        let mut rt = Realtime::new("m".into());
        let mut conv = Vec::new();
        user(&mut rt, "One");
        respond(&mut rt, &mut conv, &["A"]);
        let s = rt.for_response(&Settings::default());
        let e = rt.begin_response(&s, &conv, None).unwrap_err();
        assert!(e.message.contains("nothing new"), "{e:?}");
        let s = rt.for_response(&Settings {
            instructions: Some("Answer in French.".into()),
            ..Default::default()
        });
        let (_, from, new, _) = rt.begin_response(&s, &conv, None).unwrap();
        assert_eq!(from, 0);
        assert_eq!(new[0], Message::new("system", "Answer in French."));
        assert_eq!(new.len(), 3);
    }

    #[test]
    fn a_failed_or_cancelled_response_says_so_in_response_done() {
        let mut rt = Realtime::new("m".into());
        user(&mut rt, "One");
        let s = rt.for_response(&Settings::default());
        let (id, ..) = rt.begin_response(&s, &[], None).unwrap();
        let ev = rt.on_frame(&ServerFrame::Error {
            id: Some(id),
            error_type: "prompt_too_long".into(),
            message: "too long".into(),
        });
        assert_eq!(types(&ev), ["error", "response.done"]);
        assert_eq!(ev[0]["error"]["code"], "prompt_too_long");
        assert_eq!(ev[1]["response"]["status"], "failed");
        assert_eq!(rt.items.len(), 1, "no item for a failed response");
        // Cancelled before its first token: response.done alone.
        let (id, ..) = rt.begin_response(&s, &[], None).unwrap();
        let ev = rt.on_frame(&ServerFrame::Done {
            id,
            finish_reason: FinishReason::Cancelled,
            usage: Usage::default(),
            timings: Default::default(),
            seal: None,
        });
        assert_eq!(types(&ev), ["response.done"]);
        assert_eq!(ev[0]["response"]["status"], "cancelled");
    }

    #[test]
    fn items_are_inserted_retrieved_truncated_and_deleted_by_id() {
        let mut rt = Realtime::new("m".into());
        let a = user(&mut rt, "a");
        let c = user(&mut rt, "c");
        let ev = rt
            .create_item(
                Some(a.clone()),
                NewItem {
                    id: Some("b".into()),
                    role: "assistant".into(),
                    text: "bravo".into(),
                    function: None,
                },
            )
            .unwrap();
        assert_eq!(ev[0]["previous_item_id"], a.as_str());
        let order: Vec<_> = rt.items.iter().map(|i| i.text.as_str()).collect();
        assert_eq!(order, ["a", "bravo", "c"]);
        let dup = NewItem {
            id: Some("b".into()),
            role: "user".into(),
            text: "x".into(),
            function: None,
        };
        assert_eq!(
            rt.create_item(None, dup).unwrap_err().param.as_deref(),
            Some("item.id")
        );
        let e = rt.truncate_item("b", 9).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text_end"));
        assert_eq!(
            rt.truncate_item(&c, 0).unwrap_err().param.as_deref(),
            Some("item_id")
        );
        rt.truncate_item("b", 3).unwrap();
        let got = rt.retrieve_item("b").unwrap();
        assert_eq!(got["item"]["content"][0]["text"], "bra");
        assert_eq!(got["item"]["content"][0]["type"], "output_text");
        rt.delete_item("b").unwrap();
        assert_eq!(rt.retrieve_item("b").unwrap_err().code, "item_not_found");
    }

    #[test]
    fn a_conversation_holds_at_most_max_items() {
        let mut rt = Realtime::new("m".into());
        for _ in 0..MAX_ITEMS {
            user(&mut rt, "");
        }
        let more = NewItem {
            id: None,
            role: "user".into(),
            text: String::new(),
            function: None,
        };
        let e = rt.create_item(None, more.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("item"));
        let first = rt.items[0].id.clone();
        rt.delete_item(&first).unwrap();
        rt.create_item(None, more).unwrap();
    }

    /// A response's item counts against `MAX_ITEMS` from the moment it begins: neither a
    /// response on a full conversation nor an item created while one is in flight can take the
    /// conversation past the bound.
    #[test]
    fn responses_never_take_a_conversation_past_max_items() {
        let mut rt = Realtime::new("m".into());
        let mut conv = Vec::new();
        for _ in 0..MAX_ITEMS {
            user(&mut rt, "q");
        }
        let s = rt.for_response(&Settings::default());
        let e = rt.begin_response(&s, &conv, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("item"), "{e:?}");
        let first = rt.items[0].id.clone();
        rt.delete_item(&first).unwrap();
        // One place left: the response takes it, so an item created meanwhile is refused.
        let (id, from, new, _) = rt.begin_response(&s, &conv, None).unwrap();
        conv.truncate(from);
        conv.extend(new);
        let more = NewItem {
            id: None,
            role: "user".into(),
            text: "late".into(),
            function: None,
        };
        let e = rt.create_item(None, more).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("item"), "{e:?}");
        rt.on_frame(&ServerFrame::Started {
            id: id.clone(),
            prompt_tokens: 1,
            cached_tokens: 0,
            truncated: None,
        });
        rt.on_frame(&ServerFrame::Done {
            id,
            finish_reason: FinishReason::Stop,
            usage: Usage::default(),
            timings: Default::default(),
            seal: None,
        });
        assert_eq!(rt.items.len(), MAX_ITEMS);
    }

    #[test]
    fn audio_tools_and_unknown_events_are_refused_with_the_field_named() {
        let code = |t: &str| parse(t).1.unwrap_err();
        let e = code(r#"{"type":"input_audio_buffer.append","audio":"AA","event_id":"e1"}"#);
        assert_eq!(e.code, "audio_not_supported");
        assert_eq!(
            parse(r#"{"type":"input_audio_buffer.commit","event_id":"e1"}"#)
                .0
                .as_deref(),
            Some("e1")
        );
        let e = code(r#"{"type":"session.update","session":{"output_modalities":["audio"]}}"#);
        assert_eq!(e.param.as_deref(), Some("session.output_modalities"));
        let e = code(r#"{"type":"session.update","session":{"tools":{"type":"function"}}}"#);
        assert_eq!(e.param.as_deref(), Some("session.tools"));
        let e = code(r#"{"type":"session.update","session":{"voice":"alloy"}}"#);
        assert_eq!(e.param.as_deref(), Some("session.voice"));
        let e = code(r#"{"type":"session.update","session":{"temperature":"hot"}}"#);
        assert_eq!(e.code, "invalid_value");
        let e = code(
            r#"{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_audio","audio":"AA"}]}}"#,
        );
        assert_eq!(e.param.as_deref(), Some("item.content[0]"));
        let e = code(
            r#"{"type":"conversation.item.create","item":{"type":"function_call","name":"f"}}"#,
        );
        assert_eq!(e.param.as_deref(), Some("item.call_id"));
        let e = code(
            r#"{"type":"conversation.item.create","item":{"type":"function_call","call_id":"c","name":"f","arguments":"[1]"}}"#,
        );
        assert_eq!(e.param.as_deref(), Some("item.arguments"));
        let e = code(r#"{"type":"conversation.item.create","item":{"type":"image"}}"#);
        assert_eq!(e.param.as_deref(), Some("item.type"));
        let e = code(
            r#"{"type":"conversation.item.truncate","item_id":"x","content_index":0,"audio_end_ms":1500}"#,
        );
        assert_eq!(e.code, "audio_not_supported");
        let e = code(r#"{"type":"response.create","response":{"conversation":"none"}}"#);
        assert_eq!(e.param.as_deref(), Some("response.conversation"));
        let e = code(r#"{"type":"transcription_session.update"}"#);
        assert_eq!(e.param.as_deref(), Some("type"));
        assert_eq!(code("not json").code, "invalid_json");
        // What is served parses.
        let ok = parse(r#"{"type":"session.update","session":{"type":"realtime","output_modalities":["text"],"instructions":"Hi","max_output_tokens":"inf","temperature":0,"tracing":null}}"#).1.unwrap();
        let ClientEvent::SessionUpdate(s) = ok else {
            panic!()
        };
        assert_eq!(s.instructions.as_deref(), Some("Hi"));
        assert_eq!(s.sampling.temperature, Some(0.0));
        assert_eq!(chat_params(&s).unwrap().max_tokens, None);
        let ok = parse(r#"{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]}}"#).1.unwrap();
        assert!(matches!(ok, ClientEvent::ItemCreate { item, .. } if item.text == "ab"));
    }

    fn shipped() -> SessionConfig {
        crate::settings::Settings::load(None)
            .expect("the shipped settings load")
            .session_config()
    }

    /// The rules for a client that may send every role, with the generic call format.
    fn any_role(session: &SessionConfig) -> Rules<'_> {
        Rules {
            session,
            roles: Roles::ALL,
            syntax: None,
        }
    }

    #[test]
    fn a_function_call_streams_as_its_item_and_its_output_continues_the_conversation() {
        let session = shipped();
        let rules = any_role(&session);
        let mut rt = Realtime::new("m".into());
        let mut conversation: Vec<Message> = Vec::new();
        let tools = r#"{"type":"session.update","session":{"tools":[{"type":"function","name":"order_status","description":"Looks up an order.","parameters":{"type":"object","properties":{"order":{"type":"string"}},"required":["order"]}}],"tool_choice":"auto"}}"#;
        let Ok(Action::Send(ev)) = rt.handle(tools, &rules, &conversation, false) else {
            panic!("tools accepted")
        };
        assert_eq!(ev[0]["session"]["tools"][0]["name"], "order_status");
        user(&mut rt, "Where is order A-1?");
        let start = rt.handle(
            r#"{"type":"response.create"}"#,
            &rules,
            &conversation,
            false,
        );
        let Ok(Action::Start {
            id,
            from,
            messages,
            tools: Some(t),
            ..
        }) = start
        else {
            panic!("a response with tools: {start:?}")
        };
        assert!(t.active() && !t.parallel && t.choice == ToolChoice::Auto);
        assert!(rt.response.as_ref().is_some_and(|r| r.calls.is_some()));
        conversation.truncate(from);
        conversation.extend(messages);
        // Nothing is announced until the reply shows a call; then the call streams.
        let started = ServerFrame::Started {
            id: id.clone(),
            prompt_tokens: 9,
            cached_tokens: 0,
            truncated: None,
        };
        assert!(rt.on_frame(&started).is_empty());
        let reply = r#"{"name": "order_status", "arguments": {"order": "A-1"}}"#;
        let mut events = Vec::new();
        for (i, piece) in [&reply[..10], &reply[10..40], &reply[40..]]
            .iter()
            .enumerate()
        {
            events.extend(rt.on_frame(&ServerFrame::Delta {
                id: id.clone(),
                index: i,
                text: piece.to_string(),
            }));
        }
        events.extend(rt.on_frame(&ServerFrame::Done {
            id,
            finish_reason: FinishReason::Stop,
            usage: Usage::default(),
            timings: Default::default(),
            seal: None,
        }));
        conversation.push(Message::new("assistant", reply));
        let kinds = types(&events);
        assert_eq!(
            kinds[..2],
            ["response.output_item.added", "conversation.item.added"]
        );
        assert_eq!(events[0]["item"]["type"], "function_call");
        assert_eq!(events[0]["item"]["name"], "order_status");
        let call_id = events[0]["item"]["call_id"].as_str().unwrap().to_string();
        let args: String = (events.iter())
            .filter(|e| e["type"] == "response.function_call_arguments.delta")
            .map(|e| {
                assert_eq!(e["call_id"], call_id.as_str());
                e["delta"].as_str().unwrap()
            })
            .collect();
        assert_eq!(args, r#"{"order": "A-1"}"#);
        let tail = &kinds[kinds.len() - 4..];
        assert_eq!(
            tail,
            [
                "response.function_call_arguments.done",
                "response.output_item.done",
                "conversation.item.done",
                "response.done"
            ]
        );
        let done = events.last().unwrap();
        assert_eq!(done["response"]["output"][0]["arguments"], args.as_str());
        assert_eq!(done["response"]["status"], "completed");
        // The call's output, then a response that continues: the conversation is the session's
        // plus the result, nothing re-sent before it.
        let unknown = r#"{"type":"conversation.item.create","item":{"type":"function_call_output","call_id":"nope","output":"x"}}"#;
        let e = rt
            .handle(unknown, &rules, &conversation, false)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("item.call_id"));
        let output = format!(
            r#"{{"type":"conversation.item.create","item":{{"type":"function_call_output","call_id":"{call_id}","output":"shipped today"}}}}"#
        );
        let Ok(Action::Send(ev)) = rt.handle(&output, &rules, &conversation, false) else {
            panic!("the output is added")
        };
        assert_eq!(ev[1]["item"]["type"], "function_call_output");
        let Ok(Action::Start { from, messages, .. }) = rt.handle(
            r#"{"type":"response.create"}"#,
            &rules,
            &conversation,
            false,
        ) else {
            panic!("a second response")
        };
        assert_eq!(from, conversation.len());
        assert_eq!(
            messages,
            vec![Tools::result_message("order_status", "shipped today")]
        );
        assert!(rt.check().is_ok());
        // A call item can be truncated no more than it can be cut short by a client.
        let call_item = rt.items[1].id.clone();
        assert!(rt.truncate_item(&call_item, 1).is_err());
    }

    /// `session.truncation` is checked when it is set, by the request seam's rule, the field
    /// named as the Realtime API names it.
    #[test]
    fn truncation_is_checked_at_session_update() {
        let session = shipped();
        let rules = any_role(&session);
        let mut rt = Realtime::new("m".into());
        let mut handle = |event: &str| rt.handle(event, &rules, &[], false);
        for (value, param) in [
            (r#""middle""#, "session.truncation"),
            (
                r#"{"type":"retention_ratio","retention_ratio":5}"#,
                "session.truncation.retention_ratio",
            ),
            (
                r#"{"type":"retention_ratio","retention_ratio":0.5,"token_limits":{"post_instructions":100}}"#,
                "session.truncation.token_limits",
            ),
        ] {
            let e = handle(&format!(
                r#"{{"type":"session.update","session":{{"truncation":{value}}}}}"#
            ))
            .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{value}");
        }
        for value in [
            r#""auto""#,
            r#""disabled""#,
            r#"{"type":"retention_ratio","retention_ratio":0.5}"#,
        ] {
            let event =
                format!(r#"{{"type":"session.update","session":{{"truncation":{value}}}}}"#);
            assert!(handle(&event).is_ok(), "{value}");
        }
    }

    #[test]
    fn tools_are_checked_with_the_field_named_as_realtime_names_it() {
        let session = shipped();
        let rules = any_role(&session);
        let mut rt = Realtime::new("m".into());
        let mut refused = |event: &str| rt.handle(event, &rules, &[], false).unwrap_err();
        let e = refused(
            r#"{"type":"session.update","session":{"tools":[{"type":"function","name":"bad name"}]}}"#,
        );
        assert_eq!(e.param.as_deref(), Some("session.tools[0].name"));
        let e = refused(
            r#"{"type":"session.update","session":{"tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"function","name":"g"}}}"#,
        );
        assert_eq!(e.param.as_deref(), Some("session.tool_choice.name"));
        let e =
            refused(r#"{"type":"response.create","response":{"tools":[{"type":"retrieval"}]}}"#);
        assert_eq!(e.param.as_deref(), Some("response.tools[0].type"));
        let e = refused(r#"{"type":"response.create","response":{"tool_choice":"required"}}"#);
        assert_eq!(e.param.as_deref(), Some("response.tool_choice"));
        // A choice naming a tool the session declared before.
        let tools =
            r#"{"type":"session.update","session":{"tools":[{"type":"function","name":"f"}]}}"#;
        assert!(rt.handle(tools, &rules, &[], false).is_ok());
        let named =
            r#"{"type":"session.update","session":{"tool_choice":{"type":"function","name":"f"}}}"#;
        assert!(rt.handle(named, &rules, &[], false).is_ok());
        user(&mut rt, "hi");
        let required = r#"{"type":"response.create","response":{"tool_choice":"required"}}"#;
        let Ok(Action::Start { tools: Some(t), .. }) = rt.handle(required, &rules, &[], false)
        else {
            panic!("a response that must call f")
        };
        assert_eq!(t.choice, ToolChoice::Required);
    }
}
