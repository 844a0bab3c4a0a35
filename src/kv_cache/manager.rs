//! The KV cache manager: everything about a request's blocks, in the shape of vLLM v1's
//! `KVCacheManager` (`get_computed_blocks`, `allocate_slots`, `cache_full_blocks`, `free`), plus
//! what a chat server adds on top: session leases and pinned prefixes. Pure code (no tensors, no
//! actors), tested alone: the scheduler owns it and decides *which* requests run and how many of
//! their tokens; this decides *which blocks* hold them.
//!
//! - **Prefix caching** (with `prefix_caching` on): a request about to run its first chunk takes
//!   over the longest run of cached full blocks that match its tokens in its `CacheScope`, always
//!   leaving its last token to compute (its logits are what the next token is sampled from).
//!   Blocks a request fills are registered once their K/V are written (`cache_full_blocks`).
//! - **Leases**: a finished turn's full blocks stay referenced for the session's next turn (up to
//!   a cap per session and in all), with the partly filled block after them and the tokens it
//!   holds (only the lease references it: nothing else can share a block that is not full), so the
//!   next turn prefills only the new message. Leases are the first thing dropped, oldest first,
//!   when blocks run short; the next turn then simply finds fewer cached blocks.
//! - **Pins**: configured system prompts are prefilled once and never dropped, their partly filled
//!   last block included. A request whose cached run ends where a pin's full blocks end, and whose
//!   next tokens are the pin's partial block, gets a fresh block with a copy of that block's slots
//!   (vLLM v0's copy-on-write `blocks_to_copy`), so no principal recomputes the operator's text.
//! - **Truncation** (`truncate`): a request cut back to the tokens it keeps (speculative drafts
//!   the target rejected) frees the blocks past them; a kept partial block that is registered is
//!   copied rather than written again, so a block another request shares never changes.
//! - **Context shift** (with `context_shift` on): when a conversation outgrew the context and its
//!   oldest turns were dropped (`limits.overflow`), the request's tokens after its cached run
//!   continue a *later* run of its session's lease. Fresh blocks take those slots' K/V moved back
//!   by the dropped length (`SlotShift`: V copied, K re-rotated by -delta, llama.cpp's context
//!   shift), instead of prefilling the kept turns again. Only the session's own lease is looked at.
//!   It is an approximation: past the first layer, the kept turns' K/V were computed while the
//!   dropped turns were in view (docs/performance.md measures what it costs on real text).

use std::collections::{BTreeMap, HashMap};

use super::block_pool::{prefix_hashes, BlockHash, BlockPool, CacheScope};
use super::blocks_for;

/// Names a session's lease (the session derives it; leases of different sessions never mix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey(pub u64);

/// How blocks are kept and shared.
#[derive(Debug, Clone, Copy)]
pub struct KvConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Share cached prefix blocks between requests.
    pub prefix_caching: bool,
    /// Tokens a session's lease may keep between turns (0 = no leases).
    pub lease_tokens_per_session: usize,
    /// Tokens all leases together may keep.
    pub lease_tokens_total: usize,
    /// Move a lease's kept run to its new positions when the request continues a later part of
    /// it (see the module doc) rather than prefill it again.
    pub context_shift: bool,
}

/// A request's blocks: its block table (position `p` lives in block `table[p / block_size]`), the
/// hashes of the blocks registered so far (block `i` of the table), and the partition they are
/// hashed in. Changed only by the manager.
#[derive(Debug, Clone)]
pub struct SeqBlocks {
    table: Vec<u32>,
    hashes: Vec<BlockHash>,
    scope: CacheScope,
}

impl SeqBlocks {
    /// No blocks yet.
    pub fn new(scope: CacheScope) -> Self {
        SeqBlocks {
            table: Vec::new(),
            hashes: Vec::new(),
            scope,
        }
    }

    pub fn table(&self) -> &[u32] {
        &self.table
    }

    pub fn scope(&self) -> &CacheScope {
        &self.scope
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Moves the blocks out, leaving none (same scope) behind.
    pub fn take(&mut self) -> SeqBlocks {
        std::mem::replace(self, SeqBlocks::new(self.scope))
    }
}

/// What `computed_blocks` found for a request.
#[derive(Debug, Clone)]
pub struct Computed {
    pub blocks: SeqBlocks,
    /// Tokens those blocks already hold.
    pub tokens: usize,
}

/// Copy the first `slots` slots of block `src` into block `dst` (every layer's K and V) before
/// the step that reads `dst` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
    pub slots: usize,
}

/// Move the K/V of slots `src` to slots `dst` (same length, every layer) before the step runs:
/// V as it is, K re-rotated from position p to p - `delta` (RoPE by -delta).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotShift {
    pub src: Vec<u32>,
    pub dst: Vec<u32>,
    pub delta: usize,
}

/// A shifted run shorter than this many blocks is prefilled instead (the copy's fixed cost).
const MIN_SHIFT_BLOCKS: usize = 1;
/// A shift keeps at least this many of the request's first tokens where they were computed: a
/// model's first tokens anchor its attention (StreamingLLM's "attention sinks"), and a run
/// shifted to the very start loses them (`llama-relay perplexity --shift-keep 0` shows it).
const KEPT_HEAD: usize = 4;

/// The partly filled last block of a pinned prefix.
#[derive(Debug, Clone)]
struct PinTail {
    /// Hash of the pin's last full block: a request whose cached run ends there continues it.
    after: BlockHash,
    tokens: Vec<u32>,
    block: u32,
}

/// A session's kept blocks and the tokens they hold (every slot of each block but the last,
/// which may be partly filled).
#[derive(Debug, Clone)]
struct Lease {
    key: LeaseKey,
    table: Vec<u32>,
    tokens: Vec<u32>,
}

