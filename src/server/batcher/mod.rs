//! The batcher actor: the one owner of the engine core (model, KV cache, scheduler, samplers).
//!
//! Sessions send it `Submit` (carrying their reply `Recipient`) and `Cancel`; it answers `Submit`
//! at once (queued, or an error) and wakes itself. Each `Step` runs one core step (one scheduled
//! forward pass over every running sequence, then sampling) and sends each token to its session
//! the moment it exists;
//! it re-arms itself with `notify` while work remains (so `Submit` and `Cancel` are handled between
//! steps) and sleeps when idle: no spinning, no timer. A reply channel that no longer connects is a
//! cancel (TGI, mistral.rs). It runs on its own Arbiter because a forward step blocks the thread.
//!
//! This file holds the actor's state and its step; its messages and reply events are in
//! `messages`, their handlers in `handlers`, lease and parked-reply expiry in `expiry`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::engine::core::{Core, Event, Finish, Fork, Request, StepFailed};
use crate::engine::scheduler::{AddError, SchedulerConfig, SchedulerStats};
use crate::engine::{Engine, Priority, Quota, RequestId};
use crate::kv_cache::manager::{KvConfig, LeaseKey};
use crate::metrics::Metrics;
use crate::sampler::{SamplingParams, TokenLogprobs};
use crate::server::gate::outbox::Backlog;
use crate::server::request::reply::{FinishReason, Timings, Usage};
use crate::server::request::{Field, RequestError};
use crate::server::request::{Prompt, ValidRequest};

mod expiry;
mod handlers;
mod messages;

use expiry::*;
pub use messages::*;

#[derive(Message)]
#[rtype(result = "()")]
struct Step;

/// What the batcher keeps of a request: where its events go, and its timings.
struct Active {
    reply_to: ReplyTo,
    prompt_tokens: usize,
    cached_tokens: usize,
    submitted: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    generated: usize,
    /// Speculative drafts run for it, and those kept.
    drafted: usize,
    accepted: usize,
    /// The reply's token ids, for a session that resumes.
    ids: Vec<u32>,
    /// A paced reply: the tokens it may generate in all for now.
    allowed: Option<usize>,
    /// The queue position last reported.
    position: Option<usize>,
}

/// How often waiting requests hear of their queue position (when it changed).
pub const QUEUE_UPDATE: Duration = Duration::from_millis(500);

/// Recent starts (first admissions) counted for the queue's wait estimate.
const STARTS_KEPT: usize = 32;

impl Active {
    /// What the client has been told so far, as events.
    fn history(&self) -> Vec<EventKind> {
        let started = self.scheduled.map(|_| EventKind::Started {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
        });
        started
            .into_iter()
            .chain(self.ids.iter().map(|&t| EventKind::Token {
                id: t,
                logprobs: None,
            }))
            .collect()
    }
}

pub struct BatcherConfig {
    pub scheduler: SchedulerConfig,
    pub kv: KvConfig,
    pub max_context: usize,
    /// How long a session's lease outlives its connection.
    pub lease_grace: Duration,
    /// Speculative decoding (`None`: off).
    pub speculation: Option<crate::engine::core::Speculation>,
    /// Events a client may leave untaken before its reply is cancelled (`slow_reader`).
    pub max_queued_frames: usize,
    /// Called once, on the batcher's thread, when the engine fails for good (a panic, or
    /// `MAX_FAILED_STEPS` failed steps in a row), with the reason.
    pub on_failure: Option<OnFailure>,
}

/// What the server does when the engine fails for good (`BatcherConfig::on_failure`).
pub type OnFailure = Arc<dyn Fn(String) + Send + Sync>;

/// Failed forward steps in a row after which the engine is taken for broken: one failed step
/// fails its requests and the next may succeed (a transient allocation failure); a step that
/// keeps failing would fail every request sent to it.
pub const MAX_FAILED_STEPS: u32 = 3;

