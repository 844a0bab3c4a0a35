//! A response as it streams: `response.create`'s messages and `response.created`, then the
//! session's frames for it (`started`, deltas, `done`, `error`) as the Realtime server events, a
//! message's or a function call's (split out of the text by the tools' `CallParser`), and the
//! item it adds to the conversation when it ends.

use serde_json::{json, Value};

use crate::server::realtime::*;
use crate::server::request::reply::{FinishReason, Usage};
use crate::server::request::tools::{generic_syntax, CallParser, Piece, Tools};
use crate::server::ws::protocol::ServerFrame;
use crate::tokenizer::Message;

impl Realtime {
    /// `response.create`: the messages the items make after the session's `conversation`
    /// (from `replace_from`), the response's id and `response.created`. The caller starts the
    /// turn; its frames then come to `on_frame`.
    pub(super) fn begin_response(
        &mut self,
        settings: &Settings,
        conversation: &[Message],
        tools: Option<&Tools>,
    ) -> Result<(String, usize, Vec<Message>, Value), EventError> {
        if let Some(r) = &self.response {
            return Err(refuse(
                "conversation_already_has_active_response",
                None,
                format!("response {} is still in progress", r.id),
            ));
        }
        self.check_room()?;
        let mut want = Vec::new();
        if let Some(i) = settings.instructions.as_deref().filter(|i| !i.is_empty()) {
            want.push(Message::new("system", i));
        }
        let instructions = !want.is_empty();
        let generic = generic_syntax();
        want.extend(self.messages(tools.map_or(&generic, |t| &t.syntax)));
        let same = want
            .iter()
            .zip(conversation)
            .take_while(|(a, b)| a.role == b.role && a.content == b.content)
            .count();
        if same == want.len() {
            return Err(refuse(
                "invalid_value",
                None,
                "nothing new to respond to: add a user item first (conversation.item.create)",
            ));
        }
        let id = new_id("resp");
        let max = match &settings.max_output_tokens {
            Some(MaxTokens::Count(n)) => json!(n),
            _ => json!("inf"),
        };
        self.response = Some(InFlight {
            id: id.clone(),
            item_id: new_id("item"),
            previous: self.items.last().map(|i| i.id.clone()),
            text: String::new(),
            output: None,
            calls: tools.map(CallParser::new),
            max_output_tokens: max.clone(),
            item_messages: self.item_messages(),
            instructions,
        });
        let created = self.event(
            "response.created",
            json!({"response": self.response_json(&id, "in_progress", Value::Null, vec![], Value::Null, max)}),
        );
        Ok((id, same, want.split_off(same), created))
    }

    fn response_json(
        &self,
        id: &str,
        status: &str,
        details: Value,
        output: Vec<Value>,
        usage: Value,
        max: Value,
    ) -> Value {
        json!({"object": "realtime.response", "id": id, "status": status,
            "status_details": details, "output": output, "usage": usage,
            "conversation_id": format!("conv_{}", &self.session_id[5..]),
            "output_modalities": ["text"], "max_output_tokens": max})
    }

