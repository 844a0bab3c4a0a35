//! The HTTP/WebSocket server, in rooms along a request's path:
//! - `gate`: who may connect and how much (access, tenants, admission, rates, the slow-reader rule
//!   and the TCP peer it watches);
//! - `request`: the one seam every dialect parses into (`GenerateParams` → `ValidRequest`), its
//!   errors and their wire forms, the prompt built under a tenant's rules, and the reply's text;
//! - `batcher`: the actor that owns the engine and runs one batched step at a time;
//! - the dialects, each a parser and an encoder around the seam: `ws` (the native protocol, its
//!   session actor, parked sessions and seals), `openai` (HTTP) and `realtime`;
//! - `state` (what handlers share), `routes` (static files, health, metrics, the upgrade) and
//!   `config` (settings into server values). This file wires them together: `build`, `shutdown`.

pub mod batcher;
mod config;
pub mod gate;
pub mod openai;
pub mod realtime;
pub mod request;
pub mod routes;
pub mod state;
pub mod ws;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;
use actix_web::{web, App, HttpServer};

use crate::engine::constraint::Grammars;
use crate::engine::{Engine, EngineOptions};
use crate::metrics::Metrics;
use crate::server::batcher::{Batcher, BatcherConfig};
use crate::server::gate::peer::Peer;
use crate::server::gate::{access, admission, tenants};
use crate::server::state::{AppState, Ready, Status};
use crate::server::ws::{parked, seal};
use crate::settings::Settings;

pub use state::SessionConfig;

/// A bound, not yet awaited server.
pub struct Running {
    pub server: actix_web::dev::Server,
    pub addr: SocketAddr,
    /// Where `/health` and `/metrics` are served when `server.admin_port` is set.
    pub admin_addr: Option<SocketAddr>,
    pub state: web::Data<AppState>,
    /// Becomes `Some` when the server can never serve (the model failed to load) or the engine
    /// failed for good (`/health` is then 503 `failed`): the process should exit, after clients
    /// have had their errors, so a supervisor restarts it or shows the crash.
    pub failed: tokio::sync::watch::Receiver<Option<Failure>>,
}

/// Why the server cannot go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The model did not load: nothing was ever served. `usage` when the operator's model path
    /// or settings cannot work (`EngineError::is_usage`), so the command line exits 2, not 1.
    Load { reason: String, usage: bool },
    /// The engine failed after serving: clients got their errors.
    Engine(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Load { reason, .. } => write!(f, "the model failed to load: {reason}"),
            Failure::Engine(reason) => {
                write!(f, "the engine failed: {reason}; exiting for a restart")
            }
        }
    }
}

impl std::error::Error for Failure {}

/// A command's exit status for an error and its causes (`chain`, outermost first): 2 when what
/// the operator gave cannot work (a flag, the config file, a setting, a model path that does not
/// exist or is not a model; clap exits 2 for a bad flag itself), 1 when the machine or the engine
/// failed (a read error, a port in use, a folder that cannot be written, the default model's
/// fetch, a failed step). The first `Failure` or `EngineError` in the chain decides.
pub fn exit_status<'a>(
    chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
) -> u8 {
    chain
        .into_iter()
        .find_map(|c| {
            if let Some(f) = c.downcast_ref::<Failure>() {
                Some(match f {
                    Failure::Load { usage: true, .. } => 2,
                    _ => 1,
                })
            } else {
                (c.downcast_ref::<crate::error::EngineError>()).map(|e| {
                    if e.is_usage() {
                        2
                    } else {
                        1
                    }
                })
            }
        })
        .unwrap_or(1)
}

