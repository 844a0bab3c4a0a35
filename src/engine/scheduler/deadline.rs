//! First-token deadlines: a reply whose prompt fits a step (a chat turn) should see its first
//! token within `SchedulerConfig::ttft_target` of arriving. The step-time target alone spreads a
//! burst of turns over many steps (each step takes what the decodes leave: one or two turns), so
//! the last of sixteen visitors arriving together waits well past it.
//!
//! Before a step's prefills are chosen, the plan simulates the queue's first tokens over the
//! learned cost model (`turns_now`): this step takes the first `k` waiting turns, every later
//! step what the step-time target leaves (at least one turn, as the first new request of a step
//! goes whole). It picks the smallest `k` with the most turns meeting their deadline and raises
//! the step's time limit, and its token budget up to twice `step_tokens`, to fit them. Only a
//! deadline at risk stretches a step: earlier first tokens on average are not worth a stream's
//! gap or a long prompt's share (measured: docs/performance.md, "First-token deadlines").
//! A turn that can no longer meet its deadline does not count: its first token is late whatever
//! this step does, so the step is not stretched for it (it keeps its place in the queue). This
//! is the goodput objective that DistServe and Sarathi-Serve state for TTFT and TPOT targets,
//! planned greedily one step at a time.
//!
//! The streams give the room, within their own targets: each decoding stream keeps a pace, its
//! token `n + 1` due at arrival + `ttft_target` + `n * itl_target`, and a step never runs past the
//! earliest due one. A stream that started early is ahead of its pace and can lend a step; one
//! behind it (it waited itself) keeps the step at the step-time target. Prompts longer than a
//! step keep the product rule (they take what the streams leave): they have no deadline here, and
//! their chunks stay within the unstretched target; batch-priority requests have no deadline
//! either.

use super::*;

/// Turns the plan looks ahead at (the queue beyond them is past any deadline this step can help).
const HORIZON: usize = 64;

/// A waiting turn as the plan sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Turn {
    /// Its prefill's predicted seconds (what it adds to a step).
    pub cost: f64,
    /// Its prefill's tokens.
    pub tokens: usize,
    /// Predicted seconds from the step's start to its first token's deadline.
    pub deadline: f64,
}

/// What a later step can take: `time` predicted seconds and `tokens` tokens of prefill beside
/// the decodes (at least one turn whatever its size).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Room {
    pub time: f64,
    pub tokens: usize,
}

/// How many of `turns` (in the order they are admitted) this step should take, at least
/// `default` (what it takes without deadlines) and at most `max` (what the streams' room
/// holds): the smallest count with the fewest turns missing their deadline. Each step, this one
/// and the later ones, takes `decode` seconds for its decodes plus its turns' costs; later steps
/// take turns in order while `later` has room, at least one. A turn that would miss its deadline
/// even taken now (with every turn before it) is not counted as a miss. Pure: the scheduler's
/// cost model and clock give the numbers.
pub(super) fn turns_now(
    turns: &[Turn],
    default: usize,
    max: usize,
    decode: f64,
    later: Room,
) -> usize {
    let n = turns.len();
    let default = default.min(n);
    let mut before = 0.0;
    let reachable: Vec<bool> = turns
        .iter()
        .map(|t| {
            before += t.cost;
            decode + before <= t.deadline
        })
        .collect();
    // For `k` turns now: the turns missing a deadline they could meet.
    let missed = |k: usize| {
        let mut t = decode + turns[..k].iter().map(|t| t.cost).sum::<f64>();
        let mut count = (0..k)
            .filter(|&j| reachable[j] && t > turns[j].deadline)
            .count();
        let mut i = k;
        while i < n {
            let (first, mut time, mut tokens) = (i, 0.0, 0);
            while i < n
                && (i == first
                    || (time + turns[i].cost <= later.time
                        && tokens + turns[i].tokens <= later.tokens))
            {
                time += turns[i].cost;
                tokens += turns[i].tokens;
                i += 1;
            }
            t += decode + time;
            count += (first..i)
                .filter(|&j| reachable[j] && t > turns[j].deadline)
                .count();
        }
        count
    };
    let mut best = (missed(default), default);
    for k in default + 1..=n.min(max) {
        if best.0 == 0 {
            break;
        }
        let m = missed(k);
        if m < best.0 {
            best = (m, k);
        }
    }
    best.1
}