    /// The Realtime events for one of the session's frames (an empty list for frames this
    /// dialect has no event for).
    pub fn on_frame(&mut self, frame: &ServerFrame) -> Vec<Value> {
        let mut out = Vec::new();
        if let ServerFrame::Started {
            id,
            truncated: Some(t),
            ..
        } = frame
        {
            if self.is_active(id) {
                out.extend(self.drop_items(t.from, t.messages));
            }
        }
        match frame {
            ServerFrame::Ready { .. } => out.push(self.created()),
            // Without tools the reply is a message from its first token.
            ServerFrame::Started { id, .. }
                if self.is_active(id)
                    && self.response.as_ref().is_some_and(|r| r.calls.is_none()) =>
            {
                self.announce(None, &mut out);
            }
            ServerFrame::Delta { id, text, .. } if self.is_active(id) => {
                let Some(r) = self.response.as_mut() else {
                    return out;
                };
                let pieces = match r.calls.as_mut() {
                    Some(p) => p.feed(text),
                    None => vec![Piece::Text(text.clone())],
                };
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => {
                            self.announce(None, &mut out);
                            self.delta("response.output_text.delta", t, &mut out);
                        }
                        Piece::CallStart { index: 0, name } => {
                            let call_id = new_id("call");
                            self.announce(Some(Function::Call { call_id, name }), &mut out);
                        }
                        // One call per response (`Rules::tools`).
                        Piece::CallStart { .. } => {}
                        Piece::Arguments { index: 0, text } => {
                            self.delta("response.function_call_arguments.delta", text, &mut out)
                        }
                        Piece::Arguments { .. } => {}
                    }
                }
            }
            ServerFrame::Done {
                id,
                finish_reason,
                usage,
                ..
            } if self.is_active(id) => {
                let Some(r) = self.response.take() else {
                    return out;
                };
                out.extend(self.finish(r, *finish_reason, usage));
            }
            ServerFrame::Error {
                id,
                error_type,
                message,
            } => {
                let e = EventError {
                    code: static_code(error_type),
                    message: message.clone(),
                    param: None,
                };
                out.push(self.error(&e));
                if id.as_deref().is_some_and(|i| self.is_active(i)) {
                    if let Some(r) = self.response.take() {
                        let details =
                            json!({"type": "failed", "error": {"type": e.code, "code": e.code}});
                        let body = self.response_json(
                            &r.id,
                            "failed",
                            details,
                            vec![],
                            Value::Null,
                            r.max_output_tokens,
                        );
                        out.push(self.event("response.done", json!({ "response": body })));
                    }
                }
            }
            _ => {}
        }
        out
    }

    fn is_active(&self, id: &str) -> bool {
        self.response.as_ref().is_some_and(|r| r.id == id)
    }

    /// Announces the response's output item (once): a message, or a function call.
    fn announce(&mut self, function: Option<Function>, out: &mut Vec<Value>) {
        let Some(r) = self.response.as_mut().filter(|r| r.output.is_none()) else {
            return;
        };
        r.output = Some(function.clone());
        let (rid, iid, prev) = (r.id.clone(), r.item_id.clone(), r.previous.clone());
        let item = match &function {
            Some(Function::Call { call_id, name }) => {
                json!({"id": iid, "object": "realtime.item", "type": "function_call",
                    "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""})
            }
            _ => json!({"id": iid, "object": "realtime.item", "type": "message",
                "status": "in_progress", "role": "assistant", "content": []}),
        };
        out.push(self.event(
            "response.output_item.added",
            json!({"response_id": rid, "output_index": 0, "item": item}),
        ));
        out.push(self.event(
            "conversation.item.added",
            json!({"previous_item_id": prev, "item": item}),
        ));
        if function.is_none() {
            out.push(self.event(
                "response.content_part.added",
                json!({"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0,
                    "part": {"type": "text", "text": ""}}),
            ));
        }
    }

    /// More of the output item's text: `kind` is the text or the call arguments' delta event.
    fn delta(&mut self, kind: &str, text: String, out: &mut Vec<Value>) {
        let Some(r) = self.response.as_mut() else {
            return;
        };
        r.text.push_str(&text);
        let mut body = json!({"response_id": r.id, "item_id": r.item_id, "output_index": 0,
            "delta": text});
        match &r.output {
            Some(Some(Function::Call { call_id, .. })) => body["call_id"] = json!(call_id),
            _ => body["content_index"] = json!(0),
        }
        out.push(self.event(kind, body));
    }

    /// The closing events of a response, and its item added to the conversation.
    fn finish(&mut self, r: InFlight, reason: FinishReason, usage: &Usage) -> Vec<Value> {
        let mut out = Vec::new();
        let function = r.output.clone().flatten();
        let item = Item {
            id: r.item_id.clone(),
            role: "assistant".into(),
            text: r.text.clone(),
            function: function.clone(),
        };
        let (status, details) = match reason {
            FinishReason::Stop => ("completed", Value::Null),
            FinishReason::Length => (
                "incomplete",
                json!({"type": "incomplete", "reason": "max_output_tokens"}),
            ),
            FinishReason::Cancelled => (
                "cancelled",
                json!({"type": "cancelled", "reason": "client_cancelled"}),
            ),
            FinishReason::Shutdown => (
                "incomplete",
                json!({"type": "incomplete", "reason": "server_shutdown"}),
            ),
        };
        let item_status = if status == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        if r.output.is_none() {
            // Ended before its first piece (cancelled, or nothing written): no item was
            // announced.
            let body = self.response_json(
                &r.id,
                status,
                details,
                vec![],
                usage_json(usage),
                r.max_output_tokens,
            );
            out.push(self.event("response.done", json!({ "response": body })));
            return out;
        }
        let (rid, iid) = (r.id.clone(), r.item_id.clone());
        if let Some(Function::Call { call_id, name }) = &function {
            out.push(self.event(
                "response.function_call_arguments.done",
                json!({"response_id": rid, "item_id": iid, "output_index": 0, "call_id": call_id,
                    "name": name, "arguments": r.text}),
            ));
        } else {
            out.push(self.event(
                "response.output_text.done",
                json!({"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0, "text": r.text}),
            ));
            out.push(self.event(
                "response.content_part.done",
                json!({"response_id": rid, "item_id": iid, "output_index": 0, "content_index": 0,
                    "part": {"type": "text", "text": r.text}}),
            ));
        }
        let json = item.to_json(item_status);
        out.push(self.event(
            "response.output_item.done",
            json!({"response_id": rid, "output_index": 0, "item": json}),
        ));
        out.push(self.event(
            "conversation.item.done",
            json!({"previous_item_id": r.previous, "item": json}),
        ));
        self.items.push(item);
        let body = self.response_json(
            &rid,
            status,
            details,
            vec![json],
            usage_json(usage),
            r.max_output_tokens,
        );
        out.push(self.event("response.done", json!({ "response": body })));
        out
    }
}

/// A session's error frame's type as a Realtime error code (`ErrorKind::wire`, the one table).
fn static_code(error_type: &str) -> &'static str {
    crate::server::request::ErrorKind::from_ws(error_type)
        .map_or("server_error", |k| k.wire().realtime)
}
