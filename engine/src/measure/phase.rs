//! A measured phase: the most bytes held above what was live when it began. On the heap
//! (the CPU backend) from one of the counting allocator's watches; on a device from
//! whatever high-water mark its backend can read ([`DevicePeak`]). A heap phase counts
//! every thread's allocations, so phases that overlap in one process (CPU ranks running
//! side by side) each see the others' too: an upper bound, exact for one rank.

use super::alloc;

/// A device's own high-water mark over a phase (CUDA: its memory pool's).
pub trait DevicePeak: Send {
    /// The most bytes held above the phase's start so far; `None` when the device cannot
    /// say.
    fn peak_above_start(&self) -> Option<u64>;
}

enum Source {
    Heap { watch: usize, start: u64 },
    Device(Box<dyn DevicePeak>),
    Unmeasured,
}

/// One open phase. Dropping it closes the watch.
pub struct Phase(Source);

impl Phase {
    /// A phase measured on the heap, or unmeasured when the counting allocator is not
    /// installed or every watch is open.
    pub fn heap() -> Phase {
        if !alloc::installed() {
            return Phase(Source::Unmeasured);
        }
        match alloc::open_watch() {
            Some((watch, start)) => Phase(Source::Heap { watch, start }),
            None => Phase(Source::Unmeasured),
        }
    }

    /// A phase measured by a device's own high-water mark.
    pub fn device(peak: Box<dyn DevicePeak>) -> Phase {
        Phase(Source::Device(peak))
    }

    /// A phase nothing can measure.
    pub fn unmeasured() -> Phase {
        Phase(Source::Unmeasured)
    }

    /// The most bytes held above the phase's start so far; `None` when unmeasured.
    pub fn peak(&self) -> Option<u64> {
        match &self.0 {
            Source::Heap { watch, start } => Some(alloc::watch_peak(*watch).saturating_sub(*start)),
            Source::Device(d) => d.peak_above_start(),
            Source::Unmeasured => None,
        }
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        if let Source::Heap { watch, .. } = self.0 {
            alloc::close_watch(watch);
        }
    }
}
