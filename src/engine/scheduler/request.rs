//! A request as the scheduler holds it (`Sequence`), what a step runs (`Scheduled`), and the
//! queue API: adding, pausing, finishing, forking and removing requests.

use super::*;
use crate::engine::cost::StepShape;
use crate::kv_cache::manager::{BlockCopy, LeaseKey, SeqBlocks, SlotShift};
use crate::kv_cache::{CacheScope, Salt};
use crate::model::batch::StepBatch;

/// Names a request inside the engine (the batcher hands them out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// Whose prefill goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    /// A person is waiting (the default).
    #[default]
    Interactive,
    /// Jobs: admitted and prefilled only with what interactive requests leave.
    Batch,
}

/// A tenant's share of the scheduler (`[[tenants]]` `max_running` / `max_waiting`; for keyless
/// clients `scheduler.anonymous_max_*`). Every request of a tenant carries the same quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quota {
    /// The tenant's requests running at once (`None`: only the scheduler's cap).
    pub max_running: Option<usize>,
    /// The tenant's requests waiting at once; past it `add` refuses.
    pub max_waiting: Option<usize>,
}

/// What a request is for: only replies sample, and only replies count as a tenant's activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqKind {
    /// A reply: prefilled, then decoded and sampled.
    Reply,
    /// An operator prefix to prefill and keep cached (pinned); no sampling.
    Pin,
    /// Prefill only (a draft of a message being typed): no sampling; it ends once its prompt
    /// is computed, and only ever takes what the step-time target leaves.
    Draft,
}

/// One request's tokens and progress.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: RequestId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Its blocks (the manager's to change).
    pub blocks: SeqBlocks,
    /// Admission order into the running set (preemption takes the largest).
    pub(super) admitted: u64,
    /// `Started` was reported.
    pub started: bool,
    /// Tokens taken from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// The session lease this request continues (handed over at admission), and whether the
    /// manager may shift a later run of it (`KvManager::computed_blocks`).
    pub lease: Option<LeaseKey>,
    pub(super) shift: bool,
    pub priority: Priority,
    /// Its tenant's share.
    pub(super) quota: Quota,
    pub(super) kind: SeqKind,
    /// A paced reply at its window: it keeps its place and its blocks but does not decode.
    pub(super) paused: bool,
    /// When it was queued (the scheduler's clock): its first token's deadline and its stream's
    /// pace count from here (`deadline`).
    pub(super) arrived: std::time::Instant,
    /// Its prompt's length: the tokens after it are its reply.
    pub(super) prompt_len: usize,
    /// Speculative drafts to run after its last token in its next decode (`set_drafts`), and
    /// the chance that each is kept given the one before it was.
    pub(super) drafts: Vec<u32>,
    pub(super) draft_p: f64,
    /// Prompt tokens the prefix cache held when the plan last looked, before admission
    /// (`KvManager::cached_len`): how much prefill it will need.
    pub(super) cached_estimate: Option<usize>,
}

impl Sequence {
    pub(super) fn new(
        id: RequestId,
        tokens: Vec<u32>,
        scope: CacheScope,
        kind: SeqKind,
        arrived: std::time::Instant,
    ) -> Self {
        Sequence {
            id,
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            blocks: SeqBlocks::new(scope),
            admitted: 0,
            // A pin reports nothing: there is no one to tell it started.
            started: kind == SeqKind::Pin,
            cached_tokens: 0,
            lease: None,
            shift: false,
            priority: Priority::Interactive,
            quota: Quota::default(),
            kind,
            paused: false,
            arrived,
            cached_estimate: None,
            drafts: Vec::new(),
            draft_p: 0.0,
        }
    }

    /// Who it is for: its tenant and its principal (the cache partition's salts).
    pub(super) fn tenant(&self) -> Salt {
        self.blocks.scope().tenant
    }

    pub(super) fn principal(&self) -> Salt {
        self.blocks.scope().principal
    }

    pub(super) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// A long prefill: more than `budget` tokens left, or a prompt that needed more than
    /// `budget` new tokens when it started (its tail stays long: cut to the time target deep in
    /// its context, a tail under one budget can take dozens of steps, and counted as short it
    /// would go ahead of, and hold back, every new chat turn; `admit_short_before_long`).
    pub(super) fn long_prefill(&self, budget: usize) -> bool {
        self.pending() > budget
            || (self.computed < self.prompt_len
                && self.prompt_len.saturating_sub(self.cached_tokens) > budget)
    }

