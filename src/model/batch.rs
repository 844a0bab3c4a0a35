//! The flat step batch: the tokens of many sequences in one forward pass.
//!
//! A step holds, per sequence, a run of new tokens at consecutive positions (a prefill chunk, or a
//! single decode token), that sequence's block table, and whether its last token's logits are
//! wanted. `plan()` validates it against the cache and flattens it into the per-token arrays the
//! model consumes; an invalid batch is an error, never a panic, and never a write outside the
//! sequence's own blocks.

use crate::error::{EngineError, Result};
use crate::kv_cache::slot_of;

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// New tokens, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Position of the first new token (= tokens already in the cache for this sequence).
    pub start_pos: usize,
    /// The sequence's blocks; must cover `start_pos + tokens.len()` positions.
    pub block_table: Vec<u32>,
    /// Which of this chunk's positions get logits.
    pub logits: Logits,
}

/// The positions of a chunk whose logits a step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk before the prompt's last).
    None,
    /// The last token's: the next token's distribution.
    Last,
    /// Every token's, in order (scoring a text: `llama-relay perplexity`).
    All,
    /// Every token's, for a reply's decode: its last sampled token and the drafts that follow it.
    /// Each row's logits are what a one-token decode of it would give: the run's attention stays
    /// in F32 (never on the bf16 tile units, `kernels::attn_amx`), so verifying drafts never
    /// changes what a reply samples.
    Decode,
}

impl Logits {
    /// `Last` when `sample`, else `None`.
    pub fn last_if(sample: bool) -> Logits {
        if sample {
            Logits::Last
        } else {
            Logits::None
        }
    }
}

/// The whole step, in the order the model processes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepBatch {
    pub seqs: Vec<SeqChunk>,
}

/// Per-sequence facts that attention needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqMeta {
    /// First row of this sequence in the flat batch.
    pub q_start: usize,
    pub q_len: usize,
    /// Position of the first new token.
    pub start_pos: usize,
    pub block_table: Vec<u32>,
    /// A reply's decode (`Logits::Decode`): its attention runs exactly as a one-token decode's.
    pub exact: bool,
    /// More of this sequence's prompt follows in a later step (`Logits::None`: a prefill chunk
    /// before the prompt's last).
    pub more: bool,
}

impl SeqMeta {
    /// Number of positions attended to by the last token (history + new tokens).
    pub fn context_len(&self) -> usize {
        self.start_pos + self.q_len
    }
}

/// A validated, flattened step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqMeta>,
    /// Flat rows whose logits are returned, in batch order.
    pub logit_rows: Vec<u32>,
}

impl StepBatch {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Validates the batch and flattens it.
    pub fn plan(
        &self,
        vocab: usize,
        max_positions: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<StepPlan> {
        let bad = |m: String| Err(EngineError::InvalidBatch(m));
        if self.seqs.is_empty() {
            return bad("the step has no sequences".into());
        }
        let n = self.num_tokens();
        let mut plan = StepPlan {
            token_ids: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            slots: Vec::with_capacity(n),
            seqs: Vec::with_capacity(self.seqs.len()),
            logit_rows: Vec::new(),
        };
        let mut seen_blocks = std::collections::HashSet::new();
        for (i, s) in self.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return bad(format!("sequence {i} has no tokens"));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_positions {
                return bad(format!(
                    "sequence {i} reaches position {end}, beyond the context of {max_positions}"
                ));
            }
            if s.block_table.len() * block_size < end {
                return bad(format!(
                    "sequence {i} needs {} blocks for {end} positions, its table has {}",
                    end.div_ceil(block_size),
                    s.block_table.len()
                ));
            }
            for &b in &s.block_table[..end.div_ceil(block_size)] {
                if b as usize >= num_blocks {
                    return bad(format!(
                        "sequence {i} names block {b}, the cache has {num_blocks}"
                    ));
                }
            }
            // A block written by two sequences in one step would corrupt both.
            let first_written = s.start_pos / block_size;
            for &b in &s.block_table[first_written..end.div_ceil(block_size)] {
                if !seen_blocks.insert(b) {
                    return bad(format!("block {b} is written by two sequences in one step"));
                }
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return bad(format!(
                    "sequence {i} has token id {t}, the vocabulary has {vocab}"
                ));
            }
            let q_start = plan.token_ids.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + j;
                plan.token_ids.push(t);
                plan.positions.push(pos as u32);
                plan.slots
                    .push(slot_of(&s.block_table, pos, block_size) as u32);
            }
            match s.logits {
                Logits::None => {}
                Logits::Last => plan.logit_rows.push((q_start + s.tokens.len() - 1) as u32),
                Logits::All | Logits::Decode => plan
                    .logit_rows
                    .extend((q_start..q_start + s.tokens.len()).map(|r| r as u32)),
            }
            plan.seqs.push(SeqMeta {
                q_start,
                q_len: s.tokens.len(),
                start_pos: s.start_pos,
                block_table: s.block_table.clone(),
                exact: s.logits == Logits::Decode,
                more: s.logits == Logits::None,
            });
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_logits_name_every_row_of_their_chunk() {
        let mut whole = chunk(vec![5, 6, 7], 0, vec![2]);
        whole.logits = Logits::All;
        let mut none = chunk(vec![8, 9], 0, vec![1]);
        none.logits = Logits::None;
        let b = StepBatch {
            seqs: vec![none, whole, chunk(vec![9], 5, vec![0, 3])],
        };
        assert_eq!(b.plan(100, 64, 4, 8).unwrap().logit_rows, vec![2, 3, 4, 5]);
    }

    fn chunk(tokens: Vec<u32>, start_pos: usize, table: Vec<u32>) -> SeqChunk {
        SeqChunk {
            tokens,
            start_pos,
            block_table: table,
            logits: Logits::Last,
        }
    }

    #[test]
    fn flattens_prefill_and_decode() {
        let b = StepBatch {
            seqs: vec![
                chunk(vec![5, 6, 7], 0, vec![2]),
                chunk(vec![9], 5, vec![0, 3]),
            ],
        };
        let p = b.plan(100, 64, 4, 8).unwrap();
        assert_eq!(p.token_ids, vec![5, 6, 7, 9]);
        assert_eq!(p.positions, vec![0, 1, 2, 5]);
        assert_eq!(p.slots, vec![8, 9, 10, 13]);
        assert_eq!(p.logit_rows, vec![2, 3]);
        assert_eq!(p.seqs[1].context_len(), 6);
    }

    #[test]
    fn rejects_what_would_corrupt_the_cache() {
        let e = |b: StepBatch| b.plan(100, 64, 4, 8).unwrap_err().to_string();
        assert!(e(StepBatch {
            seqs: vec![chunk(vec![1; 5], 0, vec![0])]
        })
        .contains("needs 2 blocks"));
        assert!(e(StepBatch {
            seqs: vec![chunk(vec![1], 0, vec![8])]
        })
        .contains("block 8"));
        assert!(e(StepBatch {
            seqs: vec![chunk(vec![100], 0, vec![0])]
        })
        .contains("token id 100"));
        assert!(e(StepBatch {
            seqs: vec![chunk(vec![1], 64, vec![0; 17])]
        })
        .contains("context of 64"));
        assert!(e(StepBatch {
            seqs: vec![chunk(vec![1], 0, vec![1]), chunk(vec![2], 1, vec![1])]
        })
        .contains("two sequences"));
        assert!(e(StepBatch::default()).contains("no sequences"));
    }
}
