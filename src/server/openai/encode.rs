//! The reply encoded for OpenAI's clients: Server-Sent Events chunks as tokens arrive, or one
//! whole body.

use crate::server::openai::*;

pub(super) fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled | FinishReason::Shutdown => "stop",
    }
}

/// A reply that made calls and ended by itself ended for them.
fn finish_with_calls(r: FinishReason, calls: usize) -> &'static str {
    match r {
        FinishReason::Stop if calls > 0 => "tool_calls",
        r => finish_reason(r),
    }
}

/// A new call's id, as OpenAI spells them.
fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// The streamed response: role chunks first, then one write per event that has something to say.
pub(super) struct SseState {
    pub(super) gen: Generation,
    pub(super) meta: Meta,
    pub(super) opened: bool,
    /// Every chunk's fields before its choice, and after it, serialized once: a token's chunk
    /// serializes only its text.
    pub(super) head: String,
    pub(super) tail: &'static str,
    /// With tools: each choice's text split into calls as it streams.
    pub(super) calls: Vec<CallParser>,
}

pub(super) fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

impl SseState {
    pub(super) fn new(gen: Generation, meta: Meta) -> Self {
        let object = match meta.shape {
            Shape::Chat => "chat.completion.chunk",
            Shape::Completion => "text_completion",
        };
        let head = format!(
            "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"system_fingerprint\":{},\"choices\":[",
            json!(meta.id),
            meta.created,
            json!(meta.model),
            json!(meta.fingerprint)
        );
        let tail = if meta.include_usage {
            "],\"usage\":null}\n\n"
        } else {
            "]}\n\n"
        };
        let calls = match &meta.tools {
            Some(t) => vec![CallParser::new(t); gen.choices.len()],
            None => Vec::new(),
        };
        SseState {
            gen,
            meta,
            opened: false,
            head,
            tail,
            calls,
        }
    }

    /// A text delta without log-probabilities, the chunk nearly every token makes.
    pub(super) fn plain_delta(&self, index: usize, text: &str) -> String {
        let text = json!(text);
        let choice = match self.meta.shape {
            Shape::Chat => format!(
                "{{\"index\":{index},\"delta\":{{\"content\":{text}}},\"logprobs\":null,\"finish_reason\":null}}"
            ),
            Shape::Completion => format!(
                "{{\"index\":{index},\"text\":{text},\"logprobs\":null,\"finish_reason\":null}}"
            ),
        };
        format!("{}{choice}{}", self.head, self.tail)
    }

    pub(super) fn more(&self) -> bool {
        !self.gen.done() || !self.opened
    }

    pub(super) fn chunk(&self, choices: Vec<Value>) -> Value {
        let object = match self.meta.shape {
            Shape::Chat => "chat.completion.chunk",
            Shape::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": choices,
        });
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The next write: `None` once the stream has ended.
    pub(super) async fn next(&mut self) -> Option<Bytes> {
        if !self.opened {
            self.opened = true;
            if self.meta.shape == Shape::Chat {
                let mut s = String::new();
                for i in 0..self.gen.choices.len() {
                    s += &sse(&self.chunk(vec![json!({
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": null,
                        "finish_reason": null,
                    })]));
                }
                return Some(Bytes::from(s));
            }
        }
        loop {
            let Some(outs) = self.gen.next().await else {
                return Some(Bytes::from(self.end()));
            };
            let mut s = String::new();
            for o in outs {
                match o {
                    Out::Delta {
                        index,
                        text,
                        logprobs,
                    } if !self.calls.is_empty() => {
                        s += &self.tool_deltas(index, &text, logprobs);
                    }
                    Out::Delta {
                        index,
                        text,
                        logprobs,
                    } if !self.gen.logprobs => {
                        debug_assert!(logprobs.is_empty());
                        s += &self.plain_delta(index, &text);
                    }
                    o => {
                        let c = self.choice_chunk(o);
                        s += &sse(&self.chunk(vec![c]));
                    }
                }
            }
            if self.gen.done() {
                s += &self.end();
            }
            if !s.is_empty() {
                return Some(Bytes::from(s));
            }
        }
    }

