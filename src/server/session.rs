//! The session actor: one per WebSocket connection (actix-web-actors, as chosen; upstream
//! deprecates it in favour of actix-ws, and this file is the only one that knows).
//!
//! It holds the session id, the conversation so far and the request in flight. Every text frame is
//! parsed and validated into a typed request at the edge; a malformed frame gets an `error` frame
//! and the connection stays usable; an oversized one closes with 1009. One generation at a time.
//! Token ids become text through the incremental detokenizer (complete UTF-8 only), stop strings
//! are applied here, and the reply is streamed as `delta` frames the moment tokens arrive.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use actix_web_actors::ws;

use super::outbox::{watched, Backlog};
use super::prompt::chat_prompt;
use super::rate::TokenBucket;
use super::reply::ReplyText;
use super::tenants::{ClientKind, Identity};
use super::{AppState, Ready};
use crate::engine::scheduler::{Priority, RequestId};
use crate::kv_cache::manager::LeaseKey;
use crate::protocol::{ClientFrame, RequestError, ServerFrame, ValidChat};
use crate::server::batcher::{
    next_request_id, Cancel, CancelReason, EndLease, EventKind, GenerationEvent, ReplyTo, Submit,
};
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
    deltas: usize,
    /// For each delta sent: the reply's tokens so far, and the sent text's length after it.
    delta_ends: Vec<(usize, usize)>,
    /// The prompt's length in tokens, once `started` has reported it.
    prompt_tokens: Option<usize>,
    /// A stop string matched or a cancel was sent: ignore further tokens.
    ending: bool,
    /// The last delta the user heard, from a `cancel` with `heard_index`.
    heard: Option<usize>,
}

impl Current {
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
    /// The session's place under the connection caps, given back when it ends.
    _permit: super::admission::Permit,
    /// Text frames it may send, and refused frames it may send before it is closed.
    frames: TokenBucket,
    rejected: TokenBucket,
    /// Events the batcher posted to this session and it has not handled yet.
    backlog: Arc<Backlog>,
}

impl Session {
    pub fn new(
        state: Arc<AppState>,
        ready: Ready,
        identity: Identity,
        permit: super::admission::Permit,
    ) -> Self {
        let l = &state.session.limits;
        let now = Instant::now();
        let frames = TokenBucket::new(l.frames_per_s, l.frame_burst, now);
        let rejected = TokenBucket::new(l.rejected_frames_per_s, l.rejected_frame_burst, now);
        Session {
            frames,
            rejected,
            id: uuid::Uuid::new_v4(),
            identity,
            state,
            ready,
            conversation: Vec::new(),
            current: None,
            last_heard: Instant::now(),
            _permit: permit,
            backlog: Backlog::new(),
        }
    }

    /// Answers the upgrade and starts the session. Its outgoing stream is `watched`: the ping
    /// timer wakes it every heartbeat, so a stream not polled for `write_timeout` has a client
    /// that reads nothing, and its connection is reset.
    pub fn start(
        self,
        req: &actix_web::HttpRequest,
        stream: actix_web::web::Payload,
    ) -> actix_web::Result<actix_web::HttpResponse> {
        let l = &self.state.session;
        let codec = actix_http::ws::Codec::new().max_size(l.limits.max_frame_bytes);
        let (timeout, metrics) = (l.write_timeout, self.state.metrics.clone());
        let mut resp = ws::handshake(req)?;
        let body = Box::pin(ws::WebsocketContext::with_codec(self, stream, codec));
        let peer = req.conn_data::<super::Peer>().copied();
        Ok(resp.streaming(watched(body, peer, timeout, metrics)))
    }

    /// The session's KV lease key (its id, as a number).
    fn lease_key(&self) -> LeaseKey {
        LeaseKey(self.id.as_u64_pair().0)
    }

    fn send(&self, ctx: &mut ws::WebsocketContext<Self>, frame: &ServerFrame) {
        if let ServerFrame::Error { error_type, .. } = frame {
            self.state.metrics.error(error_type);
        }
        match serde_json::to_string(frame) {
            Ok(s) => ctx.text(s),
            Err(e) => tracing::error!(error = %e, "cannot serialize a frame"),
        }
    }

    /// Sends an error frame. A refusal of what the client sent also takes from its refused-frames
    /// bucket; when that is empty, the connection closes (1008).
    fn error(&mut self, ctx: &mut ws::WebsocketContext<Self>, id: Option<String>, e: RequestError) {
        self.send(ctx, &e.to_frame(id));
        let clients_fault = matches!(
            e,
            RequestError::InvalidRequest(_)
                | RequestError::InvalidParam { .. }
                | RequestError::PromptTooLong(_)
                | RequestError::Busy(_)
                | RequestError::RateLimited(_)
        );
        if clients_fault && !self.rejected.take(Instant::now()) {
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
        }
    }

