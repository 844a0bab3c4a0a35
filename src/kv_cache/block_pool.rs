//! Free-list of KV blocks: which block ids are in use. Pure code (no tensors, no actors).
//!
//! This is the plain allocator the engine needs for one forward step; content hashing, ref counts
//! and LRU reuse of freed blocks (prefix caching) build on it in the KV-sharing work.

use std::collections::VecDeque;

/// Hands out block ids `0..total`, first freed first reused.
#[derive(Debug, Clone)]
pub struct BlockPool {
    total: usize,
    free: VecDeque<u32>,
    in_use: Vec<bool>,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        BlockPool {
            total,
            free: (0..total as u32).collect(),
            in_use: vec![false; total],
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total - self.free.len()
    }

    /// Takes `n` blocks, or none at all when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks: Vec<u32> = self.free.drain(..n).collect();
        for &b in &blocks {
            self.in_use[b as usize] = true;
        }
        Some(blocks)
    }

    /// Returns blocks to the pool. Panics on a double free or an unknown id: both are engine bugs
    /// that would otherwise let two sequences write the same slots.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let slot = self
                .in_use
                .get_mut(b as usize)
                .unwrap_or_else(|| panic!("block {b} is outside the pool"));
            assert!(*slot, "block {b} freed twice");
            *slot = false;
            self.free.push_back(b);
        }
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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        #[test]
        fn random_alloc_free_returns_to_idle(ops in proptest::collection::vec((0usize..6, any::<bool>()), 1..200)) {
            let mut p = BlockPool::new(16);
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (n, free) in ops {
                if free && !held.is_empty() {
                    let b = held.remove(n % held.len());
                    p.release(&b);
                } else if let Some(b) = p.allocate(n) {
                    held.push(b);
                }
                let held_count: usize = held.iter().map(Vec::len).sum();
                prop_assert_eq!(p.used_count(), held_count);
                let mut all: Vec<u32> = held.iter().flatten().copied().collect();
                all.sort();
                all.dedup();
                prop_assert_eq!(all.len(), held_count, "a block handed out twice");
            }
            for b in held.drain(..) {
                p.release(&b);
            }
            prop_assert_eq!(p.free_count(), 16);
        }
    }
}
