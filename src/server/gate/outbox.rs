//! What a client has not read yet: the bound on a slow reader.
//!
//! Two limits, because a client that stops reading stalls two queues:
//! - **Events** (`Backlog`): the batcher posts each token to the session actor's mailbox (or the
//!   API stream's channel), and the connection's handler takes it. The batcher counts what it
//!   posts, the handler what it takes; past `server.max_queued_frames` untaken, the batcher
//!   cancels the reply (its KV blocks go back at once) and the client gets `slow_reader`.
//! - **Bytes** (`watched`): actix writes a response body only as fast as the socket drains, and a
//!   body is polled only when there is room: the h1 dispatcher stops polling it while its write
//!   buffer is full, and with it the session actor, its heartbeat and its timers (which is why
//!   the heartbeat cannot catch a client that stops reading). A body that is woken at least every
//!   heartbeat (a session's ping timer, the API stream's peer check) but not polled for
//!   `server.write_timeout_s` has a client that drains nothing; a task beside the connection
//!   then resets the socket (`Peer::abort`), the dispatcher drops the connection, and the actor
//!   stops as on any disconnect.
//!
//! actix-web-actors exposes neither its outgoing buffer nor a write timeout, and actix-http has
//! none, so both are here; the socket is reached through the descriptor `Peer` records.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::Stream;

use crate::metrics::Metrics;
use crate::server::gate::peer::{Peer, SendProgress};

/// Events posted to a client's handler and not yet taken.
#[derive(Debug, Default)]
pub struct Backlog(AtomicUsize);

impl Backlog {
    pub fn new() -> Arc<Self> {
        Arc::new(Backlog::default())
    }

