//! The pool of KV blocks: ref counts, content hashes and an LRU queue of free blocks. Pure code
//! (no tensors, no actors), tested alone with hand-built inputs and seeded randomized invariants.
//!
//! The design is vLLM v1's automatic prefix caching (`docs/design/prefix_caching.md` there):
//! - when a block is full its content gets a hash chained from the previous block's hash, the
//!   tenant's salt and its token ids; a new sequence takes over the longest run of cached blocks
//!   matching its prompt, read-only, with a reference each;
//! - a block whose last reference goes is not wiped: it joins the back of the free queue with its
//!   hash, so a later request can still hit it; allocation takes blocks from the front (least
//!   recently freed first) and only then forgets their hash (an eviction);
//! - a finished sequence releases its blocks tail first, so its tail is evicted before its head,
//!   which other requests are likelier to share.
//!
//! A lookup compares the stored token ids, parent hash and salt too, so a hash collision can never
//! share a block whose prefix differs.
//!
//! Whose blocks may be shared is a `CacheScope` (vLLM's per-request `cache_salt`, made per block):
//! the blocks that lie wholly inside the operator's text at the start of a prompt (a configured
//! system prompt) are salted with the tenant, every later block with the principal that sent it,
//! so one principal can never hit (or time) another's content.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// A prefix-cache partition: blocks hashed with different salts are never shared. Salts are
/// made on the server from server-side identities only (see `server::tenants`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Salt(pub u64);

/// The chained content hash of a full block (its parent's hash, its salt, its token ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

/// Which salt each block of a sequence is hashed with: the blocks wholly inside the first
/// `shared_tokens` tokens (text the operator configured, identical for every principal of the
/// tenant) take `tenant`, every later block `principal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheScope {
    pub tenant: Salt,
    pub principal: Salt,
    pub shared_tokens: usize,
}

impl CacheScope {
    /// Every block in one partition.
    pub fn private(salt: Salt) -> Self {
        CacheScope {
            tenant: salt,
            principal: salt,
            shared_tokens: 0,
        }
    }

    /// Operator text only (a pinned prefix): every block in the tenant's partition.
    pub fn operator(tenant: Salt) -> Self {
        CacheScope {
            tenant,
            principal: tenant,
            shared_tokens: usize::MAX,
        }
    }

    /// The salt of full block `i`.
    pub fn salt_of_block(&self, i: usize, block_size: usize) -> Salt {
        if (i + 1).saturating_mul(block_size) <= self.shared_tokens {
            self.tenant
        } else {
            self.principal
        }
    }
}

/// The chained hash of a full block: parent block's hash, salt, token ids.
pub fn block_hash(parent: Option<BlockHash>, salt: Salt, tokens: &[u32]) -> BlockHash {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    salt.hash(&mut h);
    tokens.hash(&mut h);
    BlockHash(h.finish())
}