/// Faults the tests inject, in builds with the `fault-injection` feature only.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The next step with work panics inside the engine.
    PanicInStep,
    /// Every step with work fails (as a model error would).
    FailSteps,
}

#[cfg(feature = "fault-injection")]
impl Fault {
    /// `LLAMA_RELAY_INJECT_FAULT` = `panic_in_step` | `fail_steps`: a fault for a whole process
    /// (the test that checks the exit status starts the binary with it).
    fn from_env() -> Option<Fault> {
        match std::env::var("LLAMA_RELAY_INJECT_FAULT").ok()?.as_str() {
            "panic_in_step" => Some(Fault::PanicInStep),
            "fail_steps" => Some(Fault::FailSteps),
            _ => None,
        }
    }
}

/// Injects a fault into the running batcher (tests only).
#[cfg(feature = "fault-injection")]
#[derive(Message)]
#[rtype(result = "()")]
pub struct InjectFault(pub Fault);

pub struct Batcher {
    core: Core,
    active: HashMap<RequestId, Active>,
    stepping: bool,
    /// Shutting down: no new requests; running ones end with `shutdown` at this instant.
    drain_deadline: Option<Instant>,
    max_context: usize,
    metrics: Arc<Metrics>,
    /// The scheduler's counters as last reported to the metrics.
    reported: SchedulerStats,
    lease_grace: Duration,
    /// Leases of closed sessions and when they go.
    lease_expiry: LeaseExpiry,
    /// Replies of parked sessions that ended while parked, whole, until resumed or expired, and
    /// when each parked request's grace ends.
    parked_done: HashMap<RequestId, Vec<EventKind>>,
    park_expiry: Expiry<RequestId>,
    max_queued_frames: usize,
    on_failure: Option<OnFailure>,
    /// Set when the engine failed for good: every request is refused with this reason.
    failed: Option<String>,
    failed_steps: u32,
    /// Each session's running draft.
    drafts: HashMap<LeaseKey, RequestId>,
    /// When requests recently started, and when the queue was last reported.
    starts: std::collections::VecDeque<Instant>,
    queue_reported: Option<Instant>,
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
}

impl Batcher {
    pub fn new(engine: Engine, cfg: BatcherConfig, metrics: Arc<Metrics>) -> Self {
        metrics.kv_blocks_total.set(engine.pool.total() as i64);
        let mut core = Core::new(engine, cfg.scheduler, cfg.kv, cfg.max_context);
        core.set_speculation(cfg.speculation);
        Batcher {
            core,
            active: HashMap::new(),
            stepping: false,
            drain_deadline: None,
            max_context: cfg.max_context,
            metrics,
            reported: SchedulerStats::default(),
            lease_grace: cfg.lease_grace,
            lease_expiry: LeaseExpiry::default(),
            parked_done: HashMap::new(),
            park_expiry: Expiry::default(),
            max_queued_frames: cfg.max_queued_frames,
            on_failure: cfg.on_failure,
            failed: None,
            failed_steps: 0,
            drafts: HashMap::new(),
            starts: std::collections::VecDeque::new(),
            queue_reported: None,
            #[cfg(feature = "fault-injection")]
            fault: Fault::from_env(),
        }
    }

    /// Speculative drafts from `draft` instead of n-gram lookup (when speculation is on).
    pub fn with_draft_model(mut self, draft: Option<crate::engine::draft::DraftModel>) -> Self {
        self.core.set_draft_model(draft);
        self
    }

    fn wake(&mut self, ctx: &mut Context<Self>) {
        if !self.stepping {
            self.stepping = true;
            ctx.notify(Step);
        }
    }

