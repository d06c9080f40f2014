//! A pass over one group: blocks computed in order, each from its slot once its weights
//! are ready (or from its own buffers when it stays), while the blocks after it, and the
//! first of the next pass's group, keep being issued into the freed slots. Only the
//! blocks the pod's plan needs move ([`crate::execution::need`]).

use std::collections::VecDeque;
use std::time::Duration;

use super::block_weights::BlockWeights;
use super::setup::Pipeline;
use crate::execution::backend::{Backend, Collective};
use crate::execution::need::{Need, PassPlan, PassWork};
use crate::{Error, Result};

impl<B: Backend, C: Collective<B>> Pipeline<B, C> {
    /// Runs one pass over group `group` in order, calling `work.block(block, weights)` for
    /// each block `plan.need` holds (and, after block 0 of a [`Need::Head`] pass, for the
    /// rest when `work.rest()` votes for them). `next` names the group of the pass that
    /// follows, if one does, so its first blocks (as far as `plan.next_need` holds them)
    /// are prefetched while this pass's last blocks compute. A block no rank computes is
    /// neither copied nor gathered; one issued before a vote said no (at most K − 1 ahead)
    /// is waited for and dropped. Every rank of the collective group must make the same
    /// sequence of calls with the same plan (lockstep by group and block index).
    pub fn pass(
        &mut self,
        group: usize,
        next: Option<usize>,
        plan: PassPlan,
        work: &mut dyn PassWork,
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
        let mut need: Vec<bool> = (0..l).map(|b| plan.need.covers(b)).collect();
        // A Head pass streams the rest on the guess that it runs: the vote after block 0
        // stops what is not yet issued.
        let streams = |g: usize, n: Need| -> Vec<(usize, usize)> {
            (0..self.kept[g].len())
                .filter(|&b| !self.kept[g][b] && n != Need::Nothing)
                .map(|b| (g, b))
                .collect()
        };
        let streamed = streams(group, plan.need);
        let next_streamed = next.map(|g| streams(g, plan.next_need)).unwrap_or_default();
        // Blocks of this pass in flight were prefetched by the pass before, on a guess of
        // its need; a pass that needs none of them drops them.
        let ours = self
            .in_flight
            .iter()
            .take_while(|&&(g, _, _)| g == group)
            .count();
        if streamed.is_empty() {
            for _ in 0..ours {
                self.discard()?;
            }
        } else if let Some(&(g, b, _)) = self.in_flight.front() {
            if (g, b) != streamed[0] {
                return Err(self.rank_error(Error::bug(format!(
                    "pipeline: pass over group {group} but block {b} of group {g} was prefetched"
                ))));
            }
        }
        // A pass that streams nothing leaves what is in flight for another group to the
        // pass it was issued for, and issues nothing more.
        let hold = streamed.is_empty() && !self.in_flight.is_empty();
        // The issue order from here: the rest of this pass, then the next pass's blocks.
        let mut queue: VecDeque<(usize, usize)> = streamed
            .iter()
            .skip(self.in_flight.len())
            .chain(&next_streamed)
            .copied()
            .collect();
        let identity: Vec<usize> = (0..layout.dtypes.len()).collect();
        for i in 0..l {
            while !hold && self.in_flight.len() < k {
                match queue.pop_front() {
                    Some((g, b)) => self.issue(g, b),
                    None => break,
                }
            }
            if !need[i] {
                self.stats.blocks_skipped += 1;
                continue;
            }
            if self.kept[group][i] {
                let w = BlockWeights::view(
                    &self.resident[group][i],
                    &identity,
                    &layout.blocks[i],
                    self.opts.dtype,
                )?;
                work.block(i, &w)?;
                self.stats.blocks_computed += 1;
            } else {
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
                let r = work.block(i, &w);
                drop(w);
                self.backend.compute_record(&self.slots[s].free);
                self.stats.blocks_computed += 1;
                r?;
            }
            if i == 0 && plan.need == Need::Head {
                let rest = work.rest()?;
                need.iter_mut().skip(1).for_each(|n| *n = rest);
                if !rest {
                    queue.retain(|&(g, _)| g != group);
                    while self.in_flight.front().is_some_and(|&(g, _, _)| g == group) {
                        self.discard()?;
                    }
                }
            }
        }
        // Issue what is left for the next pass (all of it when this one skipped its last
        // blocks).
        while !hold && self.in_flight.len() < k {
            match queue.pop_front() {
                Some((g, b)) => self.issue(g, b),
                None => break,
            }
        }
        Ok(())
    }

    /// Drops the block at the front of the queue of issued blocks: waits for its
    /// transfers (they have moved their bytes) and frees its slot unread.
    fn discard(&mut self) -> Result<()> {
        let (_, _, s) = self.in_flight.pop_front().expect("in flight");
        let stall = self
            .backend
            .compute_wait(&self.slots[s].ready)
            .map_err(|e| self.rank_error(e))?;
        self.stats.stall += stall;
        self.backend.compute_record(&self.slots[s].free);
        self.stats.blocks_dropped += 1;
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
