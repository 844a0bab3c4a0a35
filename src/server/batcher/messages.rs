//! What the batcher is sent and what it sends: `Submit` and the other messages sessions and
//! handlers post, and the events of a reply (`GenerationEvent`) through its `ReplyTo`.

use crate::server::batcher::*;

/// A fresh request id, unique in the process (sessions allocate them so that events can never
/// arrive for an id the session does not know yet).
pub fn next_request_id() -> RequestId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    RequestId(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// What a session hears about its request.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct GenerationEvent {
    pub request: RequestId,
    pub kind: EventKind,
}

#[derive(Debug, Clone)]
pub enum EventKind {
    /// Still waiting: its place in the queue changed (at most every `QUEUE_UPDATE`), with an
    /// estimate of the wait from how fast requests have been starting.
    Queued {
        position: usize,
        eta_ms: Option<u64>,
    },
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Token {
        id: u32,
        /// When the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    Failed(RequestError),
}

/// Where a request's events go: a WebSocket session actor, or the stream of an HTTP response
/// (the OpenAI API). Either way, one that no longer connects cancels the request, and one that
/// leaves more than `max_queued_frames` events untaken loses it (`outbox`).
#[derive(Clone)]
pub struct ReplyTo {
    sink: Sink,
    pub(super) backlog: Arc<Backlog>,
    /// Set by a session whose connection dropped and which waits to be resumed: its request goes
    /// on and nothing is sent (the batcher keeps the reply's token ids for the resume).
    pub(super) parked: Option<Arc<AtomicBool>>,
}

#[derive(Clone)]
enum Sink {
    Session(Recipient<GenerationEvent>),
    Stream(tokio::sync::mpsc::UnboundedSender<GenerationEvent>),
}

impl ReplyTo {
    /// A session actor, which calls `backlog.taken()` for each event it handles.
    pub fn session(to: Recipient<GenerationEvent>, backlog: Arc<Backlog>) -> Self {
        ReplyTo {
            sink: Sink::Session(to),
            backlog,
            parked: None,
        }
    }

    /// This sink, parked while `flag` is set (a session that can be resumed).
    pub fn parkable(mut self, flag: Arc<AtomicBool>) -> Self {
        self.parked = Some(flag);
        self
    }

