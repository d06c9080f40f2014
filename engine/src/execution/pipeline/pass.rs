//! A pass over one group: blocks computed in order, each from its slot once its weights
//! are ready (or from its own buffers when it stays), while the blocks after it, and the
//! first of the next pass's group, keep being issued into the freed slots.

use std::time::Duration;

use super::block_weights::BlockWeights;
use super::setup::Pipeline;
use crate::execution::backend::{Backend, Collective};
use crate::execution::weights::Weights;
use crate::{Error, Result};

impl<B: Backend, C: Collective<B>> Pipeline<B, C> {
    /// Runs one pass over every block of group `group` in order, calling
    /// `f(block, weights)` for each. `next` names the group of the pass that follows, if
    /// one does, so its first blocks are prefetched while this pass's last blocks compute.
    /// Every rank of the collective group must make the same sequence of calls (lockstep
    /// by group and block index).
    pub fn pass(
        &mut self,
        group: usize,
        next: Option<usize>,
        mut f: impl FnMut(usize, &dyn Weights) -> Result<()>,
    ) -> Result<()> {
        let layouts = self.streamed.layouts.clone();
        let layout = layouts.get(group).ok_or_else(|| {
            Error::bug(format!(
                "group: {group}: the model has {} groups",
                layouts.len()
            ))
        })?;
        let l = layout.blocks.len();
        let k = self.slots.len();
        // The blocks of this pass and of the next one that stream; kept blocks compute
        // from their own buffers while the streamed ones keep arriving.
        let streamed: Vec<usize> = (0..l).filter(|&b| !self.kept[group][b]).collect();
        let next_streamed: Vec<usize> = next
            .map(|g| {
                (0..self.kept[g].len())
                    .filter(|&b| !self.kept[g][b])
                    .collect()
            })
            .unwrap_or_default();
        // Blocks of this pass already in flight were prefetched by the pass before.
        if let (Some(&(g, b, _)), Some(&first)) = (self.in_flight.front(), streamed.first()) {
            if (g, b) != (group, first) {
                return Err(self.rank_error(Error::bug(format!(
                    "pipeline: pass over group {group} but block {b} of group {g} was prefetched"
                ))));
            }
        }
        // A pass that streams nothing leaves what is already in flight to the pass it was
        // issued for, and issues nothing more.
        let hold = streamed.is_empty() && !self.in_flight.is_empty();
        // The issue order from here: the rest of this pass, then the next pass's blocks.
        let mut cursor = (false, self.in_flight.len());
        let identity: Vec<usize> = (0..layout.dtypes.len()).collect();
        for i in 0..l {
            while !hold && self.in_flight.len() < k {
                match cursor {
                    (false, n) if n < streamed.len() => {
                        self.issue(group, streamed[n]);
                        cursor.1 += 1;
                    }
                    (false, _) => cursor = (true, 0),
                    (true, n) if n < next_streamed.len() => {
                        self.issue(next.expect("next has blocks"), next_streamed[n]);
                        cursor.1 += 1;
                    }
                    (true, _) => break,
                }
            }
            if self.kept[group][i] {
                let w = BlockWeights::view(
                    &self.resident[group][i],
                    &identity,
                    &layout.blocks[i],
                    self.opts.dtype,
                )?;
                f(i, &w)?;
                self.stats.blocks_computed += 1;
                continue;
            }
            let (g, block, s) = self.in_flight.pop_front().expect("issued ahead");
            debug_assert_eq!((g, block), (group, i));
            let stall = self
                .backend
                .compute_wait(&self.slots[s].ready)
                .map_err(|e| self.rank_error(e))?;
            self.stats.stall += stall;
            let w = BlockWeights::view(
                &self.slots[s].buffers,
                &self.streamed.shape.region_of[group],
                &layout.blocks[i],
                self.opts.dtype,
            )?;
            let r = f(i, &w);
            drop(w);
            self.backend.compute_record(&self.slots[s].free);
            self.stats.blocks_computed += 1;
            r?;
        }
        Ok(())
    }

    /// At the end of a run: adds the stall the backend had not reported yet, and
    /// returns it.
    pub fn drain_stall(&mut self) -> Result<Duration> {
        let late = self.backend.drain_stall().map_err(|e| self.rank_error(e))?;
        self.stats.stall += late;
        Ok(late)
    }
}
