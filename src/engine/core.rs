//! The engine core: continuous batching as plain method calls. Requests go in, each `step` runs
//! one scheduled forward pass over every running request and samples, and events come out. It
//! owns the engine (model, KV cache tensors, tokenizer), the scheduler (and through it the KV
//! manager) and each request's sampler, so the server's batcher actor, the `generate` command and
//! the tests all run the same scheduling, block bookkeeping and sampling (vLLM v1's `EngineCore`
//! in shape). No actors: the batcher adds messages, request timings and metrics; the core times
//! each forward pass only to teach the scheduler's cost model.
//!
//! With speculation on (`set_speculation`), each step proposes a decoding reply's n-gram drafts
//! (`speculate`) with the chance that each is kept, and the scheduler runs those worth their
//! cost (`Scheduler::trim_drafts`) after its last token in the same chunk; its rows are sampled
//! in order exactly as single decodes would sample them, and drafts count only while they equal
//! what was sampled, so a reply is the same with speculation as without; the scheduler then
//! drops the rest of the chunk's K/V (`Scheduler::resolve_drafts`). Every proposal, run or
//! not, is checked against the tokens sampled, which keeps the chance current.

use std::borrow::BorrowMut;
use std::collections::HashMap;

use super::constraint::{Constraint, Mask};
use super::draft::{Ask, DraftModel};
use super::scheduler::{AddError, Priority, Quota, RequestId, Scheduler, SchedulerConfig};
use super::speculate::{Acceptance, NgramDrafter};
use super::Engine;
use crate::error::EngineError;
use crate::kv_cache::manager::{KvConfig, KvManager, LeaseKey};
use crate::kv_cache::{BlockPool, CacheScope};
use crate::model::team;
use crate::sampler::{log_probs, Prepared, Sampler, SamplingParams, TokenLogprobs};

/// A request, validated by the caller: a non-empty prompt shorter than the context. With
/// `max_tokens` 0 it is prefill-only (a draft): its prompt is computed into the cache with what
/// the step-time target leaves, left to its lease, and it ends with `Finish::Prefilled`.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Keep generating past the model's end-of-turn ids.
    pub ignore_eos: bool,
    pub priority: Priority,
    /// Which cached blocks the request may share.
    pub scope: CacheScope,
    /// The session lease it continues and leaves its blocks to.
    pub lease: Option<LeaseKey>,
    /// Its prompt dropped turns its lease holds (the overflow policy): the kept ones that follow
    /// may be shifted from the lease (`cache.context_shift`) rather than prefilled again.
    pub shift: bool,
    /// Report each token's log-probability and this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
    /// More choices of the same prompt: each forks from this request's prefill (sharing its
    /// blocks) and samples its first token from the same logits.
    pub forks: Vec<Fork>,
    /// Its tenant's share of the scheduler.
    pub quota: Quota,
    /// The grammar its reply must follow (its forks start from the same state).
    pub constraint: Option<Constraint>,
}

/// Another choice of a request's prompt, with its own sampling (its own seed).
#[derive(Debug, Clone)]
pub struct Fork {
    pub id: RequestId,
    pub sampling: SamplingParams,
}

/// Why the core ended a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model sent an end-of-turn id.
    EndOfTurn,
    /// `max_tokens` or the context was reached.
    Length,
    /// A prefill-only request's prompt is computed.
    Prefilled,
}

/// What a step did, per request, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request's first chunk ran, `cached_tokens` of its prompt found in the cache.
    Started { id: RequestId, cached_tokens: usize },
    Token {
        id: RequestId,
        token: u32,
        /// When the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request is over (its blocks freed or left to its lease); comes after its last token.
    Finished { id: RequestId, reason: Finish },
    /// The step ran `drafted` speculative drafts of the request and kept `accepted` of them
    /// (their tokens are among the `Token` events that follow).
    Drafted {
        id: RequestId,
        drafted: usize,
        accepted: usize,
    },
    /// The request's grammar could not go on (a limit of the grammar engine reached): the
    /// request is removed, its blocks freed.
    Failed { id: RequestId, error: String },
}

/// A step that failed: its requests are removed.
#[derive(Debug)]
pub struct StepFailed {
    pub ids: Vec<RequestId>,
    pub error: EngineError,
}

