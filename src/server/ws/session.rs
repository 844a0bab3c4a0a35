//! The session actor: one per WebSocket connection (actix-web-actors, as chosen; upstream
//! deprecates it in favour of actix-ws, and this file is the only one that knows).
//!
//! It holds the session id, the conversation so far and the request in flight. Every text frame is
//! parsed and validated into a typed request at the edge; a malformed frame gets an `error` frame
//! and the connection stays usable; an oversized one closes with 1009. One generation at a time.
//! Token ids become text through the incremental detokenizer (complete UTF-8 only), stop strings
//! are applied here, and the reply is streamed as `delta` frames the moment tokens arrive.
//!
//! The conversation is the session's: a turn may replace its tail (`regenerate`, `edit`: the
//! reply's `replace_from`), and a `cancel` with `heard_index` records only what the user heard.
//! When the connection drops, the session parks (`parked`) and a new connection's `resume`
//! carries it on: a running reply is rebuilt from the token ids the batcher kept, through the
//! same event handler, so its deltas come out with the same pieces and indexes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use actix_web_actors::ws;

use crate::engine::RequestId;
use crate::kv_cache::manager::LeaseKey;
use crate::server::batcher::{
    next_request_id, Allow, Cancel, CancelReason, Draft, EndLease, EventKind, GenerationEvent,
    Park, ReplyTo, Resume, Submit,
};
use crate::server::gate::admission::Place;
use crate::server::gate::outbox::{watched, Backlog};
use crate::server::gate::rate::TokenBucket;
use crate::server::gate::tenants::{ClientKind, Identity};
use crate::server::request::prompt::chat_prompt;
use crate::server::request::reply::ReplyText;
use crate::server::request::{Field, RequestError, ValidRequest};
use crate::server::state::{AppState, Ready};
use crate::server::ws::parked::{Found, LastReply, ParkedReply, ParkedSession, Takeover};
use crate::server::ws::protocol::{validate_restore, ClientFrame, ServerFrame};
use crate::tokenizer::Message;

/// The request in flight.
struct Current {
    client_id: String,
    request: RequestId,
    /// Where the conversation is cut when the reply ends (its length for a new turn; earlier
    /// for a regenerated reply or an edited turn), and the messages that follow the cut.
    replace_from: usize,
    new_messages: Vec<Message>,
    text: ReplyText,
    /// For each delta sent (its index is its place here): the reply's tokens so far, and the
    /// sent text's length after it.
    delta_ends: Vec<(usize, usize)>,
    /// The prompt's length in tokens, once `started` has reported it.
    prompt_tokens: Option<usize>,
    /// A stop string matched or a cancel was sent: ignore further tokens.
    ending: bool,
    /// The last delta the user heard, from a `cancel` with `heard_index`.
    heard: Option<usize>,
    /// A `cancel` was sent after this many of the reply's tokens.
    cancelled_at: Option<usize>,
    /// Resumed: deltas up to this index were sent before, and `started` too.
    skip: Option<usize>,
    started: Option<ServerFrame>,
    /// A paced reply (`params.window`): the last delta the client acked, and the tokens the
    /// batcher was last allowed to generate.
    window: Option<usize>,
    acked: Option<usize>,
    allowed: usize,
}

impl Current {
    fn new(
        client_id: String,
        request: RequestId,
        replace_from: usize,
        new_messages: Vec<Message>,
        stop: Vec<String>,
    ) -> Self {
        Current {
            client_id,
            request,
            replace_from,
            new_messages,
            text: ReplyText::new(stop),
            delta_ends: Vec::new(),
            prompt_tokens: None,
            ending: false,
            heard: None,
            cancelled_at: None,
            skip: None,
            started: None,
            window: None,
            acked: None,
            allowed: 0,
        }
    }

    fn paced(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self.allowed = window.unwrap_or(0);
        self
    }

    /// The tokens a paced reply may generate now: through the acked delta, its window more,
    /// and the tokens it generated that no delta holds yet (held for a stop string or an
    /// incomplete character: the client cannot ack them).
    fn allowance(&self) -> Option<usize> {
        let w = self.window?;
        let base = self.acked.map_or(0, |k| self.delta_ends[k].0);
        let in_deltas = self.delta_ends.last().map_or(0, |d| d.0);
        Some(base + w + self.text.tokens().saturating_sub(in_deltas))
    }

