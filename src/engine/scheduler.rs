//! The scheduler: which sequences run in the next step and how many of their tokens. Pure code:
//! no actors, no tensors; the batcher owns it and feeds it sampled tokens.
//!
//! Continuous batching at iteration level (Orca, vLLM): every step, running decodes go first (one
//! token each), then prefill chunks of partly-prefilled and waiting sequences fill the rest of the
//! step's token budget, up to a maximum of running sequences. Nothing waits for a batch to fill.
//! When KV blocks run out for a decode, the most recently admitted running sequence is preempted
//! (vLLM's recompute policy): its blocks are freed and it goes back to the front of the queue to
//! prefill its prompt and what it had generated again.
//!
//! With prefix caching on, a sequence being admitted takes over the longest run of cached full
//! blocks that match its tokens (same tenant salt), always leaving at least its last token to
//! compute; blocks a sequence fills are registered with the pool at the start of the next step,
//! once their K/V have been written.
//!
//! Blocks can outlive their request. A session's *lease* keeps its conversation's full blocks
//! referenced between turns (up to a cap per session and in all), and the partly filled block
//! after them with the tokens it holds (only the lease references it: nothing else can share a
//! block that is not full), so the next turn prefills only the new message, not the end of the last
//! reply back to a block boundary; leases are the first thing dropped, oldest first, when blocks run out, and then
//! the next turn simply finds fewer cached blocks. *Pinned* prefixes (configured system prompts)
//! are prefilled once and never dropped, their partly filled last block included: a sequence that
//! starts with the whole pinned prefix gets a fresh block with a copy of that block's slots
//! (vLLM v0's copy-on-write `blocks_to_copy`), so no principal recomputes the operator's text.

use std::collections::VecDeque;

use super::step::{SeqChunk, StepBatch};
use crate::kv_cache::{blocks_for, BlockPool, CacheScope};

pub type RequestId = u64;

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Sequences running at once (prefilling or decoding).
    pub max_running: usize,
    /// Sequences waiting for admission; past it `add` refuses.
    pub max_waiting: usize,
    /// Tokens per step (decodes count one each); prefill chunks fill what decodes leave.
    pub step_tokens: usize,
    pub block_size: usize,
    /// Share cached prefix blocks between sequences.
    pub prefix_caching: bool,
    /// Tokens a session's lease may keep between turns (0 = no leases).
    pub lease_tokens_per_session: usize,
    /// Tokens all leases together may keep.
    pub lease_tokens_total: usize,
}

/// One request's tokens and cache bookkeeping.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: RequestId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    pub block_table: Vec<u32>,
    /// Admission order into the running set (preemption takes the largest).
    admitted: u64,
    /// `Started` was reported.
    pub started: bool,
    /// Which partition each block is hashed in (operator prefix: the tenant; the rest: the
    /// principal that sent it).
    pub scope: CacheScope,
    /// Tokens taken from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Hashes of the blocks registered with the pool so far (block i of the table).
    hashes: Vec<u64>,
    /// The session lease this request continues (dropped once its blocks are taken over).
    pub lease: Option<u64>,
    /// A prefix to prefill and keep (no sampling).
    pin: bool,
}

impl Sequence {
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// The queue is full.
    Overloaded { waiting: usize },
    /// The sequence could never fit in the cache.
    TooLarge { tokens: usize, cache_tokens: usize },
}

/// What the next step runs.
#[derive(Debug, Clone, Default)]
pub struct Scheduled {
    pub batch: StepBatch,
    /// Per batch entry: its request and whether a token is sampled for it after this step.
    pub entries: Vec<(RequestId, bool)>,
    /// Requests whose first chunk runs in this step, with the prompt tokens found in the cache.
    pub started: Vec<(RequestId, usize)>,
    /// Requests preempted while scheduling this step (back in the queue).
    pub preempted: Vec<RequestId>,
    /// Slots to copy between blocks before the step runs.
    pub copies: Vec<BlockCopy>,
}

/// Copy the first `slots` slots of block `src` into block `dst` (every layer's K and V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
    pub slots: usize,
}

