//! What a request presents at the gate, as `access` and `tenants` both read it: its `Origin`
//! (`normalize_origin`), its `Authorization: Bearer` key (`bearer`), the digest keys are kept and
//! compared in (`sha256`), and why a presentation is refused (`Refusal`).

use sha2::{Digest, Sha256};

use crate::server::request::ErrorKind;

/// `scheme://host[:port]` lower-cased, with the scheme's default port dropped; `None` unless it
/// is an http(s) origin with nothing after the authority.
pub fn normalize_origin(o: &str) -> Option<String> {
    let (scheme, rest) = o.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return None;
    }
    let (host, port) = split_host(rest)?;
    if host.is_empty() {
        return None;
    }
    Some(match port {
        Some(p) if p != default_port => format!("{scheme}://{host}:{p}"),
        _ => format!("{scheme}://{host}"),
    })
}

/// `host[:port]` (IPv6 in brackets) into a lower-cased host and an optional port.
pub fn split_host(s: &str) -> Option<(String, Option<u16>)> {
    let s = s.trim();
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?.parse().ok()?),
        };
        (format!("[{h}]"), port)
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p.parse().ok()?)),
            None => (s.to_string(), None),
        }
    };
    Some((host.to_ascii_lowercase(), port))
}

/// The credential of an `Authorization: Bearer X` header value (the scheme in any case).
pub fn bearer(authorization: &str) -> Option<&str> {
    authorization
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k.trim())
        .filter(|k| !k.is_empty())
}

/// SHA-256, the form secrets are kept and compared in.
pub fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// Why an upgrade is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 400: a malformed request (an unknown prefix, say).
    BadRequest(String),
    /// 401: a missing or wrong API key, or no credentials where the server needs them.
    Unauthorized(String),
    /// 403: an origin that may not connect.
    Forbidden(String),
}

impl Refusal {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Refusal::BadRequest(_) => ErrorKind::InvalidRequest,
            Refusal::Unauthorized(_) => ErrorKind::Unauthorized,
            Refusal::Forbidden(_) => ErrorKind::Forbidden,
        }
    }

    pub fn into_message(self) -> String {
        match self {
            Refusal::BadRequest(m) | Refusal::Unauthorized(m) | Refusal::Forbidden(m) => m,
        }
    }
}