    fn update_gauges(&mut self) {
        let m = &self.metrics;
        let sched = self.core.scheduler();
        m.requests_running.set(sched.running_len() as i64);
        m.requests_waiting.set(sched.waiting_len() as i64);
        let kv = sched.kv();
        let st = kv.pool().stats();
        m.kv_blocks_used.set(st.used as i64);
        m.kv_blocks_held.set(kv.held_distinct() as i64);
        m.kv_blocks_cached_free.set(st.cached_free as i64);
        m.kv_blocks_free.set(st.empty_free as i64);
        // Counters move by what changed since the last report.
        let now = sched.stats();
        let d = now.since(&self.reported);
        self.reported = now;
        m.prefix_queries.inc_by(d.prefix_queried);
        m.prefix_hits.inc_by(d.prefix_hits);
        m.kv_evictions.inc_by(d.evictions);
        m.preemptions.inc_by(d.preemptions);
        m.itl_target_misses.inc_by(d.itl_misses);
        m.prefill_tokens.inc_by(d.prefill_tokens);
        m.fairness_holds.inc_by(d.holds);
        m.ttft_deadline_steps.inc_by(d.deadline_steps);
        m.spec_draft_tokens.inc_by(d.drafted_tokens);
        m.spec_accepted_tokens.inc_by(d.accepted_tokens);
    }

    /// Ends `lease`'s draft, if one runs: the lease keeps what it computed.
    fn end_draft(&mut self, lease: LeaseKey, outcome: &str) {
        if let Some(id) = self.drafts.remove(&lease) {
            self.core.finish(id);
            self.metrics.drafts.with_label_values(&[outcome]).inc();
        }
    }

    /// Interactive requests wait for a slot: drafts give theirs up.
    fn yield_drafts(&mut self) {
        if self.drafts.is_empty() || self.core.scheduler().waiting_interactive() == 0 {
            return;
        }
        let leases: Vec<LeaseKey> = self.drafts.keys().copied().collect();
        for lease in leases {
            self.end_draft(lease, "yielded");
        }
    }

