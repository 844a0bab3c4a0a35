//! Which speculative drafts a step runs: those that raise the step's expected tokens per second.
//! A decode's drafts run after its last token in the same chunk and cost what the cost model says
//! each extra token costs the step; the j-th draft of a sequence is kept with chance `p^j` (its
//! drafts are kept in order, `speculate::Acceptance` estimates `p`). A draft is worth its place
//! while its chance over its cost is at least `GAIN` times the step's expected tokens over its
//! time. So on an idle machine a stream runs the drafts that will likely be kept, and under load
//! (when a step's tokens, not its fixed cost, make its time) only near-certain ones, or none:
//! speculation follows the batch without a batch-size threshold (vLLM's
//! `speculative_disable_by_batch_size` is set by hand; here the machine's learned costs decide).
//! The step also stays under the step-time target, and no draft runs while an interactive
//! prompt waits for prefill: a newcomer's first token never waits for drafts.

use super::*;
use crate::engine::cost::StepShape;
use crate::kv_cache::Salt;

/// How much more a draft must be worth than its cost: a draft at break-even gains nothing on
/// average but lengthens every stream's step.
pub(crate) const GAIN: f64 = 1.25;

impl Scheduler {
    /// Whether running request `s` decodes in the next step, tenants in `hold` sitting it out.
    pub(super) fn decodes_next(s: &Sequence, hold: &[Salt]) -> bool {
        s.computed > 0
            && s.pending() == 1
            && !s.paused
            && s.kind != SeqKind::Draft
            && !hold.contains(&s.tenant())
    }

    /// An interactive reply has prompt tokens to compute (queued, or admitted and prefilling).
    fn interactive_prefill_pending(&self) -> bool {
        let interactive =
            |s: &Sequence| s.kind == SeqKind::Reply && s.priority == Priority::Interactive;
        self.waiting.iter().any(interactive)
            || (self.running.iter())
                .any(|s| interactive(s) && s.pending() > 1 && s.computed < s.prompt_len)
    }

    /// For a draft source that costs work to ask (a draft model): with each decode's drafts set
    /// to placeholders of the most it may take (`set_drafts`), how many of each this step would
    /// run (`trim_drafts` without holding any tenant back). The placeholders are cleared.
    pub fn drafts_worth_running(&mut self) -> Vec<(RequestId, usize)> {
        self.trim_drafts(&[]);
        let worth = (self.running.iter())
            .filter(|s| !s.drafts.is_empty() && Self::decodes_next(s, &[]))
            .map(|s| (s.id, s.drafts.len()))
            .collect();
        for s in &mut self.running {
            s.drafts.clear();
        }
        worth
    }

    /// Cuts each decode's proposed drafts to those worth running this step (the module doc).
    pub(super) fn trim_drafts(&mut self, hold: &[Salt]) {
        if self.running.iter().all(|s| s.drafts.is_empty()) {
            return;
        }
        if self.interactive_prefill_pending() {
            for s in &mut self.running {
                s.drafts.clear();
            }
            return;
        }
        let decoding: Vec<usize> = (0..self.running.len())
            .filter(|&i| Self::decodes_next(&self.running[i], hold))
            .collect();
        let mut shape = StepShape::default();
        for &i in &decoding {
            shape.add_decode(self.running[i].computed, 1);
            shape.add_logits(1);
        }
        let limit = (self.cfg.itl_target).map(|t| t.as_secs_f64() * PLAN_FRACTION / self.safety());
        let mut cost = self.cost.predict(&shape);
        let mut tokens = decoding.len() as f64;
        let mut keep = vec![0usize; decoding.len()];
        loop {
            // The likeliest next draft of any decode (each decode's are likelier in order).
            let best = (0..decoding.len())
                .filter(|&j| keep[j] < self.running[decoding[j]].drafts.len())
                .map(|j| {
                    (
                        j,
                        self.running[decoding[j]].draft_p.powi(keep[j] as i32 + 1),
                    )
                })
                .max_by(|a, b| a.1.total_cmp(&b.1));
            let Some((j, chance)) = best else {
                break;
            };
            let s = &self.running[decoding[j]];
            let next = shape
                .with_decode(s.computed + 1 + keep[j], 1)
                .with_logits(1);
            let with = self.cost.predict(&next);
            let extra = (with - cost).max(1e-9);
            if chance * cost < GAIN * tokens * extra || limit.is_some_and(|l| with > l) {
                break;
            }
            keep[j] += 1;
            shape = next;
            cost = with;
            tokens += chance;
        }
        // (Drafts of requests that do not decode are dropped by `plan` after the decodes.)
        for (j, &i) in decoding.iter().enumerate() {
            self.running[i].drafts.truncate(keep[j]);
        }
    }
}