    fn on_text(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
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
        match frame {
            ClientFrame::Chat {
                id,
                messages,
                params,
            } => {
                let end = self.conversation.len();
                self.validated_turn(id, messages, params, end, ctx);
            }
            ClientFrame::Cancel { id, heard_index } => match &mut self.current {
                Some(c) if c.client_id == id => {
                    if let Some(h) = heard_index.filter(|&h| h >= c.deltas) {
                        let e = RequestError::InvalidParam {
                            param: "heard_index".into(),
                            reason: format!(
                                "is {h}; {} deltas of `{id}` were sent (indexes from 0)",
                                c.deltas
                            ),
                        };
                        return self.error(ctx, Some(id), e);
                    }
                    // Once is enough: repeats of a cancel (or a cancel of a reply already
                    // ending) never reach the batcher.
                    if !c.ending {
                        c.ending = true;
                        c.heard = heard_index;
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
                    let e = RequestError::InvalidParam {
                        param: "turn".into(),
                        reason: format!(
                            "is {turn}; the conversation has {n} user turns (numbered from 0)"
                        ),
                    };
                    return self.error(ctx, Some(id), e);
                };
                self.validated_turn(id, messages, params, at, ctx);
            }
            ClientFrame::Reset => {
                if let Some(c) = &self.current {
                    let id = c.client_id.clone();
                    return self.error(ctx, None, RequestError::Busy(id));
                }
                self.conversation.clear();
                self.ready.batcher.do_send(EndLease {
                    lease: self.lease_key(),
                });
            }
        }
    }

    /// `cache_key` is for API-key clients only (a browser session is its own partition).
    fn authorize(&self, chat: &ValidChat) -> Result<(), RequestError> {
        if chat.cache_key.is_some() && self.identity.kind != ClientKind::ApiKey {
            return Err(RequestError::InvalidRequest(
                "`params.cache_key` is for API-key clients; a browser session is its own cache partition".into(),
            ));
        }
        Ok(())
    }

    /// Validates a turn's messages and parameters and starts it: its reply replaces the
    /// conversation from `replace_from` on.
    fn validated_turn(
        &mut self,
        id: String,
        messages: Vec<Message>,
        params: crate::protocol::ChatParams,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let cfg = &self.state.session;
        match cfg.limits.validate_chat(
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
        chat: ValidChat,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        if let Some(c) = &self.current {
            let busy = RequestError::Busy(c.client_id.clone());
            return self.error(ctx, Some(chat.id), busy);
        }
        if let Err(e) = self.authorize(&chat) {
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
        chat: ValidChat,
        prompt: super::prompt::Prompt,
        replace_from: usize,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let request = next_request_id();
        self.current = Some(Current {
            client_id: chat.id.clone(),
            request,
            replace_from,
            new_messages: chat.messages,
            text: ReplyText::new(chat.stop),
            deltas: 0,
            delta_ends: Vec::new(),
            prompt_tokens: None,
            ending: false,
            heard: None,
        });
        let submit = Submit {
            request,
            prompt: prompt.ids,
            sampling: chat.sampling,
            max_tokens: chat.max_tokens,
            ignore_eos: chat.ignore_eos,
            priority: match chat.priority {
                crate::protocol::Priority::Interactive => Priority::Interactive,
                crate::protocol::Priority::Batch => Priority::Batch,
            },
            scope: prompt.scope,
            lease: Some(self.lease_key()),
            logprobs: None,
            forks: Vec::new(),
            reply_to: ReplyTo::session(ctx.address().recipient(), self.backlog.clone()),
            quota: self.identity.quota,
        };
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
                            .is_some_and(|c| c.request == request && c.deltas == 0)
                        {
                            act.send(ctx, &ServerFrame::Queued { id, position });
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
            let frame = ServerFrame::Delta {
                id: c.client_id.clone(),
                index: c.deltas,
                text,
            };
            c.deltas += 1;
            c.delta_ends.push((c.text.tokens(), c.text.sent().len()));
            self.send(ctx, &frame);
        }
    }
}

impl Actor for Session {
    type Context = ws::WebsocketContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.state.metrics.sessions.inc();
        let cfg = self.state.session.clone();
        let ready = ServerFrame::Ready {
            session_id: self.id.to_string(),
            model: self.ready.model.clone(),
            limits: serde_json::to_value(&cfg.limits).unwrap_or_default(),
        };
        self.send(ctx, &ready);
        ctx.run_interval(cfg.heartbeat, move |act, ctx| {
            if act.last_heard.elapsed() > cfg.client_timeout {
                tracing::info!(session = %act.id, "no pong within the timeout; closing");
                ctx.stop();
            } else {
                ctx.ping(b"");
            }
        });
        tracing::debug!(session = %self.id, "session opened");
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.state.metrics.sessions.dec();
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

impl Handler<GenerationEvent> for Session {
    type Result = ();

    fn handle(&mut self, ev: GenerationEvent, ctx: &mut Self::Context) {
        self.backlog.taken();
        let Some(c) = &mut self.current else { return };
        if c.request != ev.request {
            return;
        }
        match ev.kind {
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
                self.send(ctx, &f);
            }
            EventKind::Token { id: t, .. } => {
                if c.ending {
                    return;
                }
                let text = c.text.push(&self.ready.tokenizer, t);
                self.forward(ctx, text);
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
                    session = %self.id, request = %c.client_id, ?reason,
                    prompt_tokens = usage.prompt_tokens, cached_tokens = usage.cached_tokens,
                    generated = usage.completion_tokens, queue_ms = timings.queue_ms,
                    ttft_ms = timings.ttft_ms, decode_tok_s = timings.decode_tokens_per_s, "request done"
                );
                let reply = Message::new("assistant", c.recorded_text());
                self.conversation.truncate(c.replace_from);
                self.conversation.extend(c.new_messages);
                self.conversation.push(reply);
                self.send(
                    ctx,
                    &ServerFrame::Done {
                        id: c.client_id,
                        finish_reason: reason,
                        usage,
                        timings,
                    },
                );
            }
            EventKind::Failed(e) => {
                let id = c.client_id.clone();
                self.current = None;
                self.error(ctx, Some(id), e);
            }
        }
    }
}
