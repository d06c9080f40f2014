//! One rank's [`Pipeline`]: its state, and its setup: the checks of its shape, its streams,
//! its device buffers and staging ring, and the weights it loads once because they stay on
//! the device.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::Tensor;

use super::buffers::{Allocator, Slot, Stationary};
use super::options::{PipelineOptions, PipelineStats};
use super::streamed::Streamed;
use crate::execution::backend::{Backend, Collective};
use crate::execution::budget::{Allocation, DeviceBudget};
use crate::execution::staging::{block_copy_bytes, Ring};
use crate::layout::Piece;
use crate::{Error, Result, Strategy};

/// Refuses a pipeline whose layouts are for another dp than the collective group's, or
/// that would stream through fewer than two slots.
fn check_shape(streamed: &Streamed, dp: usize, opts: &PipelineOptions) -> Result<()> {
    if streamed.dp() != dp {
        return Err(Error::bug(format!(
            "dp: layout is for dp={} but the group has {dp} ranks",
            streamed.dp()
        )));
    }
    if opts.strategy.streams() && opts.slots < crate::strategy::MIN_STREAMING_SLOTS as usize {
        return Err(Error::invalid(
            "slots",
            format!("{}: streaming needs at least 2 slots", opts.slots),
        ));
    }
    Ok(())
}

/// Rank `rank`'s copy stream: every strategy's but `sharded`'s, which copies only at the
/// start.
fn copy_stream<B: Backend>(
    backend: &B,
    strategy: Strategy,
    rank: usize,
) -> Result<Option<B::Stream>> {
    Ok(match strategy {
        Strategy::Sharded => None,
        _ => Some(backend.new_stream(&format!("copy-r{rank}"))?),
    })
}

/// Rank `rank`'s gather stream: the strategies' that all-gather.
fn gather_stream<B: Backend>(
    backend: &B,
    strategy: Strategy,
    rank: usize,
) -> Result<Option<B::Stream>> {
    Ok(match strategy {
        Strategy::Sharded | Strategy::OffloadSharded => {
            Some(backend.new_stream(&format!("gather-r{rank}"))?)
        }
        _ => None,
    })
}

/// One rank's weights and the machinery that moves them.
pub struct Pipeline<B: Backend, C: Collective<B>> {
    pub(super) backend: Arc<B>,
    pub(super) comm: C,
    pub(super) streamed: Streamed,
    pub(super) opts: PipelineOptions,
    pub(super) copy: Option<B::Stream>,
    pub(super) gather: Option<B::Stream>,
    pub(super) slots: Vec<Slot<B::Event>>,
    /// `sharded`: per group, per region, this rank's shard of every block (empty for a
    /// group that stays whole).
    pub(super) store: Vec<Vec<Tensor>>,
    /// Per group, per block that stays on the device (every block under `resident`), per
    /// region, the full weights; empty for a block that streams.
    pub(super) resident: Vec<Vec<Vec<Tensor>>>,
    /// Per group, per block, whether it stays on the device.
    pub(super) kept: Vec<Vec<bool>>,
    /// Blocks issued but not yet computed: (group, block, slot).
    pub(super) in_flight: VecDeque<(usize, usize, usize)>,
    pub(super) issued: u64,
    pub(super) stats: PipelineStats,
    /// The staging ring, when copies from the host stage through one.
    pub(super) ring: Option<Ring<B>>,
    _allocs: Vec<Allocation>,
}

impl<B: Backend, C: Collective<B>> Pipeline<B, C> {
    /// Allocates this rank's device memory for the strategy (charged to `budget`) and,
    /// for `resident` and `sharded`, loads the weights that stay on the device.
    pub fn new(
        backend: Arc<B>,
        comm: C,
        streamed: Streamed,
        budget: &Arc<DeviceBudget>,
        opts: PipelineOptions,
    ) -> Result<Self> {
        let (rank, dp) = (comm.rank(), comm.size());
        check_shape(&streamed, dp, &opts)?;
        // Per group, per block: whether it stays on the device (whole: groups kept whole,
        // and the blocks kept of the others).
        let kept: Vec<Vec<bool>> = (0..streamed.layouts.len())
            .map(|g| streamed.kept(opts.strategy, g))
            .collect();
        let mut memory = Allocator {
            backend: &*backend,
            budget,
            allocs: Vec::new(),
        };
        let Stationary { resident, store } =
            memory.stationary(&streamed, &kept, opts.strategy, dp)?;
        let streams = kept.iter().any(|g| g.iter().any(|k| !*k));
        let slots = memory.slots(&streamed.shape, &opts, streams)?;
        let allocs = memory.allocs;
        let copy = copy_stream(&*backend, opts.strategy, rank)?;
        let gather = gather_stream(&*backend, opts.strategy, rank)?;
        let ring = match (opts.staging, &copy) {
            (Some(depth), Some(_)) if streams => {
                Some(Self::ring(&*backend, &streamed, &kept, &opts, rank, depth)?)
            }
            _ => None,
        };
        let mut stats = PipelineStats::default();
        if let Some(r) = &ring {
            stats.pinned_host_bytes = r.bytes();
            tracing::info!(
                rank,
                buffers = opts.staging,
                bytes = r.bytes(),
                "staging copies from the host through a ring"
            );
        }
        let mut p = Pipeline {
            backend,
            comm,
            streamed,
            opts,
            copy,
            gather,
            slots,
            store,
            resident,
            kept,
            in_flight: VecDeque::new(),
            issued: 0,
            stats,
            ring,
            _allocs: allocs,
        };
        p.load_stationary()?;
        Ok(p)
    }

