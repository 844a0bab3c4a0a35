//! What can go wrong with a request, in one vocabulary for every dialect: `RequestError` (with
//! the field at fault, `Field`), sorted into an `ErrorKind` whose `wire()` row is the one table of
//! how the native `/ws` protocol, OpenAI's HTTP API and the Realtime API each write it.

/// A request error. `kind()` sorts it into an `ErrorKind`, whose `wire()` row says how each dialect writes it.
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
