//! Between tenants: max-min fair admission (`next_to_admit`), a newcomer tenant taking a slot
//! from the one with the most (`preempt_for_fairness`), over-share tenants sitting out the step
//! that runs a newcomer's first chunk (`tenants_to_hold`), paused replies giving up their slot.

use super::*;
use crate::kv_cache::Salt;

impl Scheduler {
    /// Running requests per tenant and per (tenant, principal).
    #[allow(clippy::type_complexity)]
    pub(super) fn running_counts(
        &self,
    ) -> (
        std::collections::HashMap<Salt, usize>,
        std::collections::HashMap<(Salt, Salt), usize>,
    ) {
        let mut tenants: std::collections::HashMap<Salt, usize> = Default::default();
        let mut principals: std::collections::HashMap<(Salt, Salt), usize> = Default::default();
        for r in &self.running {
            *tenants.entry(r.tenant()).or_default() += 1;
            *principals.entry((r.tenant(), r.principal())).or_default() += 1;
        }
        (tenants, principals)
    }

    /// The queued request of `priority` to admit next. Tenants take turns: the request whose
    /// tenant has the fewest running requests, then whose principal has the fewest, then one
    /// that had started (preempted, or a choice forked without room), then the earliest queued
    /// (max-min fairness over running slots, so one tenant's flood cannot keep another's
    /// requests waiting). A tenant at its `max_running` waits, and so does a tenant `hold`s.
    pub(super) fn next_to_admit(&self, priority: Priority, hold: &[Salt]) -> Option<usize> {
        self.next_to_admit_of(priority, hold, |_| true)
    }

    /// `next_to_admit` among the queued requests `eligible` accepts.
    pub(super) fn next_to_admit_of(
        &self,
        priority: Priority,
        hold: &[Salt],
        eligible: impl Fn(&Sequence) -> bool,
    ) -> Option<usize> {
        let (tenants, principals) = self.running_counts();
        let running = |s: &Sequence| tenants.get(&s.tenant()).copied().unwrap_or(0);
        (self.waiting.iter().enumerate())
            .filter(|(_, s)| {
                eligible(s)
                    && s.priority == priority
                    && !s.paused
                    && !hold.contains(&s.tenant())
                    && s.quota.max_running.is_none_or(|m| running(s) < m)
            })
            .min_by_key(|&(i, s)| {
                let p = principals.get(&(s.tenant(), s.principal())).copied();
                (running(s), p.unwrap_or(0), !s.started, i)
            })
            .map(|(i, _)| i)
    }

    /// With every running slot taken and a request of `priority` waiting, a paused reply (a
    /// paced stream at its window) gives up its slot: it goes back to the queue, admitted again
    /// once acked, so clients that stop acking cannot hold the running set. False if none.
    pub(super) fn unseat_paused(
        &mut self,
        priority: Priority,
        hold: &[Salt],
        out: &mut Scheduled,
    ) -> bool {
        if self.next_to_admit(priority, hold).is_none() {
            return false;
        }
        let Some(i) = (0..self.running.len())
            .filter(|&i| self.running[i].paused)
            .max_by_key(|&i| self.running[i].admitted)
        else {
            return false;
        };
        out.preempted.push(self.preempt(i));
        true
    }

    /// With every running slot taken, an interactive request queued by a tenant that has
    /// nothing running takes a slot from the tenant with the most running (at least two): that
    /// tenant's latest admission goes back to the queue (to recompute, as on a KV shortage; with
    /// prefix caching its full blocks stay cached). Without this a tenant's flood of long replies
    /// would hold every slot until its replies end, however fairly the queue is served.
    pub(super) fn preempt_for_fairness(&mut self, out: &mut Scheduled) {
        if self.running.len() < self.cfg.max_running {
            return;
        }
        let (tenants, _) = self.running_counts();
        let starved = self.waiting.iter().any(|s| {
            s.priority == Priority::Interactive
                && s.kind != SeqKind::Pin
                && !tenants.contains_key(&s.tenant())
                && s.quota.max_running != Some(0)
        });
        if !starved {
            return;
        }
        let Some((&victim, &n)) = tenants.iter().max_by_key(|&(t, n)| (*n, t.0)) else {
            return;
        };
        if n < 2 {
            return;
        }
        let Some(i) = (0..self.running.len())
            .filter(|&i| self.running[i].tenant() == victim && self.running[i].kind != SeqKind::Pin)
            .max_by_key(|&i| self.running[i].admitted)
        else {
            return;
        };
        let id = self.preempt(i);
        out.preempted.push(id);
    }

    /// The tenants whose work waits a step so that another tenant's request goes first alone
    /// (none, most steps). When the next request to admit is an interactive one of a tenant with
    /// nothing running, its prompt fits the step, and tenants run more than their share of the
    /// running slots (`max_running` over the tenants with work, and at least two), those
    /// tenants' decodes, prefills and admissions sit this step out: the new request's first
    /// token then costs one step of its own instead of one carrying a flood's decodes, which
    /// turns alone cannot give (the flood's step is the wait). At most every other step holds,
    /// so a stream of such requests can at most halve an over-share tenant's rate; a tenant
    /// within its share is never held, and with one tenant nothing is.
    pub(super) fn tenants_to_hold(&mut self) -> Vec<Salt> {
        // (Most steps: nothing waits, or nothing runs to hold; this runs every step.)
        if std::mem::take(&mut self.held_last)
            || self.waiting.is_empty()
            || self.running.is_empty()
            || self.running.len() >= self.cfg.max_running
        {
            return Vec::new();
        }
        let Some(i) = self.next_to_admit(Priority::Interactive, &[]) else {
            return Vec::new();
        };
        let (tenants, _) = self.running_counts();
        let next = &self.waiting[i];
        if next.started
            || next.kind != SeqKind::Reply
            || tenants.contains_key(&next.tenant())
            || next.tokens.len() > self.cfg.step_tokens
        {
            return Vec::new();
        }
        let mut active: Vec<Salt> = tenants.keys().copied().collect();
        for w in &self.waiting {
            if w.priority == Priority::Interactive && w.kind == SeqKind::Reply {
                active.push(w.tenant());
            }
        }
        active.sort_by_key(|t| t.0);
        active.dedup();
        let share = self.cfg.max_running / active.len().max(1);
        let hold: Vec<Salt> = (tenants.iter())
            .filter(|&(_, &n)| n >= 2 && n > share)
            .map(|(&t, _)| t)
            .collect();
        if !hold.is_empty() {
            self.held_last = true;
            self.holds += 1;
        }
        hold
    }
}
