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
//!
//! This file holds the actor (its state, the socket's messages, the batcher's events); a
//! frame's dispatch and the turns it starts are in `frames`, the reply in flight in `current`,
//! parking and resuming in `resume`, the Realtime dialect's plumbing in `realtime_socket`.

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
use crate::server::request::stream::{ReplyStream, Update};
use crate::server::request::{RequestError, ValidRequest};
use crate::server::state::{AppState, Ready};
use crate::server::ws::dispatch::{self, Action};
use crate::server::ws::parked::{Found, LastReply, ParkedReply, ParkedSession, Takeover};
use crate::server::ws::protocol::{ClientFrame, ServerFrame, Truncated};
use crate::tokenizer::Message;

mod current;
mod frames;
mod realtime_socket;
mod resume;
mod tools;

use current::Current;

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
    /// A reply that called one of the widget's functions, waiting for its result (`tools`).
    tool_wait: Option<crate::server::ws::parked::ToolWait>,
    /// Function calls the turn being answered has made.
    turn_calls: usize,
    /// User turns the overflow policy has dropped from the front of `conversation`: `edit`'s
    /// turn numbers count from the first turn the session had.
    dropped_turns: usize,
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
            tool_wait: None,
            turn_calls: 0,
            dropped_turns: 0,
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
                request: c.reply.request(),
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
            || self.tool_wait.is_some()
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
        if c.reply.request() != request {
            return;
        }
        let token = matches!(kind, EventKind::Token { .. });
        let step = c.reply.on_event(kind, &self.ready.tokenizer);
        if let Some(cancel) = step.cancel {
            self.ready.batcher.do_send(cancel);
        }
        for update in step.updates {
            self.on_update(update, ctx);
        }
        // A paced reply's allowance grows with tokens held back from the client too.
        if token {
            self.allow_more();
        }
    }

    /// Sends what a reply update means on the wire, and records the reply when it ends.
    fn on_update(&mut self, update: Update, ctx: &mut ws::WebsocketContext<Self>) {
        let Some(c) = &mut self.current else { return };
        match update {
            Update::Queued { position, eta_ms } => {
                if c.prompt_tokens.is_none() && c.skip.is_none() {
                    let f = ServerFrame::Queued {
                        id: c.client_id.clone(),
                        position,
                        eta_ms,
                    };
                    self.send(ctx, &f);
                }
            }
            Update::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                c.prompt_tokens = Some(prompt_tokens);
                let truncated = c.dropped.map(|d| Truncated {
                    dropped_turns: d.turns,
                    first_kept_turn: self.dropped_turns + d.turns,
                    from: d.from,
                    messages: d.messages,
                });
                let f = ServerFrame::Started {
                    id: c.client_id.clone(),
                    prompt_tokens,
                    cached_tokens,
                    truncated,
                };
                c.started = Some(f.clone());
                if c.skip.is_none() {
                    self.send(ctx, &f);
                }
            }
            Update::Delta { text, .. } => self.forward(ctx, text),
            Update::Finished {
                reason,
                usage,
                timings,
            } => {
                let Some(c) = self.current.take() else { return };
                tracing::info!(
                    session = %self.id, conversation = ?self.conversation_id, request = %c.client_id, ?reason,
                    prompt_tokens = usage.prompt_tokens, cached_tokens = usage.cached_tokens,
                    generated = usage.completion_tokens, queue_ms = timings.queue_ms,
                    ttft_ms = timings.ttft_ms, decode_tok_s = timings.decode_tokens_per_s, "request done"
                );
                let reply = Message::new("assistant", c.recorded_text());
                // A call of the widget's functions: the reply waits for its result.
                let done = match self.on_call(&c, reason, ctx) {
                    Some(call) => call,
                    None => {
                        let seal =
                            (self.state.sealer).seal(&self.identity.seal_scope(), &reply.content);
                        ServerFrame::Done {
                            id: c.client_id.clone(),
                            finish_reason: reason,
                            usage,
                            timings,
                            seal: Some(seal),
                        }
                    }
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
                // The turns the prompt left out leave the conversation: the next turn's prompt
                // starts where this one's did, and finds it cached.
                if let Some(d) = c.dropped {
                    let end = (d.from + d.messages).min(self.conversation.len());
                    self.conversation.drain(d.from.min(end)..end);
                    self.dropped_turns += d.turns;
                }
            }
            Update::Failed(e) => {
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
            roles: self.identity.roles.list(),
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
}
