//! The WebSocket wire format (JSON text frames tagged by `type`), and its validation into typed
//! requests at the edge (parse, don't validate: TGI's `ValidGenerateRequest`). Every rejection
//! names the field and the limit. `docs/protocol.md` documents the frames with examples.

use serde::{Deserialize, Serialize};

use crate::sampler::{SamplingOverrides, SamplingParams};
use crate::tokenizer::Message;

/// Frames a client sends.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientFrame {
    Chat {
        id: String,
        messages: Vec<Message>,
        #[serde(default)]
        params: ChatParams,
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
        params: ChatParams,
    },
    /// Replaces user turn `turn` (0 is the first user message) and everything after it with
    /// `messages`, and replies.
    Edit {
        id: String,
        turn: usize,
        messages: Vec<Message>,
        #[serde(default)]
        params: ChatParams,
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
    Reset,
}

/// Optional generation parameters of a `chat` frame; absent ones take the server's defaults.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatParams {
    #[serde(flatten)]
    pub sampling: SamplingOverrides,
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-turn tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// A prefix-cache partition inside the API key's principal (OpenAI's `prompt_cache_key`):
    /// requests share cached blocks only with requests of the same key. API-key clients only.
    pub cache_key: Option<String>,
    /// `interactive` (default) or `batch`: batch requests are admitted and prefilled only with
    /// what interactive ones leave.
    pub priority: Option<String>,
    /// A paced stream: at most this many deltas unacknowledged (`ack`); past it the reply stops
    /// generating, its KV kept, until the client acks.
    pub window: Option<usize>,
}

/// The largest `params.window`.
pub const MAX_WINDOW: usize = 1024;

/// A request's priority on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

/// Longest `params.cache_key`.
pub const MAX_CACHE_KEY_CHARS: usize = 64;

/// Limits a server enforces, sent in `ready` so clients can respect them.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub max_context: usize,
    pub max_tokens: usize,
    pub max_frame_bytes: usize,
    pub max_messages: usize,
    pub max_message_chars: usize,
    pub max_stop_strings: usize,
    pub max_stop_chars: usize,
    pub max_id_chars: usize,
    /// Text frames a session may send a second on average, and at once.
    pub frames_per_s: f64,
    pub frame_burst: u32,
    /// Refused frames a session may send a second on average, and at once, before it is closed.
    pub rejected_frames_per_s: f64,
    pub rejected_frame_burst: u32,
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

/// Frames the server sends.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    Ready {
        session_id: String,
        model: String,
        limits: serde_json::Value,
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
    /// A `restore` rebuilt the conversation: `messages` messages.
    Restored { messages: usize },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        error_type: String,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
    Shutdown,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct Timings {
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub decode_tokens_per_s: f64,
}

/// A request error with its stable `error_type`; the one mapping to the wire is `to_frame`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    InvalidRequest(String),
    /// A field's value: `param` names it as the WebSocket protocol does (`params.max_tokens`).
    #[error("`{param}` {reason}")]
    InvalidParam { param: String, reason: String },
    #[error("{0}")]
    PromptTooLong(String),
    /// A queue is full (the server's, or the tenant's share of it).
    #[error("{0}")]
    Overloaded(String),
    #[error("request `{0}` is still generating; wait for its `done` or send `cancel`")]
    Busy(String),
    #[error("{0}")]
    NotReady(String),
    /// The client sends faster than its limits allow.
    #[error("{0}")]
    RateLimited(String),
    /// The client read nothing while its reply queued up.
    #[error("{0}")]
    SlowReader(String),
    /// A `resume` that cannot be honoured; the connection goes on as a fresh session.
    #[error("{0}")]
    ResumeFailed(String),
    #[error("{0}")]
    Internal(String),
}

/// What went wrong, as every dialect needs to say it. `wire()` is the one table of how each
/// dialect writes it: a new error is a variant and a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    PromptTooLong,
    Overloaded,
    Busy,
    NotReady,
    RateLimited,
    SlowReader,
    ResumeFailed,
    Internal,
    Unauthorized,
    Forbidden,
}

