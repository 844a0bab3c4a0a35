//! OpenAI's HTTP API on the same batcher as the WebSocket sessions: `POST /v1/chat/completions`
//! and `POST /v1/completions` (streamed as Server-Sent Events or answered whole), `GET
//! /v1/models`. A request is validated into the WebSocket protocol's `ValidRequest` (`wire`), its
//! prompt built by the same code (`prompt`), submitted with a channel as its reply address
//! (`ReplyTo::Stream`), and its tokens turned into text by the same `ReplyText`; so tenants,
//! principals, limits, prefix sharing and stop strings are the WebSocket path's. `n` choices fork
//! from one prefill. A client that goes away drops the channel, and the batcher drops the request
//! at its next step.
//!
//! Who may call: an API key (`Authorization: Bearer KEY`, as on `/ws`), or anyone where the
//! server serves keyless clients (on a server with no API key configured, whatever key an SDK
//! sends is ignored). Anonymous requests are each their own principal (no cache is
//! shared between them); `prompt_cache_key` and `user` partition an API key's cache. A browser
//! (a request with `Origin`) may call only from `server.public_origins` or, on loopback, the
//! server's own origin: those get CORS headers, other origins 403.

mod encode;
mod error;
mod generation;
pub mod wire;

use encode::*;
pub use error::ApiError;
use generation::*;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use self::wire::{
    error_body, ApiUsage, ChatLogprob, ChatRequest, CompletionLogprobs, CompletionRequest,
    CompletionTokensDetails, PromptTokensDetails, RawPrompt, TopLogprob, ValidApi,
};
use crate::engine::core::Fork;
use crate::engine::RequestId;
use crate::sampler::{SamplingParams, TokenLogprobs};
use crate::server::batcher::{next_request_id, GenerationEvent, ReplyTo, Submit};
use crate::server::gate::admission::Permit;
use crate::server::gate::credentials::Refusal;
use crate::server::gate::outbox::{watched, Backlog};
use crate::server::gate::peer::Peer;
use crate::server::gate::tenants::{ClientKind, Identity, Roles};
use crate::server::request::prompt::chat_prompt;
use crate::server::request::reply::FinishReason;
use crate::server::request::stream::{ReplyStream, Update};
use crate::server::request::tools::{parse_reply, CallParser, Piece, Tools};
use crate::server::request::Prompt;
use crate::server::request::{Dialect, ErrorKind, RequestError};
use crate::server::state::{AppState, Ready};

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope("/v1")
            .wrap(actix_web::middleware::from_fn(cors))
            .route("/chat/completions", web::post().to(chat_completions))
            .route("/completions", web::post().to(completions))
            .route("/models", web::get().to(models))
            .route("/models/{id}", web::get().to(model))
            .route("/realtime", web::get().to(realtime))
            .default_service(web::to(not_found)),
    );
}

fn state_of(req: &HttpRequest) -> web::Data<AppState> {
    req.app_data::<web::Data<AppState>>()
        .expect("state is registered")
        .clone()
}

