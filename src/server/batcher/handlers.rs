//! The batcher's message handlers: each takes its message into the engine core between steps.

use crate::server::batcher::*;

#[cfg(feature = "fault-injection")]
impl Handler<InjectFault> for Batcher {
    type Result = ();

    fn handle(&mut self, m: InjectFault, _: &mut Context<Self>) {
        self.fault = Some(m.0);
    }
}

impl Handler<Submit> for Batcher {
    type Result = Result<usize, RequestError>;

    fn handle(&mut self, mut m: Submit, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(reason) = &self.failed {
            return Err(RequestError::Internal(format!(
                "{reason}; the server is restarting"
            )));
        }
        if self.drain_deadline.is_some() {
            return Err(RequestError::NotReady("the server is shutting down".into()));
        }
        let n = m.prompt.len();
        if n == 0 {
            return Err(RequestError::InvalidRequest(
                "`messages` render to an empty prompt".into(),
            ));
        }
        if n >= self.max_context {
            return Err(RequestError::PromptTooLong(format!(
                "the prompt is {n} tokens; the context holds {} (prompt plus at least one generated token)",
                self.max_context
            )));
        }
        self.expire_leases();
        if let Some(k) = m.lease {
            // The session is back: its lease no longer expires. Its draft ends, leaving what it
            // computed to the lease this request continues.
            self.lease_expiry.remove(&k);
            self.end_draft(k, "used");
        }
        // A paced reply goes at its reader's pace, which drafts cannot speed up, and a step
        // that kept several drafts could pass its window.
        let mut sampling = m.sampling;
        sampling.speculate &= m.window.is_none();
        let request = Request {
            id: m.request,
            prompt: m.prompt,
            sampling,
            max_tokens: m.max_tokens,
            ignore_eos: m.ignore_eos,
            priority: m.priority,
            scope: m.scope,
            lease: m.lease,
            shift: m.shift,
            logprobs: m.logprobs,
            forks: m.forks.clone(),
            quota: m.quota,
            constraint: m.constraint.take(),
        };
        let position = match self.core.add(request) {
            Ok(p) => p,
            Err(AddError::Overloaded { waiting }) => {
                return Err(RequestError::Overloaded(format!(
                    "the server is at capacity ({waiting} requests waiting); try again shortly"
                )))
            }
            Err(AddError::TenantOverloaded { waiting }) => {
                return Err(RequestError::Overloaded(format!(
                    "your tenant's share of the queue is full ({waiting} requests waiting, its max_waiting); try again shortly"
                )))
            }
            Err(AddError::TooLarge {
                tokens,
                cache_tokens,
            }) => {
                return Err(RequestError::PromptTooLong(format!(
                "the prompt plus max_tokens is {tokens} tokens; the KV cache holds {cache_tokens}"
            )))
            }
        };
        let submitted = Instant::now();
        for id in std::iter::once(m.request).chain(m.forks.iter().map(|f| f.id)) {
            self.active.insert(
                id,
                Active {
                    reply_to: m.reply_to.clone(),
                    prompt_tokens: n,
                    cached_tokens: 0,
                    submitted,
                    scheduled: None,
                    first_token: None,
                    last_token: None,
                    generated: 0,
                    drafted: 0,
                    accepted: 0,
                    ids: Vec::new(),
                    allowed: m.window.filter(|_| id == m.request),
                    position: (id == m.request).then_some(position),
                },
            );
        }
        self.wake(ctx);
        Ok(position)
    }
}

impl Handler<Cancel> for Batcher {
    type Result = ();

    fn handle(&mut self, m: Cancel, ctx: &mut Context<Self>) {
        match m.reason {
            CancelReason::Disconnected => self.remove(m.request),
            CancelReason::Client { keep } => self.finish_at(
                m.request,
                FinishReason::Cancelled,
                keep.unwrap_or(usize::MAX),
            ),
            CancelReason::StopString => self.finish(m.request, FinishReason::Stop),
        }
        // The gauges follow at the next step (at most once a step, however many cancels come).
        self.wake(ctx);
    }
}

impl Handler<Allow> for Batcher {
    type Result = ();

