//! Per-object error backoff, as controller-runtime's rate limiter does it: an object whose
//! reconciles keep failing is retried after twice the wait of its last failure, from a short
//! base up to a cap, and a reconcile that succeeds resets it. A flat requeue hammers the API
//! server with a broken object forever and retries a transient failure no sooner than a
//! permanent one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// The wait after an object's first failure.
pub const BASE: Duration = Duration::from_secs(1);
/// The longest wait between retries of a failing object.
pub const CAP: Duration = Duration::from_secs(300);

/// Failures in a row, per object (by uid).
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    failures: Mutex<HashMap<String, u32>>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(BASE, CAP)
    }
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Notes one more failure of `key` and returns how long to wait before retrying it:
    /// the base doubled once per earlier failure in a row, at most the cap.
    pub fn failed(&self, key: &str) -> Duration {
        let mut f = self.failures.lock().expect("not poisoned");
        let n = f.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        wait(self.base, self.cap, *n)
    }

    /// `key` reconciled: its next failure waits the base again.
    pub fn succeeded(&self, key: &str) {
        self.failures.lock().expect("not poisoned").remove(key);
    }
}

/// The wait after the `n`th failure in a row (n >= 1).
fn wait(base: Duration, cap: Duration, n: u32) -> Duration {
    let factor = 2u32.checked_pow(n.saturating_sub(1)).unwrap_or(u32::MAX);
    base.checked_mul(factor).map_or(cap, |d| d.min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_per_failure_up_to_the_cap_and_a_success_resets_them() {
        let b = Backoff::default();
        let waits: Vec<u64> = (0..12).map(|_| b.failed("a").as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        // Another object's failures are its own.
        assert_eq!(b.failed("b"), BASE);
        b.succeeded("a");
        assert_eq!(b.failed("a"), BASE);
        // However long it has failed, the wait stays at the cap.
        assert_eq!(wait(BASE, CAP, u32::MAX), CAP);
    }
}
