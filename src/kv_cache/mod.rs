//! The paged KV cache: per-layer K and V tensors cut into fixed-size blocks (`storage`, F32, F16 or
//! the 8-bit format of `q8`), the pure
//! bookkeeping of which blocks are free and what they hold (`block_pool`), and the manager that
//! gives requests their blocks, shares cached prefixes and keeps leases and pins (`manager`).
//!
//! The layout follows vLLM's PagedAttention: a sequence owns a block table (a list of block ids);
//! token position `p` lives in slot `table[p / block_size] * block_size + p % block_size`. Storage
//! holds tensors and nothing else; the pool and the manager hold ids and nothing else, so they are
//! tested alone.

pub mod block_pool;
pub mod manager;
pub mod q8;
pub mod storage;

pub use block_pool::{BlockHash, BlockPool, CacheScope, Salt};
pub use storage::{KvCache, KvCacheSpec, KvDtype, KvShape, LayerKv, SlotIndex, Written};

/// Number of blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

/// The slot of position `pos` for a sequence with this block table.
#[inline]
pub fn slot_of(block_table: &[u32], pos: usize, block_size: usize) -> usize {
    block_table[pos / block_size] as usize * block_size + pos % block_size
}