    /// Removes a request and tells its session how it ended.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        self.finish_at(id, reason, usize::MAX);
    }

    /// `finish`, the lease keeping at most the first `keep` tokens.
    fn finish_at(&mut self, id: RequestId, reason: FinishReason, keep: usize) {
        for fork in self.core.finish_at(id, keep) {
            self.report_finished(fork, reason);
        }
        self.report_finished(id, reason);
    }

    /// Drops a request whose client is gone, with the choices still to fork from it.
    fn remove(&mut self, id: RequestId) {
        for fork in self.core.remove(id) {
            self.active.remove(&fork);
        }
        self.active.remove(&id);
    }

    /// Tells a finished request's session how it ended.
    fn report_finished(&mut self, id: RequestId, reason: FinishReason) {
        if let Some(a) = self.active.remove(&id) {
            let now = Instant::now();
            let decode_s = match (a.first_token, a.last_token) {
                (Some(f), Some(l)) if a.generated > 1 => (l - f).as_secs_f64(),
                _ => 0.0,
            };
            let timings = Timings {
                queue_ms: a
                    .scheduled
                    .map(|s| (s - a.submitted).as_secs_f64() * 1e3)
                    .unwrap_or(0.0),
                ttft_ms: a
                    .first_token
                    .map(|f| (f - a.submitted).as_secs_f64() * 1e3)
                    .unwrap_or(0.0),
                decode_tokens_per_s: if decode_s > 0.0 {
                    (a.generated - 1) as f64 / decode_s
                } else {
                    0.0
                },
            };
            self.metrics.e2e.observe((now - a.submitted).as_secs_f64());
            let usage = Usage {
                prompt_tokens: a.prompt_tokens,
                completion_tokens: a.generated,
                cached_tokens: a.cached_tokens,
                drafted_tokens: a.drafted,
                accepted_tokens: a.accepted,
            };
            let end = EventKind::Finished {
                reason,
                usage,
                timings,
            };
            self.end(id, a, end);
        }
    }

    /// Sends a request's last event; a parked session's reply is kept whole for its resume.
    fn end(&mut self, id: RequestId, a: Active, end: EventKind) {
        if a.reply_to.is_parked() {
            let mut events = a.history();
            events.push(end);
            self.parked_done.insert(id, events);
        } else {
            a.reply_to.send(GenerationEvent {
                request: id,
                kind: end,
            });
        }
    }

    fn fail_all(&mut self, ids: Vec<RequestId>, err: RequestError) {
        for id in ids {
            let forks = self.core.remove(id);
            for id in std::iter::once(id).chain(forks) {
                let Some(a) = self.active.remove(&id) else {
                    continue;
                };
                self.metrics.error(err.error_type());
                self.end(id, a, EventKind::Failed(err.clone()));
            }
        }
    }

    fn expire_leases(&mut self) {
        for k in self.lease_expiry.due(Instant::now()) {
            self.core.scheduler_mut().drop_lease(k);
        }
    }

    /// Parked requests whose session was not resumed in time end as if disconnected.
    fn expire_parked(&mut self) {
        for id in self.park_expiry.due(Instant::now()) {
            self.parked_done.remove(&id);
            if self.active.get(&id).is_some_and(|a| a.reply_to.is_parked()) {
                self.remove(id);
            }
        }
    }

    fn step(&mut self) -> bool {
        self.expire_leases();
        self.expire_parked();
        if self.drain_deadline.is_some_and(|d| Instant::now() >= d) {
            let ids: Vec<RequestId> = self.active.keys().copied().collect();
            for id in ids {
                self.finish(id, FinishReason::Shutdown);
            }
        }
        // A session that went away cancels its request.
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| !a.reply_to.connected())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.remove(id);
        }
        // A client that takes nothing while its reply goes on loses the reply (and its KV).
        let slow: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.reply_to.backlog.untaken() > self.max_queued_frames)
            .map(|(id, _)| *id)
            .collect();
        if !slow.is_empty() {
            self.metrics
                .slow_readers
                .with_label_values(&["reply_cancelled"])
                .inc_by(slow.len() as u64);
            tracing::info!(
                requests = slow.len(),
                "clients left more than server.max_queued_frames events unread; cancelling"
            );
            self.fail_all(
                slow,
                RequestError::SlowReader(format!(
                    "more than {} frames of this reply waited unread (server.max_queued_frames): it was cancelled",
                    self.max_queued_frames
                )),
            );
        }
        self.yield_drafts();
        let events = match self.run_step() {
            Ok(Some(events)) => {
                self.failed_steps = 0;
                events
            }
            Ok(None) => {
                self.update_gauges();
                return false;
            }
            Err(StepFailed { ids, error }) => {
                tracing::error!(error = %error, "forward step failed; failing its requests");
                self.failed_steps += 1;
                self.fail_all(
                    ids,
                    RequestError::Internal(format!("the model step failed: {error}")),
                );
                if self.failed_steps >= MAX_FAILED_STEPS {
                    self.fail_for_good(format!(
                        "{MAX_FAILED_STEPS} forward steps failed in a row; the last: {error}"
                    ));
                    return false;
                }
                self.update_gauges();
                return !self.core.is_idle();
            }
        };
        for s in self.core.take_mask_seconds() {
            self.metrics.grammar_mask.observe(s);
        }
        let now = Instant::now();
        for ev in events {
            match ev {
                Event::Started { id, cached_tokens } => self.on_started(id, cached_tokens, now),
                Event::Token {
                    id,
                    token,
                    logprobs,
                } => self.on_token(id, token, logprobs, now),
                Event::Drafted {
                    id,
                    drafted,
                    accepted,
                } => {
                    if let Some(a) = self.active.get_mut(&id) {
                        a.drafted += drafted;
                        a.accepted += accepted;
                    }
                    for position in 0..accepted {
                        (self.metrics.spec_accepted_per_pos)
                            .with_label_values(&[&position.to_string()])
                            .inc();
                    }
                }
                Event::Failed { id, error } => self.fail_all(
                    vec![id],
                    RequestError::invalid(
                        Field::ResponseFormat,
                        format!("stopped the reply: {error}"),
                    ),
                ),
                Event::Finished { id, reason } => {
                    let reason = match reason {
                        Finish::EndOfTurn => FinishReason::Stop,
                        Finish::Length => FinishReason::Length,
                        Finish::Prefilled => {
                            self.drafts.retain(|_, d| *d != id);
                            self.metrics.drafts.with_label_values(&["prefilled"]).inc();
                            continue;
                        }
                    };
                    self.report_finished(id, reason);
                }
            }
        }
        self.report_queue(now);
        self.update_gauges();
        !self.core.is_idle()
    }

    /// Tells waiting requests whose queue position changed where they are now, at most every
    /// `QUEUE_UPDATE`. A position counts the requests ahead that would be admitted first
    /// (interactive before batch; within a priority, queue order); the estimate is that many
    /// starts at the recent rate of starts (none before two have been seen in the last minute).
    fn report_queue(&mut self, now: Instant) {
        if self.core.scheduler().waiting_len() == 0
            || self.queue_reported.is_some_and(|t| now - t < QUEUE_UPDATE)
        {
            return;
        }
        self.queue_reported = Some(now);
        while self
            .starts
            .front()
            .is_some_and(|&t| now - t > Duration::from_secs(60))
        {
            self.starts.pop_front();
        }
        let per_start = match (self.starts.front(), self.starts.back()) {
            (Some(&first), Some(&last)) if self.starts.len() >= 2 => {
                Some((last - first).as_secs_f64() / (self.starts.len() - 1) as f64)
            }
            _ => None,
        };
        let waiting = self.core.scheduler().waiting_order();
        for (position, id) in waiting.into_iter().enumerate() {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            if a.position == Some(position) || a.scheduled.is_some() {
                continue;
            }
            a.position = Some(position);
            let eta_ms = per_start.map(|s| ((position + 1) as f64 * s * 1e3).round() as u64);
            a.reply_to.send(GenerationEvent {
                request: id,
                kind: EventKind::Queued { position, eta_ms },
            });
        }
    }

    /// One core step, with a panic inside it caught: the engine is then failed for good (its
    /// state may be half-updated) and `Ok(None)` returned.
    fn run_step(&mut self) -> Result<Option<Vec<Event>>, StepFailed> {
        #[cfg(feature = "fault-injection")]
        if !self.core.is_idle() {
            match self.fault {
                Some(Fault::FailSteps) => {
                    return Err(StepFailed {
                        ids: self.active.keys().copied().collect(),
                        error: crate::error::EngineError::Candle(candle_core::Error::Msg(
                            "injected step failure".into(),
                        )),
                    })
                }
                Some(Fault::PanicInStep) | None => {}
            }
        }
        #[cfg(feature = "fault-injection")]
        let inject =
            !self.core.is_idle() && self.fault.take_if(|f| *f == Fault::PanicInStep).is_some();
        #[cfg(not(feature = "fault-injection"))]
        let inject = false;
        let core = &mut self.core;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if inject {
                panic!("injected panic in a step");
            }
            core.step()
        })) {
            Ok(r) => r,
            Err(payload) => self.panicked(payload),
        }
    }

    fn panicked(
        &mut self,
        payload: Box<dyn std::any::Any + Send>,
    ) -> Result<Option<Vec<Event>>, StepFailed> {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        // The panic's text may hold anything the engine held (a request's tokens, say): it goes
        // to the log only; clients and /health get the fact.
        tracing::error!(panic = %what, "the engine panicked in a step");
        self.fail_for_good("the engine panicked in a step".into());
        Ok(None)
    }

    /// The engine cannot go on: every request gets `internal` with `reason`, new ones are
    /// refused with it, the failure is counted, and the server is told (`on_failure`: `/health`
    /// turns 503 and the process exits after the clients have their answers). The core is not
    /// touched again: after a panic its state may be half-updated.
    fn fail_for_good(&mut self, reason: String) {
        if self.failed.is_some() {
            return;
        }
        tracing::error!(reason = %reason, "the engine failed; failing every request");
        self.metrics.engine_failures.inc();
        let err = RequestError::Internal(format!("{reason}; the server is restarting"));
        for (id, a) in self.active.drain() {
            self.metrics.error(err.error_type());
            a.reply_to.send(GenerationEvent {
                request: id,
                kind: EventKind::Failed(err.clone()),
            });
        }
        self.failed = Some(reason.clone());
        if let Some(f) = &self.on_failure {
            f(reason);
        }
    }

    fn on_started(&mut self, id: RequestId, cached_tokens: usize, now: Instant) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        a.cached_tokens = cached_tokens;
        if a.scheduled.is_none() {
            a.scheduled = Some(now);
            if self.starts.len() == STARTS_KEPT {
                self.starts.pop_front();
            }
            self.starts.push_back(now);
            self.metrics
                .queue_time
                .observe((now - a.submitted).as_secs_f64());
            self.metrics.prompt_tokens.inc_by(a.prompt_tokens as u64);
            a.reply_to.send(GenerationEvent {
                request: id,
                kind: EventKind::Started {
                    prompt_tokens: a.prompt_tokens,
                    cached_tokens,
                },
            });
        }
    }

    fn on_token(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        now: Instant,
    ) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        a.generated += 1;
        match a.last_token {
            None => {
                a.first_token = Some(now);
                self.metrics.ttft.observe((now - a.submitted).as_secs_f64());
            }
            Some(l) => self.metrics.inter_token.observe((now - l).as_secs_f64()),
        }
        a.last_token = Some(now);
        if a.reply_to.parked.is_some() {
            a.ids.push(token);
        }
        if a.allowed.is_some_and(|n| a.generated >= n) {
            self.core.scheduler_mut().set_paused(id, true);
        }
        self.metrics.generation_tokens.inc();
        a.reply_to.send(GenerationEvent {
            request: id,
            kind: EventKind::Token {
                id: token,
                logprobs,
            },
        });
    }
}

