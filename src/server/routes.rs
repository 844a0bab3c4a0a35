//! Routes: `/ws` (the session), `/health` (503 while the model loads), `/metrics` (Prometheus),
//! and the static chat page at `/`.

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

use super::session::Session;
use super::tenants::Refusal;
use super::{AppState, Status};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/ws", web::get().to(ws))
        .route("/health", web::get().to(health))
        .route("/metrics", web::get().to(metrics))
        .route("/", web::get().to(index))
        .route("/{file:[A-Za-z0-9_.-]+}", web::get().to(static_file));
}

async fn health(state: web::Data<AppState>) -> HttpResponse {
    let status = state
        .status
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match status {
        Status::Ready(r) => HttpResponse::Ok().json(json!({"status": "ready", "model": r.model})),
        Status::Loading => HttpResponse::ServiceUnavailable()
            .json(json!({"status": "loading", "reason": "the model is loading"})),
        Status::Failed(e) => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "failed", "reason": e}))
        }
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

async fn ws(
    req: HttpRequest,
    stream: web::Payload,
    state: web::Data<AppState>,
) -> actix_web::Result<HttpResponse> {
    let Some(ready) = state.ready() else {
        return Ok(HttpResponse::ServiceUnavailable()
            .json(json!({"error_type": "not_ready", "message": "the model is not loaded yet"})));
    };
    let widget =
        web::Query::<std::collections::HashMap<String, String>>::from_query(req.query_string())
            .ok()
            .and_then(|q| q.get("widget").cloned());
    let identity = match state.tenants.identify(&req, widget.as_deref()) {
        Ok(i) => i,
        Err(Refusal::Unauthorized(m)) => {
            state.metrics.error("unauthorized");
            return Ok(HttpResponse::Unauthorized()
                .json(json!({"error_type": "unauthorized", "message": m})));
        }
        Err(Refusal::Forbidden(m)) => {
            state.metrics.error("forbidden");
            tracing::info!(reason = %m, "WebSocket upgrade refused");
            return Ok(
                HttpResponse::Forbidden().json(json!({"error_type": "forbidden", "message": m}))
            );
        }
    };
    let max_frame = state.session.limits.max_frame_bytes;
    let session = Session::new(state.into_inner(), ready, identity);
    actix_web_actors::ws::WsResponseBuilder::new(session, &req, stream)
        .frame_size(max_frame)
        .start()
}

async fn index(state: web::Data<AppState>) -> actix_web::Result<HttpResponse> {
    serve_file(&state, "index.html").await
}

async fn static_file(
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> actix_web::Result<HttpResponse> {
    serve_file(&state, &path).await
}

async fn serve_file(state: &AppState, name: &str) -> actix_web::Result<HttpResponse> {
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
    Ok(HttpResponse::Ok()
        .content_type(mime_guess_from(name))
        .insert_header(("Cache-Control", "no-cache"))
        .body(bytes))
}

/// The page built into the binary, so `llama-relay` serves it from any working directory.
const EMBEDDED: &[(&str, &str)] = &[
    ("index.html", include_str!("../../static/index.html")),
    ("chat.js", include_str!("../../static/chat.js")),
    ("chat.css", include_str!("../../static/chat.css")),
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
