//! The scheduler: which requests run in the next step and how many of their tokens. Policy only:
//! which blocks hold them is the KV cache manager's (`kv_cache::manager`), which the scheduler
//! owns and asks. Pure code: no actors, no tensors; the batcher owns it and feeds it sampled tokens.
//!
//! Continuous batching at iteration level (Orca, vLLM): every step, running decodes go first (one
//! token each, oldest admission first), then prefill chunks of partly prefilled requests
//! (admission order) and of queued ones (queue order) fill the rest of the step's token budget, up
//! to a maximum of running requests. Nothing waits for a batch to fill. When blocks run out for a
//! decode, the most recently admitted running request is preempted (vLLM's recompute policy): its
//! blocks are freed and it goes back to the front of the queue to prefill its prompt and what it
//! had generated again. Full blocks are handed to the manager to cache at the start of the next
//! step, once their K/V have been written.
//!
//! Between tenants: free slots go by max-min fairness (`next_to_admit`), a tenant with nothing
//! running takes a slot from the one with the most (`preempt_for_fairness`), and a tenant over
//! its share of the slots sits out the one step that runs such a newcomer's first chunk
//! (`tenants_to_hold`), so the newcomer's first token does not wait behind the flood's decodes.
//!
//! While replies decode, a step's prefill is sized to the step-time target (Sarathi-Serve's
//! stall-free batching, with a cost model learned from measured steps); only the step's first
//! prompt, when it fits the token budget, goes whole. Two kinds of request exist for the
//! conversation features: prefill-only requests (type-ahead drafts), which take only what the
//! target leaves and end once computed (`Scheduled::prefilled`), and paused replies (a paced
//! stream at its window), which keep their slot and blocks but do not decode.
//!
//! A second target, `ttft_target`, plans for first tokens: when the step-time target would leave
//! queued turns past their first-token deadline (a burst of visitors arriving together), the
//! step takes more of them, as far as the decoding streams are ahead of their own pace
//! (`deadline`).
//!
//! Speculative drafts proposed for a decode (`set_drafts`) run after its last token when they
//! raise the step's expected tokens per second, priced with the same cost model (`drafts`).
//!
//! One file per concern: this one plans a step (`schedule`) and preempts for blocks; `request`
//! holds the per-request state and the queue API; `budget` the step-time target and chunk sizes;
//! `admit` the order prefills are admitted in; `deadline` first-token deadlines; `drafts` which
//! speculative drafts run; `fairness` the rules between tenants. Each is an
//! `impl Scheduler` block over the same state, so a policy reads alone.

mod admit;
pub(crate) mod budget;
mod deadline;
pub(crate) mod drafts;
mod fairness;
mod request;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use super::cost::{CostModel, LinearCost};
use crate::kv_cache::manager::KvManager;
use crate::kv_cache::Salt;
use crate::model::batch::{Logits, SeqChunk};

pub use budget::MIN_CHUNK;
use budget::*;
pub use request::*;

/// What the scheduler has counted since it began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_queried: u64,
    pub prefix_hits: u64,
    /// Cached blocks evicted for new ones.
    pub evictions: u64,
    /// Running requests preempted for blocks or for a starved tenant.
    pub preemptions: u64,
    /// Steps carrying decodes that were predicted to take longer than the target (the target
    /// could not be met even with the smallest chunk, or the decodes alone exceed it).
    pub itl_misses: u64,
    /// Tokens scheduled in prefill chunks (prompt tokens not found in the cache, and
    /// recomputation after preemption).
    pub prefill_tokens: u64,
    /// Steps that held over-share tenants' work back for another tenant's first chunk.
    pub holds: u64,
    /// Steps that ran past the step-time target so that queued turns meet their first-token
    /// target (`deadline`).
    pub deadline_steps: u64,
    /// Speculative drafts run, and those kept (vLLM's `spec_decode_num_draft_tokens` and
    /// `spec_decode_num_accepted_tokens`).
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
}

