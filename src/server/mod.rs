//! The HTTP/WebSocket server: shared state, routes (`routes`), the per-connection session actor
//! (`session`), stop-string scanning (`stop`). The WebSocket plumbing (actix-web-actors) lives in
//! `session.rs` alone, so a move to actix-ws stays small.

pub mod access;
pub mod admission;
pub mod batcher;
mod config;
pub mod openai;
pub mod outbox;
pub mod parked;
pub mod prompt;
pub mod rate;
pub mod realtime;
pub mod reply;
pub mod routes;
pub mod seal;
pub mod session;
pub mod stop;
pub mod tenants;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;
use actix_web::{web, App, HttpServer};

use crate::engine::{Engine, EngineOptions};
use crate::metrics::Metrics;
use crate::protocol::Limits;
use crate::sampler::SamplingParams;
use crate::server::batcher::{Batcher, BatcherConfig};
use crate::settings::Settings;
use crate::tokenizer::TextTokenizer;

/// What a session needs once the model is loaded.
#[derive(Clone)]
pub struct Ready {
    pub batcher: Addr<Batcher>,
    pub tokenizer: Arc<TextTokenizer>,
    pub model: String,
    /// Each configured operator prompt rendered alone (a system message), by its text: the
    /// prompt tokens a request shares with it are the tenant's (`Session`), and it is what is
    /// pinned.
    pub operator_tokens: Arc<HashMap<Arc<str>, Vec<u32>>>,
    /// The longest sequence served (prompt plus reply), as the batcher checks it.
    pub max_context: usize,
}

#[derive(Clone)]
pub enum Status {
    Loading,
    Ready(Ready),
    Failed(String),
}

/// Settings a session applies to every request.
#[derive(Clone)]
pub struct SessionConfig {
    pub limits: Limits,
    pub sampling: SamplingParams,
    pub default_max_tokens: usize,
    pub heartbeat: Duration,
    pub client_timeout: Duration,
    /// A connection whose body is not polled for this long is reset (`outbox`).
    pub write_timeout: Duration,
    /// How long a session whose connection dropped can be resumed (zero: not at all).
    pub resume_grace: Duration,
}

pub struct AppState {
    pub status: RwLock<Status>,
    pub tenants: tenants::Tenants,
    pub access: access::Access,
    /// Places for sessions and API requests (connection caps).
    pub admission: admission::Admission,
    /// Sessions whose connection dropped, waiting to be resumed.
    pub parked: parked::Parked,
    pub metrics: Arc<Metrics>,
    pub session: SessionConfig,
    pub static_dir: std::path::PathBuf,
    /// When the process started (seconds since the epoch): the model's `created` in `/v1/models`.
    pub started_unix: u64,
    /// True once the server drains (`shutdown`): not ready, no new connections, and each
    /// session closes with 1012 once it has no reply running.
    pub drain: tokio::sync::watch::Sender<bool>,
    /// Seals the assistant's messages for `restore` (`server.conversation_secret`).
    pub sealer: seal::Sealer,
}

