//! A draft model for speculative decoding (`model.draft`, `scheduler.draft_source = "model"`): a
//! second, smaller model with the target's tokenizer (a 1B drafting for an 8B), on its own small
//! paged KV cache, run by the same core between the target's steps, so by the one batcher that
//! owns both. The drafts it writes take the n-gram drafts' place; the scheduler prices them and
//! the core verifies them exactly as it does n-gram drafts.
//!
//! Each step, for the decodes whose drafts the scheduler would run (`Scheduler::drafts_worth_running`),
//! it brings its cache up to each sequence's tokens (one batched chunk for all, from the longest
//! prefix of the sequence it already holds: the K/V of drafts the target rejected are simply
//! written over), then decodes k tokens greedily, batched across the sequences. A greedy draft is
//! a point mass, and for a point mass the rejection-sampling rule (Leviathan et al. 2023: keep `x`
//! with chance `min(1, p(x)/q(x)) = p(x)`, else draw from `p` without `x`) is what the core
//! already does: sample each row as without drafts, keep the draft while it equals that token. So
//! the output distribution is exactly the target's, and the same seed gives the same reply.
//!
//! Its cache is private to each sequence (no prefix sharing: a draft model's prefill is a small
//! share of the target's, and sharing would take a second KV manager with leases and scopes;
//! nothing one principal sends reaches another's draft state either). A call's catch-up is
//! bounded (`CATCH_UP_TOKENS`: a new conversation's prompt reaches the draft cache over a few
//! steps, drafting once it is in); when blocks run out, the sequences drafted least recently give
//! theirs back. vLLM's draft-model proposer has the same shape (its own KV, k greedy steps).
//!
//! Written here because the pieces are ours: the engine, the KV pool, and the core's verification.

use std::collections::HashMap;

use candle_core::D;

use super::scheduler::RequestId;
use super::Engine;
use crate::error::{EngineError, Result};
use crate::model::batch::{Logits, SeqChunk, StepBatch};
use crate::tokenizer::TextTokenizer;

/// Most tokens one call brings into the draft cache before drafting (all sequences together).
pub const CATCH_UP_TOKENS: usize = 512;

/// What the draft cache holds for one sequence.
#[derive(Debug, Default)]
struct DraftSeq {
    /// The tokens whose K/V are in `blocks`, at positions 0.. in order.
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    /// The call that last used it (the least recent give their blocks back first).
    used: u64,
}

/// One sequence's ask: its tokens so far (the last one not yet run) and how many drafts.
pub struct Ask<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
    pub drafts: usize,
}

/// The draft model with its cache and each sequence's state in it.
pub struct DraftModel {
    engine: Engine,
    seqs: HashMap<RequestId, DraftSeq>,
    calls: u64,
    /// Forward passes run, in all.
    passes: u64,
    /// Ids the target's tokenizer has: a draft past them ends the drafts.
    vocab: usize,
}