/// A running request's sampling state and limits.
struct Decoding {
    sampler: Sampler,
    max_tokens: usize,
    ignore_eos: bool,
    prompt_tokens: usize,
    generated: usize,
    lease: Option<LeaseKey>,
    logprobs: Option<usize>,
    /// Choices still to fork from this request's first sampled step.
    forks: Vec<(RequestId, Sampler)>,
    constraint: Option<Constraint>,
    /// Its drafts' source and chance of being kept, when it speculates.
    spec: Option<Spec>,
}

/// A speculating request's drafts: where they come from, how likely they are kept, and those
/// proposed for the step under way (checked against what it samples).
#[derive(Clone)]
struct Spec {
    drafter: NgramDrafter,
    acceptance: Acceptance,
    proposed: Vec<u32>,
    /// Steps since the draft model last drafted for it (it probes every `PROBE_EVERY`).
    idle: u32,
}

/// What a draft model's drafts cost against what the model's steps give, measured as moving
/// averages: the seconds of one draft-model pass (a batched forward: every drafting sequence's
/// next draft), and the tokens a second of the model's steps (drafting included). A pass is
/// worth running while the tokens it is expected to add, over its time, are at least
/// `scheduler::drafts::GAIN` times that rate: a draft model as large as the model never is, one
/// a tenth of its size nearly always is.
#[derive(Debug, Default, Clone)]
struct DraftCosts {
    pass_s: Option<f64>,
    step_s: Option<f64>,
    step_tokens: f64,
    /// Set by `Core::pin_draft_costs`: measurements change nothing.
    pinned: bool,
}

impl DraftCosts {
    /// Weight of the past in each moving average.
    const DECAY: f64 = 0.8;

    fn average(old: Option<f64>, new: f64) -> f64 {
        old.map_or(new, |o| Self::DECAY * o + (1.0 - Self::DECAY) * new)
    }

    fn observe_passes(&mut self, seconds: f64, passes: u64) {
        if passes > 0 && !self.pinned {
            self.pass_s = Some(Self::average(self.pass_s, seconds / passes as f64));
        }
    }

    fn observe_step(&mut self, seconds: f64, tokens: usize) {
        if self.pinned {
            return;
        }
        let first = self.step_s.is_none();
        self.step_s = Some(Self::average(self.step_s, seconds));
        self.step_tokens = if first {
            tokens as f64
        } else {
            Self::average(Some(self.step_tokens), tokens as f64)
        };
    }

    /// How many passes deep the drafts are worth running, for sequences that would take at most
    /// `most` drafts each with chance `p` of each being kept (the j-th with `p^j`), the passes
    /// fitting in `room` seconds when given. Unmeasured costs price nothing (the first calls
    /// measure them).
    fn depth(&self, wanted: &[(usize, f64)], room: Option<f64>) -> usize {
        let deepest = wanted.iter().map(|w| w.0).max().unwrap_or(0);
        let (Some(pass), Some(step)) = (self.pass_s, self.step_s) else {
            return deepest;
        };
        let rate = self.step_tokens / step.max(1e-9);
        let fits = room.map_or(deepest, |r| (r / pass.max(1e-9)) as usize);
        (1..=deepest.min(fits))
            .take_while(|&j| {
                let gain: f64 = (wanted.iter())
                    .filter(|w| w.0 >= j)
                    .map(|w| w.1.powi(j as i32))
                    .sum();
                gain >= super::scheduler::drafts::GAIN * rate * pass
            })
            .count()
    }
}

/// A request the draft model has not drafted for in this many steps gets one draft (run or
/// not, checked against the token sampled), so a chance of being kept that fell too low to pay
/// for drafts can rise again; n-gram drafts cost nothing to propose and are checked every step.
const PROBE_EVERY: u32 = 8;

