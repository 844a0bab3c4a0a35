//! Who is connecting: tenants, their API keys and embeddable widgets, checked on the WebSocket
//! upgrade, and the prefix-cache salt each identity maps to.
//!
//! The salt comes only from the server-side identity (an API key or a widget id defined in config),
//! never from anything a client says in a frame: prefix caching leaks timing between users who
//! share a cache, so tenants never share blocks. A browser upgrade carrying an `Origin` is accepted
//! only from the server's own origin or from an origin its widget allows (cross-site WebSocket
//! hijacking otherwise lets any page a user visits talk to the server as that user).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use actix_web::HttpRequest;
use serde::Deserialize;

use crate::error::{EngineError, Result};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WidgetSettings {
    /// Public id, used as `?widget=ID` and in `data-widget`.
    pub id: String,
    /// Origins allowed to embed it, e.g. "https://shop.example.com".
    pub origins: Vec<String>,
    /// Prepended as the system message of every conversation through this widget.
    #[serde(default)]
    pub system_prompt: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    pub name: String,
    /// Keys for server-side clients (`Authorization: Bearer KEY`).
    #[serde(default)]
    pub api_keys: Vec<String>,
    #[serde(default)]
    pub widgets: Vec<WidgetSettings>,
}

/// The identity a connection was accepted with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub salt: u64,
    pub system_prompt: Option<String>,
}

/// Why an upgrade is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 401: a missing or wrong API key.
    Unauthorized(String),
    /// 403: an origin that may not connect.
    Forbidden(String),
}

pub const DEFAULT_TENANT: &str = "default";

fn salt_of(tenant: &str) -> u64 {
    if tenant == DEFAULT_TENANT {
        return 0;
    }
    let mut h = std::hash::DefaultHasher::new();
    "llama-relay tenant".hash(&mut h);
    tenant.hash(&mut h);
    h.finish() | 1
}

/// `scheme://host[:port]` with nothing after it.
fn valid_origin(o: &str) -> bool {
    let Some((scheme, rest)) = o.split_once("://") else {
        return false;
    };
    matches!(scheme, "http" | "https")
        && !rest.is_empty()
        && !rest.contains('/')
        && !rest.contains('?')
}

#[derive(Debug, Clone, Default)]
pub struct Tenants {
    keys: HashMap<String, String>,
    widgets: HashMap<String, (String, WidgetSettings)>,
}

impl Tenants {
    /// Validates the configured tenants (unique names, keys and widget ids, well-formed origins).
    pub fn new(tenants: &[TenantSettings]) -> Result<Self> {
        let bad = |key: &str, value: &str, allowed: &str| EngineError::InvalidSetting {
            key: key.into(),
            value: value.into(),
            allowed: allowed.into(),
        };
        let mut t = Tenants::default();
        let mut names = std::collections::HashSet::new();
        for (i, ten) in tenants.iter().enumerate() {
            if ten.name.is_empty() || ten.name == DEFAULT_TENANT || !names.insert(ten.name.clone())
            {
                return Err(bad(
                    &format!("tenants[{i}].name"),
                    &ten.name,
                    "a unique, non-empty name other than \"default\"",
                ));
            }
            for k in &ten.api_keys {
                if k.len() < 16 {
                    return Err(bad(
                        &format!("tenants[{i}].api_keys"),
                        "(hidden)",
                        "keys of at least 16 characters",
                    ));
                }
                if t.keys.insert(k.clone(), ten.name.clone()).is_some() {
                    return Err(bad(
                        &format!("tenants[{i}].api_keys"),
                        "(hidden)",
                        "each key in one tenant only",
                    ));
                }
            }
            for (j, w) in ten.widgets.iter().enumerate() {
                if w.id.is_empty()
                    || !w
                        .id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                {
                    return Err(bad(
                        &format!("tenants[{i}].widgets[{j}].id"),
                        &w.id,
                        "letters, digits, '-' and '_'",
                    ));
                }
                if let Some(o) = w.origins.iter().find(|o| !valid_origin(o)) {
                    return Err(bad(&format!("tenants[{i}].widgets[{j}].origins"), o, "origins like \"https://shop.example.com\" (scheme, host, optional port; no path)"));
                }
                if t.widgets
                    .insert(w.id.clone(), (ten.name.clone(), w.clone()))
                    .is_some()
                {
                    return Err(bad(
                        &format!("tenants[{i}].widgets[{j}].id"),
                        &w.id,
                        "a widget id used once",
                    ));
                }
            }
        }
        Ok(t)
    }

    fn identity(&self, tenant: &str, system_prompt: Option<String>) -> Identity {
        Identity {
            tenant: tenant.into(),
            salt: salt_of(tenant),
            system_prompt: system_prompt.filter(|s| !s.is_empty()),
        }
    }

    /// (salt, system prompt) of every widget that has one.
    pub fn widget_prompts(&self) -> Vec<(u64, String)> {
        self.widgets
            .values()
            .filter(|(_, w)| !w.system_prompt.is_empty())
            .map(|(t, w)| (salt_of(t), w.system_prompt.clone()))
            .collect()
    }