impl DraftModel {
    /// Takes a loaded draft engine after checking that it shares `target`'s tokenizer: the same
    /// vocabulary, every token the same bytes (its end-of-turn ids may differ: a reply ends on
    /// the model's). A draft of another tokenizer would propose ids that mean other text.
    pub fn new(engine: Engine, target: &TextTokenizer) -> Result<Self> {
        let t = &engine.tokenizer;
        let differ = |what: String| {
            Err(EngineError::bad_file(
                &engine.info.path,
                format!("the draft model's tokenizer is not the model's: {what}"),
            ))
        };
        if t.vocab_size() != target.vocab_size() {
            return differ(format!(
                "{} tokens, the model has {}",
                t.vocab_size(),
                target.vocab_size()
            ));
        }
        if let Some(id) =
            (0..target.vocab_size() as u32).find(|&id| t.token_bytes(id) != target.token_bytes(id))
        {
            return differ(format!("token {id} is another text"));
        }
        Ok(DraftModel {
            vocab: target.vocab_size(),
            engine,
            seqs: HashMap::new(),
            calls: 0,
            passes: 0,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Drops what the draft cache holds for `id` (the request ended). Idempotent.
    pub fn forget(&mut self, id: RequestId) {
        if let Some(s) = self.seqs.remove(&id) {
            self.engine.pool.release_table(&s.blocks);
        }
    }

    /// Forward passes run so far (a call runs one to catch up, then one a draft after the first).
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// Sequences with state in the draft cache.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Up to `drafts` greedy tokens after each ask's tokens, in the asks' order (fewer or none
    /// where its tokens are still coming into the cache, the cache is full, or the draft
    /// model's context ends).
    pub fn draft(&mut self, asks: &[Ask]) -> Result<Vec<Vec<u32>>> {
        self.calls += 1;
        let bs = self.engine.cache.block_size();
        let max_positions = self.engine.model.max_positions();
        let mut out = vec![Vec::new(); asks.len()];
        // (ask, drafts wanted now) for the chunk that brings each sequence's cache up to date.
        let mut chunks: Vec<(usize, usize)> = Vec::new();
        let mut batch = StepBatch::default();
        let mut budget = CATCH_UP_TOKENS;
        for (i, a) in asks.iter().enumerate() {
            let n = a.tokens.len();
            if a.drafts == 0 || n == 0 || budget == 0 {
                continue;
            }
            let s = self.seqs.entry(a.id).or_default();
            s.used = self.calls;
            // The last token is run again (or first) for its logits: the next token's.
            let held = common_prefix(&s.tokens, &a.tokens[..n - 1]);
            s.tokens.truncate(held);
            // Drafts d1..dk: the chunk's last row gives d1, and d1..d(k-1) are run after it.
            let drafts = a.drafts.min((max_positions + 1).saturating_sub(n));
            if drafts == 0 {
                continue;
            }
            // A catch-up past the call's budget goes in part, drafting once it is all in.
            let (take, drafts) = if n - held > budget {
                (budget, 0)
            } else {
                (n - held, drafts)
            };
            // Positions written: up to the chunk's end, then the drafts but the last.
            let end = held + take + drafts.saturating_sub(1);
            if !self.reserve(a.id, end.div_ceil(bs)) {
                continue;
            }
            budget -= take;
            let s = &self.seqs[&a.id];
            batch.seqs.push(SeqChunk {
                tokens: a.tokens[held..held + take].to_vec(),
                start_pos: held,
                block_table: s.blocks.clone(),
                logits: Logits::last_if(drafts > 0),
            });
            chunks.push((i, drafts));
        }
        if batch.seqs.is_empty() {
            return Ok(out);
        }
        let next = self.run(&batch)?;
        for (c, (i, _)) in batch.seqs.iter().zip(&chunks) {
            self.seqs
                .get_mut(&asks[*i].id)
                .expect("reserved")
                .tokens
                .extend(&c.tokens);
        }
        // Each drafting sequence's last draft, and how many more it wants.
        let mut live: Vec<(usize, usize)> = Vec::new();
        let drafting = chunks.iter().filter(|(_, d)| *d > 0);
        for ((i, d), token) in drafting.zip(next) {
            if (token as usize) < self.vocab {
                out[*i].push(token);
                live.push((*i, *d));
            }
        }
        loop {
            live.retain(|&(i, d)| out[i].len() < d);
            if live.is_empty() {
                return Ok(out);
            }
            let mut batch = StepBatch::default();
            for &(i, _) in &live {
                let s = &self.seqs[&asks[i].id];
                batch.seqs.push(SeqChunk {
                    tokens: vec![*out[i].last().expect("a draft")],
                    start_pos: s.tokens.len(),
                    block_table: s.blocks.clone(),
                    logits: Logits::Last,
                });
            }
            let next = self.run(&batch)?;
            let mut kept = Vec::with_capacity(live.len());
            for (&(i, d), token) in live.iter().zip(next) {
                let last = *out[i].last().expect("a draft");
                self.seqs
                    .get_mut(&asks[i].id)
                    .expect("reserved")
                    .tokens
                    .push(last);
                if (token as usize) < self.vocab {
                    out[i].push(token);
                    kept.push((i, d));
                }
            }
            live = kept;
        }
    }

    /// One forward pass of the draft model: the greedy next token of each row with logits.
    fn run(&mut self, batch: &StepBatch) -> Result<Vec<u32>> {
        self.passes += 1;
        let e = &self.engine;
        match e.model.forward(batch, &e.cache)? {
            Some(l) => Ok(l.argmax(D::Minus1)?.to_vec1::<u32>()?),
            None => Ok(Vec::new()),
        }
    }

    /// Gives sequence `id` at least `blocks` blocks (extra ones beyond them back to the pool),
    /// taking them from the sequences used least recently but not in this call when the pool
    /// is short. False when even that is not enough.
    fn reserve(&mut self, id: RequestId, blocks: usize) -> bool {
        let have = self.seqs[&id].blocks.len();
        if have > blocks {
            let s = self.seqs.get_mut(&id).expect("present");
            let extra = s.blocks.split_off(blocks);
            self.engine.pool.release_table(&extra);
            return true;
        }
        let need = blocks - have;
        while self.engine.pool.free_count() < need {
            let victim = (self.seqs.iter())
                .filter(|(_, s)| s.used < self.calls && !s.blocks.is_empty())
                .min_by_key(|(_, s)| s.used)
                .map(|(v, _)| *v);
            match victim {
                Some(v) => self.forget(v),
                None => return false,
            }
        }
        let fresh = self.engine.pool.allocate(need).expect("counted free");
        self.seqs
            .get_mut(&id)
            .expect("present")
            .blocks
            .extend(fresh);
        true
    }

    /// The invariants: every block held by one sequence only, the pool's count of used blocks
    /// equal to those held, each sequence's blocks covering its tokens.
    pub fn check(&self) -> std::result::Result<(), String> {
        let bs = self.engine.cache.block_size();
        let mut seen = std::collections::HashSet::new();
        for (id, s) in &self.seqs {
            if s.blocks.len() * bs < s.tokens.len() {
                return Err(format!(
                    "{id:?} holds {} tokens in {} blocks",
                    s.tokens.len(),
                    s.blocks.len()
                ));
            }
            for &b in &s.blocks {
                if !seen.insert(b) {
                    return Err(format!("block {b} is held twice"));
                }
                if self.engine.pool.refs(b) != 1 {
                    return Err(format!(
                        "block {b} has {} references",
                        self.engine.pool.refs(b)
                    ));
                }
            }
        }
        if seen.len() != self.engine.pool.used_count() {
            return Err(format!(
                "{} blocks held, the pool has {} in use",
                seen.len(),
                self.engine.pool.used_count()
            ));
        }
        self.engine.pool.check()
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