    /// This rank's staging ring of `depth` buffers, each sized by the memory model
    /// ([`crate::memory::staging_buffer_bytes`]); refuses to start when a block this rank
    /// streams would not fit one buffer.
    fn ring(
        backend: &B,
        streamed: &Streamed,
        kept: &[Vec<bool>],
        opts: &PipelineOptions,
        rank: usize,
        depth: usize,
    ) -> Result<Ring<B>> {
        let size = crate::memory::staging_buffer_bytes(
            &streamed.bytes(),
            &streamed.placement(opts.strategy, opts.slots),
        );
        let sharded = opts.strategy == Strategy::OffloadSharded;
        for (g, layout) in streamed.layouts.iter().enumerate() {
            for b in layout.blocks.iter().filter(|b| !kept[g][b.index]) {
                let need = block_copy_bytes(b, sharded, rank);
                if need > size {
                    return Err(Error::bug(format!("staging: rank {rank} copies {need} bytes of block {} of group {g}, more than a {size}-byte staging buffer",
                            b.index
                        ),
                    ));
                }
            }
        }
        Ring::new(backend, &format!("fill-r{rank}"), depth, size)
    }

    /// Loads what stays on the device: the blocks kept whole and, under `sharded`, this
    /// rank's shards of the others.
    fn load_stationary(&mut self) -> Result<()> {
        let rank = self.comm.rank();
        let strategy = self.opts.strategy;
        let stationary = strategy == Strategy::Sharded || self.kept.iter().flatten().any(|k| *k);
        if !stationary {
            return Ok(());
        }
        let load;
        let stream = match &self.copy {
            Some(s) => s,
            None => {
                load = self.backend.new_stream(&format!("load-r{rank}"))?;
                &load
            }
        };
        for (gi, layout) in self.streamed.layouts.iter().enumerate() {
            let mapped = &self.streamed.mapped[gi];
            for b in &layout.blocks {
                let whole = self.kept[gi][b.index];
                if !whole && strategy != Strategy::Sharded {
                    continue;
                }
                for (r, reg) in b.regions.iter().enumerate() {
                    let (dst, runs) = if whole {
                        (&self.resident[gi][b.index][r], reg.pieces.clone())
                    } else {
                        // Rank r's shard of the n-th streamed block lands at n × (capacity
                        // / dp) in the store.
                        let cap = layout.region_capacity[r] / layout.dp as u64;
                        let at = self.store_index(gi, b.index) as u64 * cap;
                        let shift = |p: Piece| Piece {
                            dst: p.dst - rank as u64 * reg.shard + at,
                            ..p
                        };
                        (
                            &self.store[gi][r],
                            reg.shard_pieces(rank).into_iter().map(shift).collect(),
                        )
                    };
                    self.backend.copy_to_device(stream, dst, mapped, runs);
                }
            }
        }
        let done = self.backend.new_event();
        self.backend.record(stream, &done);
        self.backend
            .compute_wait(&done)
            .map_err(|e| self.rank_error(e))?;
        Ok(())
    }

    /// Where block `block` of group `group` sits in the shard store: its place among the
    /// group's streamed blocks.
    pub(super) fn store_index(&self, group: usize, block: usize) -> usize {
        self.kept[group][..block].iter().filter(|k| !**k).count()
    }

    /// `e` as a failure of this rank; an error that names its rank already (an
    /// abandoned collective among them, which keeps its type) is left as it is.
    pub(super) fn rank_error(&self, e: Error) -> Error {
        match e {
            Error::Rank { .. } | Error::Abandoned(_) => e,
            other => Error::Rank {
                rank: self.comm.rank(),
                msg: other.to_string(),
            },
        }
    }

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// Opens a measured phase on this rank's device ([`crate::measure`]).
    pub fn phase(&self) -> crate::measure::Phase {
        self.backend.phase()
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}
