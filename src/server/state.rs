//! The state every handler and session shares: whether the model is loaded (`Status`, `Ready`),
//! the settings a session applies (`SessionConfig`), and `AppState`, which holds the gate
//! (tenants, access, admission), parked sessions, metrics and the sealer. One value, made by
//! `server::build`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;

use crate::metrics::Metrics;
use crate::sampler::SamplingParams;
use crate::server::batcher::Batcher;
use crate::server::gate::{access, admission, tenants};
use crate::server::request::Limits;
use crate::server::ws::{parked, seal};
use crate::tokenizer::TextTokenizer;

/// What a session needs once the model is loaded.
#[derive(Clone)]
pub struct Ready {
    pub batcher: Addr<Batcher>,
    pub tokenizer: Arc<TextTokenizer>,
    /// The response formats' grammar compiler over this tokenizer's vocabulary.
    pub grammars: Arc<crate::engine::constraint::Grammars>,
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

    pub(super) fn set(&self, s: Status) {
        *self.status.write().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// The server is draining (`shutdown` began).
    pub fn draining(&self) -> bool {
        *self.drain.borrow()
    }
}
