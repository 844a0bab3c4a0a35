//! Who may reach the server at all, decided before any identity: the `Host` every request names
//! (DNS rebinding: a page on `rebind.attacker.test` that resolves to 127.0.0.1 still sends its
//! own name), the `Origin` of a keyless browser upgrade (cross-site WebSocket hijacking), whether
//! keyless non-widget clients are served, the `/metrics` token, and which routes the admin port
//! serves. Operator settings only (`[server]`); docs/security.md has the threat model.

use std::net::{IpAddr, SocketAddr};

use subtle::ConstantTimeEq;

use crate::error::{EngineError, Result};
use crate::server::gate::credentials::{bearer, normalize_origin, sha256, split_host, Refusal};

/// Loopback host names: `localhost`, 127.0.0.0/8 and `[::1]`.
fn is_loopback_host(h: &str) -> bool {
    if h == "localhost" {
        return true;
    }
    let ip = h.trim_start_matches('[').trim_end_matches(']');
    ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Operator settings for `Access` (the `[server]` keys of the same names).
#[derive(Debug, Clone, Default)]
pub struct AccessSettings {
    pub allow_anonymous: Option<bool>,
    pub public_origins: Vec<String>,
    pub allowed_hosts: Vec<String>,
    pub metrics_token: String,
}

impl AccessSettings {
    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, value: &str, allowed: &str| EngineError::InvalidSetting {
            key: key.into(),
            value: value.into(),
            allowed: allowed.into(),
        };
        if let Some(o) = self
            .public_origins
            .iter()
            .find(|o| normalize_origin(o).is_none())
        {
            return Err(bad(
                "server.public_origins",
                o,
                "origins like \"https://chat.example.com\" (scheme, host, optional port; no path)",
            ));
        }
        if let Some(h) = self.allowed_hosts.iter().find(|h| {
            *h != "*" && (h.contains("://") || h.contains('/') || split_host(h).is_none())
        }) {
            return Err(bad(
                "server.allowed_hosts",
                h,
                "host names as clients send them in `Host` (\"chat.example.com\", \"10.0.0.5:8080\"), or \"*\"",
            ));
        }
        if !self.metrics_token.is_empty() && self.metrics_token.len() < 16 {
            return Err(bad(
                "server.metrics_token",
                "(hidden)",
                "empty (no token) or at least 16 characters",
            ));
        }
        Ok(())
    }
}

/// The checks, with the addresses the server actually listens on.
#[derive(Debug, Clone)]
pub struct Access {
    /// `None`: any `Host` (the operator's `"*"`).
    allowed_hosts: Option<Vec<(String, Option<u16>)>>,
    /// No hosts configured: loopback names are allowed besides the listen address.
    loopback_hosts: bool,
    public_origins: Vec<String>,
    /// The port, when the server listens on a loopback address: its own page's origin is then
    /// `http://localhost:PORT` (or 127.0.0.1, [::1]).
    loopback_port: Option<u16>,
    pub allow_anonymous: bool,
    metrics_token: Option<[u8; 32]>,
    admin: Option<SocketAddr>,
}

impl Access {
    /// `listen` is the bound main address, `admin` the bound admin address (when configured).
    pub fn new(
        s: &AccessSettings,
        host: &str,
        listen: SocketAddr,
        admin: Option<SocketAddr>,
        has_tenants: bool,
    ) -> Result<Self> {
        s.validate()?;
        let loopback = is_loopback_host(host) || listen.ip().is_loopback();
        let allowed_hosts = if s.allowed_hosts.iter().any(|h| h == "*") {
            None
        } else if s.allowed_hosts.is_empty() {
            let mut v = Vec::new();
            if !listen.ip().is_unspecified() {
                let h = match listen.ip() {
                    IpAddr::V6(ip) => format!("[{ip}]"),
                    ip => ip.to_string(),
                };
                v.push((h, None));
            }
            Some(v)
        } else {
            Some(
                s.allowed_hosts
                    .iter()
                    .filter_map(|h| split_host(h))
                    .collect(),
            )
        };
        Ok(Access {
            allowed_hosts,
            loopback_hosts: s.allowed_hosts.is_empty(),
            public_origins: s
                .public_origins
                .iter()
                .filter_map(|o| normalize_origin(o))
                .collect(),
            loopback_port: loopback.then_some(listen.port()),
            allow_anonymous: s.allow_anonymous.unwrap_or(loopback && !has_tenants),
            metrics_token: (!s.metrics_token.is_empty())
                .then(|| sha256(s.metrics_token.as_bytes())),
            admin,
        })
    }