impl Lease {
    /// The tokens of the partly filled last block, if the last block is partly filled.
    fn tail(&self, bs: usize) -> Option<&[u32]> {
        let full = self.tokens.len() / bs;
        (full < self.table.len()).then(|| &self.tokens[full * bs..])
    }
}

pub struct KvManager {
    cfg: KvConfig,
    pool: BlockPool,
    /// Leases by age (first = oldest), and each key's place in that order.
    leases: BTreeMap<u64, Lease>,
    lease_order: HashMap<LeaseKey, u64>,
    next_lease: u64,
    /// Pinned prefixes' blocks (held for good).
    pinned: Vec<Vec<u32>>,
    pin_tails: Vec<PinTail>,
    /// Copies recorded while requests took their computed blocks, handed out with the step, and
    /// the references that keep their sources (a lease's blocks, which the lease may give up in
    /// the same step) until then.
    copies: Vec<BlockCopy>,
    shifts: Vec<SlotShift>,
    copy_sources: Vec<u32>,
    /// How many references leases and pins hold on each block they hold, and in all: kept on
    /// every change, so that reading them costs nothing however many sessions hold leases
    /// (`check()` recounts them).
    holds: HashMap<u32, u32>,
    held: HeldBlocks,
}

impl KvManager {
    pub fn new(cfg: KvConfig, pool: BlockPool) -> Self {
        KvManager {
            cfg,
            pool,
            leases: BTreeMap::new(),
            lease_order: HashMap::new(),
            next_lease: 0,
            pinned: Vec::new(),
            pin_tails: Vec::new(),
            copies: Vec::new(),
            shifts: Vec::new(),
            copy_sources: Vec::new(),
            holds: HashMap::new(),
            held: HeldBlocks::default(),
        }
    }

    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The pool back, with every block leases, pins and requests hold still referenced.
    pub fn into_pool(self) -> BlockPool {
        self.pool
    }

