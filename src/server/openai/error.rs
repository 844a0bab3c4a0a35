//! Errors in OpenAI's shape (`ApiError`): the status and type/code from the one error table
//! (`ErrorKind::wire`), the field named as OpenAI names it.

use crate::server::openai::*;

/// An error in OpenAI's shape, with its status.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) kind: &'static str,
    pub(super) code: Option<&'static str>,
    pub(super) param: Option<String>,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        m: String,
    ) -> Self {
        ApiError {
            status,
            kind,
            code,
            param: None,
            message: m,
        }
    }

    pub(super) fn invalid(param: &str, message: String) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                message,
            )
        }
    }

    pub(super) fn body(&self) -> Value {
        error_body(&self.message, self.kind, self.param.as_deref(), self.code)
    }

    pub(super) fn response(&self, state: &AppState) -> HttpResponse {
        state.metrics.error(self.code.unwrap_or(self.kind));
        let mut r = HttpResponse::build(self.status);
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.insert_header(("Retry-After", "1"));
        }
        if self.code == Some("connection_limit") {
            r.insert_header((
                "Retry-After",
                crate::server::routes::RETRY_AFTER_S.to_string(),
            ));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.insert_header(("WWW-Authenticate", "Bearer"));
        }
        r.json(self.body())
    }
}

impl ApiError {
    /// The error kind's OpenAI form (`ErrorKind::wire`, the one table).
    pub(super) fn of_kind(kind: ErrorKind, message: String) -> Self {
        let w = kind.wire();
        let status = StatusCode::from_u16(w.http).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self::new(status, w.openai_type, w.openai_code, message)
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let m = e.message(Dialect::OpenAi);
        match e {
            RequestError::InvalidParam { field, .. } => {
                ApiError::invalid(&field.name(Dialect::OpenAi), m)
            }
            RequestError::PromptTooLong(_) => ApiError {
                param: Some("messages".into()),
                ..Self::of_kind(ErrorKind::PromptTooLong, m)
            },
            e => Self::of_kind(e.kind(), m),
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        let kind = r.kind();
        Self::of_kind(kind, r.into_message())
    }
}
