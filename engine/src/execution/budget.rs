//! Exact accounting of device memory. Every device allocation the engine makes is
//! charged here first and refused when it would exceed the capacity, so the CPU backend
//! reports, byte for byte, what a GPU of that size would hold.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::{Error, Result};

#[derive(Debug, Default)]
struct State {
    used: u64,
    peak: u64,
    by_kind: BTreeMap<&'static str, u64>,
    peak_by_kind: BTreeMap<&'static str, u64>,
}

/// One device's memory budget.
#[derive(Debug)]
pub struct DeviceBudget {
    pub rank: usize,
    pub capacity: u64,
    state: Mutex<State>,
}

/// A charge against a budget, returned when dropped.
#[derive(Debug)]
pub struct Allocation {
    budget: Arc<DeviceBudget>,
    kind: &'static str,
    bytes: u64,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut s = self.budget.state.lock().expect("budget lock");
        s.used -= self.bytes;
        *s.by_kind.entry(self.kind).or_default() -= self.bytes;
    }
}

impl DeviceBudget {
    pub fn new(rank: usize, capacity: u64) -> Arc<Self> {
        Arc::new(DeviceBudget {
            rank,
            capacity,
            state: Mutex::default(),
        })
    }

    /// Charges `bytes` of `kind` (weights in slots, resident weights, ...) named `what`.
    pub fn charge(
        self: &Arc<Self>,
        kind: &'static str,
        what: &str,
        bytes: u64,
    ) -> Result<Allocation> {
        let mut s = self.state.lock().expect("budget lock");
        if s.used + bytes > self.capacity {
            return Err(Error::OutOfDeviceMemory {
                rank: self.rank,
                what: what.to_string(),
                need: bytes,
                free: self.capacity - s.used,
                capacity: self.capacity,
            });
        }
        s.used += bytes;
        s.peak = s.peak.max(s.used);
        let k = s.by_kind.entry(kind).or_default();
        *k += bytes;
        let now = *k;
        let p = s.peak_by_kind.entry(kind).or_default();
        *p = (*p).max(now);
        Ok(Allocation {
            budget: self.clone(),
            kind,
            bytes,
        })
    }

    pub fn used(&self) -> u64 {
        self.state.lock().expect("budget lock").used
    }
    pub fn peak(&self) -> u64 {
        self.state.lock().expect("budget lock").peak
    }
    /// Peak bytes per kind of allocation.
    pub fn peak_by_kind(&self) -> BTreeMap<&'static str, u64> {
        self.state.lock().expect("budget lock").peak_by_kind.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_past_capacity_and_releases_on_drop() {
        let b = DeviceBudget::new(0, 100);
        let a = b.charge("slot", "slot 0", 60).unwrap();
        let e = b.charge("slot", "slot 1", 60).unwrap_err().to_string();
        assert!(e.contains("slot 1") && e.contains("40 of 100 free"), "{e}");
        drop(a);
        let _c = b.charge("slot", "slot 1", 60).unwrap();
        assert_eq!(b.used(), 60);
        assert_eq!(b.peak(), 60);
    }
}