    /// Tokens the whole cache holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.total() * self.cfg.block_size
    }

    /// Whether a request of `tokens` tokens could ever fit.
    pub fn fits(&self, tokens: usize) -> bool {
        blocks_for(tokens, self.cfg.block_size) <= self.pool.total()
    }

    /// Prompt tokens `computed_blocks` would find in the cache's full blocks in `scope` (a
    /// lease's or pin's partly filled block not counted), changing nothing: the scheduler's
    /// estimate of a queued request's prefill. Only `scope`'s partition is looked at.
    pub fn cached_len(&self, tokens: &[u32], scope: &CacheScope) -> usize {
        if !self.cfg.prefix_caching || tokens.is_empty() {
            return 0;
        }
        let bs = self.cfg.block_size;
        self.pool
            .cached_prefix_blocks(tokens, bs, scope, (tokens.len() - 1) / bs)
            * bs
    }

    /// The blocks a request starts from (vLLM's `get_computed_blocks`): the longest cached run of
    /// its full blocks in its scope, then the session lease's partly filled block or a pinned
    /// prefix's partly filled block when the tokens continue it, always leaving the last token to
    /// compute; with `shift` (its prompt dropped turns the lease holds), a later run of the lease
    /// that the request continues, shifted (see the module doc). The session's previous lease has
    /// then served: its blocks are this request's now. Without prefix caching, nothing.
    pub fn computed_blocks(
        &mut self,
        tokens: &[u32],
        scope: CacheScope,
        lease: Option<LeaseKey>,
        shift: bool,
    ) -> Computed {
        let mut blocks = SeqBlocks::new(scope);
        if !self.cfg.prefix_caching || tokens.is_empty() {
            return Computed { blocks, tokens: 0 };
        }
        let bs = self.cfg.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        blocks.table = self.pool.acquire_prefix(tokens, bs, &scope, max_blocks);
        blocks.hashes = prefix_hashes(&tokens[..blocks.table.len() * bs], bs, &scope);
        let mut computed = blocks.table.len() * bs;
        if let Some(key) = lease {
            computed = self.continue_lease_tail(key, tokens, &mut blocks, computed);
            computed = self.fork_lease_block(key, tokens, &mut blocks, computed);
            if shift {
                computed = self.shift_lease_run(key, tokens, &mut blocks, computed);
            }
            self.drop_lease(key);
        }
        computed = self.continue_pin_tail(tokens, &mut blocks, computed);
        Computed {
            blocks,
            tokens: computed,
        }
    }

    /// The lease's partly filled last block continues the request when the full blocks before it
    /// matched and its tokens come next (with a token left to compute): the lease's reference
    /// moves to the request. Returns the tokens computed.
    fn continue_lease_tail(
        &mut self,
        key: LeaseKey,
        tokens: &[u32],
        blocks: &mut SeqBlocks,
        computed: usize,
    ) -> usize {
        let bs = self.cfg.block_size;
        let Some(&order) = self.lease_order.get(&key) else {
            return computed;
        };
        let lease = self
            .leases
            .get_mut(&order)
            .expect("lease_order points at a lease");
        let Some(tail) = lease.tail(bs) else {
            return computed;
        };
        let start = (lease.table.len() - 1) * bs;
        if blocks.table.len() == lease.table.len() - 1
            && tokens.len() > start + tail.len()
            && tokens[start..start + tail.len()] == tail[..]
        {
            let computed = start + tail.len();
            lease.tokens.truncate(start);
            let b = lease
                .table
                .pop()
                .expect("a lease with a tail holds its block");
            blocks.table.push(b);
            self.unhold(&[b], false);
            return computed;
        }
        computed
    }

    /// Where the request forks from its session's lease inside a block (a regenerated reply, an
    /// edited turn, a reply cut where the user stopped listening): when the cached run is the
    /// lease's first blocks and the lease's next block begins with the request's next tokens, a
    /// fresh block takes a copy of those slots (copy-on-write: the lease's block is left as it
    /// is), always leaving a token to compute. Only the session's own lease is looked at, so
    /// nothing crosses principals. Returns the tokens computed.
    fn fork_lease_block(
        &mut self,
        key: LeaseKey,
        tokens: &[u32],
        blocks: &mut SeqBlocks,
        computed: usize,
    ) -> usize {
        let bs = self.cfg.block_size;
        let n = blocks.table.len();
        let start = n * bs;
        if computed != start || blocks.hashes.len() != n || tokens.len() <= start + 1 {
            return computed;
        }
        let Some(lease) = self.lease_order.get(&key).and_then(|o| self.leases.get(o)) else {
            return computed;
        };
        if lease.table.len() <= n || lease.table[..n] != blocks.table[..] {
            return computed;
        }
        let theirs = &lease.tokens[start..lease.tokens.len().min(start + bs)];
        let common = theirs
            .iter()
            .zip(&tokens[start..])
            .take_while(|(a, b)| a == b)
            .count();
        let slots = common.min(tokens.len() - 1 - start);
        if slots == 0 {
            return computed;
        }
        let src = lease.table[n];
        computed + self.copy_into_fresh_block(src, slots, blocks)
    }

    /// The context shift (see the module doc): when the request's next tokens continue a run of
    /// its lease's tokens that lies further on (the turns between were dropped), fresh blocks take
    /// the longest such run's K/V moved back to the request's positions, always leaving a token
    /// to compute. Returns the tokens computed.
    fn shift_lease_run(
        &mut self,
        key: LeaseKey,
        tokens: &[u32],
        blocks: &mut SeqBlocks,
        computed: usize,
    ) -> usize {
        let bs = self.cfg.block_size;
        let want = tokens.len().saturating_sub(1);
        if !self.cfg.context_shift
            || computed < KEPT_HEAD
            || computed >= want
            || blocks.table.len() != blocks_for(computed, bs)
        {
            return computed;
        }
        let Some(lease) = self.lease_order.get(&key).and_then(|o| self.leases.get(o)) else {
            return computed;
        };
        let rest = &tokens[computed..want];
        let (mut from, mut len) = (0, 0);
        for b in computed + 1..lease.tokens.len() {
            if lease.tokens[b] != rest[0] || lease.tokens.len() - b <= len {
                continue;
            }
            let m = (lease.tokens[b..].iter().zip(rest))
                .take_while(|(a, c)| a == c)
                .count();
            if m > len {
                (from, len) = (b, m);
            }
        }
        if len < MIN_SHIFT_BLOCKS * bs {
            return computed;
        }
        let need = blocks_for(computed + len, bs) - blocks.table.len();
        let Some(fresh) = self.pool.allocate(need) else {
            return computed;
        };
        blocks.table.extend(fresh);
        let slot = |table: &[u32], p: usize| table[p / bs] * bs as u32 + (p % bs) as u32;
        let src: Vec<u32> = (from..from + len).map(|p| slot(&lease.table, p)).collect();
        let dst: Vec<u32> = (computed..computed + len)
            .map(|p| slot(&blocks.table, p))
            .collect();
        let sources: Vec<u32> = lease.table[from / bs..=(from + len - 1) / bs].to_vec();
        self.pool.retain(&sources);
        self.copy_sources.extend(sources);
        self.shifts.push(SlotShift {
            src,
            dst,
            delta: from - computed,
        });
        computed + len
    }

    /// When the cached run ends exactly where a pinned prefix's full blocks end and the pin's
    /// partly filled block's tokens come next (with a token left to compute), a fresh block takes
    /// a copy of its slots. The pin's chain is salted with its tenant, so only that tenant's
    /// requests match, and the tokens copied are the operator's. Returns the tokens computed.
    fn continue_pin_tail(
        &mut self,
        tokens: &[u32],
        blocks: &mut SeqBlocks,
        computed: usize,
    ) -> usize {
        let start = blocks.table.len() * self.cfg.block_size;
        if computed != start || blocks.hashes.len() != blocks.table.len() {
            return computed;
        }
        let Some(&last) = blocks.hashes.last() else {
            return computed;
        };
        let Some(t) = self.pin_tails.iter().find(|t| {
            t.after == last
                && tokens.len() > start + t.tokens.len()
                && tokens[start..start + t.tokens.len()] == t.tokens[..]
        }) else {
            return computed;
        };
        let (src, slots) = (t.block, t.tokens.len());
        computed + self.copy_into_fresh_block(src, slots, blocks)
    }

    /// Appends a fresh block to `blocks` that the step will fill with the first `slots` slots of
    /// `src`; the source stays referenced until the copies are handed out. Returns the slots
    /// gained (0 when no block is free).
    fn copy_into_fresh_block(&mut self, src: u32, slots: usize, blocks: &mut SeqBlocks) -> usize {
        let Some(b) = self.pool.allocate(1) else {
            return 0;
        };
        self.pool.retain(&[src]);
        self.copy_sources.push(src);
        self.copies.push(BlockCopy {
            src,
            dst: b[0],
            slots,
        });
        blocks.table.push(b[0]);
        slots
    }

    /// Grows the table to hold `tokens` tokens (vLLM's `allocate_slots`), dropping leases oldest
    /// first when free blocks run short; false (and nothing allocated) when even that is not
    /// enough.
    pub fn allocate_slots(&mut self, blocks: &mut SeqBlocks, tokens: usize) -> bool {
        let bs = self.cfg.block_size;
        self.make_room(blocks_for(tokens, bs).saturating_sub(blocks.table.len()));
        self.pool.ensure_capacity(&mut blocks.table, tokens, bs)
    }

    /// Registers the blocks that the first `computed` tokens have filled since the last call
    /// (their K/V are written), so that later requests in the same scope find them.
    pub fn cache_full_blocks(&mut self, blocks: &mut SeqBlocks, tokens: &[u32], computed: usize) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        for i in blocks.hashes.len()..computed / bs {
            let h = self.pool.register(
                blocks.table[i],
                blocks.hashes.last().copied(),
                blocks.scope.salt_of_block(i, bs),
                &tokens[i * bs..(i + 1) * bs],
            );
            blocks.hashes.push(h);
        }
    }

    /// The blocks of a fork of a request whose first `computed` tokens are in `blocks` (another
    /// choice of the same prompt, vLLM v0's `fork_seq`): the same full blocks, one more reference
    /// each, and a fresh block taking a copy of the partly filled last block's slots (the parent
    /// goes on writing its own). `None` when no block is free for that copy.
    pub fn fork(&mut self, blocks: &SeqBlocks, computed: usize) -> Option<SeqBlocks> {
        let bs = self.cfg.block_size;
        let (full, partial) = (computed / bs, computed % bs);
        let mut table = blocks.table[..full].to_vec();
        if partial > 0 {
            self.make_room(1);
            let b = self.pool.allocate(1)?[0];
            self.copies.push(BlockCopy {
                src: blocks.table[full],
                dst: b,
                slots: partial,
            });
            table.push(b);
        }
        self.pool.retain(&blocks.table[..full]);
        Some(SeqBlocks {
            table,
            hashes: blocks.hashes[..blocks.hashes.len().min(full)].to_vec(),
            scope: blocks.scope,
        })
    }

    /// Drops a request's positions from `tokens` on (the K/V of drafts the target rejected): the
    /// blocks past them are freed, with any copy pending into them. A kept partial block that
    /// was registered for the prefix cache (its K/V are valid for the tokens it was registered
    /// with, and others may share it) is not written again: the request gets a fresh block with
    /// a copy of its kept slots. When no block is free for that copy the request keeps only its
    /// full blocks. The tokens kept (`tokens`, or fewer in that case).
    pub fn truncate(&mut self, blocks: &mut SeqBlocks, tokens: usize) -> usize {
        let bs = self.cfg.block_size;
        let keep = blocks_for(tokens, bs).min(blocks.table.len());
        let tail = blocks.table.split_off(keep);
        self.copies.retain(|c| !tail.contains(&c.dst));
        self.pool.release_table(&tail);
        let (full, partial) = (tokens / bs, tokens % bs);
        if blocks.hashes.len() <= full || partial == 0 {
            blocks.hashes.truncate(full.min(keep));
            return tokens.min(keep * bs);
        }
        // The kept partial block is registered: copy its kept slots to a block of its own.
        blocks.hashes.truncate(full);
        let shared = blocks.table[full];
        blocks.table.truncate(full);
        self.make_room(1);
        let gained = self.copy_into_fresh_block(shared, partial, blocks);
        self.pool.release_table(&[shared]);
        full * bs + gained
    }

    /// Frees a request's blocks, tail first (so its tail is evicted before its head), with any
    /// copy still pending into them.
    pub fn free(&mut self, blocks: SeqBlocks) {
        self.copies.retain(|c| !blocks.table.contains(&c.dst));
        let bs = self.cfg.block_size as u32;
        (self.shifts).retain(|s| !blocks.table.contains(&(s.dst[0] / bs)));
        self.pool.release_table(&blocks.table);
    }

    /// Ends a request whose first `computed` tokens are in its blocks. With a lease key (and
    /// leases on), the conversation's full blocks up to the per-session cap, and the partly
    /// filled block after them when the cap leaves room for all of it, stay referenced for the
    /// session's next turn, replacing its previous lease; the rest is freed.
    pub fn finish(
        &mut self,
        mut blocks: SeqBlocks,
        tokens: &[u32],
        computed: usize,
        lease: Option<LeaseKey>,
    ) {
        let bs = self.cfg.block_size;
        let per_session = self.cfg.lease_tokens_per_session;
        let leasing = lease.is_some() && self.cfg.prefix_caching && per_session > 0;
        let keep = if leasing {
            (computed.min(per_session) / bs).min(blocks.table.len())
        } else {
            0
        };
        let tail_len = computed - keep * bs;
        let tail = leasing
            && tail_len > 0
            && tail_len < bs
            && computed <= per_session
            && blocks.table.len() > keep;
        let held = keep + usize::from(tail);
        let held_tokens = if tail { computed } else { keep * bs };
        // Kept blocks are findable before they are held.
        self.cache_full_blocks(&mut blocks, tokens, keep * bs);
        self.pool.release_table(&blocks.table[held..]);
        let Some(key) = lease else { return };
        self.drop_lease(key);
        if held == 0 {
            return;
        }
        let order = self.next_lease;
        self.next_lease += 1;
        self.hold(&blocks.table[..held], false);
        self.leases.insert(
            order,
            Lease {
                key,
                table: blocks.table[..held].to_vec(),
                tokens: tokens[..held_tokens].to_vec(),
            },
        );
        self.lease_order.insert(key, order);
        let cap = self.cfg.lease_tokens_total / bs;
        while self.held.leased > cap && self.drop_oldest_lease() {}
    }

    /// Drops a session's lease (its blocks stay cached until evicted). Idempotent.
    pub fn drop_lease(&mut self, key: LeaseKey) {
        if let Some(order) = self.lease_order.remove(&key) {
            let lease = self
                .leases
                .remove(&order)
                .expect("lease_order points at a lease");
            self.unhold(&lease.table, false);
            self.pool.release_table(&lease.table);
        }
    }

    fn drop_oldest_lease(&mut self) -> bool {
        let Some(key) = self.leases.first_key_value().map(|(_, l)| l.key) else {
            return false;
        };
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

    /// A pinned prefix has been prefilled: its full blocks (registered) and its partly filled
    /// last block stay referenced for good.
    pub fn pin(&mut self, mut blocks: SeqBlocks, tokens: &[u32]) {
        let bs = self.cfg.block_size;
        self.cache_full_blocks(&mut blocks, tokens, tokens.len());
        let mut keep = blocks.hashes.len();
        if keep > 0 && tokens.len() > keep * bs && blocks.table.len() > keep {
            self.pin_tails.push(PinTail {
                after: blocks.hashes[keep - 1],
                tokens: tokens[keep * bs..].to_vec(),
                block: blocks.table[keep],
            });
            keep += 1;
        }
        self.pool.release_table(&blocks.table[keep..]);
        self.hold(&blocks.table[..keep], true);
        self.pinned.push(blocks.table[..keep].to_vec());
    }

    /// Counts the references a new lease or pin takes.
    fn hold(&mut self, blocks: &[u32], pinned: bool) {
        for &b in blocks {
            *self.holds.entry(b).or_default() += 1;
        }
        if pinned {
            self.held.pinned += blocks.len();
        } else {
            self.held.leased += blocks.len();
        }
    }

    /// Counts the references a lease gives up.
    fn unhold(&mut self, blocks: &[u32], pinned: bool) {
        for b in blocks {
            let n = self.holds.get_mut(b).expect("a held block is counted");
            *n -= 1;
            if *n == 0 {
                self.holds.remove(b);
            }
        }
        if pinned {
            self.held.pinned -= blocks.len();
        } else {
            self.held.leased -= blocks.len();
        }
    }

    /// The copies the next step must make before it runs. Their sources' extra references go:
    /// nothing allocates between now and the step that makes the copies.
    pub fn take_copies(&mut self) -> Vec<BlockCopy> {
        debug_assert!(self.shifts.is_empty(), "take_shifts comes first");
        let sources = std::mem::take(&mut self.copy_sources);
        self.pool.release(&sources);
        std::mem::take(&mut self.copies)
    }

    /// The context shifts the next step must make, after the copies (a shift may fill the rest
    /// of a block a copy began). Taken before `take_copies`, which lets their sources go.
    pub fn take_shifts(&mut self) -> Vec<SlotShift> {
        std::mem::take(&mut self.shifts)
    }

    /// Distinct blocks referenced by leases and pins (the idle level of the pool).
    pub fn held_distinct(&self) -> usize {
        self.holds.len()
    }

    /// Block references held by leases and by pinned prefixes.
    pub fn held_blocks(&self) -> HeldBlocks {
        self.held
    }

    /// Sessions holding a lease.
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// Checks the manager's invariants and the pool's (tests and debug assertions).
    pub fn check(&self) -> Result<(), String> {
        self.pool.check()?;
        if self.leases.len() != self.lease_order.len() {
            return Err("leases and their order disagree".into());
        }
        for (k, o) in &self.lease_order {
            match self.leases.get(o) {
                Some(l) if l.key == *k => {}
                _ => return Err(format!("lease {k:?} is not at its place {o}")),
            }
        }
        let bs = self.cfg.block_size;
        for l in self.leases.values() {
            if l.table.is_empty() {
                return Err(format!("lease {:?} holds no block", l.key));
            }
            if l.tokens.len().div_ceil(bs) != l.table.len() {
                return Err(format!(
                    "lease {:?}: {} tokens in {} blocks",
                    l.key,
                    l.tokens.len(),
                    l.table.len()
                ));
            }
        }
        let refs = self.held_refs();
        if refs != self.holds {
            return Err("the held-block counts differ from a recount".into());
        }
        let recount = HeldBlocks {
            leased: self.leases.values().map(|l| l.table.len()).sum(),
            pinned: self.pinned.iter().map(Vec::len).sum(),
        };
        if recount != self.held {
            return Err(format!("held {:?}, recounted {recount:?}", self.held));
        }
        for (b, refs) in refs {
            if self.pool.refs(b) < refs {
                return Err(format!(
                    "block {b} is held {refs} times but has {} references",
                    self.pool.refs(b)
                ));
            }
        }
        for t in &self.pin_tails {
            if !self.pinned.iter().any(|p| p.contains(&t.block)) {
                return Err(format!("pin tail block {} is not pinned", t.block));
            }
        }
        Ok(())
    }

    /// References leases and pins hold, per block.
    fn held_refs(&self) -> HashMap<u32, u32> {
        let mut refs: HashMap<u32, u32> = HashMap::new();
        let tables = self.leases.values().map(|l| &l.table).chain(&self.pinned);
        for b in tables.flatten() {
            *refs.entry(*b).or_default() += 1;
        }
        refs
    }
}