impl Scheduler {
    /// Raises the step's time limit and token budget (`b`, already holding `decoding`'s
    /// decodes) so that the queued turns `turns_now` picks fit in it, within the streams' pace.
    /// Returns whether it did.
    pub(super) fn plan_first_tokens(&mut self, decoding: &[RequestId], b: &mut StepBudget) -> bool {
        let (Some(ttft), Some(itl), Some(limit)) =
            (self.cfg.ttft_target, self.cfg.itl_target, b.limit)
        else {
            return false;
        };
        let now = self.now();
        let safety = self.safety();
        // Seconds of real time to the cost model's seconds (`safety()`: steps run over their
        // prediction by up to this).
        let predicted = |at: std::time::Instant, fraction: f64| {
            let secs = at.saturating_duration_since(now).as_secs_f64();
            let late = now.saturating_duration_since(at).as_secs_f64();
            (secs - late) * fraction / safety
        };
        // The streams' room: the earliest due token among this step's decodes, and never
        // more than a first token's own target.
        let mut room = predicted(now + ttft, PLAN_FRACTION);
        for s in self.running.iter().filter(|s| decoding.contains(&s.id)) {
            let due = s.arrived + ttft + itl * s.generated() as u32;
            room = room.min(predicted(due, 1.0));
        }
        if room <= limit {
            return false;
        }
        let turns = self.waiting_turns(b);
        if turns.is_empty() {
            return false;
        }
        let decode = self.cost.predict(&b.shape);
        let mut shape = b.shape;
        let mut list = Vec::with_capacity(turns.len());
        let (mut default, mut max) = (None, None);
        let mut tokens = 0;
        let max_tokens = b.tokens + self.cfg.step_tokens;
        for &(start, n, arrived) in &turns {
            let before = self.cost.predict(&shape);
            shape.add_run(start, n);
            shape.add_logits(1);
            let after = self.cost.predict(&shape);
            tokens += n;
            if default.is_none() && (after > limit || tokens > b.tokens) {
                // The step as planned without deadlines: the first turn goes whole, the rest
                // while the limit holds.
                default = Some(list.len().max(1));
            }
            if max.is_none() && (after > room || tokens > max_tokens) {
                max = Some(list.len());
            }
            list.push(Turn {
                cost: after - before,
                tokens: n,
                deadline: predicted(arrived + ttft, PLAN_FRACTION),
            });
        }
        let default = default.unwrap_or(list.len());
        let max = max.unwrap_or(list.len());
        let later = Room {
            time: (limit - decode).max(0.0),
            tokens: self.cfg.step_tokens.saturating_sub(decoding.len()),
        };
        let k = turns_now(&list, default, max, decode, later);
        if k <= default {
            return false;
        }
        let need: f64 = decode + list[..k].iter().map(|t| t.cost).sum::<f64>();
        let need_tokens: usize = list[..k].iter().map(|t| t.tokens).sum();
        b.unstretched = Some(limit);
        b.limit = Some(need.max(limit));
        b.tokens = b.tokens.max(need_tokens);
        true
    }

    /// The replies waiting for their first token whose prefill fits a step, in the order the
    /// step would take them (running prefills, then the queue's interactive requests), at most
    /// `HORIZON`: each one's (start position, tokens to prefill, arrival). The queue's cached
    /// prefix is estimated (`KvManager::cached_len`, full blocks only) and kept until it
    /// shows the request short.
    fn waiting_turns(&mut self, b: &StepBudget) -> Vec<(usize, usize, std::time::Instant)> {
        let budget = self.cfg.step_tokens;
        let waits = |s: &Sequence| {
            s.kind == SeqKind::Reply
                && s.priority == Priority::Interactive
                && s.generated() == 0
                && !s.paused
                && !b.hold.contains(&s.tenant())
        };
        let mut running: Vec<&Sequence> = (self.running.iter())
            .filter(|s| waits(s) && s.computed > 0 && s.pending() > 0 && s.pending() <= budget)
            .collect();
        running.sort_by_key(|s| s.admitted);
        let mut out: Vec<_> = running
            .iter()
            .map(|s| (s.computed, s.pending(), s.arrived))
            .collect();
        self.estimate_cached();
        for s in self.waiting.iter().filter(|s| waits(s)) {
            if out.len() >= HORIZON {
                break;
            }
            let cached = s.cached_estimate.unwrap_or(0);
            let n = s.tokens.len() - cached;
            if n <= budget {
                out.push((cached, n, s.arrived));
            }
        }
        out.truncate(HORIZON);
        out
    }

    /// Sets `cached_estimate` of the first `HORIZON` queued replies yet to start: the prompt
    /// tokens the prefix cache holds in each one's own partition (`KvManager::cached_len`,
    /// full blocks only; the blocks it holds if it was tried before). An estimate that shows
    /// the request short is kept; a long one is looked at again (the prefix it needs may be
    /// cached since, a pinned prompt being computed).
    pub(super) fn estimate_cached(&mut self) {
        let budget = self.cfg.step_tokens;
        let waiting = (self.waiting.iter_mut())
            .filter(|s| s.kind == SeqKind::Reply && !s.started)
            .take(HORIZON);
        for s in waiting {
            if s.cached_estimate
                .is_some_and(|c| s.tokens.len() - c <= budget)
            {
                continue;
            }
            s.cached_estimate = Some(if s.blocks.is_empty() {
                self.kv.cached_len(&s.tokens, s.blocks.scope())
            } else {
                s.computed
            });
        }
    }
}
