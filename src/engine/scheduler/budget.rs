//! How much of a step a prefill may take: the step-time target (Sarathi-Serve's stall-free
//! batching over the learned cost model, with a margin from recent prediction errors), the token
//! budget being filled (`StepBudget`), and the chunk that fits both.

use super::*;
use crate::engine::cost::StepShape;
use crate::kv_cache::manager::KvManager;
use crate::kv_cache::Salt;
use crate::model::batch::{Logits, SeqChunk};

/// How much slower than its decodes alone a step may become for prefill-only requests (drafts):
/// on a CPU no step capacity is free, so a draft rides along only as far as it costs the
/// streams little.
pub(super) const DRAFT_SLACK: f64 = 0.1;

/// The smallest prefill chunk a step takes when the time target cannot be met (so a long prompt
/// always progresses).
pub const MIN_CHUNK: usize = 16;

/// Steps whose prediction errors set the planning margin.
pub(super) const ERROR_WINDOW: usize = 64;

/// Steps predicted under this share of the planned step time do not count toward the margin.
pub(super) const MARGIN_SHARE: f64 = 0.25;

/// Steps are planned to this share of the target: step times on a busy machine spread ~25%
/// around the prediction, and the target bounds the slow ones too.
pub(crate) const PLAN_FRACTION: f64 = 0.8;

/// Which running prefills `Scheduler::schedule_running_prefills` takes: those with at most a
/// step's token budget left, or the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Remainder {
    Short,
    Long,
}

/// What is left of a step while it is filled.
#[derive(Debug, Default)]
pub(super) struct StepBudget {
    pub(super) tokens: usize,
    pub(super) shape: StepShape,
    /// The step-time target, in seconds, when the step carries decodes.
    pub(super) limit: Option<f64>,
    /// The target before first-token deadlines stretched `limit` (`deadline`): prompts longer
    /// than a step keep it, the stretch is for the turns it was planned for.
    pub(super) unstretched: Option<f64>,
    /// When the step carries decodes: the time drafts may bring it to (`DRAFT_SLACK`).
    pub(super) spare: Option<f64>,
    /// A prefill chunk is in the step.
    pub(super) prefilled: bool,
    /// A new request's first chunk is in the step.
    pub(super) admitted: bool,
    /// A chunk was cut to the time target: no more prefill this step.
    pub(super) full: bool,
    /// Tenants whose work sits this step out (`Scheduler::tenants_to_hold`).
    pub(super) hold: Vec<Salt>,
}

/// Adds the next `n` prompt tokens of `s` to the step; false if no block is free for them.
pub(super) fn push_chunk(
    kv: &mut KvManager,
    s: &mut Sequence,
    n: usize,
    b: &mut StepBudget,
    out: &mut Scheduled,
) -> bool {
    let end = s.computed + n;
    if !kv.allocate_slots(&mut s.blocks, end) {
        return false;
    }
    let sample = end == s.tokens.len() && s.kind == SeqKind::Reply;
    if s.kind == SeqKind::Draft && end == s.tokens.len() {
        out.prefilled.push(s.id);
    }
    out.batch.seqs.push(SeqChunk {
        tokens: s.tokens[s.computed..end].to_vec(),
        start_pos: s.computed,
        block_table: s.blocks.table().to_vec(),
        logits: Logits::last_if(sample),
    });
    out.entries.push(Entry { id: s.id, sample });
    if !s.started {
        b.admitted = true;
        s.started = true;
        out.started.push(Started {
            id: s.id,
            cached_tokens: s.cached_tokens,
        });
    }
    b.shape.add_run(s.computed, n);
    b.shape.add_logits(usize::from(sample));
    b.full |= n < s.pending().min(b.tokens);
    b.prefilled = true;
    b.tokens -= n;
    s.computed = end;
    true
}

impl Scheduler {
    /// The cost model's prediction for a step, in milliseconds (for the step log).
    pub fn predict_ms(&self, shape: &StepShape) -> f64 {
        self.cost.predict(shape) * 1e3
    }

    /// Teaches the cost model a step's measured time.
    pub fn observe_step(&mut self, shape: &StepShape, seconds: f64) {
        let predicted = self.cost.predict(shape);
        // Only steps of a size the target is about: a step far under it that runs over its
        // prediction (a few milliseconds of decode beside a wake-up) threatens no gap, and its
        // larger relative error would shrink every plan.
        let sized = (self.cfg.itl_target)
            .is_none_or(|t| predicted >= t.as_secs_f64() * PLAN_FRACTION * MARGIN_SHARE);
        if predicted > 0.0 && seconds.is_finite() && sized {
            if self.errors.len() == ERROR_WINDOW {
                self.errors.pop_front();
            }
            self.errors.push_back(seconds / predicted);
        }
        self.cost.observe(shape, seconds);
    }

    /// What recent steps of the target's size took over their prediction, at the 95th
    /// percentile (1 to 3). The streams' gap target holds for their slow steps too: planned at
    /// the 90th percentile, the streams' gap p99 beside a long prompt went over the target in 3
    /// runs of 12 on a noisy 2-core guest; at the 97th the long prompt took over twice its time
    /// alone (docs/performance.md, "The planning margin").
    pub(super) fn safety(&self) -> f64 {
        if self.errors.len() < 8 {
            return 1.0;
        }
        let mut e: Vec<f64> = self.errors.iter().copied().collect();
        e.sort_by(f64::total_cmp);
        e[(e.len() * 95 / 100).min(e.len() - 2)].clamp(1.0, 3.0)
    }

    /// How many of `s`'s pending tokens the next chunk takes (0: none this step): what the token
    /// budget leaves and, for a long prompt while replies are decoding, what keeps the predicted
    /// step time under the target, at least `MIN_CHUNK` for the step's first chunk.
    pub(super) fn chunk_len(&self, b: &StepBudget, s: &Sequence) -> usize {
        let (start, pending) = (s.computed, s.pending());
        let max = pending.min(b.tokens);
        if max == 0 || b.full {
            return 0;
        }
        let limit = if s.kind == SeqKind::Draft {
            b.spare.map(|sp| b.limit.map_or(sp, |l| l.min(sp)))
        } else if pending > self.cfg.step_tokens {
            b.unstretched.or(b.limit)
        } else {
            b.limit
        };
        let Some(limit) = limit else { return max };
        if !b.admitted
            && !s.started
            && s.kind != SeqKind::Draft
            && s.tokens.len() - s.cached_tokens <= self.cfg.step_tokens
        {
            // The step's first new request, when its whole prefill fits the token budget (a
            // chat turn, an ordinary prompt), is not cut to the time target: that would delay
            // its first token by steps to save the streams milliseconds. Later ones in the same
            // step are (several whole prompts beside a full batch of decodes make the step that
            // everyone, the next request included, waits for), and so are the rest of prompts
            // cut before: they do not take the first new request's place.
            return max;
        }
        let fits = |n: usize| self.cost.predict(&b.shape.with_run(start, n)) <= limit;
        if fits(max) {
            return max;
        }
        // The predicted time grows with n: the largest n that fits, by bisection.
        let (mut lo, mut hi) = (0, max);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if lo == 0 && !b.prefilled && s.kind != SeqKind::Draft {
            MIN_CHUNK.min(max)
        } else {
            lo
        }
    }
}