/// One error kind on each wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wire {
    /// The native protocol's `error_type` (also the `llama_relay_errors_total` label).
    pub ws: &'static str,
    /// The HTTP status of an upgrade refused or an API request answered with it.
    pub http: u16,
    /// OpenAI's error `type` and `code`.
    pub openai_type: &'static str,
    pub openai_code: Option<&'static str>,
    /// The Realtime API's error `code`.
    pub realtime: &'static str,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::InvalidRequest,
        ErrorKind::PromptTooLong,
        ErrorKind::Overloaded,
        ErrorKind::Busy,
        ErrorKind::NotReady,
        ErrorKind::RateLimited,
        ErrorKind::SlowReader,
        ErrorKind::ResumeFailed,
        ErrorKind::Internal,
        ErrorKind::Unauthorized,
        ErrorKind::Forbidden,
    ];

    pub const fn wire(self) -> Wire {
        const fn w(
            ws: &'static str,
            http: u16,
            openai_type: &'static str,
            openai_code: Option<&'static str>,
            realtime: &'static str,
        ) -> Wire {
            Wire {
                ws,
                http,
                openai_type,
                openai_code,
                realtime,
            }
        }
        const INVALID: &str = "invalid_request_error";
        match self {
            ErrorKind::InvalidRequest => {
                w("invalid_request", 400, INVALID, None, "invalid_request")
            }
            ErrorKind::PromptTooLong => w(
                "prompt_too_long",
                400,
                INVALID,
                Some("context_length_exceeded"),
                "prompt_too_long",
            ),
            ErrorKind::Overloaded => w(
                "overloaded",
                429,
                "rate_limit_error",
                Some("overloaded"),
                "overloaded",
            ),
            ErrorKind::Busy => w(
                "busy",
                400,
                INVALID,
                None,
                "conversation_already_has_active_response",
            ),
            ErrorKind::NotReady => w(
                "not_ready",
                503,
                "service_unavailable",
                Some("not_ready"),
                "not_ready",
            ),
            ErrorKind::RateLimited => w(
                "rate_limited",
                429,
                "rate_limit_error",
                Some("rate_limited"),
                "rate_limit_exceeded",
            ),
            ErrorKind::SlowReader => w(
                "slow_reader",
                408,
                "timeout",
                Some("slow_reader"),
                "slow_reader",
            ),
            ErrorKind::ResumeFailed => w("resume_failed", 400, INVALID, None, "resume_failed"),
            ErrorKind::Internal => w("internal", 500, "server_error", None, "server_error"),
            ErrorKind::Unauthorized => w(
                "unauthorized",
                401,
                "authentication_error",
                Some("invalid_api_key"),
                "invalid_api_key",
            ),
            ErrorKind::Forbidden => w(
                "forbidden",
                403,
                "permission_error",
                Some("forbidden"),
                "forbidden",
            ),
        }
    }

    /// The kind a native `error_type` names (for a dialect that re-encodes native frames).
    pub fn from_ws(error_type: &str) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.wire().ws == error_type)
    }
}

impl RequestError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            RequestError::InvalidRequest(_) | RequestError::InvalidParam { .. } => {
                ErrorKind::InvalidRequest
            }
            RequestError::PromptTooLong(_) => ErrorKind::PromptTooLong,
            RequestError::Overloaded(_) => ErrorKind::Overloaded,
            RequestError::Busy(_) => ErrorKind::Busy,
            RequestError::NotReady(_) => ErrorKind::NotReady,
            RequestError::RateLimited(_) => ErrorKind::RateLimited,
            RequestError::SlowReader(_) => ErrorKind::SlowReader,
            RequestError::ResumeFailed(_) => ErrorKind::ResumeFailed,
            RequestError::Internal(_) => ErrorKind::Internal,
        }
    }

    pub fn error_type(&self) -> &'static str {
        self.kind().wire().ws
    }

    pub fn to_frame(&self, id: Option<String>) -> ServerFrame {
        ServerFrame::Error {
            id,
            error_type: self.error_type().into(),
            message: self.to_string(),
        }
    }
}

#[cfg(test)]
impl Limits {
    /// Small limits for unit tests (the WebSocket's and the OpenAI API's validation alike).
    pub fn for_tests() -> Self {
        Limits {
            max_context: 2048,
            max_tokens: 512,
            max_frame_bytes: 65536,
            max_messages: 8,
            max_message_chars: 100,
            max_stop_strings: 4,
            max_stop_chars: 16,
            max_id_chars: 64,
            frames_per_s: 10.0,
            frame_burst: 20,
            rejected_frames_per_s: 1.0,
            rejected_frame_burst: 10,
        }
    }
}

/// A validated `chat` request.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub id: String,
    pub messages: Vec<Message>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub cache_key: Option<String>,
    pub priority: Priority,
    pub window: Option<usize>,
}

fn bad(field: &str, msg: impl std::fmt::Display) -> RequestError {
    RequestError::InvalidParam {
        param: field.into(),
        reason: msg.to_string(),
    }
}

