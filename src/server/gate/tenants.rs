//! Who a connection is: tenants, their API keys, embeddable widgets and named operator prefixes,
//! decided from the upgrade request alone, and the prefix-cache partition (`CacheScope`) each
//! request of that identity runs in.
//!
//! Principals (see docs/security.md): every API key is its own principal (a tenant with
//! `cache_scope = "tenant"` makes all its keys one), optionally split further by the request's
//! `cache_key`; every widget or anonymous session is its own principal. Blocks holding only
//! operator text (a widget's `system_prompt`, a tenant's `[[tenants.prefixes]]`) are shared by
//! the tenant's principals; from the first block with a client token on, blocks are salted with
//! the principal, so nothing one principal sends can be hit, or timed, by another.
//!
//! Salts are SHA-256 of a random per-process secret and the identity, so they can be neither
//! guessed nor chosen by a client. API keys are kept as SHA-256 digests (configured as keys or
//! as `api_key_sha256`) and compared in constant time.

use std::collections::HashMap;

use crate::engine::Quota;
use crate::server::request::overflow::{Overflow, DEFAULT_RETENTION};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::{EngineError, Result};
use crate::kv_cache::{CacheScope, Salt};
use crate::server::gate::credentials::Refusal;
use crate::server::gate::credentials::{bearer, normalize_origin, sha256};
use crate::server::request::error::{Field, RequestError};
use crate::server::request::tools::{Shape, Tools};
pub use crate::settings::{
    ClientRoles, PrefixSettings, TenantSettings, ToolSettings, WidgetSettings,
};

/// What kind of client a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    ApiKey,
    Widget,
    Anonymous,
}

/// A set of message roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles(u8);

const ROLE_NAMES: [&str; 3] = ["system", "user", "assistant"];

impl Roles {
    pub const ALL: Roles = Roles(0b111);

    pub(crate) fn parse(names: &[String]) -> Option<Roles> {
        let mut r = 0;
        for n in names {
            r |= 1 << ROLE_NAMES.iter().position(|x| x == n)?;
        }
        Some(Roles(r))
    }

    pub fn allows(self, role: &str) -> bool {
        ROLE_NAMES
            .iter()
            .position(|x| *x == role)
            .is_some_and(|i| self.0 & (1 << i) != 0)
    }

    /// Message `i` of a request, from role `role`: allowed, or the error naming the roles this
    /// client may send (the one wording of the rule, whichever dialect asks).
    pub fn check(self, i: usize, role: &str) -> Result<(), RequestError> {
        if self.allows(role) {
            return Ok(());
        }
        Err(RequestError::invalid(
            Field::Role(i),
            format!(
                "{role:?} is not allowed for this client (allowed: {})",
                self.names()
            ),
        ))
    }

    /// The allowed roles' names, in the order system, user, assistant.
    pub fn list(self) -> Vec<&'static str> {
        (0..3)
            .filter(|i| self.0 & (1 << i) != 0)
            .map(|i| ROLE_NAMES[i])
            .collect()
    }

    /// "system, user" (for error messages).
    pub fn names(self) -> String {
        let v = self.list();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    }
}

/// The identity a connection was accepted with (decided on the server, from the upgrade alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub kind: ClientKind,
    pub tenant_salt: Salt,
    /// The tenant's share of the scheduler.
    pub quota: Quota,
    /// API-key clients: their principal's partition. Sessions (widget, anonymous) are each their
    /// own principal, derived from the session id (`Tenants::scope`).
    key_salt: Option<Salt>,
    /// Operator text that leads every conversation: a widget's system prompt or a named prefix.
    pub system_prompt: Option<Arc<str>>,
    /// Roles this client may send.
    pub roles: Roles,
    /// Functions the client runs for the model (a widget's operator-declared tools): already
    /// described in `system_prompt`; a reply may call them unless it asks for another format.
    pub tools: Option<Arc<Tools>>,
    /// What its conversations do when they outgrow the context (a request may choose its own).
    pub overflow: Overflow,
}