/// Browsers: only allowed origins get through, with CORS headers (preflights answered here).
async fn cors(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let Some(origin) = (req.headers().get("origin"))
        .and_then(|o| o.to_str().ok())
        .map(String::from)
    else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    let state = state_of(req.request());
    if !state.access.browser_origin_allowed(&origin) {
        let e = ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            Some("forbidden"),
            format!("cross-site request from {origin} refused (not one of server.public_origins)"),
        );
        let resp = e.response(&state);
        return Ok(req.into_response(resp));
    }
    if req.method() == Method::OPTIONS {
        let asked = (req.headers().get("access-control-request-headers"))
            .and_then(|h| h.to_str().ok())
            .unwrap_or("authorization, content-type")
            .to_string();
        let resp = HttpResponse::NoContent()
            .insert_header(("Access-Control-Allow-Origin", origin.as_str()))
            .insert_header(("Access-Control-Allow-Methods", "GET, POST, OPTIONS"))
            .insert_header(("Access-Control-Allow-Headers", asked))
            .insert_header(("Access-Control-Max-Age", "600"))
            .insert_header(("Vary", "Origin"))
            .finish();
        return Ok(req.into_response(resp));
    }
    let mut res = next.call(req).await?.map_into_boxed_body();
    let h = res.headers_mut();
    if let Ok(v) = origin.parse() {
        h.insert(actix_web::http::header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.insert(
        actix_web::http::header::VARY,
        actix_web::http::header::HeaderValue::from_static("Origin"),
    );
    Ok(res)
}

/// The browser form of the Realtime API's key: a WebSocket subprotocol
/// `openai-insecure-api-key.KEY` beside `realtime` (browsers cannot set `Authorization`).
const KEY_PROTOCOL: &str = "openai-insecure-api-key.";

/// `GET /v1/realtime?model=ID`: a WebSocket session speaking OpenAI's Realtime API, text only
/// (`crate::server::realtime`, docs/realtime.md). The key comes as the SDKs send it (`Authorization:
/// Bearer`) or in the browser form (a subprotocol), checked like every API request.
async fn realtime(
    req: HttpRequest,
    stream: web::Payload,
    state: web::Data<AppState>,
) -> actix_web::Result<HttpResponse> {
    if state.draining() {
        let e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some("draining"),
            "this server is shutting down; connect again".into(),
        );
        let mut r = e.response(&state);
        r.headers_mut().insert(
            actix_web::http::header::RETRY_AFTER,
            actix_web::http::header::HeaderValue::from_static("1"),
        );
        return Ok(r);
    }
    let from_protocol = (req.headers().get_all("sec-websocket-protocol"))
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(KEY_PROTOCOL))
        .map(|k| format!("Bearer {k}"));
    let caller = (|| {
        let (identity, ready) = match (&from_protocol, req.headers().get("authorization")) {
            (Some(auth), None) => caller_as(&req, &state, Some(auth.as_str()))?,
            _ => caller(&req, &state)?,
        };
        let query =
            crate::server::routes::query(&req).map_err(|e| ApiError::invalid("model", e))?;
        check_model(query.get("model").map(String::as_str), &ready)?;
        admitted(&req, &state, identity, ready)
    })();
    match caller {
        Ok((identity, ready, permit)) => {
            let place = crate::server::gate::admission::Place::Permit(permit);
            crate::server::ws::session::Session::new(state.into_inner(), ready, identity, place)
                .speaking_realtime()
                .start_with_protocols(&req, stream, &["realtime"])
        }
        Err(e) => Ok(e.response(&state)),
    }
}

async fn not_found(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("unknown_url"),
        format!("no route {} {}", req.method(), req.path()),
    )
    .response(&state)
}

/// Who is calling (an API key, or an anonymous client where the server serves them), and the
/// loaded model.
fn caller(req: &HttpRequest, state: &AppState) -> Result<(Identity, Ready), ApiError> {
    caller_as(req, state, crate::server::routes::authorization(req)?)
}

/// `caller`, with `auth` as the `Authorization` value.
fn caller_as(
    req: &HttpRequest,
    state: &AppState,
    auth: Option<&str>,
) -> Result<(Identity, Ready), ApiError> {
    if req
        .query_string()
        .split('&')
        .any(|p| p.starts_with("widget="))
    {
        return Err(
            Refusal::BadRequest("widgets talk to /ws; the API takes API keys".into()).into(),
        );
    }
    let keyless_server = !state.tenants.has_keys() && state.access.allow_anonymous;
    let identity = if keyless_server && !req.query_string().contains("prefix=") {
        // SDKs always send a key; a server with none configured serves everyone alike (vLLM
        // without --api-key does the same).
        let origin = req.headers().get("origin").and_then(|o| o.to_str().ok());
        state.access.keyless(origin)?;
        state.tenants.anonymous()
    } else {
        let query = crate::server::routes::query(req).map_err(Refusal::BadRequest)?;
        crate::server::routes::identify_with(req, state, auth, &query)?
    };
    let ready = state.ready().ok_or_else(|| {
        let loading = matches!(
            *state.status.read().unwrap_or_else(|e| e.into_inner()),
            crate::server::state::Status::Loading
        );
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some(if loading {
                "model_loading"
            } else {
                "not_ready"
            }),
            state.unavailable(),
        )
    })?;
    Ok((identity, ready))
}

/// `caller`, with a place under the connection caps for a request that generates.
fn caller_with(req: &HttpRequest, state: &AppState) -> Result<Caller, ApiError> {
    let (identity, ready) = caller(req, state)?;
    admitted(req, state, identity, ready)
}

fn admitted(
    req: &HttpRequest,
    state: &AppState,
    identity: Identity,
    ready: Ready,
) -> Result<Caller, ApiError> {
    let permit = crate::server::routes::admit(req, state, &identity).map_err(|full| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Some("connection_limit"),
            full.to_string(),
        )
    })?;
    Ok((identity, ready, permit))
}

