//! When things go: closed sessions' leases and parked sessions' requests, in time order, so a
//! step (or the idle sweep) looks only at the ones due.

use crate::server::batcher::*;

/// How often an idle batcher looks for expired leases and parked replies (a step looks too).
pub(super) const EXPIRY_SWEEP: Duration = Duration::from_secs(1);

/// When things go (closed sessions' leases, parked sessions' requests), in time order: each step
/// looks only at the ones due.
pub(super) struct Expiry<K> {
    pub(super) by_time: std::collections::BTreeSet<(Instant, K)>,
    pub(super) at: HashMap<K, Instant>,
}

pub(super) type LeaseExpiry = Expiry<LeaseKey>;

impl<K> Default for Expiry<K> {
    fn default() -> Self {
        Expiry {
            by_time: Default::default(),
            at: HashMap::new(),
        }
    }
}

impl<K: Copy + Ord + std::hash::Hash> Expiry<K> {
    pub(super) fn set(&mut self, k: K, t: Instant) {
        self.remove(&k);
        self.by_time.insert((t, k));
        self.at.insert(k, t);
    }

    pub(super) fn remove(&mut self, k: &K) {
        if let Some(t) = self.at.remove(k) {
            self.by_time.remove(&(t, *k));
        }
    }

    pub(super) fn len(&self) -> usize {
        self.at.len()
    }

    /// Removes and returns the keys due at `now`.
    pub(super) fn due(&mut self, now: Instant) -> Vec<K> {
        let mut out = Vec::new();
        while let Some(&(t, k)) = self.by_time.first() {
            if t > now {
                break;
            }
            self.by_time.pop_first();
            self.at.remove(&k);
            out.push(k);
        }
        out
    }
}