    /// One more posted; returns how many are now untaken.
    pub fn posted(&self) -> usize {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The handler took one.
    pub fn taken(&self) {
        // Saturating: a handler never takes more than was posted, but never wrap if it did.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    pub fn untaken(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// When a response body was last polled, in milliseconds since `origin`.
struct LastPoll {
    origin: Instant,
    ms: AtomicU64,
}

impl LastPoll {
    fn touch(&self) {
        let ms = self.origin.elapsed().as_millis() as u64;
        self.ms.store(ms, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        let now = self.origin.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.ms.load(Ordering::Relaxed)))
    }
}

/// A response body that records when it is polled (see the module doc).
pub struct Watched<S> {
    inner: S,
    last: Arc<LastPoll>,
}

impl<S: Stream + Unpin> Stream for Watched<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        self.last.touch();
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Wraps `body` and, when the connection's socket is known, watches it: not polled for
/// `timeout`, the socket is reset and `llama_relay_slow_readers_total{action="connection_closed"}`
/// rises. The body must be woken at least every `timeout / 2` while the client reads (a
/// heartbeat), or a quiet healthy client would be taken for a slow one. Call on the connection's
/// worker thread (a handler): the watch runs there too, which is what makes the descriptor safe
/// to use (see `watch`).
pub fn watched<S>(
    body: S,
    peer: Option<Peer>,
    timeout: Duration,
    metrics: Arc<Metrics>,
    on_reset: Option<Arc<AtomicBool>>,
) -> Watched<S> {
    let origin = Instant::now();
    let last = Arc::new(LastPoll {
        origin,
        ms: AtomicU64::new(0),
    });
    if let Some(peer) = peer {
        actix_web::rt::spawn(watch(
            Arc::downgrade(&last),
            peer,
            timeout,
            metrics,
            on_reset,
        ));
    }
    Watched { inner: body, last }
}

/// Checks a body's last poll a few times per `timeout` while the body lives. The body lives inside
/// the connection's dispatcher, which owns the socket: while `last` can be upgraded the
/// descriptor is the connection's own (not closed, not reused), and since this task runs on the
/// same thread nothing can drop the connection between the upgrade and `abort`.
/// `on_reset` is set before the reset (a session reset for not reading is not kept for a resume).
async fn watch(
    last: Weak<LastPoll>,
    peer: Peer,
    timeout: Duration,
    metrics: Arc<Metrics>,
    on_reset: Option<Arc<AtomicBool>>,
) {
    let tick = (timeout / 4).max(Duration::from_millis(50));
    let mut acks = AckWatch::new(Instant::now());
    loop {
        actix_web::rt::time::sleep(tick).await;
        let Some(last) = last.upgrade() else { return };
        let unacked =
            (peer.send_progress()).map_or(Duration::ZERO, |p| acks.stalled(p, Instant::now()));
        if last.idle() >= timeout || unacked >= timeout {
            metrics
                .slow_readers
                .with_label_values(&["connection_closed"])
                .inc();
            tracing::info!(
                idle_ms = last.idle().as_millis() as u64,
                unacknowledged_ms = unacked.as_millis() as u64,
                "a client read nothing for server.write_timeout_s; resetting its connection"
            );
            if let Some(f) = on_reset {
                f.store(true, Ordering::SeqCst);
            }
            peer.abort();
            return;
        }
    }
}

/// The second rule, for what the first cannot see: a send buffer big enough for the whole reply
/// (the kernel's autotuning, or `server.send_buffer_kib`) keeps the body polled while the client
/// reads nothing. Once the client's receive window is full nothing more is acknowledged, so
/// bytes waiting in the socket with none acknowledged for the timeout are a client that reads
/// nothing, whatever the buffers hold. (A client whose kernel buffers the whole reply unread
/// acknowledges it all and is not caught: that is memory of the client's, not the server's.)
#[derive(Debug)]
struct AckWatch {
    acked: u64,
    since: Instant,
}

impl AckWatch {
    fn new(now: Instant) -> Self {
        AckWatch {
            acked: 0,
            since: now,
        }
    }

    /// Takes a reading; returns how long bytes have waited with none acknowledged.
    fn stalled(&mut self, p: SendProgress, now: Instant) -> Duration {
        if !p.waiting || p.acked != self.acked {
            self.acked = p.acked;
            self.since = now;
        }
        now.saturating_duration_since(self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_waiting_unacknowledged_count_as_a_stall_and_any_ack_or_empty_socket_ends_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let p = |acked, waiting| SendProgress { acked, waiting };
        let mut w = AckWatch::new(t0);
        assert_eq!(
            w.stalled(p(100, true), t0),
            s(0),
            "the first acks are progress"
        );
        assert_eq!(w.stalled(p(100, true), t0 + s(3)), s(3));
        assert_eq!(w.stalled(p(100, true), t0 + s(5)), s(5));
        assert_eq!(
            w.stalled(p(101, true), t0 + s(6)),
            s(0),
            "one byte acknowledged"
        );
        assert_eq!(w.stalled(p(101, true), t0 + s(8)), s(2));
        assert_eq!(
            w.stalled(p(101, false), t0 + s(9)),
            s(0),
            "nothing waits: an idle client"
        );
        assert_eq!(w.stalled(p(101, false), t0 + s(30)), s(0));
        assert_eq!(
            w.stalled(p(101, true), t0 + s(31)),
            s(1),
            "counted from the last empty look"
        );
        assert_eq!(w.stalled(p(101, true), t0 + s(33)), s(3));
    }

    #[test]
    fn backlog_counts_posted_minus_taken_and_never_wraps() {
        let b = Backlog::new();
        assert_eq!(b.posted(), 1);
        assert_eq!(b.posted(), 2);
        b.taken();
        assert_eq!(b.untaken(), 1);
        b.taken();
        b.taken();
        assert_eq!(b.untaken(), 0);
    }

    #[test]
    fn a_poll_resets_the_idle_time() {
        let last = LastPoll {
            origin: Instant::now() - Duration::from_secs(5),
            ms: AtomicU64::new(0),
        };
        assert!(last.idle() >= Duration::from_secs(5));
        last.touch();
        assert!(last.idle() < Duration::from_secs(1));
    }
}
