//! A client frame carried out (`on_text`: what `ws::dispatch::handle` decided) and the turns it
//! starts: a turn is validated by the request seam, its prompt built on the blocking pool, then
//! submitted; a draft is prefilled the same way.

use crate::engine::constraint::ResponseFormat;
use crate::server::ws::session::*;

impl Session {
    /// A text frame: the native dialect's dispatch (`ws::dispatch::handle`, pure) decides, this
    /// carries it out.
    pub(super) fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        if self.realtime.is_some() {
            return self.on_realtime(text, ctx);
        }
        let frame = match dispatch::parse(text) {
            Ok(f) => f,
            Err(e) => return self.error(ctx, None, e),
        };
        if !matches!(frame, ClientFrame::Resume { .. }) {
            self.used = true;
            if self.ticket.is_some() {
                return self.refuse_ticket(ctx);
            }
        }
        let (sealer, identity) = (&self.state.sealer, &self.identity);
        let seal_verifies =
            |content: &str, seal: &str| sealer.verify(&identity.seal_scope(), content, seal);
        let view = dispatch::View {
            limits: &self.state.session.limits,
            roles: self.identity.roles,
            seal_verifies: &seal_verifies,
            conversation: &self.conversation,
            running: self.running(),
            last_reply: self.last.as_ref().map(|l| l.client_id.as_str()),
            preparing: self.preparing.is_some(),
            tool_call: self.tool_wait.as_ref().map(|w| w.call_id.as_str()),
            dropped_turns: self.dropped_turns,
        };
        let action = match dispatch::handle(frame, &view) {
            Ok(a) => a,
            Err(r) => return self.error(ctx, r.id, r.error),
        };
        match action {
            Action::Resume {
                token,
                id,
                after_index,
            } => self.resume(token, id, after_index, ctx),
            Action::Draft(text) => self.start_draft(text, ctx),
            Action::DraftLater(text) => self.pending_draft = Some(text),
            Action::Ack(index) => {
                if let Some(c) = &mut self.current {
                    // Acks may come out of order: the furthest one counts.
                    c.acked = c.acked.max(Some(index));
                }
                self.allow_more();
            }
            Action::Turn {
                id,
                messages,
                params,
                replace_from,
                ends_draft,
            } => {
                if ends_draft {
                    self.pending_draft = None;
                }
                self.turn_calls = 0;
                self.validated_turn(id, messages, *params, None, replace_from, ctx);
            }
            Action::Cancel { heard } => {
                if let Some(cancel) = self.current.as_mut().and_then(|c| c.cancel(heard)) {
                    self.ready.batcher.do_send(cancel);
                }
                if self.current.is_none() {
                    self.cancel_call(ctx);
                }
            }
            Action::ToolResult(content) => {
                if let Some(call_id) = self.tool_wait.as_ref().map(|w| w.call_id.clone()) {
                    self.tool_answered(&call_id, content, ctx);
                }
            }
            Action::Restore(messages) => {
                tracing::info!(session = %self.id, conversation = ?self.conversation_id, messages = messages.len(), "conversation restored");
                let n = messages.len();
                self.conversation = messages;
                self.dropped_turns = 0;
                self.pending_draft = None;
                self.send(ctx, &ServerFrame::Restored { messages: n });
            }
            Action::Reset => {
                self.conversation.clear();
                self.dropped_turns = 0;
                self.pending_draft = None;
                self.ready.batcher.do_send(EndLease {
                    lease: self.lease_key(),
                });
            }
            Action::Nothing => {}
        }
    }

    /// Prefills the conversation plus `text` (the user's next message so far) into the
    /// session's lease, with capacity running replies leave (`batcher::Draft`). Empty text, or
    /// a client that may not send user messages, prefills nothing.
    pub(super) fn start_draft(&mut self, text: String, ctx: &mut ws::WebsocketContext<Self>) {
        if text.trim().is_empty() || !self.identity.roles.allows("user") {
            return;
        }
        let (ready, state, identity, id) = (
            self.ready.clone(),
            self.state.clone(),
            self.identity.clone(),
            self.id,
        );
        let history = self.conversation.clone();
        // Like a chat's prompt, built on the blocking pool; `wait` keeps the session's frames in
        // order, so a `chat` right after reaches the batcher after the draft it ends.
        actix_web::rt::task::spawn_blocking(move || {
            crate::server::request::prompt::draft_prompt(
                &ready,
                &state.tenants,
                &identity,
                &id,
                &history,
                &text,
            )
        })
        .into_actor(self)
        .map(|res, act, _| {
            // Too long for the context, or not renderable: the chat will say so, not the draft.
            if let Ok(Ok(prompt)) = res {
                act.ready.batcher.do_send(Draft {
                    prompt: prompt.ids,
                    scope: prompt.scope,
                    lease: act.lease_key(),
                    quota: act.identity.quota,
                });
            }
        })
        .wait(ctx);
    }

    /// The reply in flight: the one generating, or one waiting for its call's result.
    fn running(&self) -> Option<dispatch::Running<'_>> {
        let generating = self.current.as_ref().map(|c| dispatch::Running {
            id: &c.client_id,
            deltas: c.delta_ends.len(),
            paced: c.window.is_some(),
        });
        generating.or(self.tool_wait.as_ref().map(|w| dispatch::Running {
            id: &w.client_id,
            deltas: 0,
            paced: false,
        }))
    }

    /// Validates a turn's messages and parameters and starts it, offering it `tools`: its reply
    /// replaces the conversation from `replace_from` on.
    pub(super) fn validated_turn(
        &mut self,
        id: String,
        messages: Vec<Message>,
        params: crate::server::request::GenerateParams,
        tools: Option<std::sync::Arc<crate::server::request::tools::Tools>>,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let cfg = &self.state.session;
        match cfg.limits.validate(
            id.clone(),
            messages,
            params,
            &cfg.sampling,
            cfg.default_max_tokens,
        ) {
            Ok(mut chat) => {
                if let Some(t) = tools {
                    t.apply(&mut chat);
                }
                // A widget's functions (described in its operator text) may be called, unless
                // the client asked for another format.
                if let Some(t) = &self.identity.tools {
                    if chat.format == ResponseFormat::Text && self.realtime.is_none() {
                        t.constrain(&mut chat);
                    }
                }
                self.start_chat(chat, replace_from, ctx)
            }
            Err(e) => self.error(ctx, Some(id), e),
        }
    }

    pub(super) fn start_chat(
        &mut self,
        chat: ValidRequest,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if let Some(r) = self.running() {
            let busy = RequestError::Busy(r.id.to_string());
            return self.error(ctx, Some(chat.id), busy);
        }
        let mut chat = chat;
        if let Err(e) = chat.partition(self.identity.kind == ClientKind::ApiKey, None) {
            return self.error(ctx, Some(chat.id), e);
        }
        // Rendering and tokenizing take milliseconds for a long message: on the blocking pool,
        // not on the I/O thread that serves other sockets. `wait` holds this session's next
        // frames until the request is submitted, so they keep their order.
        let (ready, state, identity, id) = (
            self.ready.clone(),
            self.state.clone(),
            self.identity.clone(),
            self.id,
        );
        let (history, request) = (self.conversation[..replace_from].to_vec(), chat.clone());
        // Until it is submitted, a parked session keeps it to start on resume.
        self.preparing = Some((chat.clone(), replace_from));
        actix_web::rt::task::spawn_blocking(move || {
            chat_prompt(&ready, &state.tenants, &identity, &id, &history, &request)
        })
        .into_actor(self)
        .map(move |res, act, ctx| {
            act.preparing = None;
            let res = res
                .unwrap_or_else(|e| Err(RequestError::Internal(format!("tokenizing failed: {e}"))));
            match res {
                Ok(prompt) => act.submit_chat(chat, prompt, replace_from, ctx),
                Err(e) => act.error(ctx, Some(chat.id), e),
            }
        })
        .wait(ctx);
    }

    /// Submits a chat whose prompt is built.
    pub(super) fn submit_chat(
        &mut self,
        chat: ValidRequest,
        prompt: crate::server::request::Prompt,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let request = next_request_id();
        self.last = None;
        let dropped = prompt.dropped;
        let submit = Submit {
            lease: Some(self.lease_key()),
            ..Submit::new(
                request,
                &chat,
                prompt,
                self.identity.quota,
                self.reply_to(ctx),
            )
        };
        let mut current = Current::new(
            chat.id.clone(),
            request,
            replace_from,
            chat.messages.clone(),
            chat.stop.clone(),
        )
        .paced(chat.window);
        current.dropped = dropped;
        // The Realtime dialect splits calls out of the text itself.
        if self.realtime.is_none() {
            current.calling = current::Calling::new(&chat, self.turn_calls);
        }
        self.current = Some(current);
        let id = chat.id;
        self.ready
            .batcher
            .send(submit)
            .into_actor(self)
            .map(move |res, act, ctx| {
                let res = res.unwrap_or_else(|e| {
                    Err(RequestError::Internal(format!("the batcher is gone: {e}")))
                });
                match res {
                    Ok(position) => {
                        // Only while it has not started yet: `started` may already have arrived.
                        if act.current.as_ref().is_some_and(|c| {
                            c.reply.request() == request && c.delta_ends.is_empty()
                        }) {
                            act.send(
                                ctx,
                                &ServerFrame::Queued {
                                    id,
                                    position,
                                    eta_ms: None,
                                },
                            );
                        }
                    }
                    Err(e) => {
                        if act
                            .current
                            .as_ref()
                            .is_some_and(|c| c.reply.request() == request)
                        {
                            act.current = None;
                        }
                        act.error(ctx, Some(id), e);
                    }
                }
            })
            .wait(ctx);
    }

    /// A paced reply whose allowance grew (an ack, or tokens held back from the client) tells
    /// the batcher.
    pub(super) fn allow_more(&mut self) {
        let Some(c) = &mut self.current else { return };
        if let Some(n) = c.allowance().filter(|&n| n > c.allowed) {
            c.allowed = n;
            self.ready.batcher.do_send(Allow {
                request: c.reply.request(),
                tokens: n,
            });
        }
    }

    /// Sends `text` as the next delta.
    pub(super) fn forward(&mut self, ctx: &mut ws::WebsocketContext<Self>, text: String) {
        let Some(c) = &mut self.current else { return };
        // A call of the widget's functions is no delta: it goes out as `tool_call`.
        let text = match &mut c.calling {
            Some(k) => k.text(&text),
            None => text,
        };
        if !text.is_empty() {
            let index = c.delta_ends.len();
            let frame = ServerFrame::Delta {
                id: c.client_id.clone(),
                index,
                text,
            };
            c.delta_ends
                .push((c.reply.text().tokens(), c.reply.text().sent().len()));
            if c.skip.is_none_or(|s| index > s) {
                self.send(ctx, &frame);
            }
        }
    }
}