/// The partly filled last block of a pinned prefix.
#[derive(Debug, Clone)]
struct PinTail {
    /// Hash of the pin's last full block: a sequence whose cached run ends there continues it.
    after: u64,
    tokens: Vec<u32>,
    block: u32,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_admission: u64,
    preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and found.
    prefix_queried: u64,
    prefix_hits: u64,
    /// Session leases by age (front = oldest): order -> (lease key, blocks).
    leases: std::collections::BTreeMap<u64, (u64, Vec<u32>)>,
    lease_order: std::collections::HashMap<u64, u64>,
    /// Lease key -> the tokens in its last block, when that block is only partly filled.
    lease_tails: std::collections::HashMap<u64, Vec<u32>>,
    next_lease: u64,
    /// Pinned prefixes' blocks (held for good).
    pinned: Vec<Vec<u32>>,
    pin_tails: Vec<PinTail>,
    /// Copies recorded while admitting sequences, handed out with the step.
    copies: Vec<BlockCopy>,
    /// Changes whenever leases or pins change (so the held-block count is recounted only then).
    holds_version: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, pool: BlockPool) -> Self {
        Scheduler {
            cfg,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_admission: 0,
            preemptions: 0,
            prefix_queried: 0,
            prefix_hits: 0,
            leases: Default::default(),
            lease_order: Default::default(),
            lease_tails: Default::default(),
            next_lease: 0,
            pinned: Vec::new(),
            pin_tails: Vec::new(),
            copies: Vec::new(),
            holds_version: 0,
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// (tokens looked up in the prefix cache, tokens found).
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.prefix_queried, self.prefix_hits)
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

    /// Queues a request that will hold at most `max_total` tokens. Returns its queue position (0 =
    /// next to be admitted).
    pub fn add(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        max_total: usize,
        scope: CacheScope,
    ) -> Result<usize, AddError> {
        let cache_tokens = self.pool.total() * self.cfg.block_size;
        if blocks_for(max_total, self.cfg.block_size) > self.pool.total() {
            return Err(AddError::TooLarge {
                tokens: max_total,
                cache_tokens,
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(AddError::Overloaded {
                waiting: self.waiting.len(),
            });
        }
        self.waiting.push_back(Sequence {
            id,
            tokens: prompt,
            computed: 0,
            block_table: Vec::new(),
            admitted: 0,
            started: false,
            scope,
            cached_tokens: 0,
            hashes: Vec::new(),
            lease: None,
            pin: false,
        });
        Ok(self.waiting.len() - 1)
    }

    /// Sets the session lease a queued request continues.
    pub fn set_lease(&mut self, id: RequestId, lease: u64) {
        if let Some(s) = self.waiting.iter_mut().find(|s| s.id == id) {
            s.lease = Some(lease);
        }
    }

    /// Queues a prefix to prefill once and keep for good (a configured system prompt, shared by
    /// the tenant's principals).
    pub fn add_pinned(&mut self, id: RequestId, tokens: Vec<u32>, tenant: crate::kv_cache::Salt) {
        if tokens.len() < self.cfg.block_size + 1 || !self.cfg.prefix_caching {
            return;
        }
        self.waiting.push_back(Sequence {
            id,
            tokens,
            computed: 0,
            block_table: Vec::new(),
            admitted: 0,
            started: true,
            scope: CacheScope::operator(tenant),
            cached_tokens: 0,
            hashes: Vec::new(),
            lease: None,
            pin: true,
        });
    }

    /// A number that changes whenever `held_distinct` may have.
    pub fn holds_version(&self) -> u64 {
        self.holds_version
    }

    /// Distinct blocks referenced only by leases and pins once nothing runs (the idle level).
    pub fn held_distinct(&self) -> usize {
        let mut all: std::collections::HashSet<u32> = std::collections::HashSet::new();
        for (_, t) in self.leases.values() {
            all.extend(t);
        }
        for t in &self.pinned {
            all.extend(t);
        }
        all.len()
    }

    /// Block references held by leases and by pinned prefixes.
    pub fn held_blocks(&self) -> (usize, usize) {
        (
            self.leases.values().map(|(_, t)| t.len()).sum(),
            self.pinned.iter().map(Vec::len).sum(),
        )
    }

    /// Ends a request; with a lease key, its conversation's full blocks stay referenced for the
    /// session's next turn (within the caps), replacing that session's previous lease.
    pub fn finish(&mut self, id: RequestId, lease: Option<u64>) {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            self.remove(id);
            return;
        };
        let s = self.running.remove(i);
        let bs = self.cfg.block_size;
        let leasing =
            lease.is_some() && self.cfg.prefix_caching && self.cfg.lease_tokens_per_session > 0;
        let keep = if leasing {
            (s.computed.min(self.cfg.lease_tokens_per_session) / bs).min(s.block_table.len())
        } else {
            0
        };
        // The partly filled block after the full ones, when the cap leaves room for all of it.
        let tail_len = s.computed - keep * bs;
        let tail = leasing
            && tail_len > 0
            && tail_len < bs
            && s.computed <= self.cfg.lease_tokens_per_session
            && s.block_table.len() > keep;
        let held = keep + usize::from(tail);
        if keep > 0 {
            // Make the kept blocks findable before holding them.
            let mut parent = None;
            for (i, (b, chunk)) in s
                .block_table
                .iter()
                .zip(s.tokens.chunks_exact(bs))
                .take(keep)
                .enumerate()
            {
                let salt = s.scope.salt_of_block(i, bs);
                parent = Some(self.pool.register(*b, parent, salt, chunk));
            }
        }
        self.pool.release_table(&s.block_table[held..]);
        if let Some(key) = lease {
            self.drop_lease(key);
            if held > 0 {
                let order = self.next_lease;
                self.next_lease += 1;
                self.leases
                    .insert(order, (key, s.block_table[..held].to_vec()));
                self.holds_version += 1;
                self.lease_order.insert(key, order);
                if tail {
                    self.lease_tails
                        .insert(key, s.tokens[keep * bs..s.computed].to_vec());
                }
                let cap = self.cfg.lease_tokens_total / bs;
                while self.held_blocks().0 > cap && self.drop_oldest_lease() {}
            }
        }
    }

    /// Drops a session's lease (its blocks stay cached until evicted). Idempotent.
    pub fn drop_lease(&mut self, key: u64) {
        self.lease_tails.remove(&key);
        if let Some(order) = self.lease_order.remove(&key) {
            if let Some((_, table)) = self.leases.remove(&order) {
                self.pool.release_table(&table);
                self.holds_version += 1;
            }
        }
    }

    fn drop_oldest_lease(&mut self) -> bool {
        let Some((_, (key, _))) = self.leases.first_key_value() else {
            return false;
        };
        let key = *key;
        self.drop_lease(key);
        true
    }

    /// Drops leases, oldest first, until `blocks` blocks are free; false if that is not enough.
    fn make_room(&mut self, blocks: usize) -> bool {
        while self.pool.free_count() < blocks {
            if !self.drop_oldest_lease() {
                return false;
            }
        }
        true
    }

    /// Removes a request wherever it is and frees its blocks. Idempotent.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.pool.release_table(&s.block_table);
            return Some(s);
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("index from position");
            self.pool.release_table(&s.block_table);
            return Some(s);
        }
        None
    }

    /// Appends a sampled token to a running sequence.
    pub fn append(&mut self, id: RequestId, token: u32) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.tokens.push(token);
        }
    }

    fn preempt_latest(&mut self) -> Option<RequestId> {
        let i = (0..self.running.len()).max_by_key(|&i| self.running[i].admitted)?;
        let mut s = self.running.remove(i);
        self.pool.release_table(&s.block_table);
        s.block_table.clear();
        s.hashes.clear();
        s.computed = 0;
        self.preemptions += 1;
        let id = s.id;
        self.waiting.push_front(s);
        Some(id)
    }

    /// Starts a sequence from the longest cached run of its full blocks, leaving at least its last
    /// token to compute (its logits are what the next token is sampled from).
    fn take_cached_prefix(&mut self, s: &mut Sequence) {
        let bs = self.cfg.block_size;
        let max_blocks = (s.tokens.len() - 1) / bs;
        let shared = self
            .pool
            .acquire_prefix(&s.tokens, bs, &s.scope, max_blocks);
        let hashes = crate::kv_cache::block_pool::prefix_hashes(
            &s.tokens[..shared.len() * bs],
            bs,
            &s.scope,
        );
        s.hashes = hashes;
        s.computed = shared.len() * bs;
        s.block_table = shared;
        if let Some(k) = s.lease {
            // The lease's partly filled last block continues this sequence when the full blocks
            // before it matched and its tokens come next (with a token left to compute): the
            // lease's reference moves to the sequence.
            if let (Some(tail), Some(order)) = (self.lease_tails.get(&k), self.lease_order.get(&k))
            {
                let table = &self.leases[order].1;
                let start = (table.len() - 1) * bs;
                if s.block_table.len() == table.len() - 1
                    && s.tokens.len() > start + tail.len()
                    && s.tokens[start..start + tail.len()] == tail[..]
                {
                    s.computed = start + tail.len();
                    let order = *order;
                    self.lease_tails.remove(&k);
                    let b = self.leases.get_mut(&order).and_then(|(_, t)| t.pop());
                    s.block_table.extend(b);
                }
            }
            // The session's previous lease has served: its blocks are now referenced by this
            // request.
            self.drop_lease(k);
        }
        self.continue_pin_tail(s);
        if !s.started {
            self.prefix_queried += s.tokens.len() as u64;
            self.prefix_hits += s.computed as u64;
            s.cached_tokens = s.computed;
        }
    }

    /// When the cached run ends exactly where a pinned prefix's full blocks end and the pin's
    /// partly filled block's tokens come next (with a token left to compute), a fresh block
    /// takes a copy of its slots. The pin's chain is salted with its tenant, so only that
    /// tenant's sequences match, and the tokens copied are the operator's.
    fn continue_pin_tail(&mut self, s: &mut Sequence) {
        let bs = self.cfg.block_size;
        let start = s.block_table.len() * bs;
        if s.computed != start || s.hashes.len() != s.block_table.len() {
            return;
        }
        let Some(&last) = s.hashes.last() else { return };
        let Some(t) = self.pin_tails.iter().find(|t| {
            t.after == last
                && s.tokens.len() > start + t.tokens.len()
                && s.tokens[start..start + t.tokens.len()] == t.tokens[..]
        }) else {
            return;
        };
        let (src, slots) = (t.block, t.tokens.len());
        if let Some(b) = self.pool.allocate(1) {
            self.copies.push(BlockCopy {
                src,
                dst: b[0],
                slots,
            });
            s.block_table.push(b[0]);
            s.computed += slots;
        }
    }

    /// Picks the next step's work; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Scheduled> {
        let mut out = Scheduled::default();
        let bs = self.cfg.block_size;
        if self.cfg.prefix_caching {
            // Blocks filled by the previous step now hold their K/V: make them findable.
            for s in &mut self.running {
                let full = s.computed / bs;
                for i in s.hashes.len()..full {
                    let parent = s.hashes.last().copied();
                    let h = self.pool.register(
                        s.block_table[i],
                        parent,
                        s.scope.salt_of_block(i, bs),
                        &s.tokens[i * bs..(i + 1) * bs],
                    );
                    s.hashes.push(h);
                }
            }
            // Prefilled pinned prefixes leave the running set and keep their full blocks.
            let mut i = 0;
            while i < self.running.len() {
                let r = &self.running[i];
                if r.pin && r.computed == r.tokens.len() {
                    let p = self.running.remove(i);
                    let mut keep = p.hashes.len();
                    if keep > 0 && p.tokens.len() > keep * bs && p.block_table.len() > keep {
                        self.pin_tails.push(PinTail {
                            after: p.hashes[keep - 1],
                            tokens: p.tokens[keep * bs..].to_vec(),
                            block: p.block_table[keep],
                        });
                        keep += 1;
                    }
                    self.pool.release_table(&p.block_table[keep..]);
                    self.pinned.push(p.block_table[..keep].to_vec());
                    self.holds_version += 1;
                } else {
                    i += 1;
                }
            }
        }
        // 1. Decodes of running sequences, oldest first; preempt the newest when blocks run out.
        let mut decode_ids: Vec<RequestId> = {
            let mut v: Vec<&Sequence> = self
                .running
                .iter()
                .filter(|s| s.computed > 0 && s.pending() == 1)
                .collect();
            v.sort_by_key(|s| s.admitted);
            v.iter().map(|s| s.id).collect()
        };
        let mut i = 0;
        while i < decode_ids.len() {
            let id = decode_ids[i];
            let Some(pos) = self.running.iter().position(|s| s.id == id) else {
                i += 1;
                continue;
            };
            let need = self.running[pos].tokens.len();
            let missing = blocks_for(need, bs).saturating_sub(self.running[pos].block_table.len());
            self.make_room(missing);
            let mut table = std::mem::take(&mut self.running[pos].block_table);
            let ok = self.pool.ensure_capacity(&mut table, need, bs);
            self.running[pos].block_table = table;
            if ok {
                i += 1;
                continue;
            }
            match self.preempt_latest() {
                Some(p) => {
                    out.preempted.push(p);
                    decode_ids.retain(|&d| d != p);
                }
                None => break,
            }
        }
        let mut budget = self.cfg.step_tokens;
        for id in &decode_ids {
            let s = self
                .running
                .iter_mut()
                .find(|s| s.id == *id)
                .expect("decode id is running");
            out.batch.seqs.push(SeqChunk {
                tokens: vec![*s.tokens.last().expect("a decoding sequence has tokens")],
                start_pos: s.computed,
                block_table: s.block_table.clone(),
                want_logits: true,
            });
            out.entries.push((s.id, true));
            s.computed += 1;
            budget = budget.saturating_sub(1);
        }
        // 2. Prefill chunks: running sequences first (admission order), then the queue.
        let mut prefilling: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].pending() > 0 && !decode_ids.contains(&self.running[i].id))
            .collect();
        prefilling.sort_by_key(|&i| self.running[i].admitted);
        for i in prefilling {
            if budget == 0 {
                break;
            }
            let r = &self.running[i];
            let next = r.computed + r.pending().min(budget);
            let missing = blocks_for(next, bs).saturating_sub(r.block_table.len());
            self.make_room(missing);
            if !push_chunk(
                &mut self.pool,
                bs,
                &mut self.running[i],
                &mut budget,
                &mut out,
            ) {
                break;
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if self.cfg.prefix_caching && s.block_table.is_empty() {
                self.take_cached_prefix(&mut s);
            }
            let next = s.computed + s.pending().min(budget);
            self.make_room(blocks_for(next, bs).saturating_sub(s.block_table.len()));
            if push_chunk(&mut self.pool, bs, &mut s, &mut budget, &mut out) {
                s.admitted = self.next_admission;
                self.next_admission += 1;
                self.running.push(s);
            } else {
                // Give the shared blocks back until there is room.
                self.copies.retain(|c| !s.block_table.contains(&c.dst));
                self.pool.release_table(&s.block_table);
                s.block_table.clear();
                s.hashes.clear();
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
        }
        out.copies = std::mem::take(&mut self.copies);
        if out.batch.seqs.is_empty() {
            None
        } else {
            Some(out)
        }
    }
}

