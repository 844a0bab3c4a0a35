//! Admission: running prefills with a step's budget or less left go first, then short prompts
//! before long ones (vLLM's `long_prefill_token_threshold` idea), each admitted request's cached
//! prefix looked up once.

use super::*;

impl Scheduler {
    /// Next chunks of running requests of `priority` that are still prefilling with `which`
    /// remainder, in admission order. The short ones (a step's token budget or less: chat turns
    /// cut to the time target when they were admitted) go first, each step, before the next
    /// short prompt is admitted and before the long prefills' chunks: ordered by admission
    /// alone, a turn admitted cut beside a long prefill waited out that whole prefill, whose
    /// chunk, cut to the target, ends each step's prefill work.
    pub(super) fn schedule_running_prefills(
        &mut self,
        decoding: &[RequestId],
        priority: Priority,
        which: Remainder,
        b: &mut StepBudget,
        out: &mut Scheduled,
    ) {
        let budget = self.cfg.step_tokens;
        let mut prefilling: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                // (A paused reply runs nothing, not even the recomputation of its tokens.)
                r.priority == priority
                    && r.pending() > 0
                    && r.long_prefill(budget) == (which == Remainder::Long)
                    && !r.paused
                    && !decoding.contains(&r.id)
                    && !b.hold.contains(&r.tenant())
            })
            .collect();
        prefilling.sort_by_key(|&i| self.running[i].admitted);
        for i in prefilling {
            let r = &self.running[i];
            let n = self.chunk_len(b, r);
            if n == 0 || !push_chunk(&mut self.kv, &mut self.running[i], n, b, out) {
                break;
            }
        }
    }

    /// Admits queued requests of `priority` (`next_to_admit` picks each) while the budget and
    /// the running cap allow: each starts from the blocks the manager finds computed, then runs
    /// its first chunk.
    pub(super) fn admit(&mut self, priority: Priority, b: &mut StepBudget, out: &mut Scheduled) {
        while b.tokens > 0 && !b.full {
            if self.running.len() >= self.cfg.max_running
                && !self.unseat_paused(priority, &b.hold, out)
            {
                break;
            }
            let Some(i) = self.next_to_admit(priority, &b.hold) else {
                break;
            };
            if !self.admit_at(i, b, out) {
                break;
            }
        }
    }

    /// A chat turn is not kept waiting behind someone's long prompt: while a running request of
    /// `priority` has more than a step's token budget of prompt left to prefill, queued requests
    /// whose whole prompt fits the budget (in the usual order, passing long prompts queued ahead
    /// of them) go into the step before that prefill's chunk. The first goes whole (it is not cut
    /// to the time target, `chunk_len`); more follow while the target leaves room, the last one
    /// possibly cut (its rest goes first next step, `schedule_running_prefills`), so turns that
    /// arrive together (streams that started together end together) all start within a step or
    /// two instead of one a step. The long prefill takes what the step has left. (vLLM's
    /// `long_prefill_token_threshold` lets shorter prompts jump ahead of longer ones the same
    /// way.)
    pub(super) fn admit_short_before_long(
        &mut self,
        priority: Priority,
        b: &mut StepBudget,
        out: &mut Scheduled,
    ) {
        let budget = self.cfg.step_tokens;
        let long_running = self.running.iter().any(|r| {
            r.priority == priority
                && !r.paused
                && r.kind != SeqKind::Draft
                && r.long_prefill(budget)
        });
        if !long_running {
            return;
        }
        self.estimate_cached();
        while b.tokens > 0 && !b.full && self.running.len() < self.cfg.max_running {
            // The next short one in the usual order: a long prompt queued ahead does not hold it.
            // Short by what it needs to prefill: a turn after a long cached prompt (a widget's
            // system prompt, the conversation so far) is short.
            let room = budget.min(b.tokens);
            let short = |s: &Sequence| {
                !s.started
                    && s.kind != SeqKind::Draft
                    && s.tokens.len() - s.cached_estimate.unwrap_or(0) <= room
            };
            let Some(i) = self.next_to_admit_of(priority, &b.hold, short) else {
                return;
            };
            if !self.admit_at(i, b, out) {
                return;
            }
        }
    }

    /// Admits waiting request `i` with its first chunk; false (it stays queued, first in line)
    /// if the step has no room for it.
    pub(super) fn admit_at(&mut self, i: usize, b: &mut StepBudget, out: &mut Scheduled) -> bool {
        let mut s = self.waiting.remove(i).expect("index from position");
        if s.blocks.is_empty() {
            let c = self
                .kv
                .computed_blocks(&s.tokens, *s.blocks.scope(), s.lease.take(), s.shift);
            s.blocks = c.blocks;
            s.computed = c.tokens;
            if !s.started {
                self.prefix.queried += s.tokens.len() as u64;
                self.prefix.hits += c.tokens as u64;
                s.cached_tokens = c.tokens;
            }
        }
        let n = self.chunk_len(b, &s);
        if n == 0 {
            // No room left in this step: it keeps the blocks it found (its lease was handed
            // over to it) and goes first next step.
            self.waiting.insert(i, s);
            return false;
        }
        if push_chunk(&mut self.kv, &mut s, n, b, out) {
            s.admitted = self.next_admission;
            self.next_admission += 1;
            self.running.push(s);
            true
        } else {
            // Give the computed blocks back until there is room.
            self.kv.free(s.blocks.take());
            s.computed = 0;
            self.waiting.insert(i, s);
            false
        }
    }
}