impl Limits {
    /// Validates a `chat` frame's fields against these limits and the server's defaults.
    pub fn validate_chat(
        &self,
        id: String,
        messages: Vec<Message>,
        p: ChatParams,
        defaults: &SamplingParams,
        default_max_tokens: usize,
    ) -> Result<ValidChat, RequestError> {
        if id.is_empty() || id.chars().count() > self.max_id_chars {
            return Err(bad(
                "id",
                format!("must be 1 to {} characters", self.max_id_chars),
            ));
        }
        self.check_messages(&messages)?;
        let sampling = sampling(&p, defaults)?;
        let max_tokens = self.max_tokens(p.max_tokens, default_max_tokens)?;
        self.check_stop(&p.stop)?;
        check_cache_key(p.cache_key.as_deref())?;
        let priority = match p.priority.as_deref() {
            None | Some("interactive") => Priority::Interactive,
            Some("batch") => Priority::Batch,
            Some(other) => {
                return Err(bad(
                    "params.priority",
                    format!("must be interactive or batch. Given: {other:?}"),
                ))
            }
        };
        if let Some(w) = p.window.filter(|&w| w == 0 || w > MAX_WINDOW) {
            return Err(bad(
                "params.window",
                format!("must be between 1 and {MAX_WINDOW}. Given: {w}"),
            ));
        }
        Ok(ValidChat {
            id,
            messages,
            sampling,
            max_tokens,
            stop: p.stop,
            ignore_eos: p.ignore_eos,
            cache_key: p.cache_key,
            priority,
            window: p.window,
        })
    }

    /// Validates a `restore` frame's transcript: the limits of any message (`max_messages`,
    /// `max_message_chars`), known roles, well-formed seals. Whether the client may send each
    /// role, or has a valid seal for it, is the session's to check.
    pub fn validate_restore(
        &self,
        messages: Vec<RestoredMessage>,
    ) -> Result<Vec<RestoredMessage>, RequestError> {
        let plain: Vec<Message> = (messages.iter())
            .map(|m| Message::new(&m.role, &m.content))
            .collect();
        self.check_messages(&plain)?;
        for (i, m) in messages.iter().enumerate() {
            let well_formed =
                |s: &String| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
            if m.seal.as_ref().is_some_and(|s| !well_formed(s)) {
                return Err(bad(
                    &format!("messages[{i}].seal"),
                    "must be the 64 hex digits a `done` gave",
                ));
            }
        }
        Ok(messages)
    }

    /// Validates a `draft` frame's text (a user message's content so far).
    pub fn validate_draft(&self, text: String) -> Result<String, RequestError> {
        let n = text.chars().count();
        if n > self.max_message_chars {
            return Err(bad(
                "text",
                format!(
                    "must be at most {} characters. Given: {n}",
                    self.max_message_chars
                ),
            ));
        }
        Ok(text)
    }