    /// Whether a widget with this id is configured.
    pub fn has_widget(&self, id: &str) -> bool {
        self.widgets.contains_key(id)
    }

    /// The widget `id` and its tenant, if a page on `origin` may use it.
    pub fn widget_for(
        &self,
        id: &str,
        origin: Option<&str>,
    ) -> std::result::Result<(&str, &WidgetSettings), Refusal> {
        let Some((tenant, w)) = self.widgets.get(id) else {
            return Err(Refusal::Forbidden(format!("unknown widget `{id}`")));
        };
        match origin {
            Some(o) if w.origins.iter().any(|a| a == o) => Ok((tenant, w)),
            Some(o) => Err(Refusal::Forbidden(format!(
                "origin {o} may not embed widget `{id}`"
            ))),
            None => Err(Refusal::Forbidden(format!(
                "widget `{id}` connects from a browser page: no Origin given"
            ))),
        }
    }

    /// Decides who an upgrade request is. `widget` is the `?widget=` query value.
    pub fn identify(
        &self,
        req: &HttpRequest,
        widget: Option<&str>,
    ) -> std::result::Result<Identity, Refusal> {
        let headers = req.headers();
        if let Some(auth) = headers.get("authorization") {
            let key = auth
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            return match key.and_then(|k| self.keys.get(k)) {
                Some(tenant) => Ok(self.identity(tenant, None)),
                None => Err(Refusal::Unauthorized("unknown API key".into())),
            };
        }
        let origin = headers.get("origin").and_then(|o| o.to_str().ok());
        if let Some(id) = widget {
            let (tenant, w) = self.widget_for(id, origin)?;
            return Ok(self.identity(tenant, Some(w.system_prompt.clone())));
        }
        // No key, no widget: the server's own page (same origin) or a non-browser client.
        if let Some(o) = origin {
            let host = headers
                .get("host")
                .and_then(|h| h.to_str().ok())
                .unwrap_or("");
            let same = o.split_once("://").map(|(_, h)| h == host).unwrap_or(false);
            if !same {
                return Err(Refusal::Forbidden(format!(
                    "cross-site WebSocket from {o} refused"
                )));
            }
        }
        Ok(self.identity(DEFAULT_TENANT, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn tenants() -> Tenants {
        Tenants::new(&[TenantSettings {
            name: "acme".into(),
            api_keys: vec!["acme-key-0123456789".into()],
            widgets: vec![WidgetSettings {
                id: "acme-help".into(),
                origins: vec!["https://shop.acme.test".into()],
                system_prompt: "Be kind.".into(),
            }],
        }])
        .unwrap()
    }

    #[test]
    fn keys_widgets_and_origins() {
        let t = tenants();
        let r = TestRequest::default()
            .insert_header(("authorization", "Bearer acme-key-0123456789"))
            .to_http_request();
        assert_eq!(t.identify(&r, None).unwrap().tenant, "acme");
        let r = TestRequest::default()
            .insert_header(("authorization", "Bearer nope"))
            .to_http_request();
        assert!(matches!(
            t.identify(&r, None),
            Err(Refusal::Unauthorized(_))
        ));
        let r = TestRequest::default()
            .insert_header(("origin", "https://shop.acme.test"))
            .to_http_request();
        let id = t.identify(&r, Some("acme-help")).unwrap();
        assert_eq!(
            (id.tenant.as_str(), id.system_prompt.as_deref()),
            ("acme", Some("Be kind."))
        );
        let r = TestRequest::default()
            .insert_header(("origin", "https://evil.test"))
            .to_http_request();
        assert!(matches!(
            t.identify(&r, Some("acme-help")),
            Err(Refusal::Forbidden(_))
        ));
        assert!(
            matches!(t.identify(&r, None), Err(Refusal::Forbidden(_))),
            "cross-site without widget"
        );
        let r = TestRequest::default()
            .insert_header(("origin", "http://localhost:8080"))
            .insert_header(("host", "localhost:8080"))
            .to_http_request();
        assert_eq!(t.identify(&r, None).unwrap().tenant, DEFAULT_TENANT);
        let r = TestRequest::default().to_http_request();
        assert_eq!(t.identify(&r, None).unwrap().salt, 0);
    }

    #[test]
    fn tenants_get_distinct_salts() {
        assert_ne!(salt_of("a"), salt_of("b"));
        assert_ne!(salt_of("a"), 0);
        assert_eq!(salt_of(DEFAULT_TENANT), 0);
    }

    #[test]
    fn bad_config_is_named() {
        let e = Tenants::new(&[TenantSettings {
            name: "x".into(),
            api_keys: vec!["short".into()],
            widgets: vec![],
        }])
        .unwrap_err()
        .to_string();
        assert!(e.contains("tenants[0].api_keys"), "{e}");
        let w = WidgetSettings {
            id: "w".into(),
            origins: vec!["https://a.test/path".into()],
            system_prompt: String::new(),
        };
        let e = Tenants::new(&[TenantSettings {
            name: "x".into(),
            api_keys: vec![],
            widgets: vec![w],
        }])
        .unwrap_err()
        .to_string();
        assert!(e.contains("origins"), "{e}");
    }
}