/// Block references held between requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeldBlocks {
    pub leased: usize,
    pub pinned: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::Salt;

    fn manager(blocks: usize, lease: usize) -> KvManager {
        let cfg = KvConfig {
            block_size: 4,
            prefix_caching: true,
            lease_tokens_per_session: lease,
            lease_tokens_total: lease,
            context_shift: false,
        };
        KvManager::new(cfg, BlockPool::new(blocks))
    }

    /// A request that has computed all of `tokens` (their K/V written).
    fn computed(kv: &mut KvManager, tokens: &[u32], scope: CacheScope) -> SeqBlocks {
        let c = kv.computed_blocks(tokens, scope, None, false);
        let mut b = c.blocks;
        assert!(kv.allocate_slots(&mut b, tokens.len()));
        kv.cache_full_blocks(&mut b, tokens, tokens.len());
        b
    }

    /// A session whose turns 6..14 were dropped: the new request's tokens after its cached run
    /// continue the lease at 14, so fresh blocks take those slots moved back by 8; the partly
    /// matching block is copied as before, and the lease's blocks live until the step has them.
    #[test]
    fn a_request_that_skips_part_of_its_lease_shifts_the_rest_back() {
        let (sys, dropped, kept) = (
            vec![1, 2, 3, 4, 5, 6],
            vec![100; 8],
            (200..210).collect::<Vec<u32>>(),
        );
        let lease_tokens = [sys.clone(), dropped, kept.clone()].concat();
        let request = [sys, kept, vec![300, 301, 302]].concat();
        // Shifted only with the setting on and the request saying its prompt dropped turns (an
        // edit whose text a later turn repeats is prefilled, as ever).
        for (setting, dropped) in [(false, true), (true, false), (true, true)] {
            let shift = setting && dropped;
            let mut kv = manager(32, 64);
            kv.cfg.context_shift = setting;
            let scope = CacheScope::private(Salt(1));
            let b = computed(&mut kv, &lease_tokens, scope);
            let lease_table = b.table().to_vec();
            kv.finish(b, &lease_tokens, 24, Some(LeaseKey(7)));
            let c = kv.computed_blocks(&request, scope, Some(LeaseKey(7)), dropped);
            kv.check().unwrap();
            let shifts = kv.take_shifts();
            let copies = kv.take_copies();
            // Block 0 cached; slots 4..6 copied from the lease's block 1 (`5, 6` then `100`).
            assert_eq!(copies.len(), 1);
            assert_eq!((copies[0].src, copies[0].slots), (lease_table[1], 2));
            if !shift {
                assert_eq!((c.tokens, shifts.len()), (6, 0));
                continue;
            }
            // Positions 6..16 from the lease's 14..24, one token left to compute.
            assert_eq!(c.tokens, 16);
            let table = c.blocks.table();
            assert_eq!(table.len(), 4);
            let slot = |t: &[u32], p: usize| t[p / 4] * 4 + (p % 4) as u32;
            assert_eq!(
                shifts,
                vec![SlotShift {
                    src: (14..24).map(|p| slot(&lease_table, p)).collect(),
                    dst: (6..16).map(|p| slot(table, p)).collect(),
                    delta: 8,
                }]
            );
            // The lease's blocks went back to the cache once the step took the copies; the
            // request's own blocks are all its own.
            assert_eq!(kv.leases(), 0);
            for &b in &table[1..] {
                assert_eq!(kv.pool().refs(b), 1, "block {b}");
            }
            kv.free(c.blocks);
            kv.check().unwrap();
            assert_eq!(kv.pool().used_count(), 0);
        }
    }

    #[test]
    fn a_truncated_request_frees_its_tail_and_never_rewrites_a_registered_block() {
        let mut kv = manager(8, 0);
        let scope = CacheScope::private(Salt(1));
        let tokens: Vec<u32> = (0..14).collect();
        // 8 tokens accepted (two full blocks, registered), then 6 drafts run.
        let mut b = computed(&mut kv, &tokens[..8], scope);
        assert!(kv.allocate_slots(&mut b, 14));
        assert_eq!((b.table().len(), kv.pool().free_count()), (4, 4));
        // One draft kept: the fourth block goes; the third (tokens 8..12) was never registered
        // (the core registers accepted tokens only), so it is kept as it is.
        let third = b.table()[2];
        assert_eq!(kv.truncate(&mut b, 9), 9);
        assert_eq!(b.table().len(), 3);
        assert_eq!(b.table()[2], third);
        assert_eq!(kv.pool().free_count(), 5);
        assert!(kv.take_copies().is_empty());
        // Into a registered full block: a copy of its kept slots in a fresh block; the
        // registered one is left to whoever shares it.
        let second = b.table()[1];
        assert_eq!(kv.truncate(&mut b, 6), 6);
        assert_ne!(b.table()[1], second);
        assert_eq!(
            kv.take_copies(),
            vec![BlockCopy {
                src: second,
                dst: b.table()[1],
                slots: 2
            }]
        );
        kv.check().unwrap();
        kv.free(b);
        kv.check().unwrap();
        assert_eq!(kv.pool().free_count(), 8);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 128, rng_seed: proptest::test_runner::RngSeed::Fixed(39), ..Default::default() })]

        /// Requests that grow by drafts and are cut back to what was kept, again and again,
        /// beside a request that shares their prefix: the invariants hold after every step, the
        /// kept blocks hold exactly the kept tokens, and everything comes back when they end.
        #[test]
        fn drafts_grown_and_cut_back_keep_the_invariants(
            steps in proptest::collection::vec((1usize..7, 0usize..7), 1..40),
            blocks in 6usize..24,
        ) {
            let mut kv = manager(blocks, 0);
            let scope = CacheScope::private(Salt(1));
            let tokens: Vec<u32> = (0..400).map(|i| i % 7).collect();
            let mut b = SeqBlocks::new(scope);
            let mut len = 0;
            let mut sharer: Option<SeqBlocks> = None;
            for (drafted, kept) in steps {
                let grown = len + drafted;
                if !kv.allocate_slots(&mut b, grown) {
                    break;
                }
                let kept = len + kept.min(drafted);
                let got = kv.truncate(&mut b, kept);
                // Registered blocks hold accepted tokens only: a cut never reaches them.
                proptest::prop_assert_eq!(got, kept);
                proptest::prop_assert_eq!(b.table().len(), got.div_ceil(4));
                kv.cache_full_blocks(&mut b, &tokens, got);
                len = got;
                kv.take_copies();
                if sharer.is_none() && len >= 8 {
                    let c = kv.computed_blocks(&tokens[..len + 1], scope, None, false);
                    proptest::prop_assert!(c.tokens >= 4);
                    sharer = Some(c.blocks);
                }
                kv.check().map_err(proptest::test_runner::TestCaseError::fail)?;
            }
            kv.free(b);
            if let Some(s) = sharer {
                kv.free(s);
            }
            kv.check().map_err(proptest::test_runner::TestCaseError::fail)?;
            proptest::prop_assert_eq!(kv.pool().free_count(), blocks);
        }

        /// A session's conversation (head, middle, tail) leased, then a request of the head, the
        /// tail and a new message (the middle dropped): whatever the lengths and tokens, every
        /// shifted slot moves the lease's K/V of the very token the request has at its new
        /// position, back by the dropped length; a token is left to compute; the shift starts
        /// only after the kept head; the invariants hold and every block comes back.
        #[test]
        fn a_shift_moves_each_kept_token_to_its_new_position(
            head in 0usize..12,
            middle in 1usize..20,
            tail in 0usize..24,
            new in 1usize..6,
            alphabet in 2u32..50,
            seed in 0u32..1000,
        ) {
            let mut kv = manager(64, 256);
            kv.cfg.context_shift = true;
            let scope = CacheScope::private(Salt(1));
            let mut next = seed;
            let mut token = || { next = next.wrapping_mul(1_103_515_245).wrapping_add(12_345); (next >> 8) % alphabet };
            let (h, m, t): (Vec<u32>, Vec<u32>, Vec<u32>) = (
                (0..head).map(|_| token()).collect(),
                (0..middle).map(|_| token()).collect(),
                (0..tail).map(|_| token()).collect(),
            );
            let leased = [h.clone(), m, t.clone()].concat();
            let request = [h, t, (0..new).map(|_| token()).collect()].concat();
            let b = computed(&mut kv, &leased, scope);
            let lease_table = b.table().to_vec();
            kv.finish(b, &leased, leased.len(), Some(LeaseKey(1)));
            let c = kv.computed_blocks(&request, scope, Some(LeaseKey(1)), true);
            let table = c.blocks.table().to_vec();
            let shifts = kv.take_shifts();
            kv.check().map_err(proptest::test_runner::TestCaseError::fail)?;
            proptest::prop_assert!(c.tokens < request.len());
            proptest::prop_assert!(shifts.len() <= 1);
            if let Some(sh) = shifts.first() {
                let start = c.tokens - sh.dst.len();
                proptest::prop_assert!(start >= KEPT_HEAD);
                proptest::prop_assert_eq!(sh.src.len(), sh.dst.len());
                for (i, (&src, &dst)) in sh.src.iter().zip(&sh.dst).enumerate() {
                    let (p, q) = (start + i, start + i + sh.delta);
                    proptest::prop_assert_eq!(dst, table[p / 4] * 4 + (p % 4) as u32);
                    proptest::prop_assert_eq!(src, lease_table[q / 4] * 4 + (q % 4) as u32);
                    proptest::prop_assert_eq!(request[p], leased[q]);
                }
            }
            kv.take_copies();
            kv.free(c.blocks);
            kv.check().map_err(proptest::test_runner::TestCaseError::fail)?;
            proptest::prop_assert_eq!(kv.pool().free_count(), 64);
        }
    }

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut kv = manager(6, 0);
        let scope = CacheScope::private(Salt(1));
        let tokens: Vec<u32> = (0..10).collect();
        let parent = computed(&mut kv, &tokens, scope);
        assert_eq!(parent.table().len(), 3);
        let child = kv.fork(&parent, 10).unwrap();
        assert_eq!(child.table()[..2], parent.table()[..2]);
        assert_ne!(child.table()[2], parent.table()[2]);
        assert_eq!(kv.pool().refs(parent.table()[0]), 2);
        assert_eq!(
            kv.take_copies(),
            vec![BlockCopy {
                src: parent.table()[2],
                dst: child.table()[2],
                slots: 2
            }]
        );
        // A prompt that fills its blocks exactly copies nothing.
        let even = computed(&mut kv, &(20..28).collect::<Vec<u32>>(), scope);
        let c2 = kv.fork(&even, 8).unwrap();
        assert_eq!(c2.table(), even.table());
        assert!(kv.take_copies().is_empty());
        // No block free for the copy: no fork.
        assert!(kv.fork(&parent, 10).is_none());
        for b in [parent, child, even, c2] {
            kv.free(b);
        }
        kv.check().unwrap();
        assert_eq!(kv.pool().free_count(), 6);
    }

    #[test]
    fn computed_blocks_are_the_cached_run_in_the_same_scope_leaving_one_token() {
        let mut kv = manager(16, 0);
        let a = CacheScope::private(Salt(1));
        let tokens: Vec<u32> = (0..12).collect();
        let first = computed(&mut kv, &tokens, a);
        // Same scope: two full blocks (the third would leave no token to compute).
        let c = kv.computed_blocks(&tokens, a, None, false);
        assert_eq!((c.tokens, c.blocks.table()), (8, &first.table()[..2]));
        kv.free(c.blocks);
        // Another scope: nothing.
        let c = kv.computed_blocks(&tokens, CacheScope::private(Salt(2)), None, false);
        assert_eq!(c.tokens, 0);
        kv.free(c.blocks);
        kv.free(first);
        assert_eq!(kv.pool().used_count(), 0);
        kv.check().unwrap();
    }

    #[test]
    fn a_lease_holds_a_turn_and_hands_its_partial_block_to_the_next() {
        let mut kv = manager(16, 64);
        let scope = CacheScope::private(Salt(1));
        let turn1: Vec<u32> = (0..10).collect(); // 2 full blocks and 2 tokens
        let b = computed(&mut kv, &turn1, scope);
        kv.finish(b, &turn1, 10, Some(LeaseKey(7)));
        assert_eq!(kv.held_blocks().leased, 3);
        assert_eq!(kv.pool().used_count(), 3);
        kv.check().unwrap();
        let mut turn2 = turn1.clone();
        turn2.extend([50, 51]);
        let c = kv.computed_blocks(&turn2, scope, Some(LeaseKey(7)), false);
        assert_eq!(c.tokens, 10, "the partial block continues the request");
        assert_eq!(kv.held_blocks().leased, 0, "the lease has served");
        assert_eq!(kv.pool().used_count(), 3);
        kv.free(c.blocks);
        assert_eq!(kv.pool().used_count(), 0);
        kv.check().unwrap();
    }

    #[test]
    fn allocation_drops_leases_oldest_first_before_failing() {
        let mut kv = manager(4, 64);
        let scope = CacheScope::private(Salt(1));
        for (key, base) in [(1u64, 0u32), (2, 100)] {
            let t: Vec<u32> = (base..base + 8).collect();
            let b = computed(&mut kv, &t, scope);
            kv.finish(b, &t, 8, Some(LeaseKey(key)));
        }
        assert_eq!(kv.pool().free_count(), 0);
        let mut b = SeqBlocks::new(scope);
        assert!(kv.allocate_slots(&mut b, 5), "lease 1 goes");
        assert_eq!(kv.held_blocks().leased, 2);
        assert!(!kv.allocate_slots(&mut b, 20), "more than the pool holds");
        assert_eq!(b.table().len(), 2, "nothing allocated when it fails");
        kv.free(b);
        kv.drop_lease(LeaseKey(2));
        assert_eq!(kv.pool().used_count(), 0);
        kv.check().unwrap();
    }

    #[test]
    fn a_pins_partial_block_is_copied_for_its_tenant_only() {
        let mut kv = manager(16, 0);
        let tenant = Salt(5);
        let sys: Vec<u32> = (0..9).collect();
        let b = computed(&mut kv, &sys, CacheScope::operator(tenant));
        kv.pin(b, &sys);
        assert_eq!(kv.held_blocks().pinned, 3);
        let mut prompt = sys.clone();
        prompt.push(40);
        let visitor = CacheScope {
            tenant,
            principal: Salt(9),
            shared_tokens: sys.len(),
        };
        let c = kv.computed_blocks(&prompt, visitor, None, false);
        assert_eq!(c.tokens, 9);
        let copies = kv.take_copies();
        assert_eq!(copies.len(), 1);
        assert_eq!((copies[0].dst, copies[0].slots), (c.blocks.table()[2], 1));
        // Freed before its step ran: the pending copy goes with it.
        kv.free(c.blocks);
        let c = kv.computed_blocks(&prompt, visitor, None, false);
        kv.free(c.blocks);
        assert!(kv.take_copies().is_empty());
        // Another tenant finds nothing.
        let c = kv.computed_blocks(&prompt, CacheScope::private(Salt(6)), None, false);
        assert_eq!(c.tokens, 0);
        kv.free(c.blocks);
        kv.check().unwrap();
    }

    #[test]
    fn a_request_that_forks_from_its_lease_inside_a_block_gets_a_copy_of_the_common_slots() {
        let mut kv = manager(16, 64);
        let scope = CacheScope::private(Salt(1));
        // A turn: prompt 0..6, reply 100..105; its lease holds all 11 tokens (3 blocks of 4).
        let prompt: Vec<u32> = (0..6).collect();
        let mut turn = prompt.clone();
        turn.extend(100..105);
        let b = computed(&mut kv, &turn, scope);
        kv.finish(b, &turn, turn.len(), Some(LeaseKey(7)));
        let lease_blocks = kv.held_blocks().leased;
        assert_eq!(lease_blocks, 3);
        // Regenerate: the same prompt again. One full block is cached; the lease's second block
        // starts with tokens 4, 5: one copied slot, the last token left to compute.
        let c = kv.computed_blocks(&prompt, scope, Some(LeaseKey(7)), false);
        assert_eq!(c.tokens, prompt.len() - 1);
        let copies = kv.take_copies();
        assert_eq!(copies.len(), 1);
        assert_eq!((copies[0].dst, copies[0].slots), (c.blocks.table()[1], 1));
        assert_eq!(kv.held_blocks().leased, 0, "the lease has served");
        kv.check().unwrap();
        kv.free(c.blocks);
        assert_eq!(
            kv.pool().used_count(),
            0,
            "the copy's source was given back"
        );

        // Edit: a turn whose tokens leave the lease at token 9 (inside its third block).
        let b = computed(&mut kv, &turn, scope);
        kv.finish(b, &turn, turn.len(), Some(LeaseKey(7)));
        let mut edited = turn[..9].to_vec();
        edited.extend([200, 201, 202]);
        let c = kv.computed_blocks(&edited, scope, Some(LeaseKey(7)), false);
        assert_eq!(c.tokens, 9, "everything before the fork");
        let copies = kv.take_copies();
        assert_eq!((copies[0].dst, copies[0].slots), (c.blocks.table()[2], 1));
        kv.free(c.blocks);

        // Another session's lease is never a source.
        let b = computed(&mut kv, &turn, scope);
        kv.finish(b, &turn, turn.len(), Some(LeaseKey(7)));
        let c = kv.computed_blocks(&prompt, scope, Some(LeaseKey(8)), false);
        assert_eq!(c.tokens, 4, "the shared full block only");
        assert!(kv.take_copies().is_empty());
        kv.free(c.blocks);
        kv.drop_lease(LeaseKey(7));
        kv.check().unwrap();
        assert_eq!(kv.pool().used_count(), 0);
    }
}