/// What the handlers share, from the settings, for a server listening on `addr` (and `admin`,
/// its admin listener): tenants, access rules, connection caps, the parked sessions' registry,
/// the sealer; the model not loaded yet (`Status::Loading`).
pub fn app_state(
    settings: &Settings,
    addr: SocketAddr,
    admin: Option<SocketAddr>,
) -> std::io::Result<AppState> {
    let invalid = |e: crate::error::EngineError| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    };
    let metrics = Arc::new(Metrics::new());
    let tenants = tenants::Tenants::new(&settings.tenants)
        .map_err(invalid)?
        .with_anonymous_quota(settings.anonymous_quota())
        .with_overflow(settings.overflow().map_err(invalid)?);
    let sv = &settings.server;
    let access = access::Access::new(
        &settings.access(),
        &sv.host,
        addr,
        admin,
        !tenants.is_empty(),
    )
    .map_err(invalid)?;
    if addr.ip().is_unspecified() && sv.allowed_hosts.is_empty() {
        tracing::warn!(
            "listening on {addr} with server.allowed_hosts empty: only loopback Host names are \
             served (421 for others); list the names clients use"
        );
    }
    tracing::info!(
        anonymous = access.allow_anonymous,
        admin = ?admin,
        "access: keyless clients {}",
        if access.allow_anonymous { "served" } else { "refused (401)" }
    );
    let file_limit = admission::raise_file_limit().unwrap_or(1024);
    let max_connections = admission::fit_to_file_limit(sv.max_connections, file_limit);
    if max_connections < sv.max_connections {
        tracing::warn!(
            file_limit,
            max_connections,
            "server.max_connections lowered to fit the open-file limit (raise `ulimit -n`)"
        );
    }
    let admission = admission::Admission::new(admission::Caps {
        total: max_connections,
        per_address: sv.max_connections_per_address,
        per_tenant: (settings.tenants.iter())
            .filter_map(|t| Some((t.name.clone(), t.max_connections?)))
            .collect(),
    });
    Ok(AppState {
        status: RwLock::new(Status::Loading),
        tenants,
        access,
        admission,
        parked: parked::Parked::new(max_connections),
        metrics: metrics.clone(),
        session: settings.session_config(),
        static_dir: settings.server.static_dir.clone().into(),
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        drain: tokio::sync::watch::channel(false).0,
        sealer: seal::Sealer::new(&settings.server.conversation_secret),
    })
}

/// Every route, behind the gate (`routes::gate`: `Host`, and what each route allows).
pub fn configure(cfg: &mut web::ServiceConfig) {
    openai::configure(cfg);
    routes::configure(cfg);
}

/// Binds the listener, starts loading the model on the batcher's own thread (the HTTP side
/// answers /health with 503 meanwhile), and builds the HTTP server. Call inside an actix System.
pub fn build(settings: &Settings, opts: EngineOptions) -> std::io::Result<Running> {
    let sv = &settings.server;
    let listener = bind(&sv.host, sv.port, "server.port")?;
    let addr = listener.local_addr()?;
    let admin = match sv.admin_port {
        Some(port) => Some(bind(&sv.admin_host, port, "server.admin_port")?),
        None => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
    let state = web::Data::new(app_state(settings, addr, admin_addr)?);
    let metrics = state.metrics.clone();
    let grammar_metrics = state.metrics.clone();
    let workers = match sv.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Parked sessions past their grace give back their connection places.
    if !settings.session_config().resume_grace.is_zero() {
        let sweep = state.clone();
        actix_web::rt::spawn(async move {
            loop {
                actix_web::rt::time::sleep(Duration::from_secs(1)).await;
                sweep.parked.sweep(std::time::Instant::now());
            }
        });
    }
    let (failed_tx, failed) = tokio::sync::watch::channel(None);
    let failed_tx = Arc::new(failed_tx);
    let failure_state = state.clone();
    let engine_failed = failed_tx.clone();
    let batcher_cfg = crate::server::batcher::BatcherConfig {
        on_failure: Some(Arc::new(move |reason: String| {
            failure_state.set(Status::Failed(reason.clone()));
            let _ = engine_failed.send(Some(Failure::Engine(reason)));
        })),
        ..settings.batcher_config()
    };
    let warm_up = settings
        .engine
        .warm_up
        .then_some(settings.scheduler.step_tokens);
    let pin_prompts = settings.cache.pin_widget_prompts && settings.cache.prefix_caching;
    let pins = state.tenants.operator_prompts();
    let load_state = state.clone();
    let draft_opts = (settings.draft_options())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let arbiter = Arbiter::new();
    arbiter.spawn_fn(move || {
        let started = std::time::Instant::now();
        let loaded = Engine::load(&opts).and_then(|mut engine| {
            if let Some(step_tokens) = warm_up {
                let took = crate::generate::warm_up(&mut engine, step_tokens)?;
                tracing::info!(
                    ms = took.as_millis() as u64,
                    "warmed up (one prefill chunk and a few decode steps)"
                );
            }
            let draft = draft_opts
                .map(|mut o| {
                    // What the model's copies left of the tile units' budget.
                    o.amx_weights_mib = crate::model::kernels::amx::budget_left() >> 20;
                    let d = crate::engine::draft::DraftModel::new(
                        Engine::load(&o)?,
                        &engine.tokenizer,
                    )?;
                    tracing::info!(
                        model = %d.engine().info.name,
                        "speculative drafts from a draft model (scheduler.draft_source = \"model\")"
                    );
                    Ok::<_, crate::error::EngineError>(d)
                })
                .transpose()?;
            Ok((engine, draft))
        });
        match loaded {
            Ok((engine, draft)) => {
                let tokenizer = engine.tokenizer.clone();
                let vocab = engine.model.config().vocab_size;
                let model = engine.info.name.clone();
                let max_context = engine.model.max_positions();
                let cfg = BatcherConfig {
                    max_context,
                    ..batcher_cfg
                };
                let batcher = Batcher::new(engine, cfg, metrics)
                    .with_draft_model(draft)
                    .start();
                let mut operator_tokens = HashMap::new();
                for (tenant, system) in &pins {
                    let tokens = match tokenizer
                        .encode_chat(&[crate::tokenizer::Message::new("system", system)], false)
                    {
                        Ok((_, tokens)) => tokens,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot render an operator system prompt");
                            continue;
                        }
                    };
                    if pin_prompts {
                        batcher.do_send(crate::server::batcher::PinPrefix {
                            tokens: tokens.clone(),
                            tenant: *tenant,
                        });
                    }
                    operator_tokens.insert(system.clone(), tokens);
                }
                tracing::info!(model = %model, seconds = started.elapsed().as_secs_f64(), "ready");
                let grammars = Arc::new(Grammars::new(tokenizer.clone(), vocab).with_metrics(
                    grammar_metrics.grammar_compile.clone(),
                    grammar_metrics.grammar_cache_hits.clone(),
                ));
                load_state.set(Status::Ready(Ready {
                    batcher,
                    grammars,
                    tokenizer,
                    model,
                    operator_tokens: Arc::new(operator_tokens),
                    max_context,
                }));
            }
            Err(e) => {
                tracing::error!(error = %e, "the model failed to load");
                load_state.set(Status::Failed(e.to_string()));
                let _ = failed_tx.send(Some(Failure::Load {
                    reason: e.to_string(),
                    usage: e.is_usage(),
                }));
            }
        }
    });
    let data = state.clone();
    let send_buffer = settings.server.send_buffer_kib * 1024;
    let mut server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .wrap(actix_web::middleware::from_fn(routes::gate))
            .configure(configure)
    })
    .on_connect(move |conn, ext| Peer::record(send_buffer, conn, ext))
    .workers(workers)
    .disable_signals()
    .shutdown_timeout(settings.server.shutdown_grace_s)
    .listen(listener)?;
    if let Some(l) = admin {
        server = server.listen(l)?;
    }
    let server = server.run();
    // The arbiter lives as long as the process; keep its handle alive.
    std::mem::forget(arbiter);
    Ok(Running {
        server,
        addr,
        admin_addr,
        state,
        failed,
    })
}