/// Hashes of the full blocks of `tokens` (a partial last block has none).
pub fn prefix_hashes(tokens: &[u32], block_size: usize, scope: &CacheScope) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for (i, chunk) in tokens.chunks_exact(block_size).enumerate() {
        let h = block_hash(parent, scope.salt_of_block(i, block_size), chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[derive(Debug, Clone, Default)]
struct Meta {
    refs: u32,
    /// Content identity while cached: (hash, parent hash, salt, tokens).
    content: Option<(BlockHash, Option<BlockHash>, Salt, Vec<u32>)>,
    /// Position in the free queue while free.
    free_key: Option<u64>,
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub total: usize,
    /// Referenced by at least one sequence.
    pub used: usize,
    /// Free but still holding a cached prefix.
    pub cached_free: usize,
    /// Free with no content.
    pub empty_free: usize,
    pub evictions: u64,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    meta: Vec<Meta>,
    /// Free blocks by the order they were freed (front = evicted first).
    free: BTreeMap<u64, u32>,
    next_key: u64,
    /// Low keys for never-used blocks so that they are taken before cached ones.
    next_front_key: u64,
    cached: HashMap<BlockHash, u32>,
    evictions: u64,
    /// Free blocks that still hold content, kept on every change (the metrics read it each
    /// step; a recount would walk every free block).
    cached_free: usize,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        let mut p = BlockPool {
            meta: vec![Meta::default(); total],
            free: BTreeMap::new(),
            next_key: u64::MAX / 2,
            next_front_key: 0,
            cached: HashMap::new(),
            evictions: 0,
            cached_free: 0,
        };
        for b in 0..total as u32 {
            p.push_free_front(b);
        }
        p
    }

    fn push_free_back(&mut self, b: u32) {
        let k = self.next_key;
        self.next_key += 1;
        self.push_free(k, b);
    }

    fn push_free_front(&mut self, b: u32) {
        let k = self.next_front_key;
        self.next_front_key += 1;
        self.push_free(k, b);
    }

    fn push_free(&mut self, k: u64, b: u32) {
        self.free.insert(k, b);
        let m = &mut self.meta[b as usize];
        m.free_key = Some(k);
        self.cached_free += usize::from(m.content.is_some());
    }

    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks with no reference (cached or not): what allocation can take.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total() - self.free.len()
    }

    pub fn stats(&self) -> PoolStats {
        let cached_free = self.cached_free;
        PoolStats {
            total: self.total(),
            used: self.used_count(),
            cached_free,
            empty_free: self.free.len() - cached_free,
            evictions: self.evictions,
        }
    }

    pub fn refs(&self, b: u32) -> u32 {
        self.meta[b as usize].refs
    }

    /// Takes `n` fresh blocks (one reference each), evicting cached content least recently freed
    /// first; none at all when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, b) = self.free.pop_first().expect("counted above");
            let m = &mut self.meta[b as usize];
            m.free_key = None;
            m.refs = 1;
            if let Some((h, ..)) = m.content.take() {
                self.cached_free -= 1;
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
                self.evictions += 1;
            }
            out.push(b);
        }
        Some(out)
    }

    /// Drops one reference from each block, in the order given: the first one freed is the first
    /// one evicted, so callers pass a sequence's blocks tail first. Panics on a block with no
    /// reference: that is an engine bug that would let two sequences write the same slots.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let m = self
                .meta
                .get_mut(b as usize)
                .unwrap_or_else(|| panic!("block {b} is outside the pool"));
            assert!(m.refs > 0, "block {b} freed twice");
            m.refs -= 1;
            if m.refs == 0 {
                self.push_free_back(b);
            }
        }
    }

    /// Adds one reference to each block, every one of them already referenced (a fork sharing
    /// its parent's full blocks).
    pub fn retain(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let m = &mut self.meta[b as usize];
            assert!(
                m.refs > 0,
                "block {b} is free: only referenced blocks are shared"
            );
            m.refs += 1;
        }
    }

    /// Releases a sequence's block table, tail first.
    pub fn release_table(&mut self, table: &[u32]) {
        let rev: Vec<u32> = table.iter().rev().copied().collect();
        self.release(&rev);
    }

    /// Records that full block `b` holds `tokens` after the block hashed `parent`.
    pub fn register(
        &mut self,
        b: u32,
        parent: Option<BlockHash>,
        salt: Salt,
        tokens: &[u32],
    ) -> BlockHash {
        let h = block_hash(parent, salt, tokens);
        let m = &mut self.meta[b as usize];
        if m.content.as_ref().is_some_and(|c| c.0 == h) {
            return h;
        }
        if m.content.is_none() && m.free_key.is_some() {
            self.cached_free += 1;
        }
        m.content = Some((h, parent, salt, tokens.to_vec()));
        // An identical block already cached stays the one lookups find.
        self.cached.entry(h).or_insert(b);
        h
    }

    /// How many of `tokens`' first full blocks (at most `max_blocks`) `acquire_prefix` would
    /// find cached in `scope`, changing nothing.
    pub fn cached_prefix_blocks(
        &self,
        tokens: &[u32],
        block_size: usize,
        scope: &CacheScope,
        max_blocks: usize,
    ) -> usize {
        self.match_prefix(tokens, block_size, scope, max_blocks)
            .len()
    }

    /// The cached blocks holding `tokens`' first full blocks in `scope`, in order, up to the
    /// first miss.
    fn match_prefix(
        &self,
        tokens: &[u32],
        block_size: usize,
        scope: &CacheScope,
        max_blocks: usize,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        let mut parent = None;
        for (i, chunk) in tokens.chunks_exact(block_size).take(max_blocks).enumerate() {
            let salt = scope.salt_of_block(i, block_size);
            let h = block_hash(parent, salt, chunk);
            let Some(&b) = self.cached.get(&h) else { break };
            let m = &self.meta[b as usize];
            let same = m.content.as_ref().is_some_and(|(ch, cp, cs, ct)| {
                *ch == h && *cp == parent && *cs == salt && ct == chunk
            });
            if !same {
                break;
            }
            out.push(b);
            parent = Some(h);
        }
        out
    }

    /// The longest run of cached blocks matching the full blocks of `tokens` (at most
    /// `max_blocks`) in `scope`, each with one new reference.
    pub fn acquire_prefix(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        scope: &CacheScope,
        max_blocks: usize,
    ) -> Vec<u32> {
        let out = self.match_prefix(tokens, block_size, scope, max_blocks);
        for &b in &out {
            let m = &mut self.meta[b as usize];
            if m.refs == 0 {
                let k = m
                    .free_key
                    .take()
                    .expect("a free block has a queue position");
                self.free.remove(&k);
                // A matched block holds content.
                self.cached_free -= 1;
            }
            m.refs += 1;
        }
        out
    }

    /// Grows a sequence's block table so that it covers `tokens` tokens.
    /// Returns false (and changes nothing) when the pool cannot supply the blocks.
    pub fn ensure_capacity(
        &mut self,
        table: &mut Vec<u32>,
        tokens: usize,
        block_size: usize,
    ) -> bool {
        let need = super::blocks_for(tokens, block_size).saturating_sub(table.len());
        if need == 0 {
            return true;
        }
        match self.allocate(need) {
            Some(b) => {
                table.extend(b);
                true
            }
            None => false,
        }
    }

    /// Checks the pool's invariants (tests and debug assertions).
    pub fn check(&self) -> Result<(), String> {
        for (b, m) in self.meta.iter().enumerate() {
            if (m.refs == 0) != m.free_key.is_some() {
                return Err(format!(
                    "block {b}: refs {} but free_key {:?}",
                    m.refs, m.free_key
                ));
            }
            if let Some(k) = m.free_key {
                if self.free.get(&k) != Some(&(b as u32)) {
                    return Err(format!("block {b} not at its queue position"));
                }
            }
            if let Some((h, p, s, t)) = &m.content {
                if block_hash(*p, *s, t) != *h {
                    return Err(format!("block {b}: hash does not match its content"));
                }
            }
        }
        let counted = self
            .free
            .values()
            .filter(|&&b| self.meta[b as usize].content.is_some())
            .count();
        if counted != self.cached_free {
            return Err(format!(
                "cached_free {} but {counted} free blocks hold content",
                self.cached_free
            ));
        }
        for (h, &b) in &self.cached {
            if self.meta[b as usize].content.as_ref().map(|c| c.0) != Some(*h) {
                return Err(format!(
                    "cached hash {h:?} points at block {b} with other content"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(p.allocate(2), None);
        assert_eq!(p.free_count(), 1);
        p.release(&[1]);
        assert_eq!(p.allocate(2), Some(vec![3, 1]));
    }

    #[test]
    fn ensure_capacity_grows_by_blocks() {
        let mut p = BlockPool::new(8);
        let mut t = Vec::new();
        assert!(p.ensure_capacity(&mut t, 1, 16));
        assert_eq!(t.len(), 1);
        assert!(p.ensure_capacity(&mut t, 16, 16));
        assert_eq!(t.len(), 1);
        assert!(p.ensure_capacity(&mut t, 17, 16));
        assert_eq!(t.len(), 2);
        assert!(!p.ensure_capacity(&mut t, 16 * 9, 16));
        assert_eq!(t.len(), 2);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_panics() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(1).unwrap();
        p.release(&b);
        p.release(&b);
    }

    fn fill(p: &mut BlockPool, table: &[u32], tokens: &[u32], bs: usize, salt: u64) {
        let salt = Salt(salt);
        let mut parent = None;
        for (b, chunk) in table.iter().zip(tokens.chunks_exact(bs)) {
            parent = Some(p.register(*b, parent, salt, chunk));
        }
    }

    #[test]
    fn a_released_prefix_is_found_again_and_shared() {
        let mut p = BlockPool::new(8);
        let toks: Vec<u32> = (0..10).collect();
        let t = p.allocate(3).unwrap(); // 10 tokens, block size 4: two full blocks
        fill(&mut p, &t, &toks, 4, 0);
        // While in use, a second sequence shares the two full blocks.
        let shared = p.acquire_prefix(&toks, 4, &CacheScope::private(Salt(0)), 8);
        assert_eq!(shared, t[..2].to_vec());
        assert_eq!(p.refs(t[0]), 2);
        p.release_table(&t);
        p.release_table(&shared);
        assert_eq!(p.used_count(), 0);
        assert_eq!(p.stats().cached_free, 2);
        // Free but cached: found again.
        let again = p.acquire_prefix(&toks, 4, &CacheScope::private(Salt(0)), 8);
        assert_eq!(again, t[..2].to_vec());
        // Another salt (tenant) or another first token finds nothing.
        assert!(p
            .acquire_prefix(&toks, 4, &CacheScope::private(Salt(1)), 8)
            .is_empty());
        let mut other = toks.clone();
        other[0] = 99;
        assert!(p
            .acquire_prefix(&other, 4, &CacheScope::private(Salt(0)), 8)
            .is_empty());
        // A prefix differing only in block 2 shares block 1 alone.
        let mut tail = toks.clone();
        tail[5] = 77;
        assert_eq!(
            p.acquire_prefix(&tail, 4, &CacheScope::private(Salt(0)), 8),
            vec![t[0]]
        );
        p.check().unwrap();
    }

    #[test]
    fn eviction_order_is_lru_with_tails_first() {
        // 6 blocks; sequence A uses 0,1,2 and B uses 3,4,5, all cached; A ends first.
        let mut p = BlockPool::new(6);
        let a = p.allocate(3).unwrap();
        let b = p.allocate(3).unwrap();
        let ta: Vec<u32> = (100..112).collect();
        let tb: Vec<u32> = (200..212).collect();
        fill(&mut p, &a, &ta, 4, 0);
        fill(&mut p, &b, &tb, 4, 0);
        p.release_table(&a);
        p.release_table(&b);
        // Free queue: A's tail to head, then B's tail to head.
        assert_eq!(p.allocate(1).unwrap(), vec![a[2]]);
        assert_eq!(p.allocate(1).unwrap(), vec![a[1]]);
        assert_eq!(p.stats().evictions, 2);
        // A's head is still cached; touching it moves it out of the queue.
        assert_eq!(
            p.acquire_prefix(&ta, 4, &CacheScope::private(Salt(0)), 1),
            vec![a[0]]
        );
        assert_eq!(p.allocate(3).unwrap(), vec![b[2], b[1], b[0]]);
        assert_eq!(p.allocate(1), None);
        p.check().unwrap();
    }

    #[test]
    fn never_used_blocks_go_before_cached_ones() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(1).unwrap();
        fill(&mut p, &a, &[1, 2, 3, 4], 4, 0);
        p.release(&a);
        assert_eq!(p.allocate(3).unwrap(), vec![1, 2, 3]);
        assert_eq!(p.stats().evictions, 0);
        assert_eq!(
            p.acquire_prefix(&[1, 2, 3, 4], 4, &CacheScope::private(Salt(0)), 1),
            a
        );
    }

    #[test]
    fn operator_blocks_are_shared_and_client_blocks_stay_with_their_principal() {
        // Block size 4: the first 8 tokens are operator text (two blocks), the rest the client's.
        let mut p = BlockPool::new(16);
        let tenant = Salt(7);
        let (alice, bob) = (Salt(100), Salt(200));
        let scope = |principal| CacheScope {
            tenant,
            principal,
            shared_tokens: 10,
        };
        let toks: Vec<u32> = (0..16).collect();
        let t = p.allocate(4).unwrap();
        let hashes = prefix_hashes(&toks, 4, &scope(alice));
        let mut parent = None;
        for (i, (b, chunk)) in t.iter().zip(toks.chunks_exact(4)).enumerate() {
            parent = Some(p.register(*b, parent, scope(alice).salt_of_block(i, 4), chunk));
            assert_eq!(parent, Some(hashes[i]));
        }
        // Bob sends the same tokens: only the two operator blocks are his to hit.
        let got = p.acquire_prefix(&toks, 4, &scope(bob), 4);
        assert_eq!(got, t[..2].to_vec());
        p.release_table(&got);
        // Alice hits all four; a pinned prefix (operator text) is found by both.
        let got = p.acquire_prefix(&toks, 4, &scope(alice), 4);
        assert_eq!(got, t);
        p.release_table(&got);
        assert_eq!(
            p.acquire_prefix(&toks, 4, &CacheScope::operator(tenant), 4)
                .len(),
            2
        );
        assert_eq!(
            CacheScope::operator(tenant).salt_of_block(1_000_000, 16),
            tenant
        );
        p.check().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Random allocate / share / register / free: ref counts stay consistent, no block is both
        /// free and in use, hashes match contents, and the pool returns to idle.
        #[test]
        fn random_operations_keep_invariants(ops in proptest::collection::vec((0u8..4, 0usize..6, 0u32..3), 1..150)) {
            let bs = 2;
            let mut p = BlockPool::new(12);
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (op, n, seed) in ops {
                let toks: Vec<u32> = (0..(n * bs) as u32).map(|i| (i + seed) % 3).collect();
                match op {
                    0 => if let Some(t) = p.allocate(n) {
                        fill(&mut p, &t, &toks, bs, 0);
                        held.push(t);
                    },
                    1 => {
                        let s = p.acquire_prefix(&toks, bs, &CacheScope::private(Salt(0)), n);
                        if !s.is_empty() { held.push(s); }
                    }
                    _ => if !held.is_empty() {
                        let t = held.remove(n % held.len());
                        p.release_table(&t);
                    },
                }
                prop_assert!(p.check().is_ok(), "{:?}", p.check());
                let refs: usize = held.iter().map(Vec::len).sum();
                let counted: usize = (0..12).map(|b| p.refs(b) as usize).sum();
                prop_assert_eq!(refs, counted);
            }
            for t in held.drain(..) {
                p.release_table(&t);
            }
            prop_assert_eq!(p.used_count(), 0);
            prop_assert_eq!(p.free_count(), 12);
            prop_assert!(p.check().is_ok());
        }
    }
}