    /// The deltas sent so far, by index.
    fn delta_texts(&self) -> Vec<String> {
        let sent = self.text.sent();
        let mut from = 0;
        self.delta_ends
            .iter()
            .map(|&(_, end)| {
                let t = sent[from..end].to_string();
                from = end;
                t
            })
            .collect()
    }

    /// The reply as the conversation records it: all that was sent, or what the user heard.
    fn recorded_text(&self) -> &str {
        let sent = self.text.sent();
        match self.heard {
            Some(h) => &sent[..self.delta_ends[h].1],
            None => sent,
        }
    }
}

pub struct Session {
    id: uuid::Uuid,
    /// Who connected (tenant, kind, roles, operator prompt), from the upgrade request alone.
    identity: Identity,
    state: Arc<AppState>,
    ready: Ready,
    conversation: Vec<Message>,
    current: Option<Current>,
    last_heard: Instant,
    /// The session's place under the connection caps, given back when it ends (a parked
    /// session keeps it: its reply still runs). A connection let in past the caps holds a
    /// ticket instead, and may only resume (it then takes over the parked session's place).
    permit: Option<crate::server::gate::admission::Permit>,
    ticket: Option<crate::server::gate::admission::Ticket>,
    /// Text frames it may send, and refused frames it may send before it is closed.
    frames: TokenBucket,
    rejected: TokenBucket,
    /// Events the batcher posted to this session and it has not handled yet.
    backlog: Arc<Backlog>,
    /// The token a new connection sends to carry this session on (`parked`), and the flag that
    /// tells the batcher the session is parked.
    token: String,
    parked: Arc<AtomicBool>,
    /// A frame other than `resume` has been handled (`resume` must come first).
    used: bool,
    /// The last reply that ended, for a resume that lost its tail.
    last: Option<LastReply>,
    /// The server closed the connection for what the client did, or to drain (or reset it for
    /// reading nothing): such a session is not parked.
    closed_for_policy: bool,
    reset_for_not_reading: Arc<AtomicBool>,
    /// A turn whose prompt is being built (not yet submitted), and where it replaces the
    /// conversation.
    preparing: Option<(ValidRequest, usize)>,
    /// A draft sent while a reply ran: prefilled once the reply ends (the latest only).
    pending_draft: Option<String>,
    /// The client's conversation id (`?conversation=`, the load balancer's routing key), for
    /// the logs.
    conversation_id: Option<String>,
    /// A `/v1/realtime` connection: the Realtime API's events instead of this protocol's frames
    /// (`realtime`). A cell because frames are sent through `&self`.
    realtime: Option<std::cell::RefCell<crate::server::realtime::Realtime>>,
}

impl Session {
    /// The client's conversation id (`?conversation=`), for the logs.
    pub fn with_conversation_id(mut self, id: Option<String>) -> Self {
        self.conversation_id = id;
        self
    }

    /// Speaks OpenAI's Realtime API (`/v1/realtime`) instead of this server's protocol.
    pub fn speaking_realtime(mut self) -> Self {
        let model = self.ready.model.clone();
        self.realtime = Some(std::cell::RefCell::new(
            crate::server::realtime::Realtime::new(model),
        ));
        self
    }

    pub fn new(
        state: Arc<AppState>,
        ready: Ready,
        identity: Identity,
        place: crate::server::gate::admission::Place,
    ) -> Self {
        let l = &state.session.limits;
        let now = Instant::now();
        let frames = TokenBucket::new(l.frames_per_s, l.frame_burst, now);
        let rejected = TokenBucket::new(l.rejected_frames_per_s, l.rejected_frame_burst, now);
        let mut session = Session {
            frames,
            rejected,
            id: uuid::Uuid::new_v4(),
            identity,
            state,
            ready,
            conversation: Vec::new(),
            current: None,
            last_heard: Instant::now(),
            permit: None,
            ticket: None,
            backlog: Backlog::new(),
            token: crate::server::ws::parked::new_token(),
            parked: Arc::new(AtomicBool::new(false)),
            used: false,
            last: None,
            closed_for_policy: false,
            reset_for_not_reading: Arc::new(AtomicBool::new(false)),
            preparing: None,
            pending_draft: None,
            conversation_id: None,
            realtime: None,
        };
        match place {
            Place::Permit(p) => session.permit = Some(p),
            Place::Ticket(t) => session.ticket = Some(t),
        }
        session
    }