    /// Tokens of its reply so far.
    pub(super) fn generated(&self) -> usize {
        self.tokens.len().saturating_sub(self.prompt_len)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// The queue is full.
    Overloaded { waiting: usize },
    /// The tenant's share of the queue (`Quota::max_waiting`) is full.
    TenantOverloaded { waiting: usize },
    /// The request could never fit in the cache.
    TooLarge { tokens: usize, cache_tokens: usize },
}

/// One batch entry's request and whether a token is sampled for it after the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub id: RequestId,
    pub sample: bool,
}

/// A request whose first chunk runs in this step, with the prompt tokens found in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    pub id: RequestId,
    pub cached_tokens: usize,
}

/// What the next step runs.
#[derive(Debug, Clone, Default)]
pub struct Scheduled {
    pub batch: StepBatch,
    /// One per batch entry, in order.
    pub entries: Vec<Entry>,
    pub started: Vec<Started>,
    /// Requests preempted while scheduling this step (back in the queue).
    pub preempted: Vec<RequestId>,
    /// Slots to copy between blocks before the step runs, then the context shifts to make.
    pub copies: Vec<BlockCopy>,
    pub shifts: Vec<SlotShift>,
    /// Prefill-only requests whose prompt this step completes (they end after it).
    pub prefilled: Vec<RequestId>,
    /// The step's shape, for the cost model (`Scheduler::observe_step` with its measured time).
    pub shape: StepShape,
    /// The step runs past the step-time target for queued turns' first tokens (`deadline`).
    pub stretched: bool,
    /// Decodes that run speculative drafts after their last token, with those drafts: such an
    /// entry has a row of logits for its last token and one for each draft.
    pub drafted: Vec<(RequestId, Vec<u32>)>,
}

/// Prompt tokens looked up in the prefix cache at first admission, and found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct PrefixStats {
    pub queried: u64,
    pub hits: u64,
}

impl Scheduler {
    /// Queues a request that will hold at most `max_total` tokens. Returns its queue position (0 =
    /// next to be admitted).
    pub fn add(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        max_total: usize,
        scope: CacheScope,
    ) -> Result<usize, AddError> {
        self.add_with(id, prompt, max_total, scope, Quota::default())
    }

