//! Routes: `/ws` (the session), `/health/live` (the process answers), `/health/ready` and
//! `/health` (503 while the model loads, after it failed, and while draining), `/metrics` (Prometheus),
//! the static chat page at `/`, the embeddable `widget.js`, and `/widget/{id}`, which tells a
//! widget whether the page embedding it may use it (a refused WebSocket upgrade tells a page
//! nothing; this answer, with CORS headers, lets the widget say why). `gate` runs before every
//! route: the `Host` check and the admin listener's split.

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

use crate::server::gate::admission::Place;
use crate::server::gate::credentials::Refusal;
use crate::server::gate::tenants::Identity;
use crate::server::state::{AppState, Status};
use crate::server::ws::session::Session;

/// Before every route: a `Host` this server does not serve gets 421 (a DNS-rebinding page sends
/// its own name); with an admin listener, `/health` and `/metrics` answer there alone and it
/// answers nothing else. The probes `/health/ready` and `/health/live` are exempt from the `Host`
/// check: health checkers name no public host (HAProxy's `httpchk` sends none, a kubelet sends
/// the pod's address), and what they answer (ok, loading, draining) tells a rebinding page
/// nothing.
pub async fn gate(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let state = req
        .app_data::<web::Data<AppState>>()
        .expect("state is registered")
        .clone();
    let host = req
        .headers()
        .get(actix_web::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(String::from)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let probe = matches!(req.path(), "/health/ready" | "/health/live");
    if !probe && !state.access.host_allowed(host.as_deref()) {
        state.metrics.error("misdirected");
        let shown = host.as_deref().unwrap_or("(none)");
        tracing::info!(host = shown, "request for a host not served");
        let resp = HttpResponse::MisdirectedRequest().json(json!({
            "error_type": "misdirected",
            "message": format!("this server does not serve host `{shown}` (server.allowed_hosts)"),
        }));
        return Ok(req.into_response(resp));
    }
    if let Some(admin) = state.access.admin() {
        let on_admin = req.app_config().local_addr() == admin;
        let admin_route = matches!(
            req.path(),
            "/health" | "/health/ready" | "/health/live" | "/metrics"
        );
        if on_admin != admin_route {
            return Ok(req.into_response(HttpResponse::NotFound().finish()));
        }
    }
    Ok(next.call(req).await?.map_into_boxed_body())
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/ws", web::get().to(ws))
        .route("/health", web::get().to(health))
        .route("/health/ready", web::get().to(ready))
        .route("/health/live", web::get().to(live))
        .route("/metrics", web::get().to(metrics))
        .route("/", web::get().to(index))
        .route("/", web::head().to(index))
        .route("/widget/{id}", web::get().to(widget_check))
        .route("/{file:[A-Za-z0-9_.-]+}", web::get().to(static_file))
        // HEAD for the static files too (caches and CDNs revalidate with it); actix sends the
        // headers without the body.
        .route("/{file:[A-Za-z0-9_.-]+}", web::head().to(static_file));
}

/// Readiness: 200 only while the server takes new work. The status word and its details.
fn readiness(state: &AppState) -> (bool, serde_json::Value) {
    if state.draining() {
        return (
            false,
            json!({"status": "draining", "reason": "the server is shutting down: running replies finish, nothing new starts"}),
        );
    }
    let status = state
        .status
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match status {
        Status::Ready(r) => (true, json!({"status": "ready", "model": r.model})),
        Status::Loading => (
            false,
            json!({"status": "loading", "reason": "the model is loading"}),
        ),
        Status::Failed(e) => (false, json!({"status": "failed", "reason": e})),
    }
}

fn readiness_response(ok: bool, body: serde_json::Value) -> HttpResponse {
    if ok {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// `/health`: readiness with its details (the model, a failure's reason).
async fn health(state: web::Data<AppState>) -> HttpResponse {
    let (ok, body) = readiness(&state);
    readiness_response(ok, body)
}

/// `/health/ready`, for probes (answered whatever the `Host`): the status word alone.
async fn ready(state: web::Data<AppState>) -> HttpResponse {
    let (ok, body) = readiness(&state);
    readiness_response(ok, json!({"status": body["status"]}))
}

/// Liveness: the process answers HTTP (loading, draining and a failed engine included: a failed
/// engine exits the process by itself).
async fn live() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "live"}))
}

