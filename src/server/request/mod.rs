//! The request seam: each dialect (the native `/ws` frames, OpenAI's HTTP API, the Realtime API)
//! only parses its wire shape into one `GenerateParams` and messages, validated here, once, into a
//! `ValidRequest` (parse, don't validate: TGI's `ValidGenerateRequest`). Every rejection names
//! the field (`Field`, which each dialect spells in its own words) and the limit.

pub mod error;
pub mod overflow;
pub mod prompt;
pub mod reply;
pub mod stop;
pub mod stream;
pub mod tools;

use serde::{Deserialize, Serialize};

pub use error::{Dialect, ErrorKind, Field, RequestError, Wire};

use crate::engine::constraint::ResponseFormat;
use crate::engine::Priority;
use crate::kv_cache::CacheScope;
use crate::sampler::{SamplingOverrides, SamplingParams};
use crate::tokenizer::Message;

/// Optional generation parameters of a `chat` frame; absent ones take the server's defaults.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateParams {
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
    /// What the reply must be: free text (default), JSON (any object, or valid against a
    /// schema), or text a regular expression or Lark grammar matches. Held as JSON until
    /// `validate` parses it, so a wrong shape is refused naming the field as other values are.
    pub response_format: Option<serde_json::Value>,
    /// What the conversation does when it outgrows the context (`overflow::Overflow`): `error`
    /// or `drop_oldest`; absent: the client's default (`limits.overflow`, its tenant's or
    /// widget's).
    pub overflow: Option<String>,
    /// With `drop_oldest`: the share of the room the kept conversation fills (default
    /// `limits.overflow_retention`).
    pub retention_ratio: Option<f32>,
}

/// The largest `params.window`.
pub const MAX_WINDOW: usize = 1024;

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
    pub max_schema_bytes: usize,
    pub max_id_chars: usize,
    /// Seconds a `tool_call` waits for its `tool_result`; calls one turn may make.
    pub tool_timeout_s: u64,
    pub max_tool_calls: usize,
    /// The share of the room a conversation keeps when `drop_oldest` drops its turns.
    pub overflow_retention: f32,
    /// Text frames a session may send a second on average, and at once.
    pub frames_per_s: f64,
    pub frame_burst: u32,
    /// Refused frames a session may send a second on average, and at once, before it is closed.
    pub rejected_frames_per_s: f64,
    pub rejected_frame_burst: u32,
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
            max_schema_bytes: 4096,
            max_id_chars: 64,
            tool_timeout_s: 30,
            max_tool_calls: 4,
            overflow_retention: 0.8,
            frames_per_s: 10.0,
            frame_burst: 20,
            rejected_frames_per_s: 1.0,
            rejected_frame_burst: 10,
        }
    }
}

/// A validated request: what every dialect submits, whatever its wire shape.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub id: String,
    pub messages: Vec<Message>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// The cache partition inside the principal, once `partition` has applied the rule.
    pub cache_key: Option<String>,
    pub priority: Priority,
    pub window: Option<usize>,
    /// Checked for size, compiled where the prompt is built (`prompt::chat_prompt`).
    pub format: ResponseFormat,
    /// The request's own overflow policy; `None`: its client's.
    pub overflow: Option<overflow::Overflow>,
    /// Functions the reply may call (`format` is then their grammar): the reply's text is
    /// parsed into calls as it streams (`tools::CallParser`).
    pub tools: Option<std::sync::Arc<tools::Tools>>,
    /// The request's own functions, described to the model where the prompt is built
    /// (`tools::lower`), whatever the choice.
    pub described: Option<std::sync::Arc<tools::Tools>>,
}

/// The token ids to run, the blocks they may share, and the compiled grammar of the request's
/// response format.
pub struct Prompt {
    pub ids: Vec<u32>,
    pub scope: CacheScope,
    pub constraint: Option<crate::engine::constraint::Constraint>,
    /// The turns the overflow policy left out, if any.
    pub dropped: Option<overflow::Dropped>,
}