fn check_model(given: Option<&str>, ready: &Ready) -> Result<(), ApiError> {
    match given {
        None => Err(ApiError::invalid("model", "`model` is required".into())),
        Some(m) if m == ready.model => Ok(()),
        Some(m) => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    ready.model
                ),
            )
        }),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            format!("the body is not a valid request: {e}"),
        )
    })
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Names this build and model (OpenAI's `system_fingerprint`): replies with equal seeds and
/// equal fingerprints are reproducible.
fn fingerprint(ready: &Ready) -> String {
    let d = crate::server::gate::credentials::sha256(
        format!("{}/{}", env!("CARGO_PKG_VERSION"), ready.model).as_bytes(),
    );
    let hex: String = d[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("fp_{hex}")
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    match caller(&req, &state) {
        Ok((_, ready)) => HttpResponse::Ok().json(json!({
            "object": "list",
            "data": [model_object(&ready, &state)],
        })),
        Err(e) => e.response(&state),
    }
}

async fn model(
    req: HttpRequest,
    id: web::Path<String>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let r = caller(&req, &state).and_then(|(_, ready)| {
        check_model(Some(&id), &ready)?;
        Ok(ready)
    });
    match r {
        Ok(ready) => HttpResponse::Ok().json(model_object(&ready, &state)),
        Err(e) => e.response(&state),
    }
}

fn model_object(ready: &Ready, state: &AppState) -> Value {
    json!({
        "id": ready.model,
        "object": "model",
        "created": state.started_unix,
        "owned_by": "llama-relay",
        "max_model_len": state.session.limits.max_context,
    })
}

/// A validated request, its prompt and where it came from, ready to run.
struct Job {
    api: ValidApi,
    prompt: Prompt,
    identity: Identity,
    ready: Ready,
    permit: Permit,
}

async fn chat_completions(
    req: HttpRequest,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> HttpResponse {
    respond(req, body, state, Shape::Chat, chat_job).await
}

/// Parses, validates, renders and tokenizes a chat request.
fn chat_job(
    body: &[u8],
    state: &AppState,
    (identity, ready, permit): Caller,
) -> Result<Job, ApiError> {
    let r: ChatRequest = parse(body)?;
    check_model(r.common.model.as_deref(), &ready)?;
    let cfg = &state.session;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let syntax = ready.tokenizer.call_syntax();
    let api = r.validate(
        id,
        &cfg.limits,
        &cfg.sampling,
        cfg.default_max_tokens,
        syntax,
    )?;
    let api = partitioned(api, &identity)?;
    let prompt = chat_prompt(
        &ready,
        &state.tenants,
        &identity,
        &uuid::Uuid::new_v4(),
        &[],
        &api.chat,
    )?;
    Ok(Job {
        api,
        prompt,
        identity,
        ready,
        permit,
    })
}

async fn completions(
    req: HttpRequest,
    body: web::Bytes,
    state: web::Data<AppState>,
) -> HttpResponse {
    respond(req, body, state, Shape::Completion, completion_job).await
}

/// Parses, validates and tokenizes a completion request.
fn completion_job(
    body: &[u8],
    state: &AppState,
    (identity, ready, permit): Caller,
) -> Result<Job, ApiError> {
    let r: CompletionRequest = parse(body)?;
    check_model(r.common.model.as_deref(), &ready)?;
    if identity.roles != Roles::ALL || identity.system_prompt.is_some() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            Some("forbidden"),
            "raw prompts skip the chat template and its roles: this client may use /v1/chat/completions only".into(),
        ));
    }
    let cfg = &state.session;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let (api, raw) = r.validate(id, &cfg.limits, &cfg.sampling)?;
    let api = partitioned(api, &identity)?;
    let ids = match raw {
        RawPrompt::Text(t) => ready
            .tokenizer
            .encode_prompt(&t)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        RawPrompt::Ids(ids) => {
            let vocab = ready.tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("`prompt` holds token id {bad}; the vocabulary has {vocab}"),
                ));
            }
            ids
        }
    };
    let scope = state.tenants.scope(
        &identity,
        &uuid::Uuid::new_v4(),
        api.chat.cache_key.as_deref(),
        0,
    );
    Ok(Job {
        api,
        prompt: Prompt {
            ids,
            scope,
            constraint: None,
            dropped: None,
        },
        identity,
        ready,
        permit,
    })
}

/// Who sent a request, and its place under the connection caps.
type Caller = (Identity, Ready, Permit);

/// The request's cache partition, by the one rule (`ValidRequest::partition`).
fn partitioned(mut api: ValidApi, identity: &Identity) -> Result<ValidApi, RequestError> {
    let user = api.user.take();
    (api.chat).partition(identity.kind == ClientKind::ApiKey, user.as_deref())?;
    Ok(api)
}

