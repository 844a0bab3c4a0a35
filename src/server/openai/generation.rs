//! A request's choices in flight: their reply text, the events the batcher sends for them, and
//! the client going away (the peer watched while nothing is written).

use crate::server::openai::*;

/// Response fields every chunk and body carries.
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) fingerprint: String,
    pub(super) shape: Shape,
    pub(super) include_usage: bool,
    /// The functions the reply may call: its text is parsed into `tool_calls`.
    pub(super) tools: Option<std::sync::Arc<Tools>>,
}

/// One choice's progress: its reply stream (text, stop strings, log-probabilities held with their
/// text), and how it ended.
pub(super) struct Choice {
    pub(super) reply: ReplyStream,
    pub(super) finish: Option<FinishReason>,
    pub(super) completion_tokens: usize,
    /// Speculative drafts run for it and those kept.
    pub(super) drafted_tokens: usize,
    pub(super) accepted_tokens: usize,
}

impl Choice {
    pub(super) fn new(request: RequestId, stop: Vec<String>) -> Self {
        Choice {
            reply: ReplyStream::new(request, stop),
            finish: None,
            completion_tokens: 0,
            drafted_tokens: 0,
            accepted_tokens: 0,
        }
    }

    /// The text sent so far.
    pub(super) fn sent(&self) -> &str {
        self.reply.text().sent()
    }
}

/// What a generation event means for the response.
pub(super) enum Out {
    Delta {
        index: usize,
        text: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
    },
    Finished {
        index: usize,
        reason: FinishReason,
    },
}

/// Events of a request's choices, turned into text.
pub(super) struct Generation {
    pub(super) rx: UnboundedReceiver<GenerationEvent>,
    /// What the batcher posted and this response has not taken yet (`outbox`).
    pub(super) backlog: Arc<Backlog>,
    pub(super) ready: Ready,
    pub(super) choices: Vec<Choice>,
    pub(super) index: HashMap<RequestId, usize>,
    pub(super) logprobs: bool,
    pub(super) prompt_tokens: usize,
    pub(super) cached_tokens: usize,
    pub(super) failed: Option<RequestError>,
    /// The first choice's timings, for the log.
    pub(super) timings: crate::server::request::reply::Timings,
    /// The request's place under the connection caps, held until the response ends.
    pub(super) _permit: Permit,
    /// The client's connection, checked at each tick.
    pub(super) peer: Option<Peer>,
    pub(super) ticker: tokio::time::Interval,
}

/// How often a request waiting for events checks that its client is still connected.
pub(super) const PEER_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

impl Generation {
    /// The next event, or `None` when the channel closed or the client went away (checked every
    /// `PEER_CHECK`, whether events come or not).
    pub(super) async fn recv(&mut self) -> Option<GenerationEvent> {
        let ev = self.recv_or_gone().await;
        if ev.is_some() {
            self.backlog.taken();
        }
        ev
    }

    pub(super) async fn recv_or_gone(&mut self) -> Option<GenerationEvent> {
        let Some(peer) = self.peer else {
            return self.rx.recv().await;
        };
        loop {
            tokio::select! {
                ev = self.rx.recv() => return ev,
                _ = self.ticker.tick() => if peer.gone() {
                    return None;
                },
            }
        }
    }

    pub(super) fn done(&self) -> bool {
        self.failed.is_some() || self.choices.iter().all(|c| c.finish.is_some())
    }

    /// The next event's output; `None` when every choice has finished or failed.
    pub(super) async fn next(&mut self) -> Option<Vec<Out>> {
        if self.done() {
            return None;
        }
        let Some(ev) = self.recv().await else {
            self.failed = Some(RequestError::Internal(
                "the request ended without an answer (client gone or batcher stopped)".into(),
            ));
            return None;
        };
        let i = *self.index.get(&ev.request)?;
        let c = &mut self.choices[i];
        let step = c.reply.on_event(ev.kind, &self.ready.tokenizer);
        if let Some(cancel) = step.cancel {
            self.ready.batcher.do_send(cancel);
        }
        let mut out = Vec::new();
        for update in step.updates {
            match update {
                Update::Queued { .. } => {}
                Update::Started { cached_tokens, .. } => {
                    if i == 0 {
                        self.cached_tokens = cached_tokens;
                    }
                }
                Update::Delta { text, logprobs } => out.push(Out::Delta {
                    index: i,
                    text,
                    logprobs,
                }),
                Update::Finished {
                    reason,
                    usage,
                    timings,
                } => {
                    if i == 0 {
                        self.timings = timings;
                    }
                    c.completion_tokens = usage.completion_tokens;
                    c.drafted_tokens = usage.drafted_tokens;
                    c.accepted_tokens = usage.accepted_tokens;
                    if reason == FinishReason::Shutdown {
                        self.failed =
                            Some(RequestError::NotReady("the server is shutting down".into()));
                    } else {
                        c.finish = Some(reason);
                        out.push(Out::Finished { index: i, reason });
                    }
                }
                Update::Failed(e) => self.failed = Some(e),
            }
        }
        if self.done() {
            let u = self.usage();
            tracing::info!(
                choices = self.choices.len(), prompt_tokens = u.prompt_tokens,
                cached_tokens = u.prompt_tokens_details.cached_tokens,
                generated = u.completion_tokens, failed = ?self.failed,
                queue_ms = self.timings.queue_ms, ttft_ms = self.timings.ttft_ms,
                decode_tok_s = self.timings.decode_tokens_per_s, "API request done"
            );
        }
        Some(out)
    }

    pub(super) fn usage(&self) -> ApiUsage {
        let completion: usize = self.choices.iter().map(|c| c.completion_tokens).sum();
        let drafted: usize = self.choices.iter().map(|c| c.drafted_tokens).sum();
        let accepted: usize = self.choices.iter().map(|c| c.accepted_tokens).sum();
        ApiUsage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: completion,
            total_tokens: self.prompt_tokens + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.cached_tokens,
            },
            completion_tokens_details: CompletionTokensDetails {
                reasoning_tokens: 0,
                accepted_prediction_tokens: accepted,
                rejected_prediction_tokens: drafted - accepted.min(drafted),
            },
        }
    }

    pub(super) fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let b = self.ready.tokenizer.token_bytes(id);
        (String::from_utf8_lossy(&b).into_owned(), b)
    }

    pub(super) fn chat_logprobs(&self, lps: &[(u32, TokenLogprobs)]) -> Vec<ChatLogprob> {
        lps.iter()
            .map(|(id, lp)| {
                let (token, bytes) = self.token_text(*id);
                ChatLogprob {
                    token,
                    logprob: lp.logprob,
                    bytes,
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(t, l)| {
                            let (token, bytes) = self.token_text(t);
                            TopLogprob {
                                token,
                                logprob: l,
                                bytes,
                            }
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// The legacy completion shape; `offset` is the choice's text length before these tokens.
    pub(super) fn completion_logprobs(
        &self,
        lps: &[(u32, TokenLogprobs)],
        offset: usize,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        let mut at = offset;
        for (id, lp) in lps {
            let (token, _) = self.token_text(*id);
            out.text_offset.push(at);
            at += token.len();
            out.tokens.push(token);
            out.token_logprobs.push(lp.logprob);
            let mut top = Map::new();
            for &(t, l) in &lp.top {
                top.insert(self.token_text(t).0, json!(l));
            }
            out.top_logprobs.push(top);
        }
        out
    }
}