impl Identity {
    /// Who a seal on an assistant message is bound to (`server::seal`): the tenant, the kind
    /// of client and the operator text it converses under (a widget's system prompt, a named
    /// prefix), the same on every replica with the same tenants (unlike the per-process cache
    /// salts).
    pub fn seal_scope(&self) -> String {
        format!(
            "{}\0{:?}\0{}",
            self.tenant,
            self.kind,
            self.system_prompt.as_deref().unwrap_or("")
        )
    }
}

pub const DEFAULT_TENANT: &str = "default";

/// `scheme://host[:port]` with nothing after it.
fn valid_origin(o: &str) -> bool {
    normalize_origin(o).is_some()
}

struct Tenant {
    name: String,
    salt: Salt,
    quota: Quota,
    /// Each prefix's operator text (its functions described after its system prompt) and its
    /// functions.
    prefixes: HashMap<String, (Arc<str>, Option<Arc<Tools>>)>,
    widget_roles: Roles,
    key_roles: Roles,
    /// Its own overflow policy (`tenants.overflow`), if it set one.
    overflow: Option<Overflow>,
}

struct Widget {
    tenant: usize,
    origins: Vec<String>,
    system_prompt: Option<Arc<str>>,
    tools: Option<Arc<Tools>>,
    overflow: Option<Overflow>,
}