/// The rule every text limit reads the same way in: "`field` must be at most N characters
/// (setting). Given: n".
pub fn at_most_chars(
    field: Field,
    text: &str,
    max: usize,
    setting: &str,
) -> Result<(), RequestError> {
    let n = text.chars().count();
    if n > max {
        return Err(RequestError::invalid(
            field,
            format!("must be at most {max} characters ({setting}). Given: {n}"),
        ));
    }
    Ok(())
}

impl Limits {
    /// Validates a request's messages and parameters against these limits and the server's
    /// defaults: the one place every dialect's request is checked.
    pub fn validate(
        &self,
        id: String,
        messages: Vec<Message>,
        p: GenerateParams,
        defaults: &SamplingParams,
        default_max_tokens: usize,
    ) -> Result<ValidRequest, RequestError> {
        if id.is_empty() || id.chars().count() > self.max_id_chars {
            return Err(RequestError::invalid(
                Field::Id,
                format!("must be 1 to {} characters", self.max_id_chars),
            ));
        }
        self.check_messages(&messages)?;
        let (sampling, max_tokens) = self.settings(&p, defaults, default_max_tokens)?;
        self.check_stop(&p.stop)?;
        check_cache_key(p.cache_key.as_deref())?;
        let priority = match p.priority.as_deref() {
            None | Some("interactive") => Priority::Interactive,
            Some("batch") => Priority::Batch,
            Some(other) => {
                return Err(RequestError::invalid(
                    Field::Priority,
                    format!("must be interactive or batch. Given: {other:?}"),
                ))
            }
        };
        if let Some(w) = p.window.filter(|&w| w == 0 || w > MAX_WINDOW) {
            return Err(RequestError::invalid(
                Field::Window,
                format!("must be between 1 and {MAX_WINDOW}. Given: {w}"),
            ));
        }
        let format = self.response_format(p.response_format)?;
        let overflow = self.overflow(p.overflow.as_deref(), p.retention_ratio)?;
        Ok(ValidRequest {
            format,
            overflow,
            id,
            messages,
            sampling,
            max_tokens,
            stop: p.stop,
            ignore_eos: p.ignore_eos,
            cache_key: p.cache_key,
            priority,
            window: p.window,
            tools: None,
            described: None,
        })
    }

    /// The sampling settings and reply length of `p` over the server's defaults: what a
    /// dialect that takes settings apart from a turn (the Realtime API's `session.update`)
    /// checks alone. The defaults were checked at start, so a value out of range is the
    /// client's.
    pub fn settings(
        &self,
        p: &GenerateParams,
        defaults: &SamplingParams,
        default_max_tokens: usize,
    ) -> Result<(SamplingParams, usize), RequestError> {
        let sampling = p.sampling.over(defaults);
        sampling.check().map_err(|e| {
            RequestError::invalid(
                Field::Sampling(e.field),
                format!("must be {}. Given: {}", e.allowed, e.given),
            )
        })?;
        let max_tokens = match p.max_tokens {
            Some(n) if n == 0 || n > self.max_tokens => {
                return Err(RequestError::invalid(
                    Field::MaxTokens,
                    format!("must be between 1 and {}. Given: {n}", self.max_tokens),
                ))
            }
            Some(n) => n,
            None => default_max_tokens.min(self.max_tokens),
        };
        Ok((sampling, max_tokens))
    }