/// Speculative decoding with n-gram drafts (`speculate`): the most drafts a decode may propose
/// and the n-gram lengths matched. Which of them run is the scheduler's call, step by step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    pub max_drafts: usize,
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl Decoding {
    /// The next token from `row` (masked already where a grammar holds the reply), counted and
    /// seen by the sampler's penalties.
    fn sample(&mut self, row: &mut [f32]) -> u32 {
        let prepared = self.sampler.prepare(row);
        self.draw(prepared)
    }

    /// `sample` for a row its sampler prepared.
    fn draw(&mut self, prepared: Prepared) -> u32 {
        let token = self.sampler.draw(prepared);
        self.sampler.observe(token);
        self.generated += 1;
        token
    }

    /// The `Token` event of `token`, with its log-probabilities from the unmasked row `raw`
    /// when the request asked for them.
    fn token_event(&self, id: RequestId, token: u32, raw: Option<&[f32]>) -> Event {
        Event::Token {
            id,
            token,
            logprobs: (self.logprobs.zip(raw)).map(|(k, raw)| log_probs(raw, token, k)),
        }
    }

    /// Proposes `drafts` for request `id`'s next step, from whichever source: cut to what its
    /// grammar allows (only those can be kept), kept to check against what the step samples,
    /// and handed to the scheduler with their chance of being kept.
    fn propose(&mut self, id: RequestId, mut drafts: Vec<u32>, sched: &mut Scheduler) {
        let Some(spec) = self.spec.as_mut() else {
            return;
        };
        if let Some(c) = self.constraint.as_mut() {
            let valid = c.valid_prefix(&drafts);
            drafts.truncate(valid);
        }
        if !drafts.is_empty() {
            sched.set_drafts(id, drafts.clone(), spec.acceptance.p());
        }
        spec.proposed = drafts;
    }

    /// Whether `token`, just sampled, ends the request (a complete grammar ends it as an
    /// end-of-turn id would).
    fn finish_reason(&self, token: u32, eos: &[u32], max_context: usize) -> Option<Finish> {
        if (!self.ignore_eos && eos.contains(&token))
            || self
                .constraint
                .as_ref()
                .is_some_and(Constraint::is_complete)
        {
            Some(Finish::EndOfTurn)
        } else if self.generated >= self.max_tokens
            || self.prompt_tokens + self.generated >= max_context
        {
            Some(Finish::Length)
        } else {
            None
        }
    }
}

/// `E` is the engine, owned (the batcher) or borrowed (`generate`).
pub struct Core<E: BorrowMut<Engine> = Engine> {
    engine: E,
    sched: Scheduler,
    live: HashMap<RequestId, Decoding>,
    max_context: usize,
    eos: Vec<u32>,
    /// How long each grammar mask took, since `take_mask_seconds` last emptied it.
    mask_seconds: Vec<f64>,
    speculation: Option<Speculation>,
    /// Writes the drafts instead of n-gram lookup, when set (`set_draft_model`).
    draft: Option<DraftModel>,
    draft_costs: DraftCosts,
}

impl<E: BorrowMut<Engine>> Core<E> {
    /// Takes the engine's block pool into the KV manager (`into_engine` gives it back).
    pub fn new(mut engine: E, sched: SchedulerConfig, kv: KvConfig, max_context: usize) -> Self {
        let e = engine.borrow_mut();
        let pool = std::mem::replace(&mut e.pool, BlockPool::new(0));
        let eos = e.tokenizer.eos_ids().to_vec();
        Core {
            engine,
            sched: Scheduler::new(sched, KvManager::new(kv, pool)),
            live: HashMap::new(),
            max_context,
            eos,
            mask_seconds: Vec::new(),
            speculation: None,
            draft: None,
            draft_costs: DraftCosts::default(),
        }
    }

    /// Drafts from a draft model (`Some`) instead of n-gram lookup, when speculation is on.
    /// Verification is the same (see `draft`): replies are unchanged either way.
    pub fn set_draft_model(&mut self, d: Option<DraftModel>) {
        self.draft = d;
        self.draft_costs = DraftCosts::default();
    }

    pub fn draft_model(&self) -> Option<&DraftModel> {
        self.draft.as_ref()
    }

    /// The draft model, taken out (speculation goes back to n-gram drafts).
    pub fn take_draft_model(&mut self) -> Option<DraftModel> {
        self.draft.take()
    }

    /// Fixes what a draft-model pass costs (seconds) and the model's rate (tokens a second)
    /// instead of measuring them (tests: which drafts run must not depend on this machine).
    pub fn pin_draft_costs(&mut self, pass_s: f64, tokens_per_s: f64) {
        self.draft_costs = DraftCosts {
            pass_s: Some(pass_s),
            step_s: Some(1.0),
            step_tokens: tokens_per_s,
            pinned: true,
        };
    }

    /// Speculates (`Some`) or not for requests added from now on. Greedy and sampled replies
    /// alike: each row's token is sampled as it would be without drafts and a draft is kept
    /// while it equals that token, so a reply is the one it would be without speculation (the
    /// same seed gives the same tokens). A reply held to a grammar proposes only drafts the
    /// grammar allows, and each row is masked as the grammar stands after the drafts before it.
    pub fn set_speculation(&mut self, s: Option<Speculation>) {
        self.speculation = s.filter(|s| s.max_drafts > 0);
    }