impl AppState {
    pub fn ready(&self) -> Option<Ready> {
        match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Ready(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// Why the server cannot take requests now (while `ready()` is `None`).
    pub fn unavailable(&self) -> String {
        match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Loading | Status::Ready(_) => "the model is not loaded yet".into(),
            Status::Failed(reason) => format!("the server failed and is restarting: {reason}"),
        }
    }

    fn set(&self, s: Status) {
        *self.status.write().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// The server is draining (`shutdown` began).
    pub fn draining(&self) -> bool {
        *self.drain.borrow()
    }
}

/// A connection's socket, kept with the connection (`HttpRequest::conn_data`) so that a handler
/// waiting on the batcher can tell that its client has gone: actix-web drops a handler only when
/// it next writes (actix-web issue #1313), and an answer that is not streamed writes nothing
/// until it is complete. The descriptor stays open as long as the connection, which outlives the
/// handler.
#[derive(Debug, Clone, Copy)]
pub struct Peer(std::os::fd::RawFd);

/// Idle seconds before the first keepalive probe, and between probes.
const KEEPALIVE_IDLE_S: libc::c_int = 30;
const KEEPALIVE_INTERVAL_S: libc::c_int = 10;

impl Peer {
    /// Records an accepted connection's socket, with keepalive on and its send buffer set to
    /// `send_buffer` bytes (0: the kernel's autotuning).
    fn record(send_buffer: usize, conn: &dyn std::any::Any, ext: &mut actix_web::dev::Extensions) {
        use std::os::fd::AsRawFd;
        if let Some(s) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
            let p = Peer(s.as_raw_fd());
            if let Err(e) = p.keepalive() {
                tracing::debug!(error = %e, "cannot turn on TCP keepalive");
            }
            if send_buffer > 0 {
                let v = send_buffer.min(libc::c_int::MAX as usize) as libc::c_int;
                if let Err(e) = p.set(libc::SOL_SOCKET, libc::SO_SNDBUF, v) {
                    tracing::debug!(error = %e, "cannot set the socket's send buffer");
                }
            }
            ext.insert(p);
        }
    }

    fn set(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: libc::c_int,
    ) -> std::io::Result<()> {
        // SAFETY: setsockopt reads an int from a live descriptor's option.
        let rc = unsafe {
            libc::setsockopt(
                self.0,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// TCP keepalive: a peer that vanished without a FIN (a dropped mobile link, a crashed
    /// host) is found after `KEEPALIVE_IDLE_S` idle seconds plus three probes, even for a
    /// connection the server is not writing to.
    fn keepalive(&self) -> std::io::Result<()> {
        let set = |level, name, value| self.set(level, name, value);
        set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE_S)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)
    }

    /// Resets the connection (a client that reads nothing): the socket is shut down both ways,
    /// which fails the dispatcher's pending write so it drops the connection, and with linger 0
    /// its close discards the unread bytes and sends RST instead of waiting on a zero window.
    pub fn abort(&self) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt reads a linger struct, shutdown takes the descriptor; the caller
        // guarantees the descriptor is still the connection's (see `outbox::watch`).
        unsafe {
            libc::setsockopt(
                self.0,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
            libc::shutdown(self.0, libc::SHUT_RDWR);
        }
    }

    /// How far the client has taken what was written: the bytes it acknowledged so far and
    /// whether bytes wait (unsent, or sent and not acknowledged), from the kernel's TCP_INFO.
    /// `None` where the kernel does not tell. A client that reads nothing fills its receive
    /// window, after which nothing more is acknowledged, however much the send buffer still takes.
    pub fn send_progress(&self) -> Option<SendProgress> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: an all-zero tcp_info is valid (plain integers); getsockopt fills at most
            // `len` bytes of it from a live descriptor (see `outbox::watch`).
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            let rc = unsafe {
                libc::getsockopt(
                    self.0,
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    (&mut info as *mut libc::tcp_info).cast(),
                    &mut len,
                )
            };
            // Kernels before 4.6 end the struct before the fields read here.
            let needed = std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + 4;
            if rc != 0 || (len as usize) < needed {
                return None;
            }
            Some(SendProgress {
                acked: info.tcpi_bytes_acked,
                waiting: info.tcpi_unacked > 0 || info.tcpi_notsent_bytes > 0,
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            None
        }
    }

    /// The client closed or reset the connection (a peek finds end of stream or an error; a
    /// pipelined request waiting to be read is data, so the client is still there).
    pub fn gone(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a peek into a one-byte buffer on a descriptor the connection keeps open.
        let n = unsafe {
            libc::recv(
                self.0,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => {
                let e = std::io::Error::last_os_error();
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                )
            }
        }
    }
}

/// What `Peer::send_progress` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendProgress {
    /// Bytes the client has acknowledged since the connection began.
    pub acked: u64,
    /// Bytes wait in the socket: not sent yet, or sent and not acknowledged.
    pub waiting: bool,
}

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

/// Binds the listener, starts loading the model on the batcher's own thread (the HTTP side
/// answers /health with 503 meanwhile), and builds the HTTP server. Call inside an actix System.
pub fn build(settings: &Settings, opts: EngineOptions) -> std::io::Result<Running> {
    let invalid = |e: crate::error::EngineError| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    };
    let metrics = Arc::new(Metrics::new());
    let tenants = tenants::Tenants::new(&settings.tenants)
        .map_err(invalid)?
        .with_anonymous_quota(settings.anonymous_quota());
    let sv = &settings.server;
    let listener = bind(&sv.host, sv.port, "server.port")?;
    let addr = listener.local_addr()?;
    let admin = match sv.admin_port {
        Some(port) => Some(bind(&sv.admin_host, port, "server.admin_port")?),
        None => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
    let access = access::Access::new(
        &settings.access(),
        &sv.host,
        addr,
        admin_addr,
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
        admin = ?admin_addr,
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
    let workers = match sv.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let state = web::Data::new(AppState {
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
    });
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
            Ok(engine)
        });
        match loaded {
            Ok(engine) => {
                let tokenizer = engine.tokenizer.clone();
                let model = engine.info.name.clone();
                let max_context = engine.model.max_positions();
                let cfg = BatcherConfig {
                    max_context,
                    ..batcher_cfg
                };
                let batcher = Batcher::new(engine, cfg, metrics).start();
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
                load_state.set(Status::Ready(Ready {
                    batcher,
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
            .configure(openai::configure)
            .configure(routes::configure)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn get(fd: i32, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes an int into `v`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                level,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        v
    }

    #[test]
    fn accepted_sockets_keep_alive_and_a_closed_peer_is_gone() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        let p = Peer(server.as_raw_fd());
        p.keepalive().unwrap();
        assert_eq!(get(p.0, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(
            get(p.0, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
            KEEPALIVE_IDLE_S
        );
        assert!(!p.gone());
        drop(client);
        let t0 = std::time::Instant::now();
        while !p.gone() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