    /// Answers the upgrade and starts the session. Its outgoing stream is `watched`: the ping
    /// timer wakes it every heartbeat, so a stream not polled for `write_timeout` has a client
    /// that reads nothing, and its connection is reset.
    pub fn start(
        self,
        req: &actix_web::HttpRequest,
        stream: actix_web::web::Payload,
    ) -> actix_web::Result<actix_web::HttpResponse> {
        self.start_with_protocols(req, stream, &[])
    }

    /// `start`, choosing the first of `protocols` the client offers as the WebSocket
    /// subprotocol.
    pub fn start_with_protocols(
        self,
        req: &actix_web::HttpRequest,
        stream: actix_web::web::Payload,
        protocols: &[&str],
    ) -> actix_web::Result<actix_web::HttpResponse> {
        let l = &self.state.session;
        let codec = actix_http::ws::Codec::new().max_size(l.limits.max_frame_bytes);
        let (timeout, metrics) = (l.write_timeout, self.state.metrics.clone());
        let reset = self.reset_for_not_reading.clone();
        let mut resp = ws::handshake_with_protocols(req, protocols)?;
        let body = Box::pin(ws::WebsocketContext::with_codec(self, stream, codec));
        let peer = req.conn_data::<crate::server::gate::peer::Peer>().copied();
        Ok(resp.streaming(watched(body, peer, timeout, metrics, Some(reset))))
    }

    /// The session's KV lease key (its id, as a number).
    fn lease_key(&self) -> LeaseKey {
        LeaseKey(self.id.as_u64_pair().0)
    }

    fn send(&self, ctx: &mut ws::WebsocketContext<Self>, frame: &ServerFrame) {
        if let ServerFrame::Error { error_type, .. } = frame {
            self.state.metrics.error(error_type);
        }
        if let Some(rt) = &self.realtime {
            for event in rt.borrow_mut().on_frame(frame) {
                ctx.text(event.to_string());
            }
            return;
        }
        match serde_json::to_string(frame) {
            Ok(s) => ctx.text(s),
            Err(e) => tracing::error!(error = %e, "cannot serialize a frame"),
        }
    }

    /// Sends an error frame. A refusal of what the client sent also takes from its refused-frames
    /// bucket; when that is empty, the connection closes (1008).
    fn error(&mut self, ctx: &mut ws::WebsocketContext<Self>, id: Option<String>, e: RequestError) {
        self.send(ctx, &ServerFrame::error(id, &e));
        let clients_fault = matches!(
            e,
            RequestError::InvalidRequest(_)
                | RequestError::InvalidParam { .. }
                | RequestError::PromptTooLong(_)
                | RequestError::Busy(_)
                | RequestError::RateLimited(_)
        );
        if clients_fault && !self.take_refusal(ctx) {
            return;
        }
        // (A chat refused because the server drains.)
        if self.current.is_none() {
            self.close_if_draining(ctx);
        }
    }

    /// Counts a refused frame against the client's budget: false (and the connection closes
    /// with 1008) when it is spent.
    fn take_refusal(&mut self, ctx: &mut ws::WebsocketContext<Self>) -> bool {
        if !self.rejected.take(Instant::now()) {
            self.closed_for_policy = true;
            self.state.metrics.error("too_many_rejected");
            tracing::info!(session = %self.id, "too many refused frames; closing");
            ctx.close(Some(ws::CloseReason {
                code: ws::CloseCode::Policy,
                description: Some(format!(
                    "more than {} refused frames (limits.rejected_frame_burst, limits.rejected_frames_per_s)",
                    self.state.session.limits.rejected_frame_burst
                )),
            }));
            ctx.stop();
            return false;
        }
        true
    }

    fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
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
    fn restore(
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
    fn start_draft(&mut self, text: String, ctx: &mut ws::WebsocketContext<Self>) {
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
    fn validated_turn(
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

    fn start_chat(
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
    fn submit_chat(
        &mut self,
        chat: ValidRequest,
        prompt: crate::server::request::prompt::Prompt,
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
    fn allow_more(&mut self) {
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
    fn forward(&mut self, ctx: &mut ws::WebsocketContext<Self>, text: String) {
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

impl Actor for Session {
    type Context = ws::WebsocketContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.state.metrics.sessions.inc();
        let cfg = self.state.session.clone();
        self.send_ready(ctx, false);
        if !cfg.resume_grace.is_zero() {
            self.state.parked.register(
                self.token.clone(),
                self.identity.clone(),
                ctx.address().recipient(),
            );
        }
        if self.ticket.is_some() {
            // Let in only to resume: it does so at once or goes.
            ctx.run_later(cfg.heartbeat, |act, ctx| {
                if act.ticket.is_some() {
                    act.refuse_ticket(ctx);
                }
            });
        }
        // A drain closes the session once it has no reply running.
        let mut drain = self.state.drain.subscribe();
        ctx.spawn(
            async move {
                let _ = drain.wait_for(|d| *d).await;
            }
            .into_actor(self)
            .map(|(), act, ctx| act.close_if_draining(ctx)),
        );
        ctx.run_interval(cfg.heartbeat, move |act, ctx| {
            if act.last_heard.elapsed() > cfg.client_timeout {
                tracing::info!(session = %act.id, "no pong within the timeout; closing");
                ctx.stop();
            } else {
                ctx.ping(b"");
            }
        });
        tracing::debug!(session = %self.id, conversation = ?self.conversation_id, "session opened");
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.state.metrics.sessions.dec();
        if self.parked.load(Ordering::SeqCst) || self.park() {
            tracing::debug!(session = %self.id, "connection gone; session parked for a resume");
            self.ready.batcher.do_send(EndLease {
                lease: self.lease_key(),
            });
            return;
        }
        self.state.parked.unregister(&self.token);
        if let Some(c) = self.current.take() {
            self.ready.batcher.do_send(Cancel {
                request: c.request,
                reason: CancelReason::Disconnected,
            });
        }
        self.ready.batcher.do_send(EndLease {
            lease: self.lease_key(),
        });
        tracing::debug!(session = %self.id, "session closed");
    }
}

impl StreamHandler<Result<ws::Message, ws::ProtocolError>> for Session {
    fn handle(&mut self, msg: Result<ws::Message, ws::ProtocolError>, ctx: &mut Self::Context) {
        self.last_heard = Instant::now();
        match msg {
            Ok(ws::Message::Text(t)) => {
                if self.frames.take(Instant::now()) {
                    self.on_text(&t, ctx)
                } else {
                    let l = &self.state.session.limits;
                    let e = RequestError::RateLimited(format!(
                        "more than {} frames a second (burst {}): this frame was not read",
                        l.frames_per_s, l.frame_burst
                    ));
                    self.error(ctx, None, e)
                }
            }
            Ok(ws::Message::Binary(_)) => self.error(
                ctx,
                None,
                RequestError::InvalidRequest(
                    "binary frames are not part of the protocol; send JSON text".into(),
                ),
            ),
            Ok(ws::Message::Ping(p)) => ctx.pong(&p),
            Ok(ws::Message::Pong(_)) => {}
            Ok(ws::Message::Close(reason)) => {
                ctx.close(reason);
                ctx.stop();
            }
            Ok(ws::Message::Continuation(_)) => self.error(
                ctx,
                None,
                RequestError::InvalidRequest("fragmented frames are not supported".into()),
            ),
            Ok(ws::Message::Nop) => {}
            Err(ws::ProtocolError::Overflow) => {
                self.closed_for_policy = true;
                self.state.metrics.error("frame_too_large");
                ctx.close(Some(ws::CloseReason {
                    code: ws::CloseCode::Size,
                    description: Some(format!(
                        "frames are limited to {} bytes",
                        self.state.session.limits.max_frame_bytes
                    )),
                }));
                ctx.stop();
            }
            Err(e) => {
                // A connection that broke (an I/O error) may be resumed; one that broke the
                // protocol may not.
                self.closed_for_policy = !matches!(e, ws::ProtocolError::Io(_));
                tracing::info!(session = %self.id, error = %e, "protocol error; closing");
                ctx.close(Some(ws::CloseReason {
                    code: ws::CloseCode::Protocol,
                    description: Some(e.to_string()),
                }));
                ctx.stop();
            }
        }
    }
}

/// A new connection resumes this session while this one still looks alive: park now and close.
impl Handler<Takeover> for Session {
    type Result = bool;

    fn handle(&mut self, _: Takeover, ctx: &mut Self::Context) -> bool {
        if !self.park() {
            return false;
        }
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Normal,
            description: Some("the session was resumed on another connection".into()),
        }));
        ctx.stop();
        true
    }
}

impl Handler<GenerationEvent> for Session {
    type Result = ();

    fn handle(&mut self, ev: GenerationEvent, ctx: &mut Self::Context) {
        self.backlog.taken();
        self.on_event(ev.request, ev.kind, ctx);
    }
}

impl Session {
    /// What the batcher reports of the request in flight (live, or replayed on a resume); a
    /// draft typed meanwhile is prefilled once it ends.
    fn on_event(
        &mut self,
        request: RequestId,
        kind: EventKind,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        self.on_reply_event(request, kind, ctx);
        if self.current.is_none() {
            if let Some(text) = self.pending_draft.take() {
                self.start_draft(text, ctx);
            }
            self.close_if_draining(ctx);
        }
    }

    /// While the server drains, a session with no reply running closes with 1012 (service
    /// restart): its client reconnects, through the load balancer, to a replica that takes
    /// new work. A running reply finishes first (within `server.shutdown_grace_s`).
    fn close_if_draining(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        if !self.state.draining()
            || self.current.is_some()
            || self.preparing.is_some()
            || self.closed_for_policy
        {
            return;
        }
        self.closed_for_policy = true;
        tracing::debug!(session = %self.id, "draining: closing with 1012");
        ctx.close(Some(ws::CloseReason {
            code: ws::CloseCode::Restart,
            description: Some("the server is shutting down: connect again".into()),
        }));
        ctx.stop();
    }

    fn on_reply_event(
        &mut self,
        request: RequestId,
        kind: EventKind,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let Some(c) = &mut self.current else { return };
        if c.request != request {
            return;
        }
        match kind {
            EventKind::Queued { position, eta_ms } => {
                if c.prompt_tokens.is_none() && c.skip.is_none() {
                    let f = ServerFrame::Queued {
                        id: c.client_id.clone(),
                        position,
                        eta_ms,
                    };
                    self.send(ctx, &f);
                }
            }
            EventKind::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                c.prompt_tokens = Some(prompt_tokens);
                let f = ServerFrame::Started {
                    id: c.client_id.clone(),
                    prompt_tokens,
                    cached_tokens,
                };
                c.started = Some(f.clone());
                if c.skip.is_none() {
                    self.send(ctx, &f);
                }
            }
            EventKind::Token { id: t, .. } => {
                if c.ending {
                    return;
                }
                let text = c.text.push(&self.ready.tokenizer, t);
                self.forward(ctx, text);
                self.allow_more();
            }
            EventKind::Finished {
                reason,
                mut usage,
                timings,
            } => {
                if !c.ending {
                    let rest = c.text.finish(&self.ready.tokenizer);
                    self.forward(ctx, rest);
                }
                let Some(c) = self.current.take() else { return };
                usage.completion_tokens = usage.completion_tokens.max(c.text.tokens());
                tracing::info!(
                    session = %self.id, conversation = ?self.conversation_id, request = %c.client_id, ?reason,
                    prompt_tokens = usage.prompt_tokens, cached_tokens = usage.cached_tokens,
                    generated = usage.completion_tokens, queue_ms = timings.queue_ms,
                    ttft_ms = timings.ttft_ms, decode_tok_s = timings.decode_tokens_per_s, "request done"
                );
                let reply = Message::new("assistant", c.recorded_text());
                let seal = (self.state.sealer).seal(&self.identity.seal_scope(), &reply.content);
                let done = ServerFrame::Done {
                    id: c.client_id.clone(),
                    finish_reason: reason,
                    usage,
                    timings,
                    seal: Some(seal),
                };
                self.send(ctx, &done);
                self.last = Some(LastReply {
                    deltas: c.delta_texts(),
                    client_id: c.client_id,
                    started: c.started,
                    end: done,
                });
                self.conversation.truncate(c.replace_from);
                self.conversation.extend(c.new_messages);
                self.conversation.push(reply);
            }
            EventKind::Failed(e) => {
                let id = c.client_id.clone();
                self.last = Some(LastReply {
                    deltas: c.delta_texts(),
                    client_id: id.clone(),
                    started: c.started.clone(),
                    end: ServerFrame::error(Some(id.clone()), &e),
                });
                self.current = None;
                self.error(ctx, Some(id), e);
            }
        }
    }

    fn send_ready(&self, ctx: &mut ws::WebsocketContext<Self>, resumed: bool) {
        let cfg = &self.state.session;
        let ready = ServerFrame::Ready {
            session_id: self.id.to_string(),
            model: self.ready.model.clone(),
            limits: serde_json::to_value(&cfg.limits).unwrap_or_default(),
            resume_token: (!cfg.resume_grace.is_zero()).then(|| self.token.clone()),
            resumed,
        };
        self.send(ctx, &ready);
    }

    /// Where the batcher sends this session's events.
    fn reply_to(&self, ctx: &mut ws::WebsocketContext<Self>) -> ReplyTo {
        ReplyTo::session(ctx.address().recipient(), self.backlog.clone())
            .parkable(self.parked.clone())
    }

    /// The connection is gone: unless resuming is off, the registry is full or the server
    /// closed the connection for what the client did, the session waits `resume_grace` for a
    /// new connection with its token, its reply going on meanwhile. True if parked.
    fn park(&mut self) -> bool {
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
            request: c.request,
            replace_from: c.replace_from,
            new_messages: c.new_messages,
            stop: c.text.stop_strings().to_vec(),
            window: c.window,
            cancelled_at: c.cancelled_at,
            heard: c.heard,
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
            reply,
            last: self.last.take(),
            preparing: self.preparing.take(),
            permit,
            expires: now + grace,
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
    fn resume(
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
    fn refuse_ticket(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
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
    fn claim_place(&mut self, ctx: &mut ws::WebsocketContext<Self>) -> bool {
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
    fn resume_failed(&mut self, ctx: &mut ws::WebsocketContext<Self>, e: RequestError) {
        self.error(ctx, None, e);
        self.claim_place(ctx);
    }

    /// Carries on a parked session on this connection.
    fn resume_parked(
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
        self.last = p.last;
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
    fn replay(
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
        c.skip = if id.as_deref() == Some(c.client_id.as_str()) {
            after_index
        } else {
            None
        };
        let request = c.request;
        self.current = Some(c);
        // Where the client's cancel stopped the reply, the replay stops too, as the old session
        // did: checked before every event, so that an end right after the cancel point sees it.
        let mut tokens = 0;
        let stop_at_cancel = |tokens: usize, current: &mut Option<Current>| {
            if let (Some(n), Some(c)) = (r.cancelled_at, current) {
                if tokens >= n && !c.ending {
                    c.ending = true;
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
    fn replay_last(
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

/// The Realtime API dialect (`/v1/realtime`, `crate::server::realtime`): its client events become what
/// the session does for `/ws` frames, under the same rules and limits.
impl Session {
    fn on_realtime(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        use crate::server::realtime::{Action, Rules};
        self.used = true;
        if self.ticket.is_some() {
            return self.refuse_ticket(ctx);
        }
        let Some(rt) = &self.realtime else { return };
        let rules = Rules {
            session: &self.state.session,
            roles: self.identity.roles,
        };
        let busy = self.current.is_some() || self.preparing.is_some();
        let action = rt
            .borrow_mut()
            .handle(text, &rules, &self.conversation, busy);
        match action {
            Ok(Action::Send(events)) => {
                for e in events {
                    ctx.text(e.to_string());
                }
            }
            Ok(Action::Start {
                id,
                from,
                messages,
                params,
                created,
            }) => {
                ctx.text(created.to_string());
                // Its refusals and its reply come back as frames (`on_frame`).
                self.validated_turn(id, messages, *params, from, ctx);
            }
            Ok(Action::Cancel(response)) => {
                if let Some(c) = self.current.as_mut().filter(|c| c.client_id == response) {
                    if !c.ending {
                        c.ending = true;
                        c.cancelled_at = Some(c.text.tokens());
                        self.ready.batcher.do_send(Cancel {
                            request: c.request,
                            reason: CancelReason::Client { keep: None },
                        });
                    }
                }
            }
            Err(e) => self.realtime_refused(ctx, e),
        }
    }

    /// An `error` event for the client event being handled; it counts as a refused frame.
    fn realtime_refused(
        &mut self,
        ctx: &mut ws::WebsocketContext<Self>,
        e: crate::server::realtime::EventError,
    ) {
        let Some(rt) = &self.realtime else { return };
        self.state.metrics.error("invalid_request");
        ctx.text(rt.borrow_mut().error(&e).to_string());
        self.take_refusal(ctx);
    }
}