    /// Replaces the scheduler's cost model (tests pin one, so that what a step holds does not
    /// depend on how fast this machine ran the steps before it).
    pub fn set_cost_model(&mut self, cost: Box<dyn super::cost::CostModel>) {
        self.sched.set_cost_model(cost);
    }

    pub fn engine(&self) -> &Engine {
        self.engine.borrow()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// For leases and pins.
    pub fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.sched
    }

    /// The engine, with its block pool back.
    pub fn into_engine(mut self) -> E {
        self.engine.borrow_mut().pool = self.sched.into_kv().into_pool();
        self.engine
    }

    /// The times the grammar masks of the steps since the last call took, one per constrained
    /// sequence and step.
    pub fn take_mask_seconds(&mut self) -> Vec<f64> {
        std::mem::take(&mut self.mask_seconds)
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// Queues a request; returns its queue position.
    pub fn add(&mut self, r: Request) -> Result<usize, AddError> {
        let n = r.prompt.len();
        let max_total = (n + r.max_tokens).min(self.max_context);
        let speculate = r.sampling.speculate;
        let sampler = Sampler::new(r.sampling, &r.prompt);
        let forks = (r.forks.iter())
            .map(|f| (f.id, Sampler::new(f.sampling.clone(), &r.prompt)))
            .collect();
        let position = (self.sched).add_with(r.id, r.prompt, max_total, r.scope, r.quota)?;
        if let Some(k) = r.lease {
            self.sched.set_lease(r.id, k, r.shift);
        }
        self.sched.set_priority(r.id, r.priority);
        if r.max_tokens == 0 {
            self.sched.set_prefill_only(r.id);
        }
        self.live.insert(
            r.id,
            Decoding {
                sampler,
                max_tokens: r.max_tokens,
                ignore_eos: r.ignore_eos,
                prompt_tokens: n,
                generated: 0,
                lease: r.lease,
                logprobs: r.logprobs,
                forks,
                spec: (self.speculation).filter(|_| speculate).map(|s| Spec {
                    drafter: NgramDrafter::new(s.min_ngram, s.max_ngram),
                    acceptance: Acceptance::new(),
                    proposed: Vec::new(),
                    idle: 0,
                }),
                constraint: r.constraint,
            },
        );
        Ok(position)
    }

    /// Ends a request now (cancelled, a stop string, shutdown): its conversation's blocks go to
    /// its lease, the rest are freed. Returns the choices that were still to fork from it (they
    /// end with it). Idempotent.
    pub fn finish(&mut self, id: RequestId) -> Vec<RequestId> {
        self.finish_at(id, usize::MAX)
    }

    /// Ends a request like `finish`, its lease keeping at most its first `keep` tokens (prompt,
    /// then reply).
    pub fn finish_at(&mut self, id: RequestId, keep: usize) -> Vec<RequestId> {
        if let Some(m) = self.draft.as_mut() {
            m.forget(id);
        }
        let d = self.live.remove(&id);
        self.sched
            .finish_at(id, d.as_ref().and_then(|d| d.lease), keep);
        d.map(|d| d.forks.into_iter().map(|f| f.0).collect())
            .unwrap_or_default()
    }

    /// Drops a request and all its blocks (its client is gone). Returns the choices that were
    /// still to fork from it. Idempotent.
    pub fn remove(&mut self, id: RequestId) -> Vec<RequestId> {
        if let Some(m) = self.draft.as_mut() {
            m.forget(id);
        }
        self.sched.remove(id);
        self.live
            .remove(&id)
            .map(|d| d.forks.into_iter().map(|f| f.0).collect())
            .unwrap_or_default()
    }

    /// Starts choice `fork` of `parent` from the parent's prompt logits `raw` (its first step
    /// with a sample): its first token, then its own sequence sharing the parent's blocks.
    fn fork(
        &mut self,
        parent: RequestId,
        fork: RequestId,
        mut sampler: Sampler,
        raw: &[f32],
        mask: Option<&Mask>,
        events: &mut Vec<Event>,
    ) {
        let Some(p) = self.live.get(&parent) else {
            return;
        };
        let mut row = raw.to_vec();
        if let Some(m) = mask {
            m.apply(&mut row);
        }
        let token = sampler.sample(&mut row);
        sampler.observe(token);
        let mut constraint = p.constraint.as_ref().map(Constraint::fork);
        if let Some(Err(error)) = constraint.as_mut().map(|c| c.accept(token)) {
            events.push(Event::Failed { id: fork, error });
            return;
        }
        let d = Decoding {
            sampler,
            max_tokens: p.max_tokens,
            ignore_eos: p.ignore_eos,
            prompt_tokens: p.prompt_tokens,
            generated: 1,
            lease: None,
            logprobs: p.logprobs,
            forks: Vec::new(),
            spec: p.spec.clone(),
            constraint,
        };
        events.push(Event::Started {
            id: fork,
            cached_tokens: d.prompt_tokens,
        });
        events.push(Event::Token {
            id: fork,
            token,
            logprobs: d.logprobs.map(|k| log_probs(raw, token, k)),
        });
        match d.finish_reason(token, &self.eos, self.max_context) {
            Some(reason) => events.push(Event::Finished { id: fork, reason }),
            None => {
                self.sched.fork(parent, fork, token);
                self.live.insert(fork, d);
            }
        }
    }

    /// Removes a request whose grammar cannot go on, and the choices still to fork from it.
    fn fail(&mut self, id: RequestId, error: String, events: &mut Vec<Event>) {
        tracing::warn!(request = id.0, error = %error, "constrained decoding stopped a request");
        for fork in self.remove(id) {
            events.push(Event::Failed {
                id: fork,
                error: error.clone(),
            });
        }
        events.push(Event::Failed { id, error });
    }

    /// Proposes drafts for each speculating request that decodes next, with their chance of
    /// being kept (the scheduler runs those worth it), never past its `max_tokens` or the
    /// context.
    fn plan_drafts(&mut self) {
        let Some(cfg) = self.speculation else {
            return;
        };
        // For the draft model: the most drafts each request may take.
        let mut asks: Vec<(RequestId, usize)> = Vec::new();
        for (id, d) in self.live.iter_mut() {
            let Some(spec) = d.spec.as_mut() else {
                continue;
            };
            spec.proposed.clear();
            let Some(s) = self.sched.get(*id) else {
                continue;
            };
            if s.computed == 0 || s.computed + 1 != s.tokens.len() {
                continue;
            }
            let room = (d.max_tokens.saturating_sub(d.generated))
                .min(self.max_context.saturating_sub(s.tokens.len()))
                .saturating_sub(1);
            if self.draft.is_some() {
                let most = cfg.max_drafts.min(room);
                if most > 0 {
                    asks.push((*id, most));
                }
                continue;
            }
            let drafts = spec.drafter.draft(&s.tokens, cfg.max_drafts.min(room));
            d.propose(*id, drafts, &mut self.sched);
        }
        if !asks.is_empty() {
            self.model_drafts(asks);
        }
    }

    /// The draft model's drafts for `asks` (request, most drafts): as many as the scheduler
    /// would run now at each request's chance of a draft being kept (a request with none worth
    /// running gets one every `PROBE_EVERY` steps, to keep its chance current), written by the
    /// draft model in one batched call, cut to what a grammar allows, and proposed as n-gram
    /// drafts are. A draft model that fails drafts nothing this step (the replies go on).
    fn model_drafts(&mut self, asks: Vec<(RequestId, usize)>) {
        for &(id, most) in &asks {
            let p = (self.live.get(&id).and_then(|d| d.spec.as_ref()))
                .map_or(0.0, |s| s.acceptance.p());
            self.sched.set_drafts(id, vec![0; most], p);
        }
        let worth: HashMap<RequestId, usize> =
            self.sched.drafts_worth_running().into_iter().collect();
        // What the step's plan would run, cut to what the draft model's passes are worth.
        let planned: Vec<(RequestId, usize, f64)> = (asks.iter())
            .filter_map(|&(id, _)| {
                let n = *worth.get(&id)?;
                let p = self.live.get(&id)?.spec.as_ref()?.acceptance.p();
                (n > 0).then_some((id, n, p))
            })
            .collect();
        let costs = &self.draft_costs;
        // The passes go in what the step's plan leaves of the step-time target (the plan fills
        // `PLAN_FRACTION` of it with the step itself).
        let room = (self.sched.itl_target())
            .map(|t| t.as_secs_f64() * (1.0 - super::scheduler::budget::PLAN_FRACTION));
        let depth = costs.depth(
            &planned.iter().map(|w| (w.1, w.2)).collect::<Vec<_>>(),
            room,
        );
        // A probe is worth it only where a draft that is always kept would be.
        let probe = costs.depth(&[(1, 1.0)], room) > 0;
        let mut wanted: Vec<(RequestId, usize)> = Vec::new();
        for (id, most) in asks {
            let Some(spec) = self.live.get_mut(&id).and_then(|d| d.spec.as_mut()) else {
                continue;
            };
            let n = match planned.iter().find(|w| w.0 == id) {
                Some(w) if depth > 0 => w.1.min(depth),
                _ if probe && spec.idle + 1 >= PROBE_EVERY => 1.min(most),
                _ => 0,
            };
            spec.idle = if n > 0 { 0 } else { spec.idle + 1 };
            if n > 0 {
                wanted.push((id, n));
            }
        }
        let (Some(model), false) = (self.draft.as_mut(), wanted.is_empty()) else {
            return;
        };
        let sched = &self.sched;
        let asks: Vec<Ask> = (wanted.iter())
            .filter_map(|&(id, drafts)| {
                let tokens = &sched.get(id)?.tokens;
                Some(Ask { id, tokens, drafts })
            })
            .collect();
        let (t, passes) = (std::time::Instant::now(), model.passes());
        let drafted = model.draft(&asks);
        (self.draft_costs).observe_passes(t.elapsed().as_secs_f64(), model.passes() - passes);
        let drafts = match drafted {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "the draft model failed: no drafts this step");
                for a in &asks {
                    model.forget(a.id);
                }
                return;
            }
        };
        let ids: Vec<RequestId> = asks.iter().map(|a| a.id).collect();
        for (id, proposed) in ids.into_iter().zip(drafts) {
            if let Some(d) = self.live.get_mut(&id) {
                d.propose(id, proposed, &mut self.sched);
            }
        }
    }

    /// Samples the rows of a request that ran `drafts` after its last token: each row's token
    /// as a step without drafts would sample it, kept while it equals the draft before it; the
    /// first that differs (or the row after the last draft) is the step's last token.
    fn verify(
        &mut self,
        id: RequestId,
        drafts: &[u32],
        rows: Vec<Vec<f32>>,
        masks: Option<Vec<Mask>>,
        events: &mut Vec<Event>,
    ) {
        let Some(d) = self.live.get_mut(&id) else {
            return;
        };
        let mut sampled = Vec::with_capacity(rows.len());
        let mut tokens = Vec::with_capacity(rows.len());
        for (i, mut row) in rows.into_iter().enumerate() {
            let raw = d.logprobs.is_some().then(|| row.clone());
            if let Some(m) = masks.as_ref().and_then(|m| m.get(i)) {
                m.apply(&mut row);
            }
            let token = d.sample(&mut row);
            if let Some(Err(error)) = d.constraint.as_mut().map(|c| c.accept(token)) {
                // Nothing of this step is sent: the request fails as a single decode would.
                self.sched.resolve_drafts(id, 0);
                self.fail(id, error, events);
                return;
            }
            sampled.push(token);
            tokens.push(d.token_event(id, token, raw.as_deref()));
            // A draft counts only where the grammar gave the next row its mask.
            let kept =
                drafts.get(i) == Some(&token) && masks.as_ref().is_none_or(|m| i + 1 < m.len());
            let finish = d.finish_reason(token, &self.eos, self.max_context);
            if finish.is_some() || !kept {
                if let Some(spec) = d.spec.as_mut() {
                    spec.acceptance.record(&spec.proposed, &sampled);
                }
                events.push(Event::Drafted {
                    id,
                    drafted: drafts.len(),
                    accepted: i,
                });
                events.append(&mut tokens);
                self.sched.resolve_drafts(id, i);
                match finish {
                    Some(reason) => {
                        self.finish(id);
                        events.push(Event::Finished { id, reason });
                    }
                    None => self.sched.append(id, token),
                }
                return;
            }
        }
    }

    /// Runs one step: `Ok(None)` when there is nothing to run.
    pub fn step(&mut self) -> Result<Option<Vec<Event>>, StepFailed> {
        let began = std::time::Instant::now();
        self.plan_drafts();
        let Some(sch) = self.sched.schedule() else {
            return Ok(None);
        };
        let mut events: Vec<Event> = sch
            .started
            .iter()
            .map(|s| Event::Started {
                id: s.id,
                cached_tokens: s.cached_tokens,
            })
            .collect();
        let t = std::time::Instant::now();
        let e = self.engine.borrow();
        let forward = || {
            sch.copies
                .iter()
                .try_for_each(|c| e.cache.copy_slots(c.src, c.dst, c.slots))
                .and_then(|_| {
                    sch.shifts.iter().try_for_each(|s| {
                        let turn = e.model.key_rotation(s.delta)?;
                        e.cache.shift_slots(&s.src, &s.dst, &turn)
                    })
                })
                .and_then(|_| e.model.forward(&sch.batch, &e.cache))
                .and_then(|l| {
                    l.map(|l| l.to_vec2::<f32>())
                        .transpose()
                        .map_err(Into::into)
                })
        };
        // The sampled requests' grammar masks, computed on a second thread while the forward
        // pass runs (they depend only on the tokens already accepted, and for a decode that
        // runs drafts on those drafts: one mask a row). A step without a constrained request
        // pays one scan of the running requests, nothing more.
        let mut constrained: Vec<(RequestId, &mut Constraint, &[u32])> = Vec::new();
        if self.live.values().any(|d| d.constraint.is_some()) {
            let sampled: std::collections::HashSet<RequestId> =
                (sch.entries.iter().filter(|e| e.sample).map(|e| e.id)).collect();
            let drafts_of = |id: &RequestId| {
                (sch.drafted.iter())
                    .find(|(d, _)| d == id)
                    .map_or(&[][..], |(_, d)| d.as_slice())
            };
            constrained = (self.live.iter_mut())
                .filter(|(id, _)| sampled.contains(id))
                .filter_map(|(id, d)| d.constraint.as_mut().map(|c| (*id, c, drafts_of(id))))
                .collect();
        }
        let (result, masks) = if constrained.is_empty() {
            (forward(), HashMap::new())
        } else {
            std::thread::scope(|s| {
                let masks = s.spawn(move || {
                    (constrained.iter_mut())
                        .map(|(id, c, drafts)| {
                            let t = std::time::Instant::now();
                            let m = c.masks_along(drafts);
                            (*id, (m, t.elapsed().as_secs_f64()))
                        })
                        .collect::<HashMap<_, _>>()
                });
                let result = forward();
                (result, masks.join().unwrap_or_default())
            })
        };
        let seconds = t.elapsed().as_secs_f64();
        let mut masks: HashMap<RequestId, Result<Vec<Mask>, String>> = (masks.into_iter())
            .map(|(id, (m, s))| {
                self.mask_seconds.push(s);
                (id, m)
            })
            .collect();
        tracing::debug!(
            seqs = sch.batch.seqs.len(),
            tokens = sch.batch.num_tokens(),
            forward_ms = seconds * 1e3,
            predicted_ms = self.sched.predict_ms(&sch.shape),
            stretched = sch.stretched,
            running = self.sched.running_len(),
            waiting = self.sched.waiting_len(),
            "step"
        );
        self.sched.observe_step(&sch.shape, seconds);
        let rows = match result {
            Ok(rows) => rows.unwrap_or_default(),
            Err(error) => {
                let mut ids: Vec<RequestId> = sch.entries.iter().map(|e| e.id).collect();
                for id in ids.clone() {
                    ids.extend(self.remove(id));
                }
                return Err(StepFailed { ids, error });
            }
        };
        for &id in &sch.prefilled {
            self.finish(id);
            events.push(Event::Finished {
                id,
                reason: Finish::Prefilled,
            });
        }
        let mut drafted: HashMap<RequestId, Vec<u32>> = sch.drafted.into_iter().collect();
        let mut rows = rows.into_iter();
        let sampled = sch.entries.iter().filter(|e| e.sample).map(|e| e.id);
        // Rows sampled alone (no drafts), masked, for `Sampler::prepare` on all threads: with
        // the default sampling a row costs ~0.1 ms when it is peaked and up to ~2.6 ms when it
        // is flat (top-p then keeps, and sorts, most of the vocabulary), which one thread would
        // pay for every stream in turn.
        let mut pending: Vec<(RequestId, Vec<f32>, Option<Vec<f32>>)> = Vec::new();
        for id in sampled {
            let drafts = drafted.remove(&id).unwrap_or_default();
            if !drafts.is_empty() {
                let own: Vec<Vec<f32>> = rows.by_ref().take(drafts.len() + 1).collect();
                match masks.remove(&id).transpose() {
                    Ok(masks) => self.verify(id, &drafts, own, masks, &mut events),
                    Err(error) => self.fail(id, error, &mut events),
                }
                continue;
            }
            let Some(mut row) = rows.next() else {
                break;
            };
            let Some(d) = self.live.get_mut(&id) else {
                continue;
            };
            let mask = match masks.remove(&id) {
                Some(Err(error)) => {
                    self.fail(id, error, &mut events);
                    continue;
                }
                Some(Ok(m)) => m.into_iter().next(),
                None => None,
            };
            let raw = (d.logprobs.is_some() || !d.forks.is_empty()).then(|| row.clone());
            for (fork, sampler) in std::mem::take(&mut d.forks) {
                let raw = raw.as_deref().expect("kept for forks");
                self.fork(id, fork, sampler, raw, mask.as_ref(), &mut events);
            }
            if !self.live.contains_key(&id) {
                continue;
            }
            if let Some(m) = &mask {
                m.apply(&mut row);
            }
            pending.push((id, row, raw));
        }
        let prepared: Vec<Option<Prepared>> = {
            let mut work: Vec<_> = (pending.iter_mut())
                .map(|(id, row, _)| (self.live.get(id).map(|d| &d.sampler), row, None))
                .collect();
            // On the model's thread team, which is spinning from the step just run.
            team::chunks_mut(&mut work, 1, 1, |_, w| {
                let (s, row, out) = &mut w[0];
                *out = s.map(|s| s.prepare(row));
            });
            work.into_iter().map(|(_, _, p)| p).collect()
        };
        for ((id, _, raw), prepared) in pending.into_iter().zip(prepared) {
            let (Some(d), Some(prepared)) = (self.live.get_mut(&id), prepared) else {
                continue;
            };
            let token = d.draw(prepared);
            if let Some(Err(error)) = d.constraint.as_mut().map(|c| c.accept(token)) {
                self.fail(id, error, &mut events);
                continue;
            }
            events.push(d.token_event(id, token, raw.as_deref()));
            if let Some(spec) = d.spec.as_mut() {
                // Drafts proposed and not run are checked against the token sampled instead.
                spec.acceptance.record(&spec.proposed, &[token]);
                spec.proposed.clear();
            }
            match d.finish_reason(token, &self.eos, self.max_context) {
                Some(reason) => {
                    self.finish(id);
                    events.push(Event::Finished { id, reason });
                }
                None => self.sched.append(id, token),
            }
        }
        if self.draft.is_some() {
            let tokens = (events.iter())
                .filter(|e| matches!(e, Event::Token { .. }))
                .count();
            (self.draft_costs).observe_step(began.elapsed().as_secs_f64(), tokens);
        }
        Ok(Some(events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draft-model pass runs while its expected tokens over its time beat the model's rate
    /// by `GAIN` and the passes fit the room the step leaves: deep for a cheap draft model and
    /// likely drafts, shallow as chances fall or room runs out, never for a draft model as slow
    /// as the model; unmeasured, as deep as asked.
    #[test]
    fn draft_passes_run_while_they_pay() {
        let mut c = DraftCosts::default();
        assert_eq!(c.depth(&[(4, 0.9), (2, 0.5)], None), 4, "unmeasured");
        // The model: 1 token per 10 ms step (100 tok/s).
        c.observe_step(0.010, 1);
        // A draft model 10x cheaper: a pass is worth it while its expected tokens >= 0.125.
        c.observe_passes(0.002, 2);
        assert_eq!(c.depth(&[(8, 0.9)], None), 8);
        // Passes of 1 ms in 5.5 ms of room: 5.
        assert_eq!(c.depth(&[(8, 0.9)], Some(0.0055)), 5);
        // 0.6^4 = 0.13 pays, 0.6^5 does not.
        assert_eq!(c.depth(&[(8, 0.6)], None), 4);
        // Two sequences share a pass: 2 x 0.3^2 = 0.18 pays.
        assert_eq!(c.depth(&[(8, 0.3), (8, 0.3)], None), 2);
        assert_eq!(c.depth(&[(8, 0.3)], None), 1);
        // A draft model as slow as the model: not even a certain draft pays.
        let mut slow = DraftCosts::default();
        slow.observe_step(0.010, 1);
        slow.observe_passes(0.010, 1);
        assert_eq!(slow.depth(&[(8, 1.0)], None), 0);
    }
}
