//! Parking a session whose connection dropped, and a new connection's `resume` taking it over:
//! the reply rebuilt from the token ids the batcher kept, through the same event handler.

use crate::server::ws::session::*;

impl Session {
    /// The connection is gone: unless resuming is off, the registry is full or the server
    /// closed the connection for what the client did, the session waits `resume_grace` for a
    /// new connection with its token, its reply going on meanwhile. True if parked.
    pub(super) fn park(&mut self) -> bool {
        let grace = self.state.session.resume_grace;
        // The Realtime API has no resume: its sessions end with their connection.
        if grace.is_zero()
            || self.realtime.is_some()
            || self.permit.is_none()
            || self.closed_for_policy
            || self.reset_for_not_reading.load(Ordering::SeqCst)
        {
            return false;
        }
        // First: from here the batcher keeps the reply going and sends it nowhere.
        self.parked.store(true, Ordering::SeqCst);
        let reply = self.current.take().map(|c| ParkedReply {
            client_id: c.client_id,
            request: c.reply.request(),
            replace_from: c.replace_from,
            new_messages: c.new_messages,
            stop: c.reply.text().stop_strings().to_vec(),
            window: c.window,
            cancelled_at: c.cancelled_at,
            heard: c.heard,
            calling: c.calling.map(|k| (k.chat, k.made)),
            dropped: c.dropped,
        });
        let request = reply.as_ref().map(|r| r.request);
        // A running reply keeps its place under the connection caps while parked (one client
        // cannot start replies and drop them to run more than its share); an idle session's
        // place comes back at once.
        let mut permit = request.and_then(|_| self.permit.take());
        if let Some(p) = &mut permit {
            p.set_parked(true);
        }
        let now = Instant::now();
        let parked = ParkedSession {
            id: self.id,
            identity: self.identity.clone(),
            conversation: std::mem::take(&mut self.conversation),
            dropped_turns: self.dropped_turns,
            reply,
            last: self.last.take(),
            preparing: self.preparing.take(),
            permit,
            expires: now + grace,
            tool_wait: self.tool_wait.take(),
        };
        if !self.state.parked.park(self.token.clone(), parked, now) {
            tracing::info!(session = %self.id, "too many parked sessions; this one ends");
            self.parked.store(false, Ordering::SeqCst);
            if let Some(request) = request {
                self.ready.batcher.do_send(Cancel {
                    request,
                    reason: CancelReason::Disconnected,
                });
            }
            return false;
        }
        if let Some(request) = request {
            self.ready.batcher.do_send(Park { request, grace });
        }
        true
    }

    /// `resume`: takes over the parked session `token` names (same client identity), and
    /// replays reply `id` after `after_index`: the running reply rebuilt from the batcher's
    /// token ids (the same deltas, with the same indexes), or the last one as it was sent.
    pub(super) fn resume(
        &mut self,
        token: String,
        id: Option<String>,
        after_index: Option<usize>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if self.used {
            let e =
                RequestError::InvalidRequest("`resume` must be a connection's first frame".into());
            return self.error(ctx, None, e);
        }
        self.used = true;
        let failed = || {
            RequestError::ResumeFailed(
                "no session to resume with this token (unknown, expired or already resumed); this connection is a fresh session".into(),
            )
        };
        match self
            .state
            .parked
            .take(&token, &self.identity, Instant::now())
        {
            Found::Parked(p) => self.resume_parked(token, *p, id, after_index, ctx),
            Found::Live(old) => {
                // The old connection parks when told to; one already closing parks on its own
                // in a moment (its mailbox no longer takes the message): look again meanwhile.
                let (state, identity) = (self.state.clone(), self.identity.clone());
                let token2 = token.clone();
                let takeover = async move {
                    let mut live = Some(old);
                    for _ in 0..40 {
                        if let Some(old) = live.take() {
                            let _ = old.send(Takeover).await;
                        }
                        match state.parked.take(&token, &identity, Instant::now()) {
                            Found::Parked(p) => return Some(p),
                            Found::Live(old) => live = Some(old),
                            Found::Nothing => {}
                        }
                        actix_web::rt::time::sleep(std::time::Duration::from_millis(25)).await;
                    }
                    None
                };
                takeover
                    .into_actor(self)
                    .map(move |found, act, ctx| match found {
                        Some(p) => act.resume_parked(token2, *p, id, after_index, ctx),
                        None => act.resume_failed(ctx, failed()),
                    })
                    .wait(ctx);
            }
            Found::Nothing => self.resume_failed(ctx, failed()),
        }
    }

