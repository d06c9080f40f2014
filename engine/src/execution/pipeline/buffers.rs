//! A rank's device buffers for its pipeline: the K slots blocks stream through and what
//! stays on the device (blocks kept whole, `sharded`'s shard store), each buffer charged to
//! the rank's device budget as it is allocated.

use std::sync::Arc;

use candle_core::Tensor;
use safetensors::Dtype;

use super::options::PipelineOptions;
use super::streamed::Streamed;
use crate::execution::backend::Backend;
use crate::execution::budget::{Allocation, DeviceBudget};
use crate::layout::SlotShape;
use crate::{Error, Result, Strategy};

pub(super) struct Slot<E> {
    pub(super) buffers: Vec<Tensor>,
    /// The copy into this slot has landed (offload-sharded: before the gather).
    pub(super) loaded: E,
    /// The block's full weights are in the slot.
    pub(super) ready: E,
    /// Compute has finished reading the slot.
    pub(super) free: E,
}

/// The device buffers of what stays on the device, by group; every group and block has
/// an entry (empty if unused).
pub(super) struct Stationary {
    /// Per group, per block, per region: the whole weights of a block that stays (every
    /// block under `resident`); none for a block that streams.
    pub(super) resident: Vec<Vec<Vec<Tensor>>>,
    /// `sharded`: per group, per region, the store of this rank's shards of the blocks
    /// that stream.
    pub(super) store: Vec<Vec<Tensor>>,
}

/// Device buffers of one rank, each charged to its budget as it is allocated; the
/// charges are the pipeline's to hold.
pub(super) struct Allocator<'a, B: Backend> {
    pub(super) backend: &'a B,
    pub(super) budget: &'a Arc<DeviceBudget>,
    pub(super) allocs: Vec<Allocation>,
}

impl<B: Backend> Allocator<'_, B> {
    /// A zeroed buffer of `bytes` bytes of `dtype`, charged as `kind` (`what` names it in
    /// an out-of-memory error).
    fn alloc(
        &mut self,
        kind: &'static str,
        what: String,
        dtype: Dtype,
        bytes: u64,
    ) -> Result<Tensor> {
        self.allocs.push(self.budget.charge(kind, &what, bytes)?);
        self.backend
            .alloc(crate::execution::dtype::candle_dtype(dtype)?, bytes)
    }

    /// The buffers of what stays on the device (see [`Stationary`]); `kept` says, per
    /// group, per block, whether it stays.
    pub(super) fn stationary(
        &mut self,
        streamed: &Streamed,
        kept: &[Vec<bool>],
        strategy: Strategy,
        dp: usize,
    ) -> Result<Stationary> {
        let (mut resident, mut store) = (Vec::new(), Vec::new());
        for (gi, layout) in streamed.layouts.iter().enumerate() {
            let mut blocks = Vec::new();
            for b in &layout.blocks {
                if !kept[gi][b.index] {
                    blocks.push(Vec::new());
                    continue;
                }
                let bufs = b
                    .regions
                    .iter()
                    .enumerate()
                    .map(|(r, reg)| {
                        self.alloc(
                            "resident_blocks",
                            format!("group {gi} block {} weights", b.index),
                            layout.dtypes[r],
                            reg.padded,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                blocks.push(bufs);
            }
            let mut regions = Vec::new();
            let streaming = kept[gi].iter().filter(|k| !**k).count() as u64;
            if strategy == Strategy::Sharded && streaming > 0 {
                for (r, &cap) in layout.region_capacity.iter().enumerate() {
                    let bytes = cap / dp as u64 * streaming;
                    regions.push(self.alloc(
                        "resident_shards",
                        format!("group {gi} shard store ({:?})", layout.dtypes[r]),
                        layout.dtypes[r],
                        bytes,
                    )?);
                }
            }
            resident.push(blocks);
            store.push(regions);
        }
        Ok(Stationary { resident, store })
    }

    /// The K slots of `shape` when some block `streams`; none otherwise, which a
    /// streaming strategy refuses (it would stream nothing).
    pub(super) fn slots(
        &mut self,
        shape: &SlotShape,
        opts: &PipelineOptions,
        streams: bool,
    ) -> Result<Vec<Slot<B::Event>>> {
        if !streams {
            if opts.strategy.streams() {
                return Err(Error::invalid(
                    "resident-components",
                    format!(
                        "every streamed component is kept resident, so {} would stream nothing: use --strategy resident",
                        opts.strategy
                    ),
                ));
            }
            return Ok(Vec::new());
        }
        let mut slots = Vec::with_capacity(opts.slots);
        for s in 0..opts.slots {
            let buffers = shape
                .capacity
                .iter()
                .zip(&shape.dtypes)
                .map(|(&cap, &dtype)| self.alloc("slots", format!("slot {s}"), dtype, cap))
                .collect::<Result<Vec<_>>>()?;
            slots.push(Slot {
                buffers,
                loaded: self.backend.new_event(),
                ready: self.backend.new_event(),
                free: self.backend.new_event(),
            });
        }
        Ok(slots)
    }
}