impl SchedulerStats {
    /// What each counter gained since `earlier`.
    pub fn since(&self, earlier: &SchedulerStats) -> SchedulerStats {
        SchedulerStats {
            prefix_queried: self.prefix_queried.saturating_sub(earlier.prefix_queried),
            prefix_hits: self.prefix_hits.saturating_sub(earlier.prefix_hits),
            evictions: self.evictions.saturating_sub(earlier.evictions),
            preemptions: self.preemptions.saturating_sub(earlier.preemptions),
            itl_misses: self.itl_misses.saturating_sub(earlier.itl_misses),
            prefill_tokens: self.prefill_tokens.saturating_sub(earlier.prefill_tokens),
            holds: self.holds.saturating_sub(earlier.holds),
            deadline_steps: self.deadline_steps.saturating_sub(earlier.deadline_steps),
            drafted_tokens: self.drafted_tokens.saturating_sub(earlier.drafted_tokens),
            accepted_tokens: self.accepted_tokens.saturating_sub(earlier.accepted_tokens),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Requests running at once (prefilling or decoding).
    pub max_running: usize,
    /// Requests waiting for admission; past it `add` refuses.
    pub max_waiting: usize,
    /// Tokens per step (decodes count one each); prefill chunks fill what decodes leave.
    pub step_tokens: usize,
    /// The step time to stay under while replies are decoding (`None`: token budget only).
    pub itl_target: Option<std::time::Duration>,
    /// The first-token target for replies whose prompt fits a step (`None`: no deadline
    /// planning; the step-time target alone). Applies only while `itl_target` is set.
    pub ttft_target: Option<std::time::Duration>,
}

/// The scheduler's clock: arrivals and first-token deadlines are read from it (tests drive a
/// simulated one, `Scheduler::with_clock`).
pub type Clock = std::sync::Arc<dyn Fn() -> std::time::Instant + Send + Sync>;

pub struct Scheduler {
    cfg: SchedulerConfig,
    clock: Clock,
    kv: KvManager,
    cost: Box<dyn CostModel>,
    /// Recent steps' measured time over predicted time: steps are planned to the target divided
    /// by a high percentile of it, so that most steps, not the average one, stay under.
    errors: VecDeque<f64>,
    /// Steps with decodes whose predicted time went over the target.
    itl_misses: u64,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_admission: u64,
    preemptions: u64,
    prefix: PrefixStats,
    /// Tokens scheduled in prefill chunks (not decodes), in all.
    prefill_tokens: u64,
    /// The last step held tenants back (`tenants_to_hold`); the next one may not.
    held_last: bool,
    /// Steps that held tenants back, in all.
    holds: u64,
    /// Steps stretched for first-token deadlines, in all.
    deadline_steps: u64,
    /// Speculative drafts run and kept, in all.
    drafted_tokens: u64,
    accepted_tokens: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, kv: KvManager) -> Self {
        Self::with_cost(cfg, kv, Box::new(LinearCost::default()))
    }

    /// Replaces the cost model (`Core::set_cost_model`).
    pub fn set_cost_model(&mut self, cost: Box<dyn CostModel>) {
        self.cost = cost;
    }

    /// With a given cost model (tests use a fixed one).
    pub fn with_cost(cfg: SchedulerConfig, kv: KvManager, cost: Box<dyn CostModel>) -> Self {
        Scheduler {
            cfg,
            clock: std::sync::Arc::new(std::time::Instant::now),
            kv,
            cost,
            errors: VecDeque::new(),
            itl_misses: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_admission: 0,
            preemptions: 0,
            prefix: PrefixStats::default(),
            prefill_tokens: 0,
            held_last: false,
            holds: 0,
            deadline_steps: 0,
            drafted_tokens: 0,
            accepted_tokens: 0,
        }
    }

    /// With `clock` instead of the system's monotonic clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub(super) fn now(&self) -> std::time::Instant {
        (self.clock)()
    }

