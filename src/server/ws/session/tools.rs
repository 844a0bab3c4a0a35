//! A widget's functions, run by the page that embeds it (docs/widget.md): a reply that calls one
//! sends no deltas but a `tool_call` frame when it ends; the session waits for the client's
//! `tool_result` (or `limits.tool_timeout_s`) and goes on with the same reply id, the result a
//! turn of the conversation, so the KV of everything before it is reused. A turn makes at most
//! `limits.max_tool_calls` calls; after them its reply must be text.

use crate::server::request::reply::FinishReason;
use crate::server::request::tools::Tools;
use crate::server::ws::parked::ToolWait;
use crate::server::ws::session::*;

impl Session {
    /// A reply that ended with a complete call: the `tool_call` frame goes out and the session
    /// waits for its result. False (the reply ends as any other) when it made no complete call.
    pub(super) fn on_call(
        &mut self,
        c: &current::Current,
        reason: FinishReason,
        ctx: &mut ws::WebsocketContext<Self>,
    ) -> Option<ServerFrame> {
        let k = c
            .calling
            .as_ref()
            .filter(|_| reason == FinishReason::Stop)?;
        let (name, arguments) = k.call.as_ref()?;
        let arguments: serde_json::Value = serde_json::from_str(arguments).ok()?;
        let call_id = format!("call_{}", uuid::Uuid::new_v4().simple());
        let limits = &self.state.session.limits;
        let timeout = std::time::Duration::from_secs(limits.tool_timeout_s);
        tracing::info!(session = %self.id, request = %c.client_id, function = %name, "tool call");
        self.tool_wait = Some(ToolWait {
            client_id: c.client_id.clone(),
            call_id: call_id.clone(),
            name: name.clone(),
            chat: k.chat.clone(),
            made: k.made + 1,
            deadline: Instant::now() + timeout,
        });
        self.time_out_call(call_id.clone(), timeout, ctx);
        Some(ServerFrame::ToolCall {
            id: c.client_id.clone(),
            call_id,
            name: name.clone(),
            arguments,
        })
    }

    /// The model hears that the function did not answer when `call_id` still waits after
    /// `after`.
    pub(super) fn time_out_call(
        &mut self,
        call_id: String,
        after: std::time::Duration,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let secs = self.state.session.limits.tool_timeout_s;
        ctx.run_later(after, move |act, ctx| {
            let text = format!("error: the function did not answer within {secs} seconds");
            act.tool_answered(&call_id, text, ctx);
        });
    }

    /// The waiting call's result: the reply goes on from it (a turn of the conversation that
    /// gives the model the function's result, as text).
    pub(super) fn tool_answered(
        &mut self,
        call_id: &str,
        content: String,
        ctx: &mut ws::WebsocketContext<Self>,
    ) {
        let Some(w) = self.tool_wait.take_if(|w| w.call_id == call_id) else {
            return;
        };
        let mut chat = *w.chat;
        chat.messages = vec![Tools::result_message(&w.name, &content)];
        match chat.tools.take() {
            // Out of calls: text (the model was told how to write a call; it may not now).
            Some(t) if w.made >= self.state.session.limits.max_tool_calls => {
                chat.format = t.text_only();
            }
            Some(t) => t.after_call().constrain(&mut chat),
            None => {}
        }
        self.turn_calls = w.made;
        let from = self.conversation.len();
        self.start_chat(chat, from, ctx);
    }

    /// `cancel` of a reply waiting for its call's result: it ends `cancelled`.
    pub(super) fn cancel_call(&mut self, ctx: &mut ws::WebsocketContext<Self>) {
        let Some(w) = self.tool_wait.take() else {
            return;
        };
        let done = ServerFrame::Done {
            id: w.client_id.clone(),
            finish_reason: FinishReason::Cancelled,
            usage: Default::default(),
            timings: Default::default(),
            seal: None,
        };
        self.send(ctx, &done);
        if let Some(last) = &mut self.last {
            last.end = done;
        }
        self.close_if_draining(ctx);
    }
}
