//! One reply in flight, as every dialect sees it: the batcher's events for a request go in, what
//! the client should be told comes out (`Update`), and when a stop string matched, the `Cancel`
//! the batcher must get. The rules every dialect shares live here once: text released through
//! `ReplyText` (so all dialects send the same text for the same tokens), tokens after a stop
//! string or a cancel dropped, log-probabilities held until the text of their tokens goes out,
//! and the usage's completion tokens at least the tokens this reply saw. Each dialect keeps only
//! what its wire needs beside it (the native session: delta indices, what the user heard, a paced
//! window; OpenAI: the choice's finish and index) and encodes the updates (frames, SSE chunks,
//! Realtime events). Pure: no actor, no socket; tested alone below.

use crate::engine::RequestId;
use crate::sampler::TokenLogprobs;
use crate::server::batcher::{Cancel, CancelReason, EventKind};
use crate::server::request::reply::{FinishReason, ReplyText, Timings, Usage};
use crate::server::request::RequestError;
use crate::tokenizer::TextTokenizer;

/// What a client is told about its reply, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// Still waiting: its place in the queue and an estimate of the wait.
    Queued {
        position: usize,
        eta_ms: Option<u64>,
    },
    /// The prompt is in: its tokens and those found in the cache.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// Text to send now, and the log-probabilities of the tokens it completes (when the request
    /// asked for them; text may be empty at the end when only log-probabilities are left).
    Delta {
        text: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
    },
    /// The reply ended.
    Finished {
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    Failed(RequestError),
}

/// What one event of the batcher means: the updates, and a cancel to send the batcher when a
/// stop string just matched.
#[derive(Debug, Default)]
pub struct Step {
    pub updates: Vec<Update>,
    pub cancel: Option<Cancel>,
}

pub struct ReplyStream {
    request: RequestId,
    text: ReplyText,
    /// A stop string matched or the client cancelled: later tokens are not the reply's.
    ending: bool,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending: Vec<(u32, TokenLogprobs)>,
}

impl ReplyStream {
    pub fn new(request: RequestId, stop: Vec<String>) -> Self {
        ReplyStream {
            request,
            text: ReplyText::new(stop),
            ending: false,
            pending: Vec::new(),
        }
    }

    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The reply's text so far (what was sent, its tokens, its stop strings).
    pub fn text(&self) -> &ReplyText {
        &self.text
    }

    /// The reply is ending (a stop string matched, or the client cancelled): tokens still on
    /// their way are dropped, and its end sends no held-back text.
    pub fn ending(&self) -> bool {
        self.ending
    }

    /// The client cancelled: from now on as `ending`.
    pub fn end(&mut self) {
        self.ending = true;
    }