    /// The KV cache manager (blocks, leases, pins).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// The KV cache manager, ending the scheduler.
    pub fn into_kv(self) -> KvManager {
        self.kv
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// The queued requests in the order they would be admitted, roughly: interactive before
    /// batch, then queue order (turns across tenants are not simulated). Drafts are left out.
    pub fn waiting_order(&self) -> Vec<RequestId> {
        let of = |p: Priority| {
            (self.waiting.iter())
                .filter(move |s| s.priority == p && s.kind != SeqKind::Draft)
                .map(|s| s.id)
        };
        of(Priority::Interactive)
            .chain(of(Priority::Batch))
            .collect()
    }

    /// Queued interactive requests.
    pub fn waiting_interactive(&self) -> usize {
        (self.waiting.iter())
            .filter(|s| s.priority == Priority::Interactive)
            .count()
    }

    /// The counters since the scheduler began (the metrics report their changes).
    /// The step-time target while replies decode (`itl_target_ms`), when set.
    pub fn itl_target(&self) -> Option<std::time::Duration> {
        self.cfg.itl_target
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            prefix_queried: self.prefix.queried,
            prefix_hits: self.prefix.hits,
            evictions: self.kv.pool().stats().evictions,
            preemptions: self.preemptions,
            itl_misses: self.itl_misses,
            prefill_tokens: self.prefill_tokens,
            holds: self.holds,
            deadline_steps: self.deadline_steps,
            drafted_tokens: self.drafted_tokens,
            accepted_tokens: self.accepted_tokens,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn get(&self, id: RequestId) -> Option<&Sequence> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .find(|s| s.id == id)
    }

    fn preempt_latest(&mut self) -> Option<RequestId> {
        // A paused reply first: it is not decoding anyway.
        let i = (0..self.running.len())
            .max_by_key(|&i| (self.running[i].paused, self.running[i].admitted))?;
        Some(self.preempt(i))
    }

    /// Sends running request `i` back to the front of the queue, its blocks freed: it
    /// recomputes its prompt and what it generated when admitted again.
    fn preempt(&mut self, i: usize) -> RequestId {
        let mut s = self.running.remove(i);
        self.kv.free(s.blocks.take());
        s.computed = 0;
        s.drafts.clear();
        self.preemptions += 1;
        let id = s.id;
        self.waiting.push_front(s);
        id
    }

    /// Picks the next step's work; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Scheduled> {
        let mut out = self.plan();
        if out.batch.seqs.is_empty() && self.held_last {
            // What the hold was for could not run (no block free for it): plan without it,
            // keeping what the first plan did to the running set and the blocks.
            self.holds -= 1;
            let mut again = self.plan();
            out.preempted.append(&mut again.preempted);
            out.copies.append(&mut again.copies);
            out.shifts.append(&mut again.shifts);
            again.preempted = out.preempted;
            again.copies = out.copies;
            again.shifts = out.shifts;
            out = again;
        }
        (!out.batch.seqs.is_empty()).then_some(out)
    }