    /// A request's response format, parsed and checked against `max_schema_bytes` (compiling
    /// it waits for the prompt's turn on the blocking pool).
    pub fn response_format(
        &self,
        v: Option<serde_json::Value>,
    ) -> Result<ResponseFormat, RequestError> {
        let bad = |reason| RequestError::invalid(Field::ResponseFormat, reason);
        let Some(v) = v else {
            return Ok(ResponseFormat::Text);
        };
        let format: ResponseFormat = serde_json::from_value(v).map_err(|e| {
            bad(format!(
                "must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}}, {{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": ...}}}}, or this server's {{\"type\": \"regex\", \"regex\": ...}} or {{\"type\": \"lark\", \"lark\": ...}}: {e}"
            ))
        })?;
        format.check(self.max_schema_bytes).map_err(bad)?;
        Ok(format)
    }

    /// A request's overflow policy: `error` or `drop_oldest`, a retention ratio only with
    /// `drop_oldest`.
    pub fn overflow(
        &self,
        name: Option<&str>,
        retention: Option<f32>,
    ) -> Result<Option<overflow::Overflow>, RequestError> {
        let given = retention.is_some();
        let retention = match retention {
            Some(r) => overflow::Overflow::check_retention(r)
                .map_err(|e| RequestError::invalid(Field::RetentionRatio, e))?,
            None => self.overflow_retention,
        };
        let policy = name
            .map(|n| {
                overflow::Overflow::parse(n, retention)
                    .map_err(|e| RequestError::invalid(Field::Overflow, e))
            })
            .transpose()?;
        if given && !matches!(policy, Some(overflow::Overflow::DropOldest { .. })) {
            return Err(RequestError::invalid(
                Field::RetentionRatio,
                "is a share of what `drop_oldest` keeps: it needs the overflow policy drop_oldest",
            ));
        }
        Ok(policy)
    }

    /// A message's text against `max_message_chars`.
    pub fn check_message_chars(&self, field: Field, text: &str) -> Result<(), RequestError> {
        at_most_chars(
            field,
            text,
            self.max_message_chars,
            "limits.max_message_chars",
        )
    }

    /// The limits of any message list (`max_messages`, `max_message_chars`) and known roles.
    pub fn check_messages(&self, messages: &[Message]) -> Result<(), RequestError> {
        if messages.is_empty() {
            return Err(RequestError::invalid(
                Field::Messages,
                "must hold at least one message",
            ));
        }
        if messages.len() > self.max_messages {
            return Err(RequestError::invalid(
                Field::Messages,
                format!(
                    "must hold at most {} messages (limits.max_messages). Given: {}",
                    self.max_messages,
                    messages.len()
                ),
            ));
        }
        for (i, m) in messages.iter().enumerate() {
            // A `tool` message is a function's result, which only a dialect's parser makes.
            let result = m.role == "tool" && m.name.is_some();
            if !result && !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                return Err(RequestError::invalid(
                    Field::Role(i),
                    format!("must be system, user or assistant. Given: {:?}", m.role),
                ));
            }
            self.check_message_chars(Field::Content(i), &m.content)?;
        }
        Ok(())
    }

    fn check_stop(&self, stop: &[String]) -> Result<(), RequestError> {
        if stop.len() > self.max_stop_strings {
            return Err(RequestError::invalid(
                Field::Stop,
                format!(
                    "must hold at most {} strings (limits.max_stop_strings). Given: {}",
                    self.max_stop_strings,
                    stop.len()
                ),
            ));
        }
        for (i, s) in stop.iter().enumerate() {
            let n = s.chars().count();
            if n == 0 || n > self.max_stop_chars {
                return Err(RequestError::invalid(
                    Field::StopString(i),
                    format!(
                        "must be 1 to {} characters (limits.max_stop_chars). Given: {n}",
                        self.max_stop_chars
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn check_cache_key(key: Option<&str>) -> Result<(), RequestError> {
    let Some(k) = key else { return Ok(()) };
    let n = k.chars().count();
    if n == 0 || n > MAX_CACHE_KEY_CHARS || k.chars().any(char::is_control) {
        return Err(RequestError::invalid(
            Field::CacheKey,
            format!(
                "must be 1 to {MAX_CACHE_KEY_CHARS} characters, none of them control characters. Given: {n} characters"
            ),
        ));
    }
    Ok(())
}

impl ValidRequest {
    /// The one cache-key rule: a cache key splits an API key's principal; any other client is
    /// its own principal already, so a cache key from it is refused (it could only be a
    /// mistake, or a probe for someone else's partition). `user` is OpenAI's end-user id: it
    /// splits an API key's principal too, and is dropped for other clients, whose SDKs send it
    /// by habit.
    pub fn partition(&mut self, api_key: bool, user: Option<&str>) -> Result<(), RequestError> {
        if !api_key {
            if self.cache_key.is_some() {
                return Err(RequestError::invalid(
                    Field::CacheKey,
                    "is for API-key clients; any other client is its own cache partition",
                ));
            }
            return Ok(());
        }
        self.cache_key = match (self.cache_key.take(), user) {
            (Some(k), Some(u)) => Some(format!("{k}\u{1f}{u}")),
            (Some(k), None) => Some(k),
            (None, Some(u)) => Some(u.to_string()),
            (None, None) => None,
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::for_tests()
    }

    #[test]
    fn validation_names_field_and_limit() {
        let l = limits();
        let d = SamplingParams::default();
        let m = vec![Message::new("user", "hi")];
        let e = |p: GenerateParams| {
            l.validate("1".into(), m.clone(), p, &d, 64)
                .unwrap_err()
                .to_string()
        };
        let s = e(GenerateParams {
            max_tokens: Some(9000),
            ..Default::default()
        });
        assert!(
            s.contains("`params.max_tokens`") && s.contains("512") && s.contains("9000"),
            "{s}"
        );
        let s = e(GenerateParams {
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
        let s = e(GenerateParams {
            stop: vec!["a".into(); 5],
            ..Default::default()
        });
        assert!(
            s.contains("`params.stop`") && s.contains("at most 4"),
            "{s}"
        );
        let s = e(GenerateParams {
            window: Some(0),
            ..Default::default()
        });
        assert!(
            s.contains("`params.window`") && s.contains("between 1 and 1024"),
            "{s}"
        );
        let s = e(GenerateParams {
            priority: Some("urgent".into()),
            ..Default::default()
        });
        assert!(
            s.contains("`params.priority`") && s.contains("interactive or batch"),
            "{s}"
        );
        let s = l
            .validate(
                "1".into(),
                vec![Message::new("robot", "x")],
                GenerateParams::default(),
                &d,
                64,
            )
            .unwrap_err()
            .to_string();
        assert!(s.contains("messages[0].role"), "{s}");
        let s = l
            .validate(
                "1".into(),
                vec![Message::new("user", &"x".repeat(101))],
                GenerateParams::default(),
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
            .validate("1".into(), m, GenerateParams::default(), &d, 64)
            .unwrap();
        assert_eq!(ok.max_tokens, 64);
    }

    #[test]
    fn one_cache_key_rule_for_every_client() {
        let l = limits();
        let d = SamplingParams::default();
        let valid = |key: Option<&str>| {
            let p = GenerateParams {
                cache_key: key.map(str::to_string),
                ..Default::default()
            };
            (l.validate("1".into(), vec![Message::new("user", "hi")], p, &d, 8)).unwrap()
        };
        // Not an API key: its own principal, a cache key refused, a user id dropped.
        let e = valid(Some("k")).partition(false, None).unwrap_err();
        assert!(e.to_string().contains("`params.cache_key`"), "{e}");
        let mut v = valid(None);
        v.partition(false, Some("u")).unwrap();
        assert_eq!(v.cache_key, None);
        // An API key: the key and the user each split it, both together.
        for (key, user, want) in [
            (Some("k"), None, Some("k")),
            (None, Some("u"), Some("u")),
            (Some("k"), Some("u"), Some("k\u{1f}u")),
            (None, None, None),
        ] {
            let mut v = valid(key);
            v.partition(true, user).unwrap();
            assert_eq!(v.cache_key.as_deref(), want);
        }
    }
}
