//! The reply in flight: its ids, where it replaces the conversation, its reply stream (the text
//! and the rules every dialect shares: `request::stream`) and the deltas sent, what the user
//! heard, and a paced reply's window.

use crate::server::request::tools::{CallParser, Piece};
use crate::server::ws::session::*;

/// The request in flight.
pub(super) struct Current {
    pub(super) client_id: String,
    /// Where the conversation is cut when the reply ends (its length for a new turn; earlier
    /// for a regenerated reply or an edited turn), and the messages that follow the cut.
    pub(super) replace_from: usize,
    pub(super) new_messages: Vec<Message>,
    pub(super) reply: ReplyStream,
    /// For each delta sent (its index is its place here): the reply's tokens so far, and the
    /// sent text's length after it.
    pub(super) delta_ends: Vec<(usize, usize)>,
    /// The prompt's length in tokens, once `started` has reported it.
    pub(super) prompt_tokens: Option<usize>,
    /// The last delta the user heard, from a `cancel` with `heard_index`.
    pub(super) heard: Option<usize>,
    /// A `cancel` was sent after this many of the reply's tokens.
    pub(super) cancelled_at: Option<usize>,
    /// Resumed: deltas up to this index were sent before, and `started` too.
    pub(super) skip: Option<usize>,
    pub(super) started: Option<ServerFrame>,
    /// A paced reply (`params.window`): the last delta the client acked, and the tokens the
    /// batcher was last allowed to generate.
    pub(super) window: Option<usize>,
    pub(super) acked: Option<usize>,
    pub(super) allowed: usize,
    /// A reply that may call the widget's functions (`session::tools`).
    pub(super) calling: Option<Calling>,
    /// The oldest turns its prompt left out (the overflow policy): they leave the conversation
    /// when the reply ends.
    pub(super) dropped: Option<crate::server::request::overflow::Dropped>,
}

/// A reply that may call the widget's functions: its text split into text and a call as it
/// streams, and what the turn goes on with.
pub(super) struct Calling {
    pub(super) parser: CallParser,
    /// The call so far: its function's name and arguments (JSON text).
    pub(super) call: Option<(String, String)>,
    pub(super) chat: Box<ValidRequest>,
    /// Calls the turn made before this reply.
    pub(super) made: usize,
}

impl Calling {
    /// For `chat`, whose reply may call its tools (`None` when it may not).
    pub(super) fn new(chat: &ValidRequest, made: usize) -> Option<Calling> {
        let tools = chat.tools.as_ref()?;
        Some(Calling {
            parser: CallParser::new(tools),
            call: None,
            chat: Box::new(chat.clone()),
            made,
        })
    }

    /// The text of `text` (the next part of the reply) to send as a delta; a call's is kept.
    pub(super) fn text(&mut self, text: &str) -> String {
        let mut plain = String::new();
        for piece in self.parser.feed(text) {
            match piece {
                Piece::Text(t) => plain.push_str(&t),
                // One call per reply (the widget's tools are not parallel).
                Piece::CallStart { index: 0, name } => self.call = Some((name, String::new())),
                Piece::Arguments { index: 0, text } => {
                    if let Some(c) = &mut self.call {
                        c.1.push_str(&text);
                    }
                }
                Piece::CallStart { .. } | Piece::Arguments { .. } => {}
            }
        }
        plain
    }
}

impl Current {
    pub(super) fn new(
        client_id: String,
        request: RequestId,
        replace_from: usize,
        new_messages: Vec<Message>,
        stop: Vec<String>,
    ) -> Self {
        Current {
            client_id,
            replace_from,
            new_messages,
            reply: ReplyStream::new(request, stop),
            delta_ends: Vec::new(),
            prompt_tokens: None,
            heard: None,
            cancelled_at: None,
            skip: None,
            started: None,
            window: None,
            acked: None,
            allowed: 0,
            calling: None,
            dropped: None,
        }
    }

    pub(super) fn paced(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self.allowed = window.unwrap_or(0);
        self
    }

    /// The tokens a paced reply may generate now: through the acked delta, its window more,
    /// and the tokens it generated that no delta holds yet (held for a stop string or an
    /// incomplete character: the client cannot ack them).
    pub(super) fn allowance(&self) -> Option<usize> {
        let w = self.window?;
        let base = self.acked.map_or(0, |k| self.delta_ends[k].0);
        let in_deltas = self.delta_ends.last().map_or(0, |d| d.0);
        Some(base + w + self.reply.text().tokens().saturating_sub(in_deltas))
    }

    /// The client cancels (`heard`: the last delta the user heard): the `Cancel` for the
    /// batcher, its lease keeping the prompt and the heard deltas' tokens. Once is enough: a
    /// repeat, or a cancel of a reply already ending, gives `None`.
    pub(super) fn cancel(&mut self, heard: Option<usize>) -> Option<Cancel> {
        if self.reply.ending() {
            return None;
        }
        self.reply.end();
        self.heard = heard;
        self.cancelled_at = Some(self.reply.text().tokens());
        let keep = heard.and_then(|h| self.prompt_tokens.map(|p| p + self.delta_ends[h].0));
        Some(Cancel {
            request: self.reply.request(),
            reason: CancelReason::Client { keep },
        })
    }

    /// The deltas sent so far, by index.
    pub(super) fn delta_texts(&self) -> Vec<String> {
        let sent = self.reply.text().sent();
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
    pub(super) fn recorded_text(&self) -> &str {
        let sent = self.reply.text().sent();
        match self.heard {
            Some(h) => &sent[..self.delta_ends[h].1],
            None => sent,
        }
    }
}