    fn check_messages(&self, messages: &[Message]) -> Result<(), RequestError> {
        if messages.is_empty() {
            return Err(bad("messages", "must hold at least one message"));
        }
        if messages.len() > self.max_messages {
            return Err(bad(
                "messages",
                format!(
                    "must hold at most {} messages. Given: {}",
                    self.max_messages,
                    messages.len()
                ),
            ));
        }
        for (i, m) in messages.iter().enumerate() {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                return Err(bad(
                    &format!("messages[{i}].role"),
                    format!("must be system, user or assistant. Given: {:?}", m.role),
                ));
            }
            let n = m.content.chars().count();
            if n > self.max_message_chars {
                return Err(bad(
                    &format!("messages[{i}].content"),
                    format!(
                        "must be at most {} characters. Given: {n}",
                        self.max_message_chars
                    ),
                ));
            }
        }
        Ok(())
    }

    fn max_tokens(&self, given: Option<usize>, default: usize) -> Result<usize, RequestError> {
        match given {
            Some(n) if n == 0 || n > self.max_tokens => Err(bad(
                "params.max_tokens",
                format!("must be between 1 and {}. Given: {n}", self.max_tokens),
            )),
            Some(n) => Ok(n),
            None => Ok(default.min(self.max_tokens)),
        }
    }

    fn check_stop(&self, stop: &[String]) -> Result<(), RequestError> {
        if stop.len() > self.max_stop_strings {
            return Err(bad(
                "params.stop",
                format!(
                    "must hold at most {} strings. Given: {}",
                    self.max_stop_strings,
                    stop.len()
                ),
            ));
        }
        for (i, s) in stop.iter().enumerate() {
            let n = s.chars().count();
            if n == 0 || n > self.max_stop_chars {
                return Err(bad(
                    &format!("params.stop[{i}]"),
                    format!(
                        "must be 1 to {} characters. Given: {n}",
                        self.max_stop_chars
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The request's sampling settings over the server's defaults, checked against the one
/// definition of their ranges (the defaults were checked at start, so a value out of range is
/// the client's).
fn sampling(p: &ChatParams, defaults: &SamplingParams) -> Result<SamplingParams, RequestError> {
    let sampling = p.sampling.over(defaults);
    sampling.check().map_err(|e| {
        bad(
            &format!("params.{}", e.field),
            format!("must be {}. Given: {}", e.allowed, e.given),
        )
    })?;
    Ok(sampling)
}

fn check_cache_key(key: Option<&str>) -> Result<(), RequestError> {
    let Some(k) = key else { return Ok(()) };
    let n = k.chars().count();
    if n == 0 || n > MAX_CACHE_KEY_CHARS || k.chars().any(char::is_control) {
        return Err(bad(
            "params.cache_key",
            format!(
                "must be 1 to {MAX_CACHE_KEY_CHARS} characters, none of them control characters. Given: {n} characters"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn each_error_kind_has_its_own_native_and_realtime_names() {
        for (i, a) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(ErrorKind::from_ws(a.wire().ws), Some(*a));
            for b in &ErrorKind::ALL[i + 1..] {
                assert_ne!(a.wire().ws, b.wire().ws);
            }
            let w = a.wire();
            assert!((400..600).contains(&w.http), "{a:?}");
        }
        assert_eq!(ErrorKind::from_ws("no_such_type"), None);
    }

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
        let e = l.validate_restore(messages).unwrap_err().to_string();
        assert!(e.contains("messages[1].seal"), "{e}");
        let ok = parse(&format!(
            r#"{{"type":"restore","messages":[{{"role":"assistant","content":"Hello.","seal":"{}"}}]}}"#,
            "ab".repeat(32)
        ))
        .unwrap();
        let ClientFrame::Restore { messages } = ok else {
            panic!("not a restore")
        };
        assert_eq!(l.validate_restore(messages).unwrap().len(), 1);
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
            let e = l.validate_restore(messages).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn validation_names_field_and_limit() {
        let l = limits();
        let d = SamplingParams::default();
        let m = vec![Message::new("user", "hi")];
        let e = |p: ChatParams| {
            l.validate_chat("1".into(), m.clone(), p, &d, 64)
                .unwrap_err()
                .to_string()
        };
        let s = e(ChatParams {
            max_tokens: Some(9000),
            ..Default::default()
        });
        assert!(
            s.contains("`params.max_tokens`") && s.contains("512") && s.contains("9000"),
            "{s}"
        );
        let s = e(ChatParams {
            sampling: SamplingOverrides {
                temperature: Some(3.0),
                ..Default::default()
            },
            ..Default::default()
        });
        assert!(
            s.contains("`params.temperature`") && s.contains("between 0 and 2"),
            "{s}"
        );
        let s = e(ChatParams {
            stop: vec!["a".into(); 5],
            ..Default::default()
        });
        assert!(
            s.contains("`params.stop`") && s.contains("at most 4"),
            "{s}"
        );
        let s = e(ChatParams {
            window: Some(0),
            ..Default::default()
        });
        assert!(
            s.contains("`params.window`") && s.contains("between 1 and 1024"),
            "{s}"
        );
        let s = e(ChatParams {
            priority: Some("urgent".into()),
            ..Default::default()
        });
        assert!(
            s.contains("`params.priority`") && s.contains("interactive or batch"),
            "{s}"
        );
        let s = l
            .validate_chat(
                "1".into(),
                vec![Message::new("robot", "x")],
                ChatParams::default(),
                &d,
                64,
            )
            .unwrap_err()
            .to_string();
        assert!(s.contains("messages[0].role"), "{s}");
        let s = l
            .validate_chat(
                "1".into(),
                vec![Message::new("user", &"x".repeat(101))],
                ChatParams::default(),
                &d,
                64,
            )
            .unwrap_err()
            .to_string();
        assert!(
            s.contains("messages[0].content") && s.contains("100"),
            "{s}"
        );
        let ok = l
            .validate_chat("1".into(), m, ChatParams::default(), &d, 64)
            .unwrap();
        assert_eq!(ok.max_tokens, 64);
    }

    #[test]
    fn errors_map_to_frames_with_stable_types() {
        let f = RequestError::Overloaded("full".into()).to_frame(Some("x".into()));
        let j = serde_json::to_value(&f).unwrap();
        assert_eq!(j["type"], "error");
        assert_eq!(j["error_type"], "overloaded");
        assert_eq!(j["id"], "x");
    }
}
