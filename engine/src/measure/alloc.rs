//! A counting global allocator: the system allocator with live bytes and high-water marks
//! kept in relaxed atomics. A binary opts in with
//! `#[global_allocator] static A: CountingAlloc = CountingAlloc;` (the `layerwise` binary
//! does, and so do the test binaries that measure); elsewhere the counters stay at zero
//! and [`installed`] says so, so nobody reads a zero as a measurement.
//!
//! Besides the process-wide high-water mark, [`WATCHES`] slots keep one high-water mark
//! each for the phases open at once (rank threads measure their passes side by side): an
//! allocation raises every open watch, at the cost of a few relaxed atomics, and a phase
//! reads its own watch without disturbing the others.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// Phases that can be open at once; a phase that finds none free goes unmeasured.
pub const WATCHES: usize = 32;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// Bit i set: watch i is open.
static OPEN: AtomicU32 = AtomicU32::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static WATCH_PEAK: [AtomicU64; WATCHES] = [ZERO; WATCHES];

/// The system allocator, counted.
pub struct CountingAlloc;

fn grew(by: usize) {
    let live = LIVE.fetch_add(by as u64, Relaxed) + by as u64;
    PEAK.fetch_max(live, Relaxed);
    let mut open = OPEN.load(Relaxed);
    while open != 0 {
        let i = open.trailing_zeros() as usize;
        WATCH_PEAK[i].fetch_max(live, Relaxed);
        open &= open - 1;
    }
}

fn shrank(by: usize) {
    LIVE.fetch_sub(by as u64, Relaxed);
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds GlobalAlloc's
// contract; the counters are only read and written with atomics and never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            if !INSTALLED.load(Relaxed) {
                INSTALLED.store(true, Relaxed);
            }
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            if !INSTALLED.load(Relaxed) {
                INSTALLED.store(true, Relaxed);
            }
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // Counted as the new block arriving before the old one leaves, as a moving
            // realloc holds both for a moment.
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

/// Whether this process counts its allocations (its binary installed [`CountingAlloc`]).
pub fn installed() -> bool {
    INSTALLED.load(Relaxed)
}

/// Heap bytes live now.
pub fn live() -> u64 {
    LIVE.load(Relaxed)
}

/// The most heap bytes live at once since the start or the last [`reset_peak`].
pub fn peak() -> u64 {
    PEAK.load(Relaxed).max(live())
}

/// Starts the process-wide high-water mark again from what is live now.
pub fn reset_peak() {
    PEAK.store(live(), Relaxed);
}

/// Opens a watch starting at what is live now; `None` when all [`WATCHES`] are open.
pub(super) fn open_watch() -> Option<(usize, u64)> {
    let mut open = OPEN.load(Relaxed);
    loop {
        let i = (!open).trailing_zeros() as usize;
        if i >= WATCHES {
            return None;
        }
        let start = live();
        // Set before the bit, so an allocation that sees the bit raises a fresh mark.
        WATCH_PEAK[i].store(start, Relaxed);
        match OPEN.compare_exchange_weak(open, open | 1 << i, Relaxed, Relaxed) {
            Ok(_) => return Some((i, start)),
            Err(now) => open = now,
        }
    }
}

/// The high-water mark of watch `i` so far.
pub(super) fn watch_peak(i: usize) -> u64 {
    WATCH_PEAK[i].load(Relaxed).max(live())
}

/// Closes watch `i`.
pub(super) fn close_watch(i: usize) {
    OPEN.fetch_and(!(1 << i), Relaxed);
}