pub struct Tenants {
    /// Random per process: salts cannot be computed outside it.
    secret: [u8; 32],
    tenants: Vec<Tenant>,
    /// SHA-256 of each key, its tenant, and the key's own salt.
    keys: Vec<([u8; 32], usize, Salt)>,
    widgets: HashMap<String, Widget>,
    default_salt: Salt,
    /// Keyless clients' share of the scheduler (`scheduler.anonymous_max_*`).
    anonymous_quota: Quota,
    /// The server's overflow policy (`limits.overflow`), and the retention ratio of every
    /// `drop_oldest` (`limits.overflow_retention`).
    overflow: Overflow,
    retention: f32,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("tenants", &self.tenants.len())
            .field("keys", &self.keys.len())
            .field("widgets", &self.widgets.len())
            .finish()
    }
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Tenants {
    /// Validates the configured tenants (unique names, keys, widget ids and prefix names,
    /// well-formed origins, known roles).
    pub fn new(tenants: &[TenantSettings]) -> Result<Self> {
        let mut t = Tenants {
            secret: rand::random(),
            tenants: Vec::new(),
            keys: Vec::new(),
            widgets: HashMap::new(),
            default_salt: Salt(0),
            anonymous_quota: Quota::default(),
            overflow: Overflow::Error,
            retention: DEFAULT_RETENTION,
        };
        t.default_salt = t.derive(&[b"tenant", DEFAULT_TENANT.as_bytes()]);
        let bad = |key: String, value: &str, allowed: &str| EngineError::InvalidSetting {
            key,
            value: value.into(),
            allowed: allowed.into(),
        };
        let mut names = std::collections::HashSet::new();
        for (i, ten) in tenants.iter().enumerate() {
            if ten.name.is_empty() || ten.name == DEFAULT_TENANT || !names.insert(ten.name.clone())
            {
                return Err(bad(
                    format!("tenants[{i}].name"),
                    &ten.name,
                    "a unique, non-empty name other than \"default\"",
                ));
            }
            let keys_salt = match ten.cache_scope.as_deref() {
                None | Some("key") => None,
                Some("tenant") => Some(t.derive(&[b"tenant keys", ten.name.as_bytes()])),
                Some(other) => {
                    return Err(bad(
                        format!("tenants[{i}].cache_scope"),
                        other,
                        "\"key\" (each API key its own cache partition) or \"tenant\"",
                    ))
                }
            };
            let roles = |key: &str, v: &[String]| {
                Roles::parse(v).ok_or_else(|| {
                    bad(
                        format!("tenants[{i}].client_roles.{key}"),
                        &format!("{v:?}"),
                        "a list of \"system\", \"user\", \"assistant\"",
                    )
                })
            };
            let overflow = |key: String, o: &Option<String>| {
                (o.as_deref())
                    .map(|name| {
                        Overflow::parse(name, DEFAULT_RETENTION)
                            .map_err(|_| bad(key, name, "\"error\" or \"drop_oldest\""))
                    })
                    .transpose()
            };
            let tenant_overflow = overflow(format!("tenants[{i}].overflow"), &ten.overflow)?;
            let widget_roles = roles("widget", &ten.client_roles.widget)?;
            let key_roles = roles("api_key", &ten.client_roles.api_key)?;
            let mut digests = Vec::new();
            for k in &ten.api_keys {
                if k.len() < 16 {
                    return Err(bad(
                        format!("tenants[{i}].api_keys"),
                        "(hidden)",
                        "keys of at least 16 characters",
                    ));
                }
                digests.push(sha256(k.as_bytes()));
            }
            for h in &ten.api_key_sha256 {
                digests.push(parse_hex32(&h.to_ascii_lowercase()).ok_or_else(|| {
                    bad(
                        format!("tenants[{i}].api_key_sha256"),
                        h,
                        "64 hex digits (sha256sum of the key)",
                    )
                })?);
            }
            for d in digests {
                if t.keys.iter().any(|(k, ..)| *k == d) {
                    return Err(bad(
                        format!("tenants[{i}].api_keys"),
                        "(hidden)",
                        "each key once, in one tenant only",
                    ));
                }
                let salt =
                    keys_salt.unwrap_or_else(|| t.derive(&[b"key", ten.name.as_bytes(), &d]));
                t.keys.push((d, i, salt));
            }
            let mut prefixes = HashMap::new();
            for (j, p) in ten.prefixes.iter().enumerate() {
                if !valid_id(&p.name) || prefixes.contains_key(&p.name) {
                    return Err(bad(
                        format!("tenants[{i}].prefixes[{j}].name"),
                        &p.name,
                        "a name of letters, digits, '-' and '_', used once in the tenant",
                    ));
                }
                if p.system_prompt.is_empty() {
                    return Err(bad(
                        format!("tenants[{i}].prefixes[{j}].system_prompt"),
                        "\"\"",
                        "the operator's text the prefix holds",
                    ));
                }
                let tools = declared_tools(&p.tools, &p.tool_choice)
                    .map_err(|(k, e)| bad(format!("tenants[{i}].prefixes[{j}].{k}"), "", &e))?;
                let text = described(&p.system_prompt, tools.as_ref());
                prefixes.insert(
                    p.name.clone(),
                    (Arc::from(text.as_str()), tools.map(Arc::new)),
                );
            }
            for (j, w) in ten.widgets.iter().enumerate() {
                if !valid_id(&w.id) {
                    return Err(bad(
                        format!("tenants[{i}].widgets[{j}].id"),
                        &w.id,
                        "letters, digits, '-' and '_'",
                    ));
                }
                if let Some(o) = w.origins.iter().find(|o| !valid_origin(o)) {
                    return Err(bad(format!("tenants[{i}].widgets[{j}].origins"), o, "origins like \"https://shop.example.com\" (scheme, host, optional port; no path)"));
                }
                let tools = declared_tools(&w.tools, &w.tool_choice)
                    .map_err(|(k, e)| bad(format!("tenants[{i}].widgets[{j}].{k}"), "", &e))?;
                let prompt = described(&w.system_prompt, tools.as_ref());
                let widget = Widget {
                    tenant: i,
                    origins: w
                        .origins
                        .iter()
                        .filter_map(|o| normalize_origin(o))
                        .collect(),
                    system_prompt: (!prompt.is_empty()).then(|| Arc::from(prompt.as_str())),
                    tools: tools.map(Arc::new),
                    overflow: overflow(format!("tenants[{i}].widgets[{j}].overflow"), &w.overflow)?,
                };
                if t.widgets.insert(w.id.clone(), widget).is_some() {
                    return Err(bad(
                        format!("tenants[{i}].widgets[{j}].id"),
                        &w.id,
                        "a widget id used once",
                    ));
                }
            }
            for (key, v) in [
                ("max_running", ten.max_running),
                ("max_waiting", ten.max_waiting),
            ] {
                if v == Some(0) {
                    return Err(bad(
                        format!("tenants.{}.{key}", ten.name),
                        "0",
                        "1 or more, or unset",
                    ));
                }
            }
            t.tenants.push(Tenant {
                quota: Quota {
                    max_running: ten.max_running,
                    max_waiting: ten.max_waiting,
                },
                salt: t.derive(&[b"tenant", ten.name.as_bytes()]),
                name: ten.name.clone(),
                prefixes,
                widget_roles,
                key_roles,
                overflow: tenant_overflow,
            });
        }
        Ok(t)
    }

    /// Whether any API key is configured.
    pub fn has_keys(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether any tenant is configured.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// A salt from the process secret and `parts` (each length-prefixed, so parts cannot run
    /// into each other).
    fn derive(&self, parts: &[&[u8]]) -> Salt {
        let mut h = Sha256::new();
        h.update(self.secret);
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        let d = h.finalize();
        Salt(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")))
    }

    /// The cache partition of a request: `session` is the session's id (its own principal when
    /// the client is a widget or anonymous visitor), `cache_key` the request's optional
    /// partition (API-key clients only), `shared_tokens` how many leading prompt tokens are
    /// operator text.
    pub fn scope(
        &self,
        id: &Identity,
        session: &uuid::Uuid,
        cache_key: Option<&str>,
        shared_tokens: usize,
    ) -> CacheScope {
        let base = match id.key_salt {
            Some(s) => s,
            None => self.derive(&[b"session", id.tenant.as_bytes(), session.as_bytes()]),
        };
        let principal = match cache_key {
            Some(k) => self.derive(&[b"cache_key", &base.0.to_le_bytes(), k.as_bytes()]),
            None => base,
        };
        CacheScope {
            tenant: id.tenant_salt,
            principal,
            shared_tokens,
        }
    }

    /// (tenant salt, text) of every configured operator prompt (widget system prompts and
    /// tenant prefixes), once each: these are pinned at start.
    pub fn operator_prompts(&self) -> Vec<(Salt, Arc<str>)> {
        let mut out: Vec<(Salt, Arc<str>)> = Vec::new();
        let widgets = self
            .widgets
            .values()
            .filter_map(|w| Some((self.tenants[w.tenant].salt, w.system_prompt.clone()?)));
        let prefixes = self
            .tenants
            .iter()
            .flat_map(|t| t.prefixes.values().map(|p| (t.salt, p.0.clone())));
        for (salt, text) in widgets.chain(prefixes) {
            if !out.iter().any(|(s, t)| *s == salt && *t == text) {
                out.push((salt, text));
            }
        }
        out
    }

    /// Whether a widget with this id is configured.
    pub fn has_widget(&self, id: &str) -> bool {
        self.widgets.contains_key(id)
    }

    /// The identity of widget `id` when a page on `origin` may use it.
    pub fn widget(&self, id: &str, origin: Option<&str>) -> std::result::Result<Identity, Refusal> {
        let Some(w) = self.widgets.get(id) else {
            return Err(Refusal::Forbidden(format!("unknown widget `{id}`")));
        };
        let Some(o) = origin else {
            return Err(Refusal::Forbidden(format!(
                "widget `{id}` connects from a browser page: no Origin given"
            )));
        };
        if !normalize_origin(o).is_some_and(|n| w.origins.contains(&n)) {
            return Err(Refusal::Forbidden(format!(
                "origin {o} may not embed widget `{id}`"
            )));
        }
        let t = &self.tenants[w.tenant];
        Ok(Identity {
            tenant: t.name.clone(),
            kind: ClientKind::Widget,
            tenant_salt: t.salt,
            quota: t.quota,
            key_salt: None,
            system_prompt: w.system_prompt.clone(),
            roles: t.widget_roles,
            tools: w.tools.clone(),
            overflow: self.overflow_of(w.overflow.or(t.overflow)),
        })
    }

    /// The identity of an `Authorization` header's value, or 401. The key is hashed and
    /// compared with every configured digest in constant time.
    pub fn api_key(
        &self,
        authorization: &str,
        prefix: Option<&str>,
    ) -> std::result::Result<Identity, Refusal> {
        let key = bearer(authorization).ok_or_else(|| {
            Refusal::Unauthorized("the Authorization header must be `Bearer KEY`".into())
        })?;
        let d = sha256(key.as_bytes());
        // Every digest is compared, whichever matches.
        let mut found = None;
        for (k, tenant, salt) in &self.keys {
            if bool::from(k.ct_eq(&d)) {
                found = Some((*tenant, *salt));
            }
        }
        let Some((tenant, salt)) = found else {
            return Err(Refusal::Unauthorized("unknown API key".into()));
        };
        let t = &self.tenants[tenant];
        let (system_prompt, tools) = match prefix {
            None => (None, None),
            Some(p) => {
                let (text, tools) = t.prefixes.get(p).cloned().ok_or_else(|| {
                    Refusal::BadRequest(format!(
                        "`prefix` {p:?} is not one of tenant `{}`'s prefixes",
                        t.name
                    ))
                })?;
                (Some(text), tools)
            }
        };
        Ok(Identity {
            tenant: t.name.clone(),
            kind: ClientKind::ApiKey,
            tenant_salt: t.salt,
            quota: t.quota,
            key_salt: Some(salt),
            system_prompt,
            roles: t.key_roles,
            tools,
            overflow: self.overflow_of(t.overflow),
        })
    }

    /// Sets the server's overflow policy (`limits.overflow`), and the retention ratio every
    /// `drop_oldest` policy keeps.
    pub fn with_overflow(mut self, overflow: Overflow) -> Self {
        if let Overflow::DropOldest { retention } = overflow {
            self.retention = retention;
        }
        self.overflow = overflow;
        self
    }

    /// A tenant's or widget's own policy with the server's retention ratio, or the server's.
    fn overflow_of(&self, own: Option<Overflow>) -> Overflow {
        match own {
            Some(Overflow::DropOldest { .. }) => Overflow::DropOldest {
                retention: self.retention,
            },
            Some(Overflow::Error) => Overflow::Error,
            None => self.overflow,
        }
    }

    /// Sets the keyless clients' share of the scheduler.
    pub fn with_anonymous_quota(mut self, quota: Quota) -> Self {
        self.anonymous_quota = quota;
        self
    }

    /// An anonymous visitor of the default tenant: its own principal, any role (there is no
    /// operator prompt to override; what it sends stays in its session).
    pub fn anonymous(&self) -> Identity {
        Identity {
            tenant: DEFAULT_TENANT.into(),
            kind: ClientKind::Anonymous,
            tenant_salt: self.default_salt,
            quota: self.anonymous_quota,
            key_salt: None,
            system_prompt: None,
            roles: Roles::ALL,
            tools: None,
            overflow: self.overflow,
        }
    }
}

/// Most bytes of JSON a widget's tools may take (operator text, but each is compiled into a
/// grammar: llguidance's fuel bounds the rest).
const MAX_WIDGET_TOOLS_BYTES: usize = 65536;

/// Operator text with the functions' description after it: operator text too, shared and
/// cached with it.
fn described(system_prompt: &str, tools: Option<&Tools>) -> String {
    match tools {
        Some(t) if system_prompt.is_empty() => t.system_text(),
        Some(t) => format!("{system_prompt}\n\n{}", t.system_text()),
        None => system_prompt.to_string(),
    }
}

/// A widget's or a prefix's declared tools, checked as a client's would be (`Tools::parse`),
/// one call per reply; the failing key and why.
fn declared_tools(
    tools: &[ToolSettings],
    tool_choice: &Option<String>,
) -> std::result::Result<Option<Tools>, (String, String)> {
    if tools.is_empty() {
        return match tool_choice {
            None => Ok(None),
            Some(_) => Err(("tool_choice".into(), "needs `tools`".into())),
        };
    }
    let list: Vec<serde_json::Value> = (tools.iter())
        .map(|t| {
            serde_json::json!({"type": "function", "name": t.name, "description": t.description,
                "parameters": t.parameters})
        })
        .collect();
    let choice = match tool_choice.as_deref() {
        None | Some("auto") => None,
        Some("required") => Some(serde_json::json!("required")),
        Some(other) => {
            return Err((
                "tool_choice".into(),
                format!("\"auto\" or \"required\", not {other:?}"),
            ))
        }
    };
    Tools::parse(
        Some(&list),
        choice.as_ref(),
        Some(false),
        MAX_WIDGET_TOOLS_BYTES,
        Shape::Flat,
    )
    .map_err(|e| match e {
        RequestError::InvalidParam { field, reason } => {
            (field.name(crate::server::request::Dialect::OpenAi), reason)
        }
        other => ("tools".into(), other.to_string()),
    })
}

/// An id the operator or a client names things by: 1 to 64 of `A-Z a-z 0-9 _ -`.
pub(crate) fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acme(cache_scope: Option<&str>) -> Tenants {
        Tenants::new(&[TenantSettings {
            name: "acme".into(),
            api_keys: vec!["acme-key-0123456789".into(), "acme-key-second-one".into()],
            api_key_sha256: vec![format!("{:x}", Sha256::digest(b"acme-key-from-digest"))],
            widgets: vec![WidgetSettings {
                id: "acme-help".into(),
                origins: vec!["https://shop.acme.test".into()],
                system_prompt: "Be kind.".into(),
                ..Default::default()
            }],
            prefixes: vec![PrefixSettings {
                name: "support".into(),
                system_prompt: "You answer support questions.".into(),
                ..Default::default()
            }],
            cache_scope: cache_scope.map(String::from),
            client_roles: ClientRoles::default(),
            ..Default::default()
        }])
        .unwrap()
    }

    #[test]
    fn keys_any_bearer_case_and_digests() {
        let t = acme(None);
        for h in [
            "Bearer acme-key-0123456789",
            "bearer acme-key-0123456789",
            "BEARER  acme-key-0123456789 ",
            "Bearer acme-key-from-digest",
        ] {
            let id = t.api_key(h, None).unwrap_or_else(|e| panic!("{h}: {e:?}"));
            assert_eq!((id.tenant.as_str(), id.kind), ("acme", ClientKind::ApiKey));
            assert_eq!(id.roles, Roles::ALL);
        }
        for h in [
            "Bearer nope",
            "Basic acme-key-0123456789",
            "acme-key-0123456789",
            "Bearer ",
        ] {
            assert!(
                matches!(t.api_key(h, None), Err(Refusal::Unauthorized(_))),
                "{h}"
            );
        }
        let id = t
            .api_key("Bearer acme-key-0123456789", Some("support"))
            .unwrap();
        assert_eq!(
            id.system_prompt.as_deref(),
            Some("You answer support questions.")
        );
        assert!(matches!(
            t.api_key("Bearer acme-key-0123456789", Some("nope")),
            Err(Refusal::BadRequest(_))
        ));
    }

    #[test]
    fn widgets_by_origin_with_user_role_only() {
        let t = acme(None);
        let id = t
            .widget("acme-help", Some("https://shop.acme.test"))
            .unwrap();
        assert_eq!(
            (id.tenant.as_str(), id.system_prompt.as_deref()),
            ("acme", Some("Be kind."))
        );
        assert!(id.roles.allows("user") && !id.roles.allows("system"));
        assert_eq!(id.roles.names(), "user");
        // Origins compare by scheme, host and port; default ports and case normalize.
        assert!(t
            .widget("acme-help", Some("https://SHOP.acme.test:443"))
            .is_ok());
        for o in [
            "http://shop.acme.test",
            "https://shop.acme.test:8443",
            "https://evil.test",
        ] {
            assert!(
                matches!(t.widget("acme-help", Some(o)), Err(Refusal::Forbidden(_))),
                "{o}"
            );
        }
        assert!(matches!(
            t.widget("acme-help", None),
            Err(Refusal::Forbidden(_))
        ));
        assert!(matches!(
            t.widget("nope", Some("https://shop.acme.test")),
            Err(Refusal::Forbidden(_))
        ));
    }

    /// A widget's overflow policy over its tenant's over the server's; every `drop_oldest`
    /// keeps the server's retention ratio; an unknown policy is refused naming its key.
    #[test]
    fn overflow_policies_resolve_widget_over_tenant_over_server() {
        let keep = Overflow::DropOldest { retention: 0.6 };
        let tenant = |tenant: Option<&str>, widget: Option<&str>| TenantSettings {
            name: "acme".into(),
            api_keys: vec!["acme-0123456789abcdef".into()],
            overflow: tenant.map(String::from),
            widgets: vec![WidgetSettings {
                id: "help".into(),
                origins: vec!["https://shop.acme.test".into()],
                overflow: widget.map(String::from),
                ..Default::default()
            }],
            ..Default::default()
        };
        let of = |t: TenantSettings, server: Overflow| {
            let t = Tenants::new(&[t]).unwrap().with_overflow(server);
            let w = t.widget("help", Some("https://shop.acme.test")).unwrap();
            let k = t.api_key("Bearer acme-0123456789abcdef", None).unwrap();
            (w.overflow, k.overflow, t.anonymous().overflow)
        };
        assert_eq!(
            of(tenant(None, None), Overflow::Error),
            (Overflow::Error, Overflow::Error, Overflow::Error)
        );
        assert_eq!(of(tenant(None, None), keep), (keep, keep, keep));
        assert_eq!(
            of(tenant(Some("drop_oldest"), None), Overflow::Error),
            (
                Overflow::DropOldest {
                    retention: DEFAULT_RETENTION
                },
                Overflow::DropOldest {
                    retention: DEFAULT_RETENTION
                },
                Overflow::Error
            )
        );
        assert_eq!(
            of(tenant(Some("drop_oldest"), Some("error")), keep),
            (Overflow::Error, keep, keep)
        );
        let e = Tenants::new(&[tenant(None, Some("shift"))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("tenants[0].widgets[0].overflow"), "{e}");
    }

    #[test]
    fn a_widgets_tools_are_checked_and_described_in_its_operator_text() {
        use crate::settings::ToolSettings;
        let tenant = |tools: Vec<ToolSettings>, choice: Option<&str>| TenantSettings {
            name: "acme".into(),
            widgets: vec![WidgetSettings {
                id: "help".into(),
                origins: vec!["https://shop.acme.test".into()],
                system_prompt: "Be kind.".into(),
                tools,
                tool_choice: choice.map(String::from),
                overflow: None,
            }],
            ..Default::default()
        };
        let tool = |name: &str| ToolSettings {
            name: name.into(),
            description: "Looks up an order.".into(),
            parameters: Some(serde_json::json!({"type": "object"})),
        };
        let t = Tenants::new(&[tenant(vec![tool("order_status")], None)]).unwrap();
        let w = t.widget("help", Some("https://shop.acme.test")).unwrap();
        let tools = w.tools.as_ref().expect("the widget's tools");
        assert!(tools.active() && !tools.parallel);
        let prompt = w.system_prompt.as_deref().unwrap();
        assert!(prompt.starts_with("Be kind.\n\nYou can call these functions:"));
        assert!(prompt.contains("order_status"));
        let e = |ten| Tenants::new(&[ten]).unwrap_err().to_string();
        let s = e(tenant(vec![tool("bad name")], None));
        assert!(s.contains("tenants[0].widgets[0].tools[0].name"), "{s}");
        let s = e(tenant(vec![tool("a"), tool("a")], None));
        assert!(s.contains("declared twice"), "{s}");
        let s = e(tenant(vec![tool("a")], Some("always")));
        assert!(s.contains("tenants[0].widgets[0].tool_choice"), "{s}");
        let s = e(tenant(vec![], Some("required")));
        assert!(s.contains("needs `tools`"), "{s}");
        // A named prefix's tools: for the API-key clients that select it.
        let t = Tenants::new(&[TenantSettings {
            name: "acme".into(),
            api_keys: vec!["acme-key-0123456789".into()],
            prefixes: vec![PrefixSettings {
                name: "orders".into(),
                system_prompt: "You answer order questions.".into(),
                tools: vec![tool("order_status")],
                tool_choice: Some("required".into()),
            }],
            ..Default::default()
        }])
        .unwrap();
        let k = t
            .api_key("Bearer acme-key-0123456789", Some("orders"))
            .unwrap();
        let tools = k.tools.as_ref().expect("the prefix's tools");
        assert_eq!(
            tools.choice,
            crate::server::request::tools::ToolChoice::Required
        );
        assert!(k.system_prompt.as_deref().unwrap().contains("order_status"));
        let plain = t.api_key("Bearer acme-key-0123456789", None).unwrap();
        assert!(plain.tools.is_none());
        // What is pinned at start is the text with the description.
        assert!(t
            .operator_prompts()
            .iter()
            .any(|(_, p)| p.contains("order_status")));
    }

    #[test]
    fn principals_get_their_own_partitions() {
        let t = acme(None);
        let s1 = uuid::Uuid::new_v4();
        let s2 = uuid::Uuid::new_v4();
        let k1 = t.api_key("Bearer acme-key-0123456789", None).unwrap();
        let k2 = t.api_key("Bearer acme-key-second-one", None).unwrap();
        let w = t
            .widget("acme-help", Some("https://shop.acme.test"))
            .unwrap();
        let a = t.anonymous();
        let p = |id: &Identity, s: &uuid::Uuid, ck: Option<&str>| t.scope(id, s, ck, 0).principal;
        // A key is one principal whatever the session; two keys are two.
        assert_eq!(p(&k1, &s1, None), p(&k1, &s2, None));
        assert_ne!(p(&k1, &s1, None), p(&k2, &s1, None));
        // cache_key partitions within the key.
        assert_ne!(p(&k1, &s1, Some("u1")), p(&k1, &s1, Some("u2")));
        assert_eq!(p(&k1, &s1, Some("u1")), p(&k1, &s2, Some("u1")));
        assert_ne!(p(&k1, &s1, Some("u1")), p(&k2, &s1, Some("u1")));
        // Widget and anonymous sessions: each session alone.
        assert_ne!(p(&w, &s1, None), p(&w, &s2, None));
        assert_ne!(p(&a, &s1, None), p(&a, &s2, None));
        assert_ne!(p(&w, &s1, None), p(&a, &s1, None));
        // Operator text is the tenant's, shared by its widgets and keys.
        assert_eq!(
            t.scope(&w, &s1, None, 0).tenant,
            t.scope(&k1, &s1, None, 0).tenant
        );
        assert_ne!(
            t.scope(&w, &s1, None, 0).tenant,
            t.scope(&a, &s1, None, 0).tenant
        );
        // cache_scope = "tenant": the keys share one partition (widgets still do not).
        let t = acme(Some("tenant"));
        let k1 = t.api_key("Bearer acme-key-0123456789", None).unwrap();
        let k2 = t.api_key("Bearer acme-key-second-one", None).unwrap();
        assert_eq!(t.scope(&k1, &s1, None, 0), t.scope(&k2, &s2, None, 0));
        // Another process (secret) gives other salts.
        assert_ne!(
            acme(None).anonymous().tenant_salt,
            acme(None).anonymous().tenant_salt
        );
    }

    #[test]
    fn operator_prompts_are_listed_once() {
        let t = acme(None);
        let p = t.operator_prompts();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p.iter().all(|(s, _)| *s
            == t.widget("acme-help", Some("https://shop.acme.test"))
                .unwrap()
                .tenant_salt));
    }

    #[test]
    fn bad_config_is_named() {
        let e = |ten: TenantSettings| Tenants::new(&[ten]).unwrap_err().to_string();
        let s = e(TenantSettings {
            name: "x".into(),
            api_keys: vec!["short".into()],
            ..Default::default()
        });
        assert!(s.contains("tenants[0].api_keys"), "{s}");
        let s = e(TenantSettings {
            name: "x".into(),
            widgets: vec![WidgetSettings {
                id: "w".into(),
                origins: vec!["https://a.test/path".into()],
                system_prompt: String::new(),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert!(s.contains("origins"), "{s}");
        let s = e(TenantSettings {
            name: "x".into(),
            api_key_sha256: vec!["abc".into()],
            ..Default::default()
        });
        assert!(s.contains("api_key_sha256"), "{s}");
        let s = e(TenantSettings {
            name: "x".into(),
            cache_scope: Some("world".into()),
            ..Default::default()
        });
        assert!(s.contains("cache_scope"), "{s}");
        let s = e(TenantSettings {
            name: "x".into(),
            client_roles: ClientRoles {
                widget: vec!["robot".into()],
                ..Default::default()
            },
            ..Default::default()
        });
        assert!(s.contains("client_roles.widget"), "{s}");
    }
}