async fn metrics(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|a| a.to_str().ok());
    if !state.access.metrics_authorized(auth) {
        return HttpResponse::Unauthorized()
            .insert_header(("WWW-Authenticate", "Bearer"))
            .json(json!({"error_type": "unauthorized", "message": "/metrics needs Authorization: Bearer TOKEN (server.metrics_token)"}));
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

/// An upgrade refused, in the native dialect's shape (`ErrorKind::wire`, the one table), counted.
fn refuse(state: &AppState, r: Refusal) -> HttpResponse {
    let w = r.kind().wire();
    state.metrics.error(w.ws);
    let status = actix_web::http::StatusCode::from_u16(w.http)
        .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR);
    HttpResponse::build(status).json(json!({"error_type": w.ws, "message": r.into_message()}))
}

async fn ws(
    req: HttpRequest,
    stream: web::Payload,
    state: web::Data<AppState>,
) -> actix_web::Result<HttpResponse> {
    let Some(ready) = state.ready() else {
        return Ok(HttpResponse::ServiceUnavailable()
            .json(json!({"error_type": "not_ready", "message": state.unavailable()})));
    };
    if state.draining() {
        state.metrics.error("draining");
        return Ok(HttpResponse::ServiceUnavailable()
            .insert_header(("Retry-After", "1"))
            .json(json!({"error_type": "draining", "message": "this server is shutting down; connect again (a load balancer sends you to another replica)"})));
    }
    let bad_request = |m: String| refuse(&state, Refusal::BadRequest(m));
    let query = match query(&req) {
        Ok(q) => q,
        Err(m) => return Ok(bad_request(m)),
    };
    let conversation = match conversation_key(&query) {
        Ok(c) => c,
        Err(m) => return Ok(bad_request(m)),
    };
    let identity = match authorization(&req).and_then(|a| identify_with(&req, &state, a, &query)) {
        Ok(i) => i,
        Err(r) => {
            if let Refusal::Forbidden(m) = &r {
                tracing::info!(reason = %m, "WebSocket upgrade refused");
            }
            return Ok(refuse(&state, r));
        }
    };
    // An address whose dropped sessions hold its places may come back to resume them.
    let place = match admit(&req, &state, &identity).map_err(|full| {
        let ticket = (!state.session.resume_grace.is_zero())
            .then(|| state.admission.admit_to_resume(peer_ip(&req)))
            .flatten();
        ticket.ok_or(full)
    }) {
        Ok(p) => Place::Permit(p),
        Err(Ok(t)) => Place::Ticket(t),
        Err(Err(full)) => {
            state.metrics.error("connection_limit");
            tracing::info!(reason = %full, "WebSocket upgrade refused: connection cap");
            return Ok(HttpResponse::ServiceUnavailable()
                .insert_header(("Retry-After", RETRY_AFTER_S.to_string()))
                .json(json!({"error_type": "overloaded", "message": full.to_string()})));
        }
    };
    Session::new(state.into_inner(), ready, identity, place)
        .with_conversation_id(conversation)
        .start(&req, stream)
}

/// The conversation's routing key, `?conversation=ID` (1 to 64 of `A-Z a-z 0-9 _ -`): a load
/// balancer hashes it so that every turn and reconnect of a conversation reaches the replica
/// holding its KV blocks (docs/deploy.md). The server only checks it and logs it with the
/// session.
fn conversation_key(query: &QueryMap) -> Result<Option<String>, String> {
    match query.get("conversation") {
        None => Ok(None),
        Some(c) if crate::server::gate::tenants::valid_id(c) => Ok(Some(c.clone())),
        Some(_) => {
            Err("`conversation` must be 1 to 64 characters of A-Z, a-z, 0-9, `_` and `-`".into())
        }
    }
}