    fn handle(&mut self, m: Allow, ctx: &mut Context<Self>) {
        let Some(a) = self.active.get_mut(&m.request) else {
            return;
        };
        let Some(allowed) = &mut a.allowed else {
            return;
        };
        *allowed = (*allowed).max(m.tokens);
        if a.generated < *allowed {
            self.core.scheduler_mut().set_paused(m.request, false);
            self.wake(ctx);
        }
    }
}

impl Handler<Step> for Batcher {
    type Result = ();

    fn handle(&mut self, _: Step, ctx: &mut Context<Self>) {
        if self.step() {
            ctx.notify(Step);
        } else {
            self.stepping = false;
        }
    }
}

impl Handler<GetStatus> for Batcher {
    type Result = BatcherStatus;

    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> BatcherStatus {
        BatcherStatus {
            running: self.core.scheduler().running_len(),
            waiting: self.core.scheduler().waiting_len(),
            kv_blocks_used: self.core.scheduler().kv().pool().used_count(),
            kv_blocks_total: self.core.scheduler().kv().pool().total(),
            kv_blocks_held: self.core.scheduler().kv().held_distinct(),
        }
    }
}

impl Handler<Shutdown> for Batcher {
    type Result = ();

    fn handle(&mut self, m: Shutdown, ctx: &mut Context<Self>) {
        // Checked at every step (a timer would wait behind a busy step loop).
        self.drain_deadline = Some(Instant::now() + m.deadline);
        self.wake(ctx);
    }
}

impl Handler<EndLease> for Batcher {
    type Result = ();

    fn handle(&mut self, m: EndLease, _: &mut Context<Self>) {
        self.end_draft(m.lease, "ended");
        self.lease_expiry
            .set(m.lease, Instant::now() + self.lease_grace);
        self.expire_leases();
    }
}

impl Handler<Draft> for Batcher {
    type Result = ();

    fn handle(&mut self, m: Draft, ctx: &mut Context<Self>) {
        self.end_draft(m.lease, "replaced");
        let n = m.prompt.len();
        if self.failed.is_some()
            || self.drain_deadline.is_some()
            || n == 0
            || n >= self.max_context
            || self.core.scheduler().waiting_interactive() > 0
        {
            return;
        }
        self.lease_expiry.remove(&m.lease);
        let id = next_request_id();
        let request = Request {
            id,
            prompt: m.prompt,
            sampling: SamplingParams::default(),
            max_tokens: 0,
            ignore_eos: false,
            priority: Priority::Batch,
            scope: m.scope,
            lease: Some(m.lease),
            shift: false,
            logprobs: None,
            forks: Vec::new(),
            quota: m.quota,
            constraint: None,
        };
        // A full queue has no capacity to spare: the draft is simply not prefilled.
        if self.core.add(request).is_ok() {
            self.drafts.insert(m.lease, id);
            self.wake(ctx);
        }
    }
}

impl Handler<Park> for Batcher {
    type Result = ();

    fn handle(&mut self, m: Park, ctx: &mut Context<Self>) {
        self.park_expiry.set(m.request, Instant::now() + m.grace);
        self.expire_parked();
        self.wake(ctx);
    }
}

impl Handler<Resume> for Batcher {
    type Result = Option<Vec<EventKind>>;

    fn handle(&mut self, m: Resume, _: &mut Context<Self>) -> Self::Result {
        self.expire_parked();
        self.lease_expiry.remove(&m.lease);
        let Some(request) = m.request else {
            return Some(Vec::new());
        };
        self.park_expiry.remove(&request);
        if let Some(events) = self.parked_done.remove(&request) {
            return Some(events);
        }
        let a = self.active.get_mut(&request)?;
        if !a.reply_to.is_parked() {
            return None;
        }
        a.reply_to = m.reply_to;
        Some(a.history())
    }
}

impl Handler<PinPrefix> for Batcher {
    type Result = ();

    fn handle(&mut self, m: PinPrefix, ctx: &mut Context<Self>) {
        self.core
            .scheduler_mut()
            .add_pinned(next_request_id(), m.tokens, m.tenant);
        self.wake(ctx);
    }
}