/// Admits the caller, builds its job with `build` and runs it, or answers the error. Parsing a
/// body of up to a megabyte, rendering its template and tokenizing it take milliseconds: `build`
/// runs on the blocking pool, not on the I/O thread that serves other sockets (as the WebSocket
/// session does).
async fn respond(
    req: HttpRequest,
    body: web::Bytes,
    state: web::Data<AppState>,
    shape: Shape,
    build: fn(&[u8], &AppState, Caller) -> Result<Job, ApiError>,
) -> HttpResponse {
    let job = match caller_with(&req, &state) {
        Ok(caller) => {
            let st = state.clone();
            actix_web::rt::task::spawn_blocking(move || build(&body, &st, caller))
                .await
                .unwrap_or_else(|e| {
                    Err(RequestError::Internal(format!("preparing the request failed: {e}")).into())
                })
        }
        Err(e) => Err(e),
    };
    match job {
        Ok(job) => run(req, job, shape, state).await,
        Err(e) => e.response(&state),
    }
}

/// Which of OpenAI's two response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Chat,
    Completion,
}

/// Submits the job and answers with its stream or its whole result.
async fn run(req: HttpRequest, job: Job, shape: Shape, state: web::Data<AppState>) -> HttpResponse {
    let Job {
        api,
        prompt,
        identity,
        ready,
        permit,
    } = job;
    let (tx, rx) = unbounded_channel();
    let backlog = Backlog::new();
    let ids: Vec<RequestId> = (0..api.n).map(|_| next_request_id()).collect();
    let forks = ids[1..]
        .iter()
        .enumerate()
        .map(|(i, &id)| Fork {
            id,
            sampling: SamplingParams {
                // Each choice its own seed, all following from the request's.
                seed: api.chat.sampling.seed.map(|s| s.wrapping_add(i as u64 + 1)),
                ..api.chat.sampling.clone()
            },
        })
        .collect();
    let prompt_tokens = prompt.ids.len();
    // The oldest messages `truncation` left out (the overflow policy): named in a header, as
    // OpenAI's chat completions have no field for it.
    let dropped = prompt.dropped.map(|d| {
        (
            actix_web::http::header::HeaderName::from_static(DROPPED_HEADER),
            actix_web::http::header::HeaderValue::from(d.messages),
        )
    });
    let submit = Submit {
        logprobs: api.logprobs,
        forks,
        ..Submit::new(
            ids[0],
            &api.chat,
            prompt,
            identity.quota,
            ReplyTo::stream(tx, backlog.clone()),
        )
    };
    let admitted = ready
        .batcher
        .send(submit)
        .await
        .unwrap_or_else(|e| Err(RequestError::Internal(format!("the batcher is gone: {e}"))));
    if let Err(e) = admitted {
        return ApiError::from(e).response(&state);
    }
    tracing::debug!(id = %api.chat.id, tenant = %identity.tenant, n = api.n, "API request queued");
    let gen = Generation {
        rx,
        backlog,
        ready: ready.clone(),
        choices: ids
            .iter()
            .map(|&id| Choice::new(id, api.chat.stop.clone()))
            .collect(),
        index: ids.iter().enumerate().map(|(i, &id)| (id, i)).collect(),
        logprobs: api.logprobs.is_some(),
        prompt_tokens,
        cached_tokens: 0,
        failed: None,
        timings: Default::default(),
        _permit: permit,
        peer: req.conn_data::<Peer>().copied(),
        ticker: {
            let mut t = tokio::time::interval(PEER_CHECK);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        },
    };
    let meta = Meta {
        id: api.chat.id.clone(),
        created: unix_now(),
        model: ready.model.clone(),
        fingerprint: fingerprint(&ready),
        shape,
        include_usage: api.include_usage,
        tools: api.chat.tools.clone(),
    };
    if api.stream {
        let stream =
            futures_util::stream::unfold(Some(SseState::new(gen, meta)), |st| async move {
                let mut st = st?;
                let bytes = st.next().await?;
                Some((Ok::<_, actix_web::Error>(bytes), st.more().then_some(st)))
            });
        // The peer check wakes the stream every PEER_CHECK while it waits: not polled for
        // write_timeout, its client reads nothing (`outbox`).
        let body = watched(
            Box::pin(stream),
            req.conn_data::<Peer>().copied(),
            state.session.write_timeout,
            state.metrics.clone(),
            None,
        );
        let mut resp = HttpResponse::Ok();
        resp.insert_header(("Content-Type", "text/event-stream"))
            .insert_header(("Cache-Control", "no-cache"))
            .insert_header(("X-Accel-Buffering", "no"));
        if let Some(h) = dropped {
            resp.insert_header(h);
        }
        return resp.streaming(body);
    }
    let mut resp = whole(gen, meta, &state).await;
    if let Some((name, value)) = dropped.filter(|_| resp.status().is_success()) {
        resp.headers_mut().insert(name, value);
    }
    resp
}

/// The response header that counts the request's oldest messages its prompt left out
/// (`truncation: "auto"`, or the tenant's `drop_oldest` policy).
pub const DROPPED_HEADER: &str = "llama-relay-dropped-messages";