/// Seconds a client refused by a connection cap is told to wait.
pub(super) const RETRY_AFTER_S: u32 = 5;

/// A place for a session or an API request of `identity` from the request's peer address.
pub(super) fn admit(
    req: &HttpRequest,
    state: &AppState,
    identity: &Identity,
) -> Result<crate::server::gate::admission::Permit, crate::server::gate::admission::Full> {
    state.admission.admit(peer_ip(req), &identity.tenant)
}

fn peer_ip(req: &HttpRequest) -> std::net::IpAddr {
    req.peer_addr()
        .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip())
}

/// A request's query parameters, parsed once (a repeated name: the last one).
pub(super) type QueryMap = std::collections::HashMap<String, String>;

pub(super) fn query(req: &HttpRequest) -> Result<QueryMap, String> {
    web::Query::<QueryMap>::from_query(req.query_string())
        .map(web::Query::into_inner)
        .map_err(|e| format!("malformed query: {e}"))
}

/// The request's `Authorization` value, if it sent one.
pub(super) fn authorization(req: &HttpRequest) -> Result<Option<&str>, Refusal> {
    match req.headers().get("authorization") {
        Some(a) => a
            .to_str()
            .map(Some)
            .map_err(|_| Refusal::Unauthorized("unreadable Authorization header".into())),
        None => Ok(None),
    }
}

/// Who an upgrade is, from its headers and query (`widget`, `prefix`) alone: an API key (`auth`,
/// the `Authorization` value, any scheme case, or the Realtime API's browser form, a WebSocket
/// subprotocol; `prefix` selects one of its tenant's named prefixes), a widget (`?widget=ID`
/// from one of its origins), or an anonymous client where the server allows them (a browser
/// only from the server's own origin).
pub(super) fn identify_with(
    req: &HttpRequest,
    state: &AppState,
    auth: Option<&str>,
    query: &QueryMap,
) -> Result<Identity, Refusal> {
    let headers = req.headers();
    let origin = headers.get("origin").and_then(|o| o.to_str().ok());
    let prefix = query.get("prefix").map(String::as_str);
    if let Some(auth) = auth {
        return state.tenants.api_key(auth, prefix);
    }
    if prefix.is_some() {
        return Err(Refusal::BadRequest(
            "`prefix` selects a tenant's named prefix and needs an API key".into(),
        ));
    }
    if let Some(id) = query.get("widget") {
        return state.tenants.widget(id, origin);
    }
    state.access.keyless(origin)?;
    Ok(state.tenants.anonymous())
}

/// How long browsers and CDNs may reuse `widget.js` before revalidating it: embedding sites load
/// it on every page view, and an hour bounds how long a fix takes to reach them.
const WIDGET_MAX_AGE_S: u32 = 3600;

/// The chat page's Content-Security-Policy: its scripts, styles and sockets come from this
/// server only, so even a rendering bug could not load or run anything from elsewhere.
const PAGE_CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

async fn index(req: HttpRequest, state: web::Data<AppState>) -> actix_web::Result<HttpResponse> {
    serve_file(&req, &state, "index.html").await
}