    fn plan(&mut self) -> Scheduled {
        let mut out = Scheduled::default();
        self.cache_written_blocks();
        let mut b = StepBudget {
            tokens: self.cfg.step_tokens,
            ..StepBudget::default()
        };
        self.preempt_for_fairness(&mut out);
        b.hold = self.tenants_to_hold();
        self.trim_drafts(&b.hold);
        let decoding = self.schedule_decodes(&b.hold, &mut out);
        // The step-time target a miss is counted against (none when first tokens' deadlines
        // stretched the step on purpose).
        let mut itl_limit = None;
        for id in &decoding {
            let s = self
                .running
                .iter_mut()
                .find(|s| s.id == *id)
                .expect("a decode id is running");
            let mut tokens = vec![*s.tokens.last().expect("a decoding request has tokens")];
            tokens.extend_from_slice(&s.drafts);
            let n = tokens.len();
            out.batch.seqs.push(SeqChunk {
                tokens,
                start_pos: s.computed,
                block_table: s.blocks.table().to_vec(),
                logits: Logits::Decode,
            });
            out.entries.push(Entry {
                id: s.id,
                sample: true,
            });
            if n > 1 {
                out.drafted.push((s.id, s.drafts.clone()));
            }
            b.shape.add_decode(s.computed, n);
            b.shape.add_logits(n);
            s.computed += n;
            b.tokens = b.tokens.saturating_sub(n);
        }
        // Drafts of requests that do not decode this step are dropped.
        for s in &mut self.running {
            if !s.drafts.is_empty() && !decoding.contains(&s.id) {
                s.drafts.clear();
            }
        }
        if !decoding.is_empty() {
            let safety = self.safety();
            b.limit = self
                .cfg
                .itl_target
                .map(|t| t.as_secs_f64() * PLAN_FRACTION / safety);
            b.spare = Some(self.cost.predict(&b.shape) * (1.0 + DRAFT_SLACK));
            if self.plan_first_tokens(&decoding, &mut b) {
                self.deadline_steps += 1;
                out.stretched = true;
                itl_limit = None;
            } else {
                itl_limit = b.limit;
            }
        }
        for priority in [Priority::Interactive, Priority::Batch] {
            self.schedule_running_prefills(&decoding, priority, Remainder::Short, &mut b, &mut out);
            self.admit_short_before_long(priority, &mut b, &mut out);
            self.schedule_running_prefills(&decoding, priority, Remainder::Long, &mut b, &mut out);
            self.admit(priority, &mut b, &mut out);
        }
        if itl_limit.is_some_and(|l| self.cost.predict(&b.shape) > l) {
            self.itl_misses += 1;
        }
        let drafted: usize = out.drafted.iter().map(|(_, d)| d.len()).sum();
        self.prefill_tokens += (out.batch.num_tokens() - decoding.len() - drafted) as u64;
        out.shape = b.shape;
        out.shifts = self.kv.take_shifts();
        out.copies = self.kv.take_copies();
        out
    }

    /// Hands the blocks the previous step filled to the manager, and moves prefilled pinned
    /// prefixes out of the running set into the manager's keeping.
    fn cache_written_blocks(&mut self) {
        for s in &mut self.running {
            self.kv
                .cache_full_blocks(&mut s.blocks, &s.tokens, s.computed);
        }
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.kind == SeqKind::Pin && r.computed == r.tokens.len() {
                let p = self.running.remove(i);
                self.kv.pin(p.blocks, &p.tokens);
            } else {
                i += 1;
            }
        }
    }

    /// Finds room for every running decode, oldest admission first, preempting the newest
    /// admission when blocks run out. Returns the requests that decode this step, in order.
    fn schedule_decodes(&mut self, hold: &[Salt], out: &mut Scheduled) -> Vec<RequestId> {
        let mut ids: Vec<(u64, RequestId)> = self
            .running
            .iter()
            .filter(|s| Self::decodes_next(s, hold))
            .map(|s| (s.admitted, s.id))
            .collect();
        ids.sort();
        let mut ids: Vec<RequestId> = ids.into_iter().map(|(_, id)| id).collect();
        let mut i = 0;
        while i < ids.len() {
            let Some(pos) = self.running.iter().position(|s| s.id == ids[i]) else {
                i += 1;
                continue;
            };
            let s = &mut self.running[pos];
            if self
                .kv
                .allocate_slots(&mut s.blocks, s.tokens.len() + s.drafts.len())
            {
                i += 1;
                continue;
            }
            match self.preempt_latest() {
                Some(p) => {
                    out.preempted.push(p);
                    ids.retain(|&d| d != p);
                }
                None => break,
            }
        }
        ids
    }
}