    /// One event of the batcher for this reply.
    pub fn on_event(&mut self, kind: EventKind, tok: &TextTokenizer) -> Step {
        let mut step = Step::default();
        match kind {
            EventKind::Queued { position, eta_ms } => {
                step.updates.push(Update::Queued { position, eta_ms })
            }
            EventKind::Started {
                prompt_tokens,
                cached_tokens,
            } => step.updates.push(Update::Started {
                prompt_tokens,
                cached_tokens,
            }),
            EventKind::Token { id, logprobs } => {
                if self.ending {
                    return step;
                }
                if let Some(lp) = logprobs {
                    self.pending.push((id, lp));
                }
                let text = self.text.push(tok, id);
                if self.text.stopped() {
                    self.ending = true;
                    step.cancel = Some(Cancel {
                        request: self.request,
                        reason: CancelReason::StopString,
                    });
                }
                if !text.is_empty() {
                    step.updates.push(Update::Delta {
                        text,
                        logprobs: std::mem::take(&mut self.pending),
                    });
                }
            }
            EventKind::Finished {
                reason,
                mut usage,
                timings,
            } => {
                let rest = if self.ending {
                    String::new()
                } else {
                    self.text.finish(tok)
                };
                if !rest.is_empty() || !self.pending.is_empty() {
                    step.updates.push(Update::Delta {
                        text: rest,
                        logprobs: std::mem::take(&mut self.pending),
                    });
                }
                usage.completion_tokens = usage.completion_tokens.max(self.text.tokens());
                step.updates.push(Update::Finished {
                    reason,
                    usage,
                    timings,
                });
            }
            EventKind::Failed(e) => step.updates.push(Update::Failed(e)),
        }
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TextTokenizer;

    /// The tiny Llama 3 fixture's tokenizer (Llama 3's vocabulary), unpacked once.
    fn tokenizer() -> TextTokenizer {
        use std::io::Read;
        static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
        let dir = DIR.get_or_init(|| {
            let fx = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
            let f = std::fs::File::open(fx.join("llama3-tiny/tokenizer.json.xz")).unwrap();
            let mut json = Vec::new();
            xz2::read::XzDecoder::new(f).read_to_end(&mut json).unwrap();
            let dir =
                std::env::temp_dir().join(format!("llama-relay-stream-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("tokenizer.json"), json).unwrap();
            dir
        });
        TextTokenizer::from_hf_dir(dir, &[]).unwrap()
    }

    /// `text` as token ids, one event each.
    fn tokens(tok: &TextTokenizer, text: &str) -> Vec<u32> {
        tok.inner().encode(text, false).unwrap().get_ids().to_vec()
    }

    fn token(id: u32) -> EventKind {
        EventKind::Token { id, logprobs: None }
    }

    fn finished(completion_tokens: usize) -> EventKind {
        EventKind::Finished {
            reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens,
                cached_tokens: 0,
                ..Usage::default()
            },
            timings: Timings::default(),
        }
    }

    fn texts(steps: &[Step]) -> String {
        steps
            .iter()
            .flat_map(|s| &s.updates)
            .filter_map(|u| match u {
                Update::Delta { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_cancels_once() {
        let tok = tokenizer();
        let ids = tokens(&tok, "Hello there. User: more words after the stop");
        let mut r = ReplyStream::new(RequestId(7), vec!["User:".into()]);
        let steps: Vec<Step> = ids.iter().map(|&id| r.on_event(token(id), &tok)).collect();
        assert_eq!(texts(&steps), "Hello there. ");
        let cancels: Vec<_> = steps.iter().filter_map(|s| s.cancel.as_ref()).collect();
        assert_eq!(cancels.len(), 1);
        assert_eq!(cancels[0].request, RequestId(7));
        assert_eq!(cancels[0].reason, CancelReason::StopString);
        assert!(r.ending());
        // Tokens after the match are not the reply's; the end adds no text, and the usage counts
        // at least the tokens the reply took up to the match (the batcher may report fewer).
        let seen = r.text().tokens();
        assert!(seen < ids.len());
        let end = r.on_event(finished(0), &tok);
        match &end.updates[..] {
            [Update::Finished { usage, .. }] => assert_eq!(usage.completion_tokens, seen),
            u => panic!("{u:?}"),
        }
    }

    #[test]
    fn held_back_text_goes_out_at_the_end_with_the_pending_logprobs() {
        let tok = tokenizer();
        let ids = tokens(&tok, "All done. User");
        let mut r = ReplyStream::new(RequestId(1), vec![" User:".into()]);
        let lp = |id: u32| TokenLogprobs {
            logprob: -(id as f32),
            top: Vec::new(),
        };
        let steps: Vec<Step> = ids
            .iter()
            .map(|&id| {
                let logprobs = Some(lp(id));
                r.on_event(EventKind::Token { id, logprobs }, &tok)
            })
            .collect();
        // " User" might still become " User:": held back, its log-probabilities with it.
        let sent = texts(&steps);
        assert_eq!(sent, "All done.");
        let sent_lps: usize = steps
            .iter()
            .flat_map(|s| &s.updates)
            .map(|u| match u {
                Update::Delta { logprobs, .. } => logprobs.len(),
                _ => 0,
            })
            .sum();
        let end = r.on_event(finished(ids.len()), &tok);
        match &end.updates[..] {
            [Update::Delta { text, logprobs }, Update::Finished { usage, .. }] => {
                assert_eq!(format!("{sent}{text}"), "All done. User");
                assert!(!logprobs.is_empty());
                assert_eq!(sent_lps + logprobs.len(), ids.len());
                assert_eq!(usage.completion_tokens, ids.len());
            }
            u => panic!("{u:?}"),
        }
    }

    #[test]
    fn after_a_cancel_tokens_in_flight_are_dropped_and_nothing_held_is_sent() {
        let tok = tokenizer();
        let ids = tokens(&tok, "Fine. User");
        let mut r = ReplyStream::new(RequestId(2), vec!["User:".into()]);
        for &id in &ids {
            r.on_event(token(id), &tok);
        }
        r.end();
        let late = r.on_event(token(ids[0]), &tok);
        assert!(late.updates.is_empty() && late.cancel.is_none());
        let end = r.on_event(finished(ids.len() + 1), &tok);
        assert!(matches!(
            &end.updates[..],
            [Update::Finished { usage, .. }] if usage.completion_tokens == ids.len() + 1
        ));
        assert_eq!(r.text().sent(), "Fine. ");
    }

    #[test]
    fn queue_start_and_failure_pass_through_in_order() {
        let tok = tokenizer();
        let mut r = ReplyStream::new(RequestId(3), Vec::new());
        let queued = EventKind::Queued {
            position: 2,
            eta_ms: Some(40),
        };
        assert_eq!(
            r.on_event(queued, &tok).updates,
            [Update::Queued {
                position: 2,
                eta_ms: Some(40)
            }]
        );
        let started = EventKind::Started {
            prompt_tokens: 9,
            cached_tokens: 4,
        };
        assert_eq!(
            r.on_event(started, &tok).updates,
            [Update::Started {
                prompt_tokens: 9,
                cached_tokens: 4
            }]
        );
        let failed = EventKind::Failed(RequestError::Internal("boom".into()));
        assert_eq!(
            r.on_event(failed, &tok).updates,
            [Update::Failed(RequestError::Internal("boom".into()))]
        );
    }
}
