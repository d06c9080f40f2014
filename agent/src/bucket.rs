//! A token bucket for the prewarm bandwidth cap. Pure: time comes in as seconds since an
//! origin the caller picks, so tests drive it without sleeping.
//!
//! Readers *reserve* bytes: the bucket may go into debt, and the reply is how long the
//! reader must wait before its read, so a reservation never has to be retried and many
//! threads sharing one bucket still add up to the cap.

/// Bytes per second with a burst allowance.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: f64,
}

impl TokenBucket {
    /// A bucket refilling at `rate` bytes/s, holding at most `burst` bytes, full at time `now`.
    pub fn new(rate: u64, burst: u64, now: f64) -> Self {
        let burst = burst.max(1) as f64;
        TokenBucket {
            rate: rate.max(1) as f64,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Reserves `bytes` at time `now` and returns how many seconds to wait before using them.
    pub fn reserve(&mut self, bytes: u64, now: f64) -> f64 {
        if now > self.last {
            self.tokens = (self.tokens + (now - self.last) * self.rate).min(self.burst);
            self.last = now;
        }
        self.tokens -= bytes as f64;
        if self.tokens >= 0.0 {
            0.0
        } else {
            -self.tokens / self.rate
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_is_free_then_rate_holds() {
        let mut b = TokenBucket::new(100, 50, 0.0);
        assert_eq!(b.reserve(50, 0.0), 0.0);
        // 100 more bytes at 100 B/s: wait one second.
        assert!((b.reserve(100, 0.0) - 1.0).abs() < 1e-9);
        // Another 100 queued behind it: two seconds from now.
        assert!((b.reserve(100, 0.0) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn long_run_matches_the_rate() {
        // Simulate a reader that sleeps exactly as told: 300 MB at 100 MB/s takes ~3 s.
        let mut b = TokenBucket::new(100_000_000, 8 << 20, 0.0);
        let mut t = 0.0;
        for _ in 0..300 {
            t += b.reserve(1_000_000, t);
        }
        assert!(
            (t - (300e6 - (8u64 << 20) as f64) / 100e6).abs() < 1e-6,
            "{t}"
        );
    }

    #[test]
    fn idle_time_refills_only_up_to_the_burst() {
        let mut b = TokenBucket::new(10, 20, 0.0);
        assert_eq!(b.reserve(20, 0.0), 0.0);
        // A long idle period refills to 20, not 10 000.
        assert_eq!(b.reserve(20, 1000.0), 0.0);
        assert!((b.reserve(10, 1000.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn threads_sharing_a_bucket_add_up_to_the_cap() {
        // Four readers interleaving reservations at the same instant queue one behind another.
        let mut b = TokenBucket::new(1000, 1, 0.0);
        let waits: Vec<f64> = (0..4).map(|_| b.reserve(1000, 0.0)).collect();
        for (i, w) in waits.iter().enumerate() {
            assert!((w - (i as f64 + 1.0 - 0.001)).abs() < 1e-9, "{waits:?}");
        }
    }
}
