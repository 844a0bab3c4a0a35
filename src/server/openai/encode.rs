//! The reply encoded for OpenAI's clients: Server-Sent Events chunks as tokens arrive, or one
//! whole body.

use crate::server::openai::*;

pub(super) fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled | FinishReason::Shutdown => "stop",
    }
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
        SseState {
            gen,
            meta,
            opened: false,
            head,
            tail,
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
                "finish_reason": finish_reason(reason),
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
            let reason = c.finish.map(finish_reason);
            match meta.shape {
                Shape::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.sent()},
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