    pub(super) fn is_parked(&self) -> bool {
        self.parked
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// A response stream, whose reader calls `backlog.taken()` for each event it receives.
    pub fn stream(
        to: tokio::sync::mpsc::UnboundedSender<GenerationEvent>,
        backlog: Arc<Backlog>,
    ) -> Self {
        ReplyTo {
            sink: Sink::Stream(to),
            backlog,
            parked: None,
        }
    }

    pub(super) fn send(&self, ev: GenerationEvent) {
        if self.is_parked() {
            return;
        }
        self.backlog.posted();
        match &self.sink {
            Sink::Session(r) => r.do_send(ev),
            Sink::Stream(s) => {
                // A closed stream is noticed at the next step (`connected`).
                let _ = s.send(ev);
            }
        }
    }

    pub(super) fn connected(&self) -> bool {
        if self.is_parked() {
            return true;
        }
        match &self.sink {
            Sink::Session(r) => r.connected(),
            Sink::Stream(s) => !s.is_closed(),
        }
    }
}

/// A session's connection dropped and it waits to be resumed (its `ReplyTo`'s flag is already
/// set): its request goes on for `grace`, then ends as if disconnected.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Park {
    pub request: RequestId,
    pub grace: Duration,
}

/// A resumed session takes over a parked request: its events from now on go to `reply_to`, and
/// the answer is the request's events so far (`started`, every token, and its end if it ended
/// while parked), for the session to rebuild the reply from. `None`: the request is gone (it
/// failed, or the grace ran out).
#[derive(Message)]
#[rtype(result = "Option<Vec<EventKind>>")]
pub struct Resume {
    pub request: Option<RequestId>,
    pub lease: LeaseKey,
    pub reply_to: ReplyTo,
}

/// Queue a generation.
#[derive(Message)]
#[rtype(result = "Result<usize, RequestError>")]
pub struct Submit {
    pub request: RequestId,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub priority: Priority,
    /// Which cached blocks the request may share (from its server-side identity).
    pub scope: crate::kv_cache::CacheScope,
    /// The session's lease key: its conversation's blocks stay cached for its next turn.
    pub lease: Option<LeaseKey>,
    /// Its prompt dropped the conversation's oldest turns (`Prompt::dropped`): the kept ones may
    /// be shifted from the lease rather than prefilled again (`cache.context_shift`).
    pub shift: bool,
    /// Report log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// More choices of the same prompt (one prefill); their events go to `reply_to` too.
    pub forks: Vec<Fork>,
    pub reply_to: ReplyTo,
    /// The tenant's share of the scheduler.
    pub quota: Quota,
    /// A paced reply: the tokens it may generate before its client allows more (`Allow`).
    pub window: Option<usize>,
    /// The grammar of its response format.
    pub constraint: Option<crate::engine::constraint::Constraint>,
}

impl Submit {
    /// A validated request with its built prompt, whichever dialect it came in: its settings, the
    /// blocks it may share and the tenant's quota. No lease, log-probabilities or forks: a
    /// dialect that has them sets them.
    pub fn new(
        request: RequestId,
        valid: &ValidRequest,
        prompt: Prompt,
        quota: Quota,
        reply_to: ReplyTo,
    ) -> Self {
        Submit {
            request,
            prompt: prompt.ids,
            sampling: valid.sampling.clone(),
            max_tokens: valid.max_tokens,
            ignore_eos: valid.ignore_eos,
            priority: valid.priority,
            scope: prompt.scope,
            lease: None,
            shift: prompt.dropped.is_some(),
            logprobs: None,
            forks: Vec::new(),
            reply_to,
            quota,
            window: valid.window,
            constraint: prompt.constraint,
        }
    }
}

/// A paced reply may generate up to `tokens` tokens in all (its client acknowledged what it
/// showed); it resumes decoding if it was paused below that.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Allow {
    pub request: RequestId,
    pub tokens: usize,
}

/// Stop a generation at the next step (idempotent).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel {
    pub request: RequestId,
    pub reason: CancelReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelReason {
    /// The client asked; the session reports `done` with `cancelled`. With `keep`, the
    /// session's lease keeps only the first `keep` tokens (prompt, then the reply as far as the
    /// user heard it).
    Client {
        keep: Option<usize>,
    },
    /// A stop string matched; the session reports `done` with `stop`.
    StopString,
    Disconnected,
}

/// A session closed: its lease goes after the grace period (unless it comes back).
#[derive(Message)]
#[rtype(result = "()")]
pub struct EndLease {
    pub lease: LeaseKey,
}

/// Prefill a session's draft (its conversation plus the message being typed) into its lease,
/// with only what the step-time target leaves beside running replies. The session's next
/// draft, its next `Submit` or its `EndLease` ends it, the lease keeping what was computed; it
/// is dropped when interactive requests wait for a slot. Nothing is reported back.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Draft {
    pub prompt: Vec<u32>,
    pub scope: crate::kv_cache::CacheScope,
    pub lease: LeaseKey,
    pub quota: Quota,
}

/// Prefill a prefix (a configured system prompt) and keep it cached for good.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PinPrefix {
    pub tokens: Vec<u32>,
    /// The tenant whose principals share it.
    pub tenant: crate::kv_cache::Salt,
}

/// Stop admitting; finish what runs within `deadline`, then end the rest with `shutdown`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown {
    pub deadline: Duration,
}

/// How many requests are in flight (for graceful shutdown and tests).
#[derive(Message)]
#[rtype(result = "BatcherStatus")]
pub struct GetStatus;

#[derive(Debug, Clone, Copy, PartialEq, Eq, MessageResponse)]
pub struct BatcherStatus {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Blocks held between requests: session leases and pinned prefixes (the idle level).
    pub kv_blocks_held: usize,
}
