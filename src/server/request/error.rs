//! What can go wrong with a request, in one vocabulary for every dialect: `RequestError` (with
//! the field at fault, `Field`), sorted into an `ErrorKind` whose `wire()` row is the one table of
//! how the native `/ws` protocol, OpenAI's HTTP API and the Realtime API each write it.

/// A field of a request, named once: each dialect spells it in its own words (`name`), so a
/// rule checked in the seam reads `params.max_tokens` on `/ws`, `max_tokens` over HTTP and
/// `response.max_output_tokens` on the Realtime API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// The client's request id.
    Id,
    Messages,
    Role(usize),
    Content(usize),
    /// An assistant message's seal (`restore`).
    Seal(usize),
    MaxTokens,
    Stop,
    StopString(usize),
    /// One of `SamplingOverrides::FIELDS`.
    Sampling(&'static str),
    CacheKey,
    Priority,
    Window,
    ResponseFormat,
    /// The overflow policy (`params.overflow`; OpenAI's and the Realtime API's `truncation`),
    /// and its retention ratio.
    Overflow,
    RetentionRatio,
    /// A field only one dialect has, as that dialect names it (`n`, `stream_options`, `index`).
    Wire(String),
}

/// Who reads an error: the dialects name fields differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect<'a> {
    /// The native `/ws` protocol.
    Native,
    /// OpenAI's HTTP API.
    OpenAi,
    /// The Realtime API, inside the object the settings came in (`session`, `response`).
    Realtime(&'a str),
}

impl Field {
    pub fn name(&self, d: Dialect) -> String {
        // The request's id and messages, and a dialect's own fields: every dialect alike.
        let param = match self {
            Field::Wire(name) => return name.clone(),
            Field::Id => return "id".into(),
            Field::Messages => return "messages".into(),
            Field::Role(i) => return format!("messages[{i}].role"),
            Field::Content(i) => return format!("messages[{i}].content"),
            Field::Seal(i) => return format!("messages[{i}].seal"),
            Field::MaxTokens => "max_tokens".to_string(),
            Field::Stop => "stop".into(),
            Field::StopString(i) => format!("stop[{i}]"),
            Field::Sampling(name) => (*name).into(),
            Field::CacheKey => "cache_key".into(),
            Field::Priority => "priority".into(),
            Field::Window => "window".into(),
            Field::ResponseFormat => "response_format".into(),
            Field::Overflow => "overflow".into(),
            Field::RetentionRatio => "retention_ratio".into(),
        };
        // A generation parameter: under `params` on `/ws`, bare over HTTP, inside the event's
        // object on the Realtime API, with the two names the dialects spell their own way.
        match (self, d) {
            (Field::MaxTokens, Dialect::Realtime(within)) => format!("{within}.max_output_tokens"),
            (Field::CacheKey, Dialect::OpenAi) => "prompt_cache_key".into(),
            (Field::Overflow, Dialect::OpenAi) => "truncation".into(),
            (Field::Overflow, Dialect::Realtime(within)) => format!("{within}.truncation"),
            (Field::RetentionRatio, Dialect::Realtime(within)) => {
                format!("{within}.truncation.retention_ratio")
            }
            (_, Dialect::Native) => format!("params.{param}"),
            (_, Dialect::OpenAi) => param,
            (_, Dialect::Realtime(within)) => format!("{within}.{param}"),
        }
    }
}

/// A request error. `kind()` sorts it into an `ErrorKind`, whose `wire()` row says how each
/// dialect writes it; `message(dialect)` is its text with the field named as that dialect does
/// (`Display` is the native protocol's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    InvalidRequest(String),
    /// A field's value, and the rule it breaks (`must be between 1 and 512. Given: 0`).
    #[error("`{}` {reason}", field.name(Dialect::Native))]
    InvalidParam { field: Field, reason: String },
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
    pub fn invalid(field: Field, reason: impl std::fmt::Display) -> Self {
        RequestError::InvalidParam {
            field,
            reason: reason.to_string(),
        }
    }

    /// The text for a client of dialect `d`.
    pub fn message(&self, d: Dialect) -> String {
        match self {
            RequestError::InvalidParam { field, reason } => format!("`{}` {reason}", field.name(d)),
            e => e.to_string(),
        }
    }

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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dialect_names_a_field_its_own_way() {
        let names = |f: Field| {
            (
                f.name(Dialect::Native),
                f.name(Dialect::OpenAi),
                f.name(Dialect::Realtime("response")),
            )
        };
        let s = |a: &str, b: &str, c: &str| (a.to_string(), b.to_string(), c.to_string());
        assert_eq!(
            names(Field::MaxTokens),
            s(
                "params.max_tokens",
                "max_tokens",
                "response.max_output_tokens"
            )
        );
        assert_eq!(
            names(Field::Sampling("top_p")),
            s("params.top_p", "top_p", "response.top_p")
        );
        assert_eq!(
            names(Field::CacheKey),
            s("params.cache_key", "prompt_cache_key", "response.cache_key")
        );
        assert_eq!(
            names(Field::StopString(2)),
            s("params.stop[2]", "stop[2]", "response.stop[2]")
        );
        assert_eq!(
            names(Field::Content(1)),
            s(
                "messages[1].content",
                "messages[1].content",
                "messages[1].content"
            )
        );
        let e = RequestError::invalid(Field::MaxTokens, "must be between 1 and 8. Given: 0");
        assert_eq!(
            e.to_string(),
            "`params.max_tokens` must be between 1 and 8. Given: 0"
        );
        assert_eq!(
            e.message(Dialect::OpenAi),
            "`max_tokens` must be between 1 and 8. Given: 0"
        );
    }

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
}
