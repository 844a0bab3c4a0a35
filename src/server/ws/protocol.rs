//! The native WebSocket wire format (JSON text frames tagged by `type`); `docs/protocol.md`
//! documents the frames with examples. A `chat` frame's `params` are the request seam's
//! `GenerateParams`, validated there (`server::request`); the `restore` transcript is this
//! dialect's own and is checked here.

use serde::{Deserialize, Serialize};

use crate::server::request::reply::{FinishReason, Timings, Usage};
use crate::server::request::{Field, GenerateParams, Limits, RequestError};
use crate::tokenizer::Message;

/// Frames a client sends.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientFrame {
    Chat {
        id: String,
        messages: Vec<Message>,
        #[serde(default)]
        params: GenerateParams,
    },
    /// Ends the running reply. With `heard_index`, the conversation keeps only the text of
    /// deltas `0..=heard_index` (what the user saw or heard: barge-in), and so does the KV.
    Cancel {
        id: String,
        #[serde(default)]
        heard_index: Option<usize>,
    },
    /// Replaces the last reply with a new one to the same conversation.
    Regenerate {
        id: String,
        #[serde(default)]
        params: GenerateParams,
    },
    /// Replaces user turn `turn` (0 is the first user message) and everything after it with
    /// `messages`, and replies.
    Edit {
        id: String,
        turn: usize,
        messages: Vec<Message>,
        #[serde(default)]
        params: GenerateParams,
    },
    /// The first frame of a new connection: carry on the session whose `ready` gave `token`,
    /// replaying reply `id`'s deltas after `after_index` (all of them without it).
    Resume {
        token: String,
        #[serde(default)]
        id: Option<String>,
        #[serde(default)]
        after_index: Option<usize>,
    },
    /// What the user is typing (the next user message so far): the server prefills the
    /// conversation plus this text with capacity running replies leave unused, so that the
    /// `chat` that follows finds it computed. Answers nothing.
    Draft {
        text: String,
    },
    /// Rebuilds the conversation of a session that has none yet from the transcript the client
    /// kept (its session was on a replica that drained or died): each assistant message from a
    /// client that may not send assistant messages carries the `seal` its `done` gave.
    Restore {
        messages: Vec<RestoredMessage>,
    },
    /// A paced stream's client has shown (or spoken) reply `id`'s deltas through `index`.
    Ack {
        id: String,
        index: usize,
    },
    /// The result of the function a `tool_call` asked for (text, or any JSON, which the model
    /// reads as its text): the reply goes on from it.
    ToolResult {
        call_id: String,
        content: serde_json::Value,
    },
    Reset,
}

/// A message of a `restore` transcript.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoredMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's seal, from the `done` that ended it.
    #[serde(default)]
    pub seal: Option<String>,
}

/// Turns the overflow policy dropped from a conversation (`started.truncated`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Truncated {
    /// User turns this reply's prompt left out.
    pub dropped_turns: usize,
    /// The user turn the conversation now starts at, numbered from 0 as `edit` counts them
    /// (from the first turn the session ever had).
    pub first_kept_turn: usize,
    /// The messages left out: `messages` from message `from` of the conversation the prompt was
    /// built from (the Realtime dialect deletes their items).
    #[serde(skip)]
    pub from: usize,
    #[serde(skip)]
    pub messages: usize,
}

/// Frames the server sends.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    Ready {
        session_id: String,
        model: String,
        limits: serde_json::Value,
        /// The message roles this client may send (a page offers a system prompt only where
        /// `system` is among them).
        roles: Vec<&'static str>,
        /// Sent with a `resume` frame after the connection drops (absent when resuming is off).
        #[serde(skip_serializing_if = "Option::is_none")]
        resume_token: Option<String>,
        /// This `ready` answers a `resume`: the session carries on.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        resumed: bool,
    },
    Queued {
        id: String,
        position: usize,
        /// An estimate of the wait until the request starts, from how fast requests have been
        /// starting.
        #[serde(skip_serializing_if = "Option::is_none")]
        eta_ms: Option<u64>,
    },
    Started {
        id: String,
        prompt_tokens: usize,
        cached_tokens: usize,
        /// The oldest turns this reply's prompt left out (the overflow policy `drop_oldest`):
        /// the conversation goes on without them.
        #[serde(skip_serializing_if = "Option::is_none")]
        truncated: Option<Truncated>,
    },
    Delta {
        id: String,
        index: usize,
        text: String,
    },
    Done {
        id: String,
        finish_reason: FinishReason,
        usage: Usage,
        timings: Timings,
        /// The seal of the reply as the conversation recorded it (its text, or what was heard
        /// of it): keep it with the reply to `restore` the conversation elsewhere.
        #[serde(skip_serializing_if = "Option::is_none")]
        seal: Option<String>,
    },
    /// Reply `id` calls a function of the widget's: the client runs it and answers with a
    /// `tool_result` for `call_id`; the reply then goes on (the same `id`: `started`, deltas from
    /// index 0, `done`).
    ToolCall {
        id: String,
        call_id: String,
        name: String,
        arguments: serde_json::Value,
    },
    /// A `restore` rebuilt the conversation: `messages` messages.
    Restored { messages: usize },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        error_type: String,
        message: String,
    },
}

