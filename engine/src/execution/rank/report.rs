//! What a rank did, as [`RankResult`]: K, the blocks it kept, its stalls and step times, the
//! bytes it moved and its memory peak. The rank adds up its [`Tally`] and its pipeline's
//! counters here when it exits; `RunStats` and the server's metrics read the result.

use std::collections::BTreeMap;
use std::time::Duration;

use super::state::RankWork;
use crate::execution::backend::{Backend, Collective};
use crate::Result;

/// What one rank did, for `RunStats`.
pub struct RankResult {
    /// K this rank ran with.
    pub slots: usize,
    /// Blocks of each streamed group this rank kept on the device (what
    /// `--resident-blocks auto` chose).
    pub resident_blocks: usize,
    /// Compute waiting for weights, in passes where this rank had work.
    pub stall: Duration,
    /// Time of this rank's denoising steps (passes that completed a step).
    pub step_time: Duration,
    pub steps: usize,
    /// Time of the passes where this rank computed (steps and other passes alike).
    pub busy_time: Duration,
    /// Stall and time of the busy passes that switched groups (the pass after a pass
    /// over another group: text encoder to transformer, one expert to the other).
    pub switch_stall: Duration,
    pub switch_time: Duration,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    /// Bytes of `bytes_copied` that went through the staging ring.
    pub bytes_staged: u64,
    /// Page-locked host bytes this rank held for staging, at their peak.
    pub pinned_host_bytes: u64,
    pub peak: u64,
    pub peak_by_kind: BTreeMap<&'static str, u64>,
    /// Per phase, the most bytes a busy pass or a decode held above its start
    /// ([`crate::measure`]).
    pub measured: crate::measure::PhasePeaks,
    /// Bytes of an element of the dtype its blocks computed in.
    pub compute_bytes: u64,
    /// Blocks it computed; blocks of its busy passes its request's step cache did not
    /// compute; blocks of its passes no rank computed (never moved); blocks moved ahead
    /// of a vote that then skipped them.
    pub blocks_computed: u64,
    pub blocks_saved: u64,
    pub blocks_skipped: u64,
    pub blocks_dropped: u64,
}

impl<B: Backend, C: Collective<B>> RankWork<'_, B, C> {
    /// At exit: adds the stall the device measured but had not reported yet (its timing
    /// events are read back a few blocks late), counted when the last passes were busy,
    /// and returns what this rank did with K = `slots`.
    pub(super) fn finish(self, slots: usize) -> Result<RankResult> {
        let late = self.pipe.drain_stall()?;
        let t = self.tally;
        let s = self.pipe.stats().clone();
        Ok(RankResult {
            slots,
            resident_blocks: self.run.streamed.resident_blocks,
            stall: if t.last_busy { t.stall + late } else { t.stall },
            step_time: t.step_time,
            steps: t.steps,
            busy_time: t.busy_time,
            switch_stall: t.switch_stall,
            switch_time: t.switch_time,
            bytes_copied: s.bytes_copied,
            bytes_gathered: s.bytes_gathered,
            bytes_staged: s.bytes_staged,
            pinned_host_bytes: s.pinned_host_bytes,
            peak: self.budget.peak(),
            peak_by_kind: self.budget.peak_by_kind(),
            measured: t.measured,
            compute_bytes: self.run.dtype.size_in_bytes() as u64,
            blocks_computed: t.blocks_computed,
            blocks_saved: t.blocks_saved,
            blocks_skipped: s.blocks_skipped,
            blocks_dropped: s.blocks_dropped,
        })
    }
}
