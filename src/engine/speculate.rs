//! Speculative decoding's pure parts: where drafts come from and how likely they are kept. No
//! tensors and no scheduler state: the core asks a sequence's `NgramDrafter` for up to k tokens
//! and runs them as one chunk beside the other sequences of the step.
//!
//! - **Drafts by n-gram lookup** (prompt-lookup decoding, as vLLM's `ngram` proposer and
//!   llama.cpp's `lookup`): the longest suffix of the sequence (between `min_n` and `max_n`
//!   tokens) that occurred before, and the tokens that followed its latest occurrence. Support
//!   replies quote what they were given (a policy, an order number, the visitor's words), so the
//!   next tokens are often already in the context. An index of every n-gram's latest end keeps a
//!   lookup O(max_n) however long the conversation.
//! - **Acceptance** (in the core): each row's token is sampled as a step without drafts would
//!   sample it, and a draft counts while it equals that token. For an n-gram draft (a point mass)
//!   this is the rule of Leviathan et al. 2023 exactly (kept with probability `p(x)`, a rejection
//!   drawing from `p` without `x`), and more: the same seed gives the same reply.
//! - **How likely a draft is kept** (`Acceptance`): each sequence's recent share of drafts kept,
//!   counting the drafts a step did not run too (checked against the token sampled in their
//!   place), so the scheduler can price drafts (`Scheduler::trim_drafts`) and a sequence whose
//!   text is not a quotation pays nothing for it.
//!
//! Written here because no crate does this for a batched server of our own: what matters (the
//! index, the estimate) is ours to test.

use std::collections::HashMap;

/// Proposes drafts from a sequence's own tokens (prompt and output so far).
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    /// For each n-gram length (index `n - min_n`): the n-gram's tokens' hash, and the end
    /// (exclusive) of its latest occurrence among those indexed.
    latest: Vec<HashMap<u64, usize>>,
    /// N-grams ending at or before this position are indexed.
    indexed: usize,
}

fn hash_of(tokens: &[u32]) -> u64 {
    // FNV-1a over the ids: cheap, and a collision is caught by comparing the tokens.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl NgramDrafter {
    /// Matches suffixes of `min_n..=max_n` tokens (1 <= min_n <= max_n).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        assert!(1 <= min_n && min_n <= max_n, "1 <= min_n <= max_n");
        NgramDrafter {
            min_n,
            max_n,
            latest: vec![HashMap::new(); max_n - min_n + 1],
            indexed: 0,
        }
    }

    /// Up to `k` drafts to follow `tokens` (the whole sequence, which only ever grows between
    /// calls): the tokens after the latest earlier occurrence of its longest matching suffix.
    pub fn draft(&mut self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        if self.indexed > len {
            // A different sequence: start over.
            *self = NgramDrafter::new(self.min_n, self.max_n);
        }
        // Index the n-grams that end before the suffix's end, so the suffix finds an earlier
        // occurrence, never itself.
        let upto = len.saturating_sub(1);
        for end in self.indexed + 1..=upto {
            for n in self.min_n..=self.max_n.min(end) {
                let h = hash_of(&tokens[end - n..end]);
                self.latest[n - self.min_n].insert(h, end);
            }
        }
        self.indexed = self.indexed.max(upto);
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            let Some(&end) = self.latest[n - self.min_n].get(&hash_of(suffix)) else {
                continue;
            };
            if &tokens[end - n..end] != suffix {
                continue;
            }
            let next = &tokens[end..len.min(end + k)];
            if !next.is_empty() {
                return next.to_vec();
            }
        }
        Vec::new()
    }
}

/// How likely a sequence's next draft is to be kept: the share of its drafts that were, with
/// every draft counted whether it ran or not. A draft the step did not run is checked against
/// the token sampled in its place, so the estimate follows the text at no cost even while the
/// scheduler runs no drafts (under load, or after a run of misses), and a sequence that starts
/// quoting again is seen at once. Drafts are kept in order, so the j-th draft of a step is kept
/// with probability about `p^j` (`Scheduler::trim_drafts` prices them so). Counts decay, so the
/// estimate follows the text's recent stretch; a prior keeps a new sequence's first guesses sane.
#[derive(Debug, Clone)]
pub struct Acceptance {
    kept: f64,
    missed: f64,
}

impl Default for Acceptance {
    fn default() -> Self {
        Acceptance::new()
    }
}