/// Binds a listener; an error names the address, the setting and, for an address in use, the fix.
fn bind(host: &str, port: u16, setting: &str) -> std::io::Result<std::net::TcpListener> {
    std::net::TcpListener::bind((host, port)).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                " (another process listens there: stop it, or choose another port with {} or \
                 --port)",
                setting
            ),
            std::io::ErrorKind::PermissionDenied => {
                " (ports below 1024 need privileges: choose a higher one)".into()
            }
            _ => String::new(),
        };
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {host}:{port}: {e}{hint}"),
        )
    })
}

/// Graceful shutdown (a drain, on SIGTERM): `/health/ready` turns 503 `draining` so a load
/// balancer sends nothing new here, WebSocket upgrades get 503, the batcher stops admitting,
/// running generations get `grace` to finish and the rest end with `done` and finish_reason
/// `shutdown`; every session closes with 1012 (service restart) as soon as it has no reply
/// running, so its client reconnects through the balancer to another replica at once. Returns
/// when nothing is in flight.
pub async fn shutdown(state: &AppState, grace: Duration) {
    state.drain.send_replace(true);
    let Some(ready) = state.ready() else { return };
    let _ = ready
        .batcher
        .send(crate::server::batcher::Shutdown { deadline: grace })
        .await;
    let until = std::time::Instant::now() + grace + Duration::from_secs(2);
    while std::time::Instant::now() < until {
        match ready.batcher.send(crate::server::batcher::GetStatus).await {
            Ok(s) if s.running + s.waiting > 0 => {
                actix_web::rt::time::sleep(Duration::from_millis(50)).await
            }
            _ => break,
        }
    }
    // Let the sessions write their last frames.
    actix_web::rt::time::sleep(Duration::from_millis(200)).await;
}
