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

use super::stop::scan;
use super::tenants::{ClientKind, Identity};
use super::{AppState, Ready};
use crate::engine::scheduler::{Priority, RequestId};
use crate::kv_cache::manager::LeaseKey;
use crate::protocol::{ClientFrame, RequestError, ServerFrame, ValidChat};
use crate::server::batcher::{
    next_request_id, Cancel, CancelReason, EndLease, EventKind, GenerationEvent, ReplyTo, Submit,
};
use crate::tokenizer::{IncrementalDecoder, Message};

/// The request in flight.
struct Current {
    client_id: String,
    request: RequestId,
    new_messages: Vec<Message>,
    detok: IncrementalDecoder,
    stop: Vec<String>,
    /// Text decoded and not yet sent (held back for stop strings).
    tail: String,
    /// Text sent so far.
    sent: String,
    deltas: usize,
    /// A stop string matched or a cancel was sent: ignore further tokens.
    ending: bool,
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
}

impl Session {
    pub fn new(state: Arc<AppState>, ready: Ready, identity: Identity) -> Self {
        Session {
            id: uuid::Uuid::new_v4(),
            identity,
            state,
            ready,
            conversation: Vec::new(),
            current: None,
            last_heard: Instant::now(),
        }
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

    fn error(&self, ctx: &mut ws::WebsocketContext<Self>, id: Option<String>, e: RequestError) {
        self.send(ctx, &e.to_frame(id));
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
                let cfg = &self.state.session;
                match cfg.limits.validate_chat(
                    id.clone(),
                    messages,
                    params,
                    &cfg.sampling,
                    cfg.default_max_tokens,
                ) {
                    Ok(chat) => self.start_chat(chat, ctx),
                    Err(e) => self.error(ctx, Some(id), e),
                }
            }
            ClientFrame::Cancel { id } => match &mut self.current {
                Some(c) if c.client_id == id => {
                    // Once is enough: repeats of a cancel (or a cancel of a reply already
                    // ending) never reach the batcher.
                    if !c.ending {
                        c.ending = true;
                        self.ready.batcher.do_send(Cancel {
                            request: c.request,
                            reason: CancelReason::Client,
                        });
                    }
                }
                _ => self.error(
                    ctx,
                    Some(id),
                    RequestError::InvalidRequest("`id` names no running request".into()),
                ),
            },
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

    /// What this client may send beyond what `validate_chat` checks: its roles, and
    /// `cache_key` for API-key clients only.
    fn authorize(&self, chat: &ValidChat) -> Result<(), RequestError> {
        let id = &self.identity;
        if let Some((i, m)) = chat
            .messages
            .iter()
            .enumerate()
            .find(|(_, m)| !id.roles.allows(&m.role))
        {
            return Err(RequestError::InvalidRequest(format!(
                "`messages[{i}].role` {:?} is not allowed for this client (allowed: {})",
                m.role,
                id.roles.names()
            )));
        }
        if chat.cache_key.is_some() && id.kind != ClientKind::ApiKey {
            return Err(RequestError::InvalidRequest(
                "`params.cache_key` is for API-key clients; a browser session is its own cache partition".into(),
            ));
        }
        Ok(())
    }

    /// The leading prompt tokens that are operator text (shared within the tenant): those equal
    /// to the operator prompt rendered alone.
    fn shared_tokens(&self, prompt: &[u32]) -> usize {
        let Some(op) = (self.identity.system_prompt.as_ref())
            .and_then(|sys| self.ready.operator_tokens.get(sys))
        else {
            return 0;
        };
        op.iter().zip(prompt).take_while(|(a, b)| a == b).count()
    }

    fn start_chat(&mut self, chat: ValidChat, ctx: &mut ws::WebsocketContext<Self>) {
        if let Some(c) = &self.current {
            let busy = RequestError::Busy(c.client_id.clone());
            return self.error(ctx, Some(chat.id), busy);
        }
        if let Err(e) = self.authorize(&chat) {
            return self.error(ctx, Some(chat.id), e);
        }
        let mut all = Vec::with_capacity(self.conversation.len() + chat.messages.len() + 1);
        if let Some(sys) = &self.identity.system_prompt {
            all.push(Message::new("system", sys));
        }
        all.extend(self.conversation.iter().cloned());
        all.extend(chat.messages.iter().cloned());
        let prompt = match self.ready.tokenizer.encode_chat(&all, true) {
            Ok((_, ids)) => ids,
            Err(e) => {
                return self.error(
                    ctx,
                    Some(chat.id),
                    RequestError::InvalidRequest(e.to_string()),
                )
            }
        };
        let shared = self.shared_tokens(&prompt);
        let scope =
            self.state
                .tenants
                .scope(&self.identity, &self.id, chat.cache_key.as_deref(), shared);
        let request = next_request_id();
        self.current = Some(Current {
            client_id: chat.id.clone(),
            request,
            new_messages: chat.messages,
            detok: IncrementalDecoder::new(true),
            stop: chat.stop,
            tail: String::new(),
            sent: String::new(),
            deltas: 0,
            ending: false,
        });
        let submit = Submit {
            request,
            prompt,
            sampling: chat.sampling,
            max_tokens: chat.max_tokens,
            ignore_eos: chat.ignore_eos,
            priority: match chat.priority {
                crate::protocol::Priority::Interactive => Priority::Interactive,
                crate::protocol::Priority::Batch => Priority::Batch,
            },
            scope,
            lease: Some(self.lease_key()),
            logprobs: None,
            forks: Vec::new(),
            reply_to: ReplyTo::Session(ctx.address().recipient()),
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

    /// Sends what the stop strings allow of the unsent text; on a match, ends the request.
    fn flush(&mut self, ctx: &mut ws::WebsocketContext<Self>, at_end: bool) {
        let Some(c) = &mut self.current else { return };
        let s = scan(&c.tail, &c.stop);
        let send = if at_end && !s.stopped {
            c.tail.len()
        } else {
            s.send
        };
        let text: String = c.tail.drain(..send).collect();
        if s.stopped && !c.ending {
            c.ending = true;
            c.tail.clear();
            self.ready.batcher.do_send(Cancel {
                request: c.request,
                reason: CancelReason::StopString,
            });
        }
        if !text.is_empty() {
            c.sent.push_str(&text);
            let frame = ServerFrame::Delta {
                id: c.client_id.clone(),
                index: c.deltas,
                text,
            };
            c.deltas += 1;
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
            Ok(ws::Message::Text(t)) => self.on_text(&t, ctx),
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
        let Some(c) = &mut self.current else { return };
        if c.request != ev.request {
            return;
        }
        match ev.kind {
            EventKind::Started {
                prompt_tokens,
                cached_tokens,
            } => {
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
                match c.detok.push(&self.ready.tokenizer, t) {
                    Ok(Some(text)) => {
                        c.tail.push_str(&text);
                        self.flush(ctx, false);
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "detokenizer"),
                }
            }
            EventKind::Finished {
                reason,
                mut usage,
                timings,
            } => {
                if !c.ending {
                    if let Ok(Some(rest)) = c.detok.finish(&self.ready.tokenizer) {
                        c.tail.push_str(&rest);
                    }
                    self.flush(ctx, true);
                }
                let Some(c) = self.current.take() else { return };
                usage.completion_tokens = usage.completion_tokens.max(c.detok.ids().len());
                tracing::info!(
                    session = %self.id, request = %c.client_id, ?reason,
                    prompt_tokens = usage.prompt_tokens, cached_tokens = usage.cached_tokens,
                    generated = usage.completion_tokens, queue_ms = timings.queue_ms,
                    ttft_ms = timings.ttft_ms, decode_tok_s = timings.decode_tokens_per_s, "request done"
                );
                self.conversation.extend(c.new_messages);
                self.conversation.push(Message::new("assistant", &c.sent));
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