    /// A connection let in past the caps that did not resume: it ends, asked to come back
    /// later (1013).
    pub(super) fn refuse_ticket(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        let e = RequestError::Overloaded(
            "this connection was let in past the connection caps only to resume a session of this address (`resume` first); its caps are full: try again shortly".into(),
        );
        self.send(ctx, &ServerFrame::error(None, &e));
        self.state.metrics.error("connection_limit");
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Again,
            description: Some("connection caps full".into()),
        }));
        ctx.stop();
    }

    /// A place under the caps for a connection let in on a ticket whose resume brought none:
    /// false (and the connection ends) when the caps are still full.
    pub(super) fn claim_place(&mut self, ctx: &mut ws::WebsocketContext<Self>) -> bool {
        let Some(ticket) = &self.ticket else {
            return true;
        };
        match self
            .state
            .admission
            .admit(ticket.address(), &self.identity.tenant)
        {
            Ok(p) => {
                self.permit = Some(p);
                self.ticket = None;
                true
            }
            Err(_) => {
                self.refuse_ticket(ctx);
                false
            }
        }
    }

    /// A resume that finds nothing: the connection goes on as a fresh session, if it has a
    /// place for one.
    pub(super) fn resume_failed(&mut self, ctx: &mut ws::WebsocketContext<Self>, e: RequestError) {
        self.error(ctx, None, e);
        self.claim_place(ctx);
    }

    /// Carries on a parked session on this connection.
    pub(super) fn resume_parked(
        &mut self,
        token: String,
        mut p: ParkedSession,
        id: Option<String>,
        after_index: Option<usize>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        tracing::debug!(session = %p.id, "session resumed");
        // The parked place comes back to a connection: this one's, if it came in on a ticket.
        if let Some(mut permit) = p.permit.take() {
            permit.set_parked(false);
            if self.permit.is_none() {
                self.permit = Some(permit);
                self.ticket = None;
            }
        }
        if !self.claim_place(ctx) {
            // The session stays parked for another try while its grace lasts.
            self.state.parked.park(token, p, Instant::now());
            return;
        }
        self.id = p.id;
        self.conversation = p.conversation;
        self.dropped_turns = p.dropped_turns;
        self.last = p.last;
        // A call still waiting: its timeout runs on this connection.
        if let Some(w) = p.tool_wait {
            let left = w.deadline.saturating_duration_since(Instant::now());
            self.time_out_call(w.call_id.clone(), left, ctx);
            self.turn_calls = w.made;
            self.tool_wait = Some(w);
        }
        let reply = p.reply;
        let preparing = p.preparing;
        let resume = Resume {
            request: reply.as_ref().map(|r| r.request),
            lease: self.lease_key(),
            reply_to: self.reply_to(ctx),
        };
        self.ready
            .batcher
            .send(resume)
            .into_actor(self)
            .map(move |events, act, ctx| {
                act.send_ready(ctx, true);
                let events = events.ok().flatten();
                match (reply, events) {
                    (Some(r), Some(events)) => act.replay(r, events, id, after_index, ctx),
                    (Some(r), None) => {
                        let e = RequestError::ResumeFailed(
                            "the reply ended while the connection was down and was not kept".into(),
                        );
                        act.error(ctx, Some(r.client_id), e)
                    }
                    (None, _) if preparing.is_some() => {
                        // The turn had not reached the batcher: it starts now.
                        if let Some((chat, replace_from)) = preparing {
                            act.start_chat(chat, replace_from, ctx);
                        }
                    }
                    (None, _) => {
                        if !act.replay_last(id.as_deref(), after_index, ctx) {
                            if let Some(id) = id {
                                let e = RequestError::ResumeFailed(format!(
                                    "request `{id}` was not running when the connection dropped; send it again"
                                ));
                                act.error(ctx, Some(id), e);
                            }
                        }
                    }
                }
            })
            .wait(ctx);
    }

    /// Rebuilds a parked reply from its events so far, sending what the client has not seen.
    pub(super) fn replay(
        &mut self,
        r: ParkedReply,
        events: Vec<EventKind>,
        id: Option<String>,
        after_index: Option<usize>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let mut c = Current::new(
            r.client_id,
            r.request,
            r.replace_from,
            r.new_messages,
            r.stop,
        )
        .paced(r.window);
        c.dropped = r.dropped;
        if let Some((chat, made)) = &r.calling {
            c.calling = current::Calling::new(chat, *made);
            self.turn_calls = *made;
        }
        c.skip = if id.as_deref() == Some(c.client_id.as_str()) {
            after_index
        } else {
            None
        };
        let request = c.reply.request();
        self.current = Some(c);
        // Where the client's cancel stopped the reply, the replay stops too, as the old session
        // did: checked before every event, so that an end right after the cancel point sees it.
        let mut tokens = 0;
        let stop_at_cancel = |tokens: usize, current: &mut Option<Current>| {
            if let (Some(n), Some(c)) = (r.cancelled_at, current) {
                if tokens >= n && !c.reply.ending() {
                    c.reply.end();
                    c.heard = r.heard;
                    c.cancelled_at = Some(n);
                }
            }
        };
        for kind in events {
            stop_at_cancel(tokens, &mut self.current);
            if matches!(kind, EventKind::Token { .. }) {
                tokens += 1;
            }
            self.on_event(request, kind, ctx);
        }
        stop_at_cancel(tokens, &mut self.current);
    }

    /// Resends the end of the last reply (after `after_index`) when `id` names it; false when
    /// it does not.
    pub(super) fn replay_last(
        &mut self,
        id: Option<&str>,
        after_index: Option<usize>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) -> bool {
        let Some(last) = self.last.clone() else {
            return false;
        };
        if id != Some(last.client_id.as_str()) {
            return false;
        }
        if after_index.is_none() {
            if let Some(f) = &last.started {
                self.send(ctx, f);
            }
        }
        for (index, text) in last.deltas.into_iter().enumerate() {
            if after_index.is_none_or(|a| index > a) {
                let f = ServerFrame::Delta {
                    id: last.client_id.clone(),
                    index,
                    text,
                };
                self.send(ctx, &f);
            }
        }
        self.send(ctx, &last.end);
        true
    }
}