async fn static_file(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> actix_web::Result<HttpResponse> {
    serve_file(&req, &state, &path).await
}

async fn serve_file(
    req: &HttpRequest,
    state: &AppState,
    name: &str,
) -> actix_web::Result<HttpResponse> {
    // The route pattern admits no '/' and no leading dot-dot path; check again all the same.
    if name.contains("..") || name.starts_with('.') {
        return Ok(HttpResponse::NotFound().finish());
    }
    // The configured folder first (edit the page without rebuilding), then the copy built in.
    let bytes = match std::fs::read(state.static_dir.join(name)) {
        Ok(b) => b,
        Err(_) => match EMBEDDED.iter().find(|(n, _)| *n == name) {
            Some((_, body)) => body.as_bytes().to_vec(),
            None => return Ok(HttpResponse::NotFound().body(format!("{name} not found"))),
        },
    };
    let etag = {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        bytes.hash(&mut h);
        format!("\"{:016x}\"", h.finish())
    };
    let fresh = req
        .headers()
        .get("if-none-match")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut resp = if fresh {
        HttpResponse::NotModified()
    } else {
        HttpResponse::Ok()
    };
    resp.insert_header(("ETag", etag.as_str()))
        .insert_header(("X-Content-Type-Options", "nosniff"));
    if name == "widget.js" {
        // Loaded by other sites' pages: public, cacheable, readable cross-origin. Who may talk to
        // the server is decided on the WebSocket upgrade and at /widget/{id}, per widget.
        resp.insert_header((
            "Cache-Control",
            format!("public, max-age={WIDGET_MAX_AGE_S}, stale-while-revalidate=86400"),
        ))
        .insert_header(("Access-Control-Allow-Origin", "*"))
        .insert_header(("Cross-Origin-Resource-Policy", "cross-origin"));
    } else {
        resp.insert_header(("Cache-Control", "no-cache"));
        if name.ends_with(".html") {
            resp.insert_header(("Content-Security-Policy", PAGE_CSP))
                .insert_header(("Referrer-Policy", "no-referrer"));
        }
    }
    if fresh {
        return Ok(resp.finish());
    }
    Ok(resp.content_type(mime_guess_from(name)).body(bytes))
}

/// `GET /widget/{id}`: 200 when the requesting page's `Origin` may use the widget, 403 (origin not
/// allowed) or 404 (no such widget) otherwise, each readable by that page (CORS) so the widget can
/// tell its user. The WebSocket upgrade checks the same rule again.
async fn widget_check(
    req: HttpRequest,
    id: web::Path<String>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let origin = req.headers().get("origin").and_then(|o| o.to_str().ok());
    let known = state.tenants.has_widget(&id);
    let verdict = state.tenants.widget(&id, origin);
    let mut resp = match (&verdict, known) {
        (Ok(_), _) => HttpResponse::Ok(),
        (Err(_), true) => HttpResponse::Forbidden(),
        (Err(_), false) => HttpResponse::NotFound(),
    };
    resp.insert_header(("Access-Control-Allow-Origin", origin.unwrap_or("*")))
        .insert_header(("Vary", "Origin"))
        .insert_header(("Cache-Control", "no-store"));
    match verdict {
        Ok(_) => resp.json(json!({"widget": id.as_str(), "ws": format!("/ws?widget={id}")})),
        Err(r) => {
            // A known widget is refused to this origin; an unknown one is not found.
            let error_type = if known {
                crate::server::request::ErrorKind::Forbidden.wire().ws
            } else {
                "not_found"
            };
            resp.json(json!({"error_type": error_type, "message": r.into_message()}))
        }
    }
}

/// The page built into the binary, so `llama-relay` serves it from any working directory.
const EMBEDDED: &[(&str, &str)] = &[
    ("index.html", include_str!("../../static/index.html")),
    ("chat.js", include_str!("../../static/chat.js")),
    ("chat.css", include_str!("../../static/chat.css")),
    ("widget.js", include_str!("../../static/widget.js")),
    ("favicon.svg", include_str!("../../static/favicon.svg")),
];

fn mime_guess_from(name: &str) -> &'static str {
    match name.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("png") => "image/png",
        Some("svg") => "image/svg+xml",
        Some("json") => "application/json",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    //! The static routes and the widget's origin check, on the real routes and gate without a
    //! model (`actix_web::test`): the state is the one `server::build` makes, still loading.

    use actix_web::http::StatusCode;
    use actix_web::{test, App};
    use serde_json::Value;

    use crate::settings::{Settings, TenantSettings, WidgetSettings};

    const HOST: &str = "127.0.0.1:8080";

    fn settings() -> Settings {
        let mut s = Settings::load(None).unwrap();
        s.tenants = vec![TenantSettings {
            name: "alpha".into(),
            api_keys: vec!["alpha-key-0123456789".into()],
            widgets: vec![WidgetSettings {
                id: "alpha-help".into(),
                origins: vec!["http://shop.alpha.test".into()],
                system_prompt: "You help Alpha's customers.".into(),
                ..Default::default()
            }],
            ..Default::default()
        }];
        s
    }

    macro_rules! service {
        () => {{
            let addr = HOST.parse().unwrap();
            let state = crate::server::app_state(&settings(), addr, None).unwrap();
            test::init_service(
                App::new()
                    .app_data(actix_web::web::Data::new(state))
                    .wrap(actix_web::middleware::from_fn(super::gate))
                    .configure(crate::server::configure),
            )
            .await
        }};
    }

    fn get(path: &str) -> test::TestRequest {
        test::TestRequest::get()
            .uri(path)
            .insert_header(("Host", HOST))
    }

    fn header(r: &actix_web::dev::ServiceResponse, k: &str) -> String {
        (r.headers().get(k))
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    }

    #[actix_rt::test]
    async fn the_widget_script_is_cacheable_and_loadable_from_any_site() {
        let app = service!();
        let r = test::call_service(&app, get("/widget.js").to_request()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(header(&r, "cache-control").contains("max-age=3600"));
        assert_eq!(header(&r, "access-control-allow-origin"), "*");
        assert_eq!(header(&r, "cross-origin-resource-policy"), "cross-origin");
        assert!(header(&r, "content-type").starts_with("text/javascript"));
        let etag = header(&r, "etag");
        assert!(etag.starts_with('"'), "{etag}");
        let body = test::read_body(r).await;
        assert!(String::from_utf8_lossy(&body).contains("LlamaRelay"));
        let again = get("/widget.js").insert_header(("If-None-Match", etag.as_str()));
        let r = test::call_service(&app, again.to_request()).await;
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
        let head = test::TestRequest::default()
            .method(actix_web::http::Method::HEAD)
            .uri("/widget.js")
            .insert_header(("Host", HOST));
        let r = test::call_service(&app, head.to_request()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(header(&r, "etag"), etag);
        let r = test::call_service(&app, get("/").to_request()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(header(&r, "content-security-policy").contains("script-src 'self'"));
    }

    #[actix_rt::test]
    async fn the_widget_check_answers_its_own_origins_only() {
        let app = service!();
        let allowed = ("Origin", "http://shop.alpha.test");
        let r = test::call_service(
            &app,
            get("/widget/alpha-help")
                .insert_header(allowed)
                .to_request(),
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(
            header(&r, "access-control-allow-origin"),
            "http://shop.alpha.test"
        );
        let v: Value = test::read_body_json(r).await;
        assert_eq!(v["ws"], "/ws?widget=alpha-help");
        let r = test::call_service(
            &app,
            (get("/widget/alpha-help").insert_header(("Origin", "https://evil.test"))).to_request(),
        )
        .await;
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        let v: Value = test::read_body_json(r).await;
        assert_eq!(v["error_type"], "forbidden");
        assert!(
            v["message"].as_str().unwrap().contains("https://evil.test"),
            "{v}"
        );
        let r = test::call_service(
            &app,
            get("/widget/nope").insert_header(allowed).to_request(),
        )
        .await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }

    #[actix_rt::test]
    async fn a_host_not_served_is_misdirected_and_probes_answer_while_loading() {
        let app = service!();
        let wrong = test::TestRequest::get()
            .uri("/")
            .insert_header(("Host", "rebind.attacker.test"));
        let r = test::call_service(&app, wrong.to_request()).await;
        assert_eq!(r.status(), StatusCode::MISDIRECTED_REQUEST);
        // Readiness is 503 until the model is loaded; liveness answers whatever the Host.
        let probe = |path: &str| {
            test::TestRequest::get()
                .uri(path)
                .insert_header(("Host", "10.0.0.7:8080"))
                .to_request()
        };
        let r = test::call_service(&app, probe("/health/ready")).await;
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = test::call_service(&app, probe("/health/live")).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
}