impl Actor for Batcher {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Sessions may queue many events at once; the batcher itself must never refuse a Cancel.
        ctx.set_mailbox_capacity(usize::MAX);
        // Leases and parked replies expire on time on an idle server too, not only at the next
        // step: their blocks go back to the pool and the gauges say so.
        ctx.run_interval(EXPIRY_SWEEP, |b, _| {
            let (leases, parked) = (b.lease_expiry.len(), b.park_expiry.len());
            b.expire_leases();
            b.expire_parked();
            if (leases, parked) != (b.lease_expiry.len(), b.park_expiry.len()) {
                b.update_gauges();
            }
        });
    }

    /// The batcher only stops when a handler panicked (the runtime drops the actor): its
    /// requests and the server hear of it as of any engine failure.
    fn stopped(&mut self, _: &mut Self::Context) {
        self.fail_for_good("the batcher stopped unexpectedly (a panic in a handler)".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_expiries_come_due_in_time_order_and_a_return_cancels_one() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut e = LeaseExpiry::default();
        e.set(LeaseKey(1), at(30));
        e.set(LeaseKey(2), at(10));
        e.set(LeaseKey(3), at(20));
        e.set(LeaseKey(1), at(5)); // closed again: the later time replaces the earlier
        e.remove(&LeaseKey(3)); // the session came back
        assert_eq!(e.due(at(0)), vec![]);
        assert_eq!(e.due(at(10)), vec![LeaseKey(1), LeaseKey(2)]);
        assert_eq!(e.due(at(100)), vec![]);
        assert!(e.at.is_empty() && e.by_time.is_empty());
    }
}
