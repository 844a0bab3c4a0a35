//! A token bucket (`rate` tokens a second, at most `burst` saved): how many frames one WebSocket
//! session may send, and how many of them may be refused, before the server stops reading what
//! it sends. Pure: the caller passes the time.

use std::time::Instant;

#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate: f64, burst: u32, now: Instant) -> Self {
        TokenBucket {
            rate,
            burst: f64::from(burst),
            tokens: f64::from(burst),
            last: now,
        }
    }

    /// Takes a token if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_then_the_rate() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut b = TokenBucket::new(2.0, 3, t0);
        assert!(b.take(t0) && b.take(t0) && b.take(t0));
        assert!(!b.take(t0));
        assert!(!b.take(at(400)));
        assert!(b.take(at(500)), "one token after half a second at 2/s");
        assert!(!b.take(at(600)));
        // Saving stops at the burst.
        assert!((0..3).all(|_| b.take(at(60_000))));
        assert!(!b.take(at(60_000)));
        // Time going backwards takes nothing away.
        assert!(!b.take(t0));
    }
}