    /// Whether a request naming `host` in its `Host` header is for this server. Loopback names
    /// are always allowed unless the operator listed hosts; a request with no `Host` is not.
    pub fn host_allowed(&self, host: Option<&str>) -> bool {
        let Some(allowed) = &self.allowed_hosts else {
            return true;
        };
        let Some((h, port)) = host.and_then(split_host) else {
            return false;
        };
        allowed
            .iter()
            .any(|(ah, ap)| *ah == h && (ap.is_none() || *ap == port))
            || (self.loopback_hosts && is_loopback_host(&h))
    }

    /// A keyless, widgetless upgrade: anonymous access must be on, and a browser (one that sends
    /// `Origin`) must come from the server's own public origin, or on loopback from a loopback
    /// origin of this very port over http.
    pub fn keyless(&self, origin: Option<&str>) -> std::result::Result<(), Refusal> {
        if !self.allow_anonymous {
            return Err(Refusal::Unauthorized(
                "this server needs an API key (Authorization: Bearer KEY) or a widget (?widget=ID)"
                    .into(),
            ));
        }
        match origin {
            Some(o) if !self.browser_origin_allowed(o) => Err(Refusal::Forbidden(format!(
                "cross-site WebSocket from {o} refused (not one of server.public_origins)"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether a browser page on `origin` may call this server without a widget: one of
    /// `server.public_origins`, or on loopback an http origin of this very port.
    pub fn browser_origin_allowed(&self, origin: &str) -> bool {
        let n = normalize_origin(origin);
        if n.as_ref().is_some_and(|n| self.public_origins.contains(n)) {
            return true;
        }
        if let (Some(port), Some(n)) = (self.loopback_port, &n) {
            if let Some(rest) = n.strip_prefix("http://") {
                return split_host(rest)
                    .is_some_and(|(h, p)| is_loopback_host(&h) && p == Some(port));
            }
        }
        false
    }

    /// `/metrics` with `server.metrics_token` set needs `Authorization: Bearer TOKEN`.
    pub fn metrics_authorized(&self, authorization: Option<&str>) -> bool {
        let Some(want) = &self.metrics_token else {
            return true;
        };
        authorization
            .and_then(bearer)
            .is_some_and(|token| bool::from(sha256(token.as_bytes()).ct_eq(want)))
    }

    /// The admin listener's address, when `/health` and `/metrics` moved there.
    pub fn admin(&self) -> Option<SocketAddr> {
        self.admin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(s: AccessSettings, host: &str, tenants: bool) -> Access {
        let listen: SocketAddr = format!(
            "{}:8080",
            if host == "localhost" {
                "127.0.0.1"
            } else {
                host
            }
        )
        .parse()
        .unwrap();
        Access::new(&s, host, listen, None, tenants).unwrap()
    }

    #[test]
    fn origins_normalize() {
        assert_eq!(
            normalize_origin("HTTPS://Shop.Example.com:443").as_deref(),
            Some("https://shop.example.com")
        );
        assert_eq!(
            normalize_origin("http://127.0.0.1:8080").as_deref(),
            Some("http://127.0.0.1:8080")
        );
        assert_eq!(
            normalize_origin("http://[::1]:80").as_deref(),
            Some("http://[::1]")
        );
        for bad in [
            "null",
            "https://a.test/x",
            "ftp://a.test",
            "https://",
            "https://a:b",
            "https://u@a.test",
        ] {
            assert_eq!(normalize_origin(bad), None, "{bad}");
        }
    }

    #[test]
    fn hosts_default_to_loopback_and_the_listen_address() {
        let a = access(AccessSettings::default(), "127.0.0.1", false);
        for h in [
            "127.0.0.1:8080",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "127.0.0.2",
        ] {
            assert!(a.host_allowed(Some(h)), "{h}");
        }
        for h in ["rebind.attacker.test:8080", "evil.test", "", "a b"] {
            assert!(!a.host_allowed(Some(h)), "{h}");
        }
        assert!(!a.host_allowed(None));
        let a = access(AccessSettings::default(), "10.0.0.5", false);
        assert!(a.host_allowed(Some("10.0.0.5:8080")));
        assert!(!a.host_allowed(Some("10.0.0.6:8080")));
        let listed = AccessSettings {
            allowed_hosts: vec!["chat.example.com".into(), "10.0.0.5:8443".into()],
            ..Default::default()
        };
        let a = access(listed, "0.0.0.0", false);
        assert!(a.host_allowed(Some("chat.example.com")));
        assert!(a.host_allowed(Some("Chat.Example.com:8080")));
        assert!(a.host_allowed(Some("10.0.0.5:8443")));
        assert!(!a.host_allowed(Some("10.0.0.5:8080")));
        assert!(
            !a.host_allowed(Some("localhost")),
            "listed hosts replace the defaults"
        );
        let any = AccessSettings {
            allowed_hosts: vec!["*".into()],
            ..Default::default()
        };
        assert!(access(any, "0.0.0.0", false).host_allowed(Some("whatever.test")));
    }

    #[test]
    fn keyless_browsers_come_from_public_or_loopback_origins() {
        let a = access(AccessSettings::default(), "127.0.0.1", false);
        assert!(a.allow_anonymous);
        assert!(a.keyless(None).is_ok());
        assert!(a.keyless(Some("http://127.0.0.1:8080")).is_ok());
        assert!(a.keyless(Some("http://localhost:8080")).is_ok());
        for o in [
            "https://127.0.0.1:8080",
            "http://127.0.0.1:9999",
            "http://rebind.attacker.test:8080",
            "null",
        ] {
            assert!(
                matches!(a.keyless(Some(o)), Err(Refusal::Forbidden(_))),
                "{o}"
            );
        }
        let public = AccessSettings {
            public_origins: vec!["https://chat.example.com".into()],
            allow_anonymous: Some(true),
            ..Default::default()
        };
        let a = access(public, "0.0.0.0", true);
        assert!(a.keyless(Some("https://chat.example.com")).is_ok());
        assert!(
            a.keyless(Some("http://localhost:8080")).is_err(),
            "not on loopback"
        );
    }

    #[test]
    fn anonymous_defaults_off_with_tenants_or_off_loopback() {
        assert!(!access(AccessSettings::default(), "127.0.0.1", true).allow_anonymous);
        assert!(!access(AccessSettings::default(), "0.0.0.0", false).allow_anonymous);
        let a = access(AccessSettings::default(), "127.0.0.1", true);
        assert!(matches!(a.keyless(None), Err(Refusal::Unauthorized(_))));
    }

    #[test]
    fn metrics_token() {
        let a = access(AccessSettings::default(), "127.0.0.1", false);
        assert!(a.metrics_authorized(None));
        let t = AccessSettings {
            metrics_token: "metrics-token-0123456789".into(),
            ..Default::default()
        };
        let a = access(t, "127.0.0.1", false);
        assert!(!a.metrics_authorized(None));
        assert!(!a.metrics_authorized(Some("Bearer wrong-token-0123456789")));
        assert!(a.metrics_authorized(Some("bearer metrics-token-0123456789")));
        assert!(AccessSettings {
            metrics_token: "short".into(),
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
