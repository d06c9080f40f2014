//! How long compute waited for weights, measured on the device: timing-event pairs around
//! each compute-stream wait, read back once complete, so the host never blocks for them.

use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver as cu;

/// Device-side stall measurement: a ring of timing-event pairs recorded around each
/// compute-stream wait, read back once they have completed (so the figure lags by a few
/// blocks but never blocks the host). Allocated once.
pub(super) struct Timing {
    pub(super) pairs: Vec<(cu::CudaEvent, cu::CudaEvent, bool)>,
    pub(super) next: usize,
}

/// Timing pairs in flight per rank.
pub(super) const TIMING_PAIRS: usize = 32;

/// Adds up the stalls of completed timing pairs.
pub(super) fn harvest(t: &mut Timing) -> Duration {
    let mut sum = Duration::ZERO;
    for (a, b, busy) in t.pairs.iter_mut().filter(|p| p.2) {
        if b.try_is_complete().unwrap_or(true) {
            if let Ok(ms) = a.elapsed_ms(b) {
                sum += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            }
            *busy = false;
        }
    }
    sum
}