    /// A delta of a reply that may call tools: its text as content, or as `tool_calls` chunks
    /// (the first of a call with its id and name, then fragments of its arguments).
    fn tool_deltas(
        &mut self,
        index: usize,
        text: &str,
        mut logprobs: Vec<(u32, TokenLogprobs)>,
    ) -> String {
        let mut s = String::new();
        for piece in self.calls[index].feed(text) {
            let delta = match piece {
                Piece::Text(t) if !self.gen.logprobs => {
                    s += &self.plain_delta(index, &t);
                    continue;
                }
                Piece::Text(t) => {
                    let o = Out::Delta {
                        index,
                        text: t,
                        logprobs: std::mem::take(&mut logprobs),
                    };
                    let c = self.choice_chunk(o);
                    s += &sse(&self.chunk(vec![c]));
                    continue;
                }
                Piece::CallStart { index: k, name } => json!({"tool_calls": [{"index": k,
                    "id": call_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}}]}),
                Piece::Arguments { index: k, text } => {
                    json!({"tool_calls": [{"index": k, "function": {"arguments": text}}]})
                }
            };
            let c =
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null});
            s += &sse(&self.chunk(vec![c]));
        }
        s
    }

    pub(super) fn choice_chunk(&self, o: Out) -> Value {
        let g = &self.gen;
        match (o, self.meta.shape) {
            (
                Out::Delta {
                    index,
                    text,
                    logprobs,
                },
                Shape::Chat,
            ) => json!({
                "index": index,
                "delta": {"content": text},
                "logprobs": g.logprobs.then(|| json!({"content": g.chat_logprobs(&logprobs)})),
                "finish_reason": null,
            }),
            (
                Out::Delta {
                    index,
                    text,
                    logprobs,
                },
                Shape::Completion,
            ) => {
                let offset = g.choices[index].sent().len() - text.len();
                json!({
                    "index": index,
                    "text": text,
                    "logprobs": g.logprobs.then(|| g.completion_logprobs(&logprobs, offset)),
                    "finish_reason": null,
                })
            }
            (Out::Finished { index, reason }, Shape::Chat) => json!({
                "index": index,
                "delta": {},
                "logprobs": null,
                "finish_reason": finish_with_calls(reason, self.calls.get(index).map_or(0, CallParser::calls)),
            }),
            (Out::Finished { index, reason }, Shape::Completion) => json!({
                "index": index,
                "text": "",
                "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
        }
    }

    /// The usage chunk (when asked for), or the error, then `[DONE]`.
    pub(super) fn end(&mut self) -> String {
        let mut s = String::new();
        if let Some(e) = &self.gen.failed {
            s += &sse(&ApiError::from(e.clone()).body());
        } else if self.meta.include_usage {
            let mut v = self.chunk(Vec::new());
            v["usage"] = json!(self.gen.usage());
            s += &sse(&v);
        }
        s + "data: [DONE]\n\n"
    }
}

/// The non-streamed response: every choice's whole text.
pub(super) async fn whole(mut gen: Generation, meta: Meta, state: &AppState) -> HttpResponse {
    let n = gen.choices.len();
    let mut chat_lps: Vec<Vec<ChatLogprob>> = vec![Vec::new(); n];
    let mut cmpl_lps: Vec<CompletionLogprobs> = vec![CompletionLogprobs::default(); n];
    while let Some(outs) = gen.next().await {
        for o in outs {
            if let Out::Delta {
                index,
                text,
                logprobs,
            } = o
            {
                if !gen.logprobs {
                    continue;
                }
                match meta.shape {
                    Shape::Chat => chat_lps[index].extend(gen.chat_logprobs(&logprobs)),
                    Shape::Completion => {
                        let offset = gen.choices[index].sent().len() - text.len();
                        let l = gen.completion_logprobs(&logprobs, offset);
                        let c = &mut cmpl_lps[index];
                        c.tokens.extend(l.tokens);
                        c.token_logprobs.extend(l.token_logprobs);
                        c.top_logprobs.extend(l.top_logprobs);
                        c.text_offset.extend(l.text_offset);
                    }
                }
            }
        }
    }
    if let Some(e) = gen.failed.take() {
        return ApiError::from(e).response(state);
    }
    let choices: Vec<Value> = gen
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (text, calls) = match &meta.tools {
                Some(t) => parse_reply(t, c.sent()),
                None => (c.sent().to_string(), Vec::new()),
            };
            let reason = c.finish.map(|r| finish_with_calls(r, calls.len()));
            let message = if calls.is_empty() {
                json!({"role": "assistant", "content": text})
            } else {
                let calls: Vec<Value> = (calls.into_iter())
                    .map(|(name, arguments)| {
                        json!({"id": call_id(), "type": "function",
                        "function": {"name": name, "arguments": arguments}})
                    })
                    .collect();
                json!({"role": "assistant", "content": (!text.is_empty()).then_some(text),
                    "tool_calls": calls})
            };
            match meta.shape {
                Shape::Chat => json!({
                    "index": i,
                    "message": message,
                    "logprobs": gen.logprobs.then(|| json!({"content": chat_lps[i]})),
                    "finish_reason": reason,
                }),
                Shape::Completion => json!({
                    "index": i,
                    "text": c.sent(),
                    "logprobs": gen.logprobs.then(|| &cmpl_lps[i]),
                    "finish_reason": reason,
                }),
            }
        })
        .collect();
    let object = match meta.shape {
        Shape::Chat => "chat.completion",
        Shape::Completion => "text_completion",
    };
    HttpResponse::Ok().json(json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": choices,
        "usage": gen.usage(),
    }))
}