impl Acceptance {
    /// Each earlier observation's weight is multiplied by this at every new one (about the
    /// last ten drafts count).
    const DECAY: f64 = 0.9;
    /// The prior, in observations: a new sequence starts at 0.5, and a steady record outweighs
    /// it (twenty kept in a row read 0.95).
    const PRIOR_KEPT: f64 = 0.5;
    const PRIOR_MISSED: f64 = 0.5;

    pub fn new() -> Self {
        Acceptance {
            kept: 0.0,
            missed: 0.0,
        }
    }

    /// The chance that the next draft is kept.
    pub fn p(&self) -> f64 {
        (self.kept + Self::PRIOR_KEPT)
            / (self.kept + self.missed + Self::PRIOR_KEPT + Self::PRIOR_MISSED)
    }

    /// A step sampled `sampled` after proposing `drafts` (of which it may have run none, some
    /// or all): drafts count as kept while they equal the sampled tokens, the first that differs
    /// as missed; drafts past the sampled tokens tell nothing.
    pub fn record(&mut self, drafts: &[u32], sampled: &[u32]) {
        for (d, t) in drafts.iter().zip(sampled) {
            self.kept *= Self::DECAY;
            self.missed *= Self::DECAY;
            if d == t {
                self.kept += 1.0;
            } else {
                self.missed += 1.0;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The lookup by its definition: the longest suffix with an earlier occurrence, its latest.
    fn reference(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min_n..=max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            for end in (n..len).rev() {
                if &tokens[end - n..end] == suffix {
                    let next = &tokens[end..len.min(end + k)];
                    if !next.is_empty() {
                        return next.to_vec();
                    }
                    break;
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn a_quoted_phrase_is_drafted_from_its_earlier_occurrence() {
        // "... order A - 1 2 3 shipped ... your order A - 1" → drafts "2 3 shipped".
        let text: Vec<u32> = vec![5, 9, 40, 41, 42, 43, 77, 8, 6, 5, 9, 40, 41];
        let mut d = NgramDrafter::new(1, 3);
        assert_eq!(d.draft(&text, 3), vec![42, 43, 77]);
        // As the sequence grows by the accepted tokens the index follows it.
        let mut grown = text.clone();
        grown.extend([42, 43]);
        assert_eq!(d.draft(&grown, 2), vec![77, 8]);
        // Nothing earlier to quote: no drafts.
        assert_eq!(
            NgramDrafter::new(1, 3).draft(&[1, 2, 3], 4),
            Vec::<u32>::new()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(39), ..ProptestConfig::default() })]

        /// Fed a growing sequence step by step, the index drafts what the definition says.
        #[test]
        fn drafts_match_the_reference_lookup(
            tokens in proptest::collection::vec(0u32..4, 1..120),
            min_n in 1usize..3,
            extra in 0usize..3,
            k in 0usize..6,
            step in 1usize..7,
        ) {
            let max_n = min_n + extra;
            let mut d = NgramDrafter::new(min_n, max_n);
            let mut len = 1;
            while len <= tokens.len() {
                let got = d.draft(&tokens[..len], k);
                prop_assert_eq!(got, reference(&tokens[..len], min_n, max_n, k), "len {}", len);
                len += step;
            }
        }
    }

    #[test]
    fn acceptance_follows_the_drafts_kept_whether_they_ran_or_not() {
        let mut a = Acceptance::new();
        assert_eq!(a.p(), 0.5, "the prior");
        // Two drafts kept, the third missed: the tokens after the miss tell nothing.
        a.record(&[1, 2, 3, 4], &[1, 2, 9, 4]);
        let after = a.p();
        assert!(after > 0.5 && after < 0.7, "{after}");
        // A draft that did not run is checked against the token sampled instead.
        let mut quoting = Acceptance::new();
        for _ in 0..20 {
            quoting.record(&[7], &[7]);
        }
        assert!(quoting.p() > 0.94, "{}", quoting.p());
        // Text that stops quoting brings it down within a few steps, and back up again.
        for _ in 0..10 {
            quoting.record(&[7], &[8]);
        }
        assert!(quoting.p() < 0.4, "{}", quoting.p());
        for _ in 0..10 {
            quoting.record(&[7, 7], &[7, 7]);
        }
        assert!(quoting.p() > 0.8, "{}", quoting.p());
        // Nothing sampled or nothing drafted: no observation.
        let mut none = Acceptance::new();
        none.record(&[], &[1]);
        none.record(&[1], &[]);
        assert_eq!(none.p(), 0.5);
    }
}