/// Adds the next prefill chunk of `s` within `budget`; false if no block is free for it.
fn push_chunk(
    pool: &mut BlockPool,
    bs: usize,
    s: &mut Sequence,
    budget: &mut usize,
    out: &mut Scheduled,
) -> bool {
    let chunk = s.pending().min(*budget);
    let end = s.computed + chunk;
    if !pool.ensure_capacity(&mut s.block_table, end, bs) {
        return false;
    }
    let want = end == s.tokens.len() && !s.pin;
    out.batch.seqs.push(SeqChunk {
        tokens: s.tokens[s.computed..end].to_vec(),
        start_pos: s.computed,
        block_table: s.block_table.clone(),
        want_logits: want,
    });
    out.entries.push((s.id, want));
    if !s.started {
        s.started = true;
        out.started.push((s.id, s.cached_tokens));
    }
    s.computed = end;
    *budget -= chunk;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::Salt;
    use proptest::prelude::*;

    /// One partition for every block (these tests are about scheduling, not principals).
    fn scope(salt: u64) -> CacheScope {
        CacheScope::private(Salt(salt))
    }

    fn sched(blocks: usize, max_running: usize, step_tokens: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_running,
                max_waiting: 4,
                step_tokens,
                block_size: 4,
                prefix_caching: false,
                lease_tokens_per_session: 0,
                lease_tokens_total: 0,
            },
            BlockPool::new(blocks),
        )
    }

    /// Runs a step and feeds back a token for every sampled entry.
    fn step(s: &mut Scheduler) -> Scheduled {
        let out = s.schedule().expect("work");
        for &(id, want) in &out.entries {
            if want {
                s.append(id, 7);
            }
        }
        out
    }

    #[test]
    fn decodes_first_then_prefill_chunks_within_budget() {
        let mut s = sched(32, 4, 8);
        s.add(1, vec![1; 5], 20, scope(0)).unwrap();
        let a = step(&mut s);
        assert_eq!(a.entries, vec![(1, true)]);
        assert_eq!(a.started, vec![(1, 0)]);
        s.add(2, vec![2; 20], 30, scope(0)).unwrap();
        let b = step(&mut s);
        // Request 1 decodes (1 token), request 2 prefills 7 tokens (budget 8).
        assert_eq!(b.entries, vec![(1, true), (2, false)]);
        assert_eq!(b.batch.seqs[1].tokens.len(), 7);
        let c = step(&mut s);
        assert_eq!(c.batch.seqs[1].start_pos, 7);
        assert_eq!(c.batch.num_tokens(), 8);
    }

    #[test]
    fn queue_bound_and_size_bound() {
        let mut s = sched(4, 1, 8);
        assert_eq!(
            s.add(9, vec![1; 3], 17, scope(0)),
            Err(AddError::TooLarge {
                tokens: 17,
                cache_tokens: 16
            })
        );
        for i in 0..4 {
            assert_eq!(s.add(i, vec![1; 3], 4, scope(0)), Ok(i as usize));
        }
        assert_eq!(
            s.add(5, vec![1], 4, scope(0)),
            Err(AddError::Overloaded { waiting: 4 })
        );
    }

    #[test]
    fn max_running_holds_the_rest_in_the_queue() {
        let mut s = sched(32, 2, 64);
        for i in 0..3 {
            s.add(i, vec![1; 4], 8, scope(0)).unwrap();
        }
        let a = step(&mut s);
        assert_eq!(a.entries.len(), 2);
        assert_eq!(s.waiting_len(), 1);
        s.remove(0);
        let b = step(&mut s);
        assert!(b.entries.contains(&(2, true)));
    }

    #[test]
    fn preempts_the_most_recently_admitted_and_recomputes_it() {
        // 4 blocks of 4 tokens. Two sequences of 8 tokens fill the cache.
        let mut s = sched(4, 4, 64);
        s.add(1, vec![1; 7], 16, scope(0)).unwrap();
        s.add(2, vec![2; 7], 16, scope(0)).unwrap();
        step(&mut s); // both prefill 7, sample 1 token each -> 8 tokens, 2 blocks each
        step(&mut s); // decode: 8 computed, 9th token pending; needs a 3rd block each: none free
        let c = s.schedule().unwrap();
        assert_eq!(c.preempted, vec![2], "the newest goes back to the queue");
        assert_eq!(c.entries, vec![(1, true)]);
        assert_eq!(s.waiting_len(), 1);
        let back = s.get(2).unwrap();
        assert_eq!(back.computed, 0);
        assert_eq!(
            back.tokens.len(),
            9,
            "its generated tokens are kept and recomputed"
        );
        assert_eq!(s.preemptions(), 1);
    }

    #[test]
    fn cancel_frees_blocks_in_any_phase() {
        let mut s = sched(16, 4, 4);
        s.add(1, vec![1; 10], 12, scope(0)).unwrap();
        step(&mut s); // mid-prefill: 4 of 10
        assert!(s.pool().used_count() > 0);
        s.remove(1);
        assert_eq!(s.pool().used_count(), 0);
        assert!(s.remove(1).is_none());
        assert!(s.is_idle());
    }

    #[test]
    fn a_second_sequence_reuses_the_first_ones_full_blocks() {
        let mut s = Scheduler::new(
            SchedulerConfig {
                max_running: 4,
                max_waiting: 4,
                step_tokens: 64,
                block_size: 4,
                prefix_caching: true,
                lease_tokens_per_session: 64,
                lease_tokens_total: 64,
            },
            BlockPool::new(16),
        );
        let prompt: Vec<u32> = (0..10).collect();
        s.add(1, prompt.clone(), 12, scope(7)).unwrap();
        step(&mut s); // prefill 10 tokens: blocks 0-1 full
        step(&mut s); // decode; registers the full blocks
        s.add(2, prompt.clone(), 12, scope(7)).unwrap();
        s.add(3, prompt.clone(), 12, scope(8)).unwrap(); // another tenant
        let out = step(&mut s);
        assert_eq!(out.started, vec![(2, 8), (3, 0)]);
        let b2 = &out.batch.seqs[1];
        assert_eq!(
            (b2.start_pos, b2.tokens.len()),
            (8, 2),
            "only the unshared tail is computed"
        );
        assert_eq!(
            s.get(1).unwrap().block_table[..2],
            s.get(2).unwrap().block_table[..2]
        );
        assert_ne!(
            s.get(1).unwrap().block_table[0],
            s.get(3).unwrap().block_table[0]
        );
        assert_eq!(s.prefix_stats(), (30, 8));
        // Ending request 2 frees only its own blocks; request 1 keeps the shared ones.
        let used = s.pool().used_count();
        s.remove(2);
        assert_eq!(s.pool().used_count(), used - 1);
        s.remove(1);
        s.remove(3);
        assert_eq!(s.pool().used_count(), 0);
        // The prompt's blocks are still cached for the next request.
        s.add(4, prompt, 12, scope(7)).unwrap();
        assert_eq!(step(&mut s).started, vec![(4, 8)]);
    }

    fn caching(blocks: usize, lease_per_session: usize, lease_total: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_running: 4,
                max_waiting: 4,
                step_tokens: 64,
                block_size: 4,
                prefix_caching: true,
                lease_tokens_per_session: lease_per_session,
                lease_tokens_total: lease_total,
            },
            BlockPool::new(blocks),
        )
    }

    #[test]
    fn a_lease_keeps_a_conversation_for_the_next_turn_and_hands_it_over() {
        let mut s = caching(16, 64, 64);
        let turn1: Vec<u32> = (0..10).collect();
        s.add(1, turn1.clone(), 13, scope(0)).unwrap();
        step(&mut s);
        step(&mut s);
        step(&mut s); // 10 prompt + 3 generated; 12 computed
        s.finish(1, Some(42));
        assert_eq!(
            s.held_blocks().0,
            3,
            "12 computed tokens: 3 full blocks kept"
        );
        assert_eq!(s.pool().used_count(), 3);
        // Turn 2 extends turn 1: it starts from the leased blocks, and the lease is handed over.
        let mut turn2 = s_tokens(&turn1, 3);
        turn2.extend([50, 51, 52]);
        s.add(2, turn2, 20, scope(0)).unwrap();
        s.set_lease(2, 42);
        assert_eq!(step(&mut s).started, vec![(2, 12)]);
        assert_eq!(s.held_blocks().0, 0);
        s.finish(2, None);
        s.drop_lease(42);
        assert_eq!(s.pool().used_count(), 0);
    }

    #[test]
    fn a_lease_keeps_its_partly_filled_block_and_the_next_turn_continues_it() {
        let mut s = caching(16, 64, 64);
        let turn1: Vec<u32> = (0..12).collect();
        s.add(1, turn1.clone(), 15, scope(0)).unwrap();
        step(&mut s);
        step(&mut s);
        step(&mut s); // 12 prompt + 3 generated; 14 computed: 3 full blocks and 2 tokens
        s.finish(1, Some(42));
        assert_eq!(s.held_blocks().0, 4, "3 full blocks and the partial one");
        assert_eq!(s.pool().used_count(), 4);
        // Turn 2 continues exactly: all 14 computed tokens are reused, the partial block included.
        let mut turn2 = s_tokens(&turn1, 3);
        turn2.extend([50, 51, 52]);
        s.add(2, turn2.clone(), 20, scope(0)).unwrap();
        s.set_lease(2, 42);
        assert_eq!(step(&mut s).started, vec![(2, 14)]);
        assert_eq!(s.held_blocks().0, 0);
        assert_eq!(
            s.pool().used_count(),
            5,
            "the partial block was continued, not copied"
        );
        s.pool().check().unwrap();
        s.finish(2, Some(42));
        // Turn 3 diverges inside the partial block: only the full blocks are reused, and the
        // partial block the lease held is freed.
        let mut turn3 = turn2[..13].to_vec();
        turn3.extend([90, 91, 92, 93]);
        s.add(3, turn3, 20, scope(0)).unwrap();
        s.set_lease(3, 42);
        assert_eq!(step(&mut s).started, vec![(3, 12)]);
        s.finish(3, None);
        s.drop_lease(42);
        assert_eq!(s.pool().used_count(), 0);
        s.pool().check().unwrap();
    }

    /// Turn 1's tokens as the scheduler generated them in the test above (7 sampled thrice).
    fn s_tokens(prompt: &[u32], generated: usize) -> Vec<u32> {
        let mut t = prompt.to_vec();
        t.extend(std::iter::repeat_n(7, generated));
        t
    }

    #[test]
    fn leases_are_capped_and_dropped_before_anything_is_preempted() {
        // Per-session cap: 8 tokens = 2 blocks.
        let mut s = caching(8, 8, 8);
        s.add(1, (0..12).collect(), 13, scope(0)).unwrap();
        step(&mut s);
        s.finish(1, Some(1));
        assert_eq!(s.held_blocks().0, 2);
        // A second lease pushes the total over 8 tokens: the oldest goes.
        s.add(2, (100..112).collect(), 13, scope(0)).unwrap();
        step(&mut s);
        s.finish(2, Some(2));
        assert_eq!(s.held_blocks().0, 2);
        // A request needing the whole pool drops the lease instead of failing.
        s.add(3, (200..231).collect(), 32, scope(0)).unwrap();
        let out = step(&mut s);
        assert_eq!(out.entries, vec![(3, true)]);
        assert!(out.preempted.is_empty());
        assert_eq!(s.held_blocks().0, 0);
    }

    #[test]
    fn pinned_prefixes_are_prefilled_once_and_kept() {
        let mut s = caching(16, 0, 0);
        let sys: Vec<u32> = (0..9).collect();
        s.add_pinned(99, sys.clone(), crate::kv_cache::Salt(5));
        let out = s.schedule().unwrap();
        assert_eq!(
            out.entries,
            vec![(99, false)],
            "no token is sampled for a pin"
        );
        assert!(s.schedule().is_none());
        assert_eq!(
            s.held_blocks().1,
            3,
            "two full blocks kept, and the partly filled one"
        );
        let mut prompt = sys.clone();
        prompt.extend([40, 41]);
        s.add(1, prompt.clone(), 14, scope(5)).unwrap();
        let out = step(&mut s);
        // The pin's partly filled block is copied into a fresh one: all 9 tokens are cached.
        assert_eq!(out.started, vec![(1, 9)]);
        let table = &out.batch.seqs[0].block_table;
        assert_eq!(out.copies.len(), 1);
        assert_eq!(out.copies[0].dst, table[2]);
        assert_eq!(out.copies[0].slots, 1);
        assert_eq!(out.batch.seqs[0].tokens, vec![40, 41]);
        // A prompt that leaves the pin inside its last block, or another tenant, copies nothing.
        s.finish(1, None);
        let mut other = sys[..8].to_vec();
        other.extend([50, 51, 52]);
        s.add(2, other, 14, scope(5)).unwrap();
        let out = step(&mut s);
        assert_eq!((out.started.clone(), out.copies.len()), (vec![(2, 8)], 0));
        s.finish(2, None);
        s.add(3, prompt, 14, scope(6)).unwrap();
        let out = step(&mut s);
        assert_eq!((out.started.clone(), out.copies.len()), (vec![(3, 0)], 0));
    }

    #[test]
    fn principals_share_the_pinned_prefix_and_nothing_they_sent() {
        let mut s = caching(32, 0, 0);
        let tenant = Salt(5);
        let sys: Vec<u32> = (0..9).collect(); // two full blocks of operator text, then one token
        s.add_pinned(99, sys.clone(), tenant);
        s.schedule().unwrap();
        let scope = |p| CacheScope {
            tenant,
            principal: Salt(p),
            shared_tokens: sys.len(),
        };
        let mut prompt = sys.clone();
        prompt.extend(40..60); // 29 tokens: 7 full blocks
        s.add(1, prompt.clone(), 30, scope(1)).unwrap();
        assert_eq!(step(&mut s).started, vec![(1, 9)], "the pin is shared");
        step(&mut s); // registers request 1's full blocks
        s.finish(1, None);
        // Another principal, the same text: only the operator blocks.
        s.add(2, prompt.clone(), 30, scope(2)).unwrap();
        assert_eq!(step(&mut s).started, vec![(2, 9)]);
        s.finish(2, None);
        // The same principal again: its own blocks too (all but the last token's).
        s.add(3, prompt.clone(), 30, scope(1)).unwrap();
        assert_eq!(step(&mut s).started, vec![(3, 28)]);
        s.finish(3, None);
        assert_eq!(s.pool().used_count(), s.held_blocks().1);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Random adds, steps and cancels never hand out a block twice, never exceed the budget,
        /// and always end with the pool idle.
        #[test]
        fn random_workloads_return_to_idle(ops in proptest::collection::vec((0u8..3, 1usize..14, 1usize..10), 1..80), caching in any::<bool>()) {
            let mut s = Scheduler::new(
                SchedulerConfig { max_running: 3, max_waiting: 4, step_tokens: 6, block_size: 4, prefix_caching: caching, lease_tokens_per_session: 16, lease_tokens_total: 24 },
                BlockPool::new(12),
            );
            let mut next = 0u64;
            let mut gen: std::collections::HashMap<u64, (usize, usize)> = Default::default();
            for (op, a, b) in ops {
                match op {
                    0 => {
                        if s.add(next, vec![3; a], a + b, scope(next % 2)).is_ok() {
                            gen.insert(next, (0, b));
                        }
                        next += 1;
                    }
                    1 => { s.remove((a as u64) % next.max(1)); }
                    _ => {
                        if let Some(out) = s.schedule() {
                            prop_assert!(out.batch.num_tokens() <= 6 + 3);
                            let mut seen = std::collections::HashSet::new();
                            for c in &out.batch.seqs {
                                let first = c.start_pos / 4;
                                let last = (c.start_pos + c.tokens.len()).div_ceil(4);
                                for blk in &c.block_table[first..last] {
                                    prop_assert!(seen.insert(*blk), "block written twice");
                                }
                            }
                            for &(id, want) in &out.entries {
                                if want {
                                    let g = gen.get_mut(&id).unwrap();
                                    g.0 += 1;
                                    if g.0 >= g.1 { s.finish(id, Some(id % 3)); } else { s.append(id, 5); }
                                }
                            }
                        }
                    }
                }
            }
            for id in 0..next { s.remove(id); }
            for k in 0..3 { s.drop_lease(k); }
            prop_assert!(s.pool().check().is_ok());
            prop_assert_eq!(s.pool().used_count(), 0);
            prop_assert!(s.is_idle());
        }
    }
}