impl ServerFrame {
    /// An `error` frame: the error's kind as its `error_type`, its text as the message.
    pub fn error(id: Option<String>, e: &RequestError) -> ServerFrame {
        ServerFrame::Error {
            id,
            error_type: e.kind().wire().ws.into(),
            message: e.to_string(),
        }
    }
}

/// Validates a `restore` frame's transcript: the limits of any message (`max_messages`,
/// `max_message_chars`), known roles, well-formed seals. Whether the client may send each
/// role, or has a valid seal for it, is the session's to check.
pub fn validate_restore(
    limits: &Limits,
    messages: Vec<RestoredMessage>,
) -> Result<Vec<RestoredMessage>, RequestError> {
    let plain: Vec<Message> = (messages.iter())
        .map(|m| Message::new(&m.role, &m.content))
        .collect();
    limits.check_messages(&plain)?;
    for (i, m) in messages.iter().enumerate() {
        let well_formed = |s: &String| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
        if m.seal.as_ref().is_some_and(|s| !well_formed(s)) {
            return Err(RequestError::invalid(
                Field::Seal(i),
                "must be the 64 hex digits a `done` gave",
            ));
        }
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::for_tests()
    }

    fn parse(s: &str) -> Result<ClientFrame, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn frames_parse_by_type() {
        assert!(matches!(
            parse(r#"{"type":"reset"}"#).unwrap(),
            ClientFrame::Reset
        ));
        assert!(matches!(
            parse(r#"{"type":"cancel","id":"a"}"#).unwrap(),
            ClientFrame::Cancel { .. }
        ));
        let c = parse(r#"{"type":"chat","id":"1","messages":[{"role":"user","content":"hi"}],"params":{"temperature":0}}"#).unwrap();
        assert!(matches!(c, ClientFrame::Chat { .. }));
        assert!(parse(r#"{"type":"dance"}"#).is_err());
        assert!(
            parse(r#"{"type":"chat","id":"1","messages":[],"params":{"temprature":1}}"#).is_err()
        );
    }

    #[test]
    fn restore_frames_parse_and_validate_by_message() {
        let l = limits();
        let f = parse(r#"{"type":"restore","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Hello.","seal":"00"}]}"#).unwrap();
        let ClientFrame::Restore { messages } = f else {
            panic!("not a restore")
        };
        let e = validate_restore(&l, messages).unwrap_err().to_string();
        assert!(e.contains("messages[1].seal"), "{e}");
        let ok = parse(&format!(
            r#"{{"type":"restore","messages":[{{"role":"assistant","content":"Hello.","seal":"{}"}}]}}"#,
            "ab".repeat(32)
        ))
        .unwrap();
        let ClientFrame::Restore { messages } = ok else {
            panic!("not a restore")
        };
        assert_eq!(validate_restore(&l, messages).unwrap().len(), 1);
        // Unknown fields, unknown roles, nothing at all: refused.
        assert!(
            parse(r#"{"type":"restore","messages":[{"role":"user","content":"hi","x":1}]}"#)
                .is_err()
        );
        for (frame, field) in [
            (
                r#"{"type":"restore","messages":[{"role":"robot","content":"hi"}]}"#,
                "messages[0].role",
            ),
            (r#"{"type":"restore","messages":[]}"#, "messages"),
        ] {
            let ClientFrame::Restore { messages } = parse(frame).unwrap() else {
                panic!("not a restore")
            };
            let e = validate_restore(&l, messages).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn errors_map_to_frames_with_stable_types() {
        let f = ServerFrame::error(Some("x".into()), &RequestError::Overloaded("full".into()));
        let j = serde_json::to_value(&f).unwrap();
        assert_eq!(j["type"], "error");
        assert_eq!(j["error_type"], "overloaded");
        assert_eq!(j["id"], "x");
    }
}
