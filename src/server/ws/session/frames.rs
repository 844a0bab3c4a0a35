//! A client frame's dispatch (`on_text`) and the turns it starts: `chat`, `regenerate`, `edit`,
//! `restore`, `draft`, `ack`, `cancel`; a turn is validated by the request seam, its prompt built
//! on the blocking pool, then submitted.

use crate::server::ws::session::*;

impl Session {
    pub(super) fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        if self.realtime.is_some() {
            return self.on_realtime(text, ctx);
        }
        let frame: ClientFrame = match serde_json::from_str(text) {
            Ok(f) => f,
            Err(e) => {
                return self.error(
                    ctx,
                    None,
                    RequestError::InvalidRequest(format!("malformed frame: {e}")),
                );
            }
        };
        if !matches!(frame, ClientFrame::Resume { .. }) {
            self.used = true;
            if self.ticket.is_some() {
                return self.refuse_ticket(ctx);
            }
        }
        match frame {
            ClientFrame::Resume {
                token,
                id,
                after_index,
            } => self.resume(token, id, after_index, ctx),
            ClientFrame::Draft { text } => match (self.state.session.limits)
                .check_message_chars(Field::Wire("text".into()), &text)
                .map(|()| text)
            {
                Ok(text) if self.current.is_some() || self.preparing.is_some() => {
                    self.pending_draft = Some(text)
                }
                Ok(text) => self.start_draft(text, ctx),
                Err(e) => self.error(ctx, None, e),
            },
            ClientFrame::Ack { id, index } => match &mut self.current {
                Some(c) if c.client_id == id && c.window.is_some() => {
                    if index >= c.delta_ends.len() {
                        let e = RequestError::invalid(
                            Field::Wire("index".into()),
                            format!(
                                "is {index}; {} deltas of `{id}` were sent (indexes from 0)",
                                c.delta_ends.len()
                            ),
                        );
                        return self.error(ctx, Some(id), e);
                    }
                    // Acks may come out of order: the furthest one counts.
                    c.acked = c.acked.max(Some(index));
                    self.allow_more();
                }
                Some(c) if c.client_id == id => self.error(
                    ctx,
                    Some(id),
                    RequestError::InvalidRequest(
                        "`ack` is for paced replies (`params.window`)".into(),
                    ),
                ),
                // A reply that just ended: an ack in flight is not an error.
                _ if self.last.as_ref().is_some_and(|l| l.client_id == id) => {}
                _ => self.error(
                    ctx,
                    Some(id),
                    RequestError::InvalidRequest("`id` names no running request".into()),
                ),
            },
            ClientFrame::Chat {
                id,
                messages,
                params,
            } => {
                self.pending_draft = None;
                let end = self.conversation.len();
                self.validated_turn(id, messages, params, end, ctx);
            }
            ClientFrame::Cancel { id, heard_index } => match &mut self.current {
                Some(c) if c.client_id == id => {
                    if let Some(h) = heard_index.filter(|&h| h >= c.delta_ends.len()) {
                        let e = RequestError::invalid(
                            Field::Wire("heard_index".into()),
                            format!(
                                "is {h}; {} deltas of `{id}` were sent (indexes from 0)",
                                c.delta_ends.len()
                            ),
                        );
                        return self.error(ctx, Some(id), e);
                    }
                    // Once is enough: repeats of a cancel (or a cancel of a reply already
                    // ending) never reach the batcher.
                    if !c.ending {
                        c.ending = true;
                        c.heard = heard_index;
                        c.cancelled_at = Some(c.text.tokens());
                        // The lease keeps the prompt and the heard deltas' tokens.
                        let keep = heard_index
                            .and_then(|h| c.prompt_tokens.map(|p| p + c.delta_ends[h].0));
                        self.ready.batcher.do_send(Cancel {
                            request: c.request,
                            reason: CancelReason::Client { keep },
                        });
                    }
                }
                _ => self.error(
                    ctx,
                    Some(id),
                    RequestError::InvalidRequest("`id` names no running request".into()),
                ),
            },
            ClientFrame::Regenerate { id, params } => {
                let Some(last) = self
                    .conversation
                    .iter()
                    .rposition(|m| m.role == "assistant")
                else {
                    let e = RequestError::InvalidRequest("there is no reply to regenerate".into());
                    return self.error(ctx, Some(id), e);
                };
                // The turn that reply answered: the messages since the reply before it.
                let start = self.conversation[..last]
                    .iter()
                    .rposition(|m| m.role == "assistant")
                    .map_or(0, |i| i + 1);
                let messages = self.conversation[start..last].to_vec();
                self.validated_turn(id, messages, params, start, ctx);
            }
            ClientFrame::Edit {
                id,
                turn,
                messages,
                params,
            } => {
                let users = self.conversation.iter().enumerate();
                let Some(at) = users
                    .filter(|(_, m)| m.role == "user")
                    .nth(turn)
                    .map(|(i, _)| i)
                else {
                    let n = self
                        .conversation
                        .iter()
                        .filter(|m| m.role == "user")
                        .count();
                    let e = RequestError::invalid(
                        Field::Wire("turn".into()),
                        format!("is {turn}; the conversation has {n} user turns (numbered from 0)"),
                    );
                    return self.error(ctx, Some(id), e);
                };
                self.validated_turn(id, messages, params, at, ctx);
            }
            ClientFrame::Restore { messages } => {
                match validate_restore(&self.state.session.limits, messages) {
                    Ok(m) => self.restore(m, ctx),
                    Err(e) => self.error(ctx, None, e),
                }
            }
            ClientFrame::Reset => {
                if let Some(c) = &self.current {
                    let id = c.client_id.clone();
                    return self.error(ctx, None, RequestError::Busy(id));
                }
                self.conversation.clear();
                self.pending_draft = None;
                self.ready.batcher.do_send(EndLease {
                    lease: self.lease_key(),
                });
            }
        }
    }

    /// `restore`: a session with no conversation yet takes the transcript its client kept. An
    /// assistant message from a client that may not send assistant messages needs the seal its
    /// `done` gave (for this client: same tenant, kind and operator text); any other role the
    /// client may not send is refused as in a `chat`. Nothing is computed until the next chat.
    pub(super) fn restore(
        &mut self,
        messages: Vec<crate::server::ws::protocol::RestoredMessage>,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if let Some(c) = &self.current {
            let id = c.client_id.clone();
            return self.error(ctx, None, RequestError::Busy(id));
        }
        if !self.conversation.is_empty() || self.preparing.is_some() {
            return self.error(
                ctx,
                None,
                RequestError::InvalidRequest(
                    "`restore` starts a conversation: send it before the first chat (or after `reset`)"
                        .into(),
                ),
            );
        }
        let scope = self.identity.seal_scope();
        for (i, m) in messages.iter().enumerate() {
            if self.identity.roles.allows(&m.role) {
                continue;
            }
            let sealed = m.role == "assistant"
                && (m.seal.as_deref())
                    .is_some_and(|s| self.state.sealer.verify(&scope, &m.content, s));
            if sealed {
                continue;
            }
            let e = if m.role == "assistant" {
                RequestError::invalid(
                    Field::Seal(i),
                    "an assistant message from this client needs the seal its `done` gave, for this very text",
                )
            } else {
                match self.identity.roles.check(i, &m.role) {
                    Err(e) => e,
                    Ok(()) => continue,
                }
            };
            return self.error(ctx, None, e);
        }
        self.conversation = (messages.iter())
            .map(|m| Message::new(&m.role, &m.content))
            .collect();
        self.pending_draft = None;
        tracing::info!(session = %self.id, conversation = ?self.conversation_id, messages = messages.len(), "conversation restored");
        self.send(
            ctx,
            &ServerFrame::Restored {
                messages: messages.len(),
            },
        );
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

    /// Validates a turn's messages and parameters and starts it: its reply replaces the
    /// conversation from `replace_from` on.
    pub(super) fn validated_turn(
        &mut self,
        id: String,
        messages: Vec<Message>,
        params: crate::server::request::GenerateParams,
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
            Ok(chat) => self.start_chat(chat, replace_from, ctx),
            Err(e) => self.error(ctx, Some(id), e),
        }
    }

    pub(super) fn start_chat(
        &mut self,
        chat: ValidRequest,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if let Some(c) = &self.current {
            let busy = RequestError::Busy(c.client_id.clone());
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
        let (history, messages, key) = (
            self.conversation[..replace_from].to_vec(),
            chat.messages.clone(),
            chat.cache_key.clone(),
        );
        // Until it is submitted, a parked session keeps it to start on resume.
        self.preparing = Some((chat.clone(), replace_from));
        actix_web::rt::task::spawn_blocking(move || {
            chat_prompt(
                &ready,
                &state.tenants,
                &identity,
                &id,
                &history,
                &messages,
                key.as_deref(),
            )
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
        self.current = Some(
            Current::new(
                chat.id.clone(),
                request,
                replace_from,
                chat.messages,
                chat.stop,
            )
            .paced(chat.window),
        );
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
                        if act
                            .current
                            .as_ref()
                            .is_some_and(|c| c.request == request && c.delta_ends.is_empty())
                        {
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
                        if act.current.as_ref().is_some_and(|c| c.request == request) {
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
                request: c.request,
                tokens: n,
            });
        }
    }

    /// Sends `text` as the next delta; when a stop string matched, ends the request.
    pub(super) fn forward(&mut self, ctx: &mut ws::WebsocketContext<Self>, text: String) {
        let Some(c) = &mut self.current else { return };
        if c.text.stopped() && !c.ending {
            c.ending = true;
            self.ready.batcher.do_send(Cancel {
                request: c.request,
                reason: CancelReason::StopString,
            });
        }
        if !text.is_empty() {
            let index = c.delta_ends.len();
            let frame = ServerFrame::Delta {
                id: c.client_id.clone(),
                index,
                text,
            };
            c.delta_ends.push((c.text.tokens(), c.text.sent().len()));
            if c.skip.is_none_or(|s| index > s) {
                self.send(ctx, &frame);
            }
        }
    }
}
