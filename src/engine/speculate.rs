//! Speculative decoding's pure parts: where drafts come from and how many to draft next. No
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
//! - **How many to draft** (`DraftLength`): follows each sequence's recent acceptance, backing off
//!   to none while drafts keep failing and probing again later, so a sequence whose text is not
//!   a quotation pays nothing for it.
//!
//! Written here because no crate does this for a batched server of our own: what matters (the
//! index, the back-off) is ours to test.

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

/// How many drafts a sequence runs next, from how its recent drafts fared: the share kept (a
/// moving average) scales `max_k`; below `floor` it drafts none, probing with one draft every
/// `probe_every` steps, so that a sequence whose text stops quoting stops paying for drafts and
/// one that starts again is found.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max_k: usize,
    /// Moving average of the share of drafts kept.
    kept: f32,
    /// Steps since the last draft while backed off.
    idle: usize,
}

impl DraftLength {
    const WEIGHT: f32 = 0.3;
    const FLOOR: f32 = 0.15;
    const PROBE_EVERY: usize = 8;

    /// Starts hopeful (the whole share), so a new sequence drafts at once.
    pub fn new(max_k: usize) -> Self {
        DraftLength {
            max_k,
            kept: 1.0,
            idle: 0,
        }
    }

    /// Drafts to run this step.
    pub fn this_step(&mut self) -> usize {
        if self.max_k == 0 {
            return 0;
        }
        if self.kept < Self::FLOOR {
            self.idle += 1;
            return usize::from(self.idle.is_multiple_of(Self::PROBE_EVERY));
        }
        ((self.kept * self.max_k as f32).ceil() as usize).clamp(1, self.max_k)
    }

    /// `kept` of `drafted` drafts were accepted (a step that drafted nothing is not counted).
    pub fn record(&mut self, drafted: usize, kept: usize) {
        if drafted == 0 {
            return;
        }
        let share = kept.min(drafted) as f32 / drafted as f32;
        self.kept = (1.0 - Self::WEIGHT) * self.kept + Self::WEIGHT * share;
        if self.kept >= Self::FLOOR {
            self.idle = 0;
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
    fn a_sequence_whose_drafts_fail_backs_off_and_probes_again() {
        let mut l = DraftLength::new(4);
        assert_eq!(l.this_step(), 4, "hopeful at first");
        for _ in 0..10 {
            let k = l.this_step();
            l.record(k, 0);
        }
        // Backed off: mostly none, one probe draft every few steps.
        let runs: Vec<usize> = (0..16).map(|_| l.this_step()).collect();
        assert_eq!(runs.iter().sum::<usize>(), 2, "{runs:?}");
        // Drafts that are kept again bring the length back up.
        for _ in 0..12 {
            l.record(1, 1);
        }
        assert_eq!(l.this_step(), 4);
        l.record(4, 2);
        assert!((1..=4).contains(&l.this_step()));
        assert_eq!(DraftLength::new(0).this_step(), 0);
    }
}
