//! A `/v1/realtime` connection's events: the Realtime dialect's pure `handle` decides, this
//! plumbing sends its events and starts or cancels the turn.

use crate::server::ws::session::*;

/// The Realtime API dialect (`/v1/realtime`, `crate::server::realtime`): its client events become what
/// the session does for `/ws` frames, under the same rules and limits.
impl Session {
    pub(super) fn on_realtime(&mut self, text: &str, ctx: &mut ws::WebsocketContext<Self>) {
        use crate::server::realtime::{Action, Rules};
        self.used = true;
        if self.ticket.is_some() {
            return self.refuse_ticket(ctx);
        }
        let Some(rt) = &self.realtime else { return };
        let rules = Rules {
            session: &self.state.session,
            roles: self.identity.roles,
            syntax: self.ready.tokenizer.call_syntax(),
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
                tools,
                created,
            }) => {
                ctx.text(created.to_string());
                // Its refusals and its reply come back as frames (`on_frame`).
                self.validated_turn(id, messages, *params, tools, from, ctx);
            }
            Ok(Action::Cancel(response)) => {
                let current = self.current.as_mut().filter(|c| c.client_id == response);
                if let Some(cancel) = current.and_then(|c| c.cancel(None)) {
                    self.ready.batcher.do_send(cancel);
                }
            }
            Err(e) => self.realtime_refused(ctx, e),
        }
    }

    /// An `error` event for the client event being handled; it counts as a refused frame.
    pub(super) fn realtime_refused(
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