    /// `add` for a tenant with a `quota`.
    pub fn add_with(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        max_total: usize,
        scope: CacheScope,
        quota: Quota,
    ) -> Result<usize, AddError> {
        if !self.kv.fits(max_total) {
            return Err(AddError::TooLarge {
                tokens: max_total,
                cache_tokens: self.kv.capacity_tokens(),
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(AddError::Overloaded {
                waiting: self.waiting.len(),
            });
        }
        if let Some(max) = quota.max_waiting {
            let waiting = (self.waiting.iter())
                .filter(|s| s.tenant() == scope.tenant)
                .count();
            if waiting >= max {
                return Err(AddError::TenantOverloaded { waiting });
            }
        }
        let mut s = Sequence::new(id, prompt, scope, SeqKind::Reply, self.now());
        s.quota = quota;
        self.waiting.push_back(s);
        Ok(self.waiting.len() - 1)
    }

    /// Sets a queued request's priority.
    pub fn set_priority(&mut self, id: RequestId, priority: Priority) {
        if let Some(s) = self.waiting.iter_mut().find(|s| s.id == id) {
            s.priority = priority;
        }
    }

    /// Pauses or resumes a request's decoding (a paced reply at its window, or acked again).
    pub fn set_paused(&mut self, id: RequestId, paused: bool) {
        if let Some(s) = (self.running.iter_mut())
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
        {
            s.paused = paused;
        }
    }

    /// Makes a queued request prefill-only (`SeqKind::Draft`).
    pub fn set_prefill_only(&mut self, id: RequestId) {
        if let Some(s) = self.waiting.iter_mut().find(|s| s.id == id) {
            s.kind = SeqKind::Draft;
        }
    }

    /// Sets the session lease a queued request continues; `shift`: its prompt dropped turns the
    /// lease holds, so a later run of it may be shifted.
    pub fn set_lease(&mut self, id: RequestId, lease: LeaseKey, shift: bool) {
        if let Some(s) = self.waiting.iter_mut().find(|s| s.id == id) {
            s.lease = Some(lease);
            s.shift = shift;
        }
    }

    /// Queues a prefix to prefill once and keep for good (a configured system prompt, shared by
    /// the tenant's principals). Nothing to keep without prefix caching or a full block.
    pub fn add_pinned(&mut self, id: RequestId, tokens: Vec<u32>, tenant: Salt) {
        let kv = self.kv.config();
        if tokens.len() < kv.block_size + 1 || !kv.prefix_caching {
            return;
        }
        self.waiting.push_back(Sequence::new(
            id,
            tokens,
            CacheScope::operator(tenant),
            SeqKind::Pin,
            self.now(),
        ));
    }

    /// Ends a request; with a lease key, its conversation's blocks stay for the session's next
    /// turn (within the manager's caps).
    pub fn finish(&mut self, id: RequestId, lease: Option<LeaseKey>) {
        self.finish_at(id, lease, usize::MAX);
    }

    /// Ends a request like `finish`, keeping at most its first `keep` tokens (prompt, then
    /// reply) for the lease: a reply the user stopped hearing part way leaves only what was
    /// heard.
    pub fn finish_at(&mut self, id: RequestId, lease: Option<LeaseKey>, keep: usize) {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            self.remove(id);
            return;
        };
        let s = self.running.remove(i);
        self.kv
            .finish(s.blocks, &s.tokens, s.computed.min(keep), lease);
    }

    /// Drops a session's lease. Idempotent.
    pub fn drop_lease(&mut self, key: LeaseKey) {
        self.kv.drop_lease(key);
    }

    /// Removes a request wherever it is and frees its blocks. Idempotent.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let mut s = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i).expect("index from position")
        };
        self.kv.free(s.blocks.take());
        Some(s)
    }

    /// Appends a sampled token to a running request.
    pub fn append(&mut self, id: RequestId, token: u32) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.tokens.push(token);
        }
    }

    /// Speculative drafts proposed for running request `id`'s next decode, each kept (given the
    /// one before it was) with chance `p`: the next step runs those worth their cost
    /// (`trim_drafts`) after its last token in the same chunk, each with its logits. They are
    /// not its tokens until `resolve_drafts` keeps them. Cleared if the request does not decode
    /// in the next step.
    pub fn set_drafts(&mut self, id: RequestId, drafts: Vec<u32>, p: f64) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.drafts = drafts;
            s.draft_p = p.clamp(0.0, 1.0);
        }
    }

    /// After the step that ran request `id`'s drafts: the first `accepted` become its tokens,
    /// and the K/V of the rest are dropped (`KvManager::truncate`). Call before `append`,
    /// `finish` or anything else of the request's.
    pub fn resolve_drafts(&mut self, id: RequestId, accepted: usize) {
        let Some(s) = self.running.iter_mut().find(|s| s.id == id) else {
            return;
        };
        let drafts = std::mem::take(&mut s.drafts);
        let accepted = accepted.min(drafts.len());
        s.tokens.extend_from_slice(&drafts[..accepted]);
        s.computed -= drafts.len() - accepted;
        s.computed = self.kv.truncate(&mut s.blocks, s.computed);
        self.drafted_tokens += drafts.len() as u64;
        self.accepted_tokens += accepted as u64;
    }

    /// Adds `child`, another choice of running request `parent`'s prompt, in the step that
    /// computed the parent's last prompt token (before the parent's own token is appended): it
    /// shares the parent's blocks (`KvManager::fork`), holds `first` (sampled from the same
    /// logits) and decodes from the next step, so `n` choices cost one prefill. With no block
    /// free for the copy it queues first and prefills on its own; past `max_running` it queues
    /// first holding its blocks.
    pub fn fork(&mut self, parent: RequestId, child: RequestId, first: u32) {
        let Some(p) = self.running.iter().find(|s| s.id == parent) else {
            return;
        };
        let mut s = Sequence::new(
            child,
            p.tokens.clone(),
            *p.blocks.scope(),
            SeqKind::Reply,
            p.arrived,
        );
        s.prompt_len = p.prompt_len;
        s.tokens.push(first);
        s.priority = p.priority;
        s.started = true;
        let Some(blocks) = self.kv.fork(&p.blocks, p.computed) else {
            self.waiting.push_front(s);
            return;
        };
        s.blocks = blocks;
        s.computed = s.tokens.len() - 1;
        s.cached_tokens = s.computed;
        if self.running.len() < self.cfg.max_running {
            s.admitted = self.next_admission;
            self.next_admission += 1;
            self.running.push(s);
        } else {
            self.waiting.push_front(s);
        }
    }
}
