//! The transfers that bring a block into a slot: the copy from the host (straight from the
//! mapping or through the staging ring) and the all-gather of the shards, each ordered
//! after the slot's previous reader by events, with the spans the trace records of them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::Tensor;

use super::options::Stage;
use super::setup::Pipeline;
use crate::execution::backend::{Backend, Collective, GatherSource};
use crate::execution::trace::Lane;
use crate::layout::Piece;
use crate::Strategy;

impl<B: Backend, C: Collective<B>> Pipeline<B, C> {
    /// Enqueues the transfers that bring block `block` of group `group` into the next slot.
    pub(super) fn issue(&mut self, group: usize, block: usize) {
        let k = self.slots.len();
        let s = (self.issued % k as u64) as usize;
        self.issued += 1;
        self.in_flight.push_back((group, block, s));
        let (rank, dp) = (self.comm.rank(), self.comm.size());
        let layout = &self.streamed.layouts[group];
        let region_of = &self.streamed.shape.region_of[group];
        let mapped = &self.streamed.mapped[group];
        let b = &layout.blocks[block];
        let slot = &self.slots[s];
        let be = &self.backend;
        if let Some(copy) = &self.copy {
            be.wait(copy, &slot.free);
            if let Some(h) = &self.opts.hook {
                let h = h.clone();
                be.host_fn(copy, Box::new(move || h(Stage::Copy)));
            }
            let runs: Vec<Vec<Piece>> = b
                .regions
                .iter()
                .map(|reg| match self.opts.strategy {
                    Strategy::OffloadSharded => reg.shard_pieces(rank),
                    _ => reg.pieces.clone(),
                })
                .collect();
            let n: u64 = runs.iter().flatten().map(|p| p.len).sum();
            self.stats.bytes_copied += n;
            // The ring's fill and the copy stream's wait for it come before the span, so
            // the copy lane times the transfers alone.
            let filled = self.ring.as_mut().map(|ring| {
                self.stats.bytes_staged += n;
                ring.fill(be, copy, mapped, &runs)
            });
            let span = self.span_begin(copy, Lane::Copy, block);
            let dsts: Vec<&Tensor> = (0..runs.len())
                .map(|r| &slot.buffers[region_of[r]])
                .collect();
            match (filled, &self.ring) {
                (Some(f), Some(ring)) => ring.copy(be, copy, f, &dsts),
                _ => {
                    for (dst, runs) in dsts.into_iter().zip(runs) {
                        be.copy_to_device(copy, dst, mapped, runs);
                    }
                }
            }
            self.span_end(copy, span, Lane::Copy, block);
            let done = if self.gather.is_some() {
                &slot.loaded
            } else {
                &slot.ready
            };
            be.record(copy, done);
        }
        if let Some(gather) = &self.gather {
            be.wait(
                gather,
                if self.copy.is_some() {
                    &slot.loaded
                } else {
                    &slot.free
                },
            );
            if let Some(h) = &self.opts.hook {
                let h = h.clone();
                be.host_fn(gather, Box::new(move || h(Stage::Gather)));
            }
            let span = self.span_begin(gather, Lane::Gather, block);
            for (r, reg) in b.regions.iter().enumerate() {
                let src = if self.opts.strategy == Strategy::Sharded {
                    let cap = layout.region_capacity[r] / dp as u64;
                    GatherSource::Buffer {
                        tensor: self.store[group][r].clone(),
                        offset: self.store_index(group, block) as u64 * cap,
                    }
                } else {
                    GatherSource::InPlace
                };
                self.stats.bytes_gathered += reg.shard * (dp as u64 - 1);
                self.comm
                    .all_gather(gather, &slot.buffers[region_of[r]], reg.shard, src);
            }
            self.span_end(gather, span, Lane::Gather, block);
            be.record(gather, &slot.ready);
        }
    }

    /// Enqueues a host function that stamps when `stream` reaches this point.
    fn span_begin(&self, stream: &B::Stream, _lane: Lane, _block: usize) -> Option<Arc<AtomicU64>> {
        let t = self.opts.trace.as_ref()?;
        let (t, cell) = (t.clone(), Arc::new(AtomicU64::new(0)));
        let c = cell.clone();
        self.backend.host_fn(
            stream,
            Box::new(move || c.store(t.now_us().to_bits(), Ordering::Relaxed)),
        );
        Some(cell)
    }

    /// Enqueues the host function that closes the span `span_begin` opened.
    fn span_end(&self, stream: &B::Stream, cell: Option<Arc<AtomicU64>>, lane: Lane, block: usize) {
        let (Some(t), Some(cell)) = (self.opts.trace.clone(), cell) else {
            return;
        };
        let rank = self.comm.rank();
        self.backend.host_fn(
            stream,
            Box::new(move || {
                t.record(
                    rank,
                    lane,
                    block,
                    f64::from_bits(cell.load(Ordering::Relaxed)),
                )
            }),
        );
    }
}
