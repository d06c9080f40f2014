//! The block pipeline of one rank: copy, gather and compute as three streams of work
//! joined by events. While block i computes, blocks i+1 .. i+K-1 are being copied and
//! gathered into the other slots; a slot is refilled only after the compute that reads
//! it has recorded its `free` event. One implementation for every backend.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor};
use safetensors::Dtype;

use super::backend::{Backend, Collective, GatherSource};
use super::budget::{Allocation, DeviceBudget};
use super::trace::{Lane, Trace};
use super::weights::Weights;
use crate::checkpoint::Mapped;
use crate::layout::{BlockLayout, ModelLayout, Piece};
use crate::{Error, Result, Strategy};

/// The two kinds of transfer a test hook can slow down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Copy,
    Gather,
}

/// Called on the copy or gather stream right before each transfer (tests use it to
/// inject random delays; it runs on that stream's thread).
pub type Hook = Arc<dyn Fn(Stage) + Send + Sync>;

/// Counters of one rank's pipeline.
#[derive(Debug, Clone, Default)]
pub struct PipelineStats {
    /// Time compute spent waiting for weights.
    pub stall: Duration,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    pub blocks_computed: u64,
}

pub fn candle_dtype(d: Dtype) -> Result<DType> {
    Ok(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("{other:?} weights are not supported"),
            ))
        }
    })
}

/// The views of one block's tensors in device memory, converted to f32 on request.
pub struct BlockWeights {
    tensors: HashMap<String, Tensor>,
}

impl BlockWeights {
    fn view(buffers: &[Tensor], block: &BlockLayout) -> Result<BlockWeights> {
        let mut tensors = HashMap::with_capacity(block.tensors.len());
        for t in &block.tensors {
            let buf = &buffers[t.group];
            let esz = buf.dtype().size_in_bytes() as u64;
            let numel: usize = t.shape.iter().product();
            let v = buf
                .narrow(0, (t.offset / esz) as usize, numel)?
                .reshape(t.shape.as_slice())?;
            tensors.insert(t.name.clone(), v);
        }
        Ok(BlockWeights { tensors })
    }
}

impl Weights for BlockWeights {
    fn get(&self, name: &str) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::invalid("block weights", format!("no tensor `{name}` in this block"))
        })?;
        Ok(t.to_dtype(DType::F32)?)
    }
}

struct Slot<E> {
    buffers: Vec<Tensor>,
    /// The copy into this slot has landed (offload-sharded: before the gather).
    loaded: E,
    /// The block's full weights are in the slot.
    ready: E,
    /// Compute has finished reading the slot.
    free: E,
}

/// Options that shape one rank's pipeline.
#[derive(Clone)]
pub struct PipelineOptions {
    pub strategy: Strategy,
    /// K, the number of device slots (≥ 2 for streaming strategies).
    pub slots: usize,
    pub hook: Option<Hook>,
    /// Records copy and gather spans from inside the streams' work.
    pub trace: Option<Arc<Trace>>,
}

/// One rank's weights and the machinery that moves them.
pub struct Pipeline<B: Backend, C: Collective<B>> {
    backend: Arc<B>,
    comm: C,
    layout: Arc<ModelLayout>,
    mapped: Mapped,
    opts: PipelineOptions,
    copy: Option<B::Stream>,
    gather: Option<B::Stream>,
    slots: Vec<Slot<B::Event>>,
    /// `sharded`: per dtype group, this rank's shard of every block.
    store: Vec<Tensor>,
    /// `resident`: per block, per dtype group, the full weights.
    resident: Vec<Vec<Tensor>>,
    /// Blocks issued but not yet computed: (block, slot).
    in_flight: VecDeque<(usize, usize)>,
    issued: u64,
    consumed: u64,
    stats: PipelineStats,
    _allocs: Vec<Allocation>,
}

impl<B: Backend, C: Collective<B>> Pipeline<B, C> {
    /// Allocates this rank's device memory for the strategy (charged to `budget`) and,
    /// for `resident` and `sharded`, loads the weights that stay on the device.
    pub fn new(
        backend: Arc<B>,
        comm: C,
        layout: Arc<ModelLayout>,
        mapped: Mapped,
        budget: &Arc<DeviceBudget>,
        opts: PipelineOptions,
    ) -> Result<Self> {
        let (rank, dp) = (comm.rank(), comm.size());
        if layout.dp != dp {
            return Err(Error::invalid(
                "dp",
                format!(
                    "layout is for dp={} but the group has {dp} ranks",
                    layout.dp
                ),
            ));
        }
        if opts.strategy.streams() && opts.slots < 2 {
            return Err(Error::invalid(
                "slots",
                format!("{}: streaming needs at least 2 slots", opts.slots),
            ));
        }
        let dtypes = layout
            .groups
            .iter()
            .map(|d| candle_dtype(*d))
            .collect::<Result<Vec<_>>>()?;
        let mut allocs = Vec::new();
        let mut alloc =
            |kind: &'static str, what: String, dtype: DType, bytes: u64| -> Result<Tensor> {
                allocs.push(budget.charge(kind, &what, bytes)?);
                backend.alloc(dtype, bytes)
            };
        let mut slots = Vec::new();
        let mut store = Vec::new();
        let mut resident = Vec::new();
        match opts.strategy {
            Strategy::Resident => {
                for b in &layout.blocks {
                    let bufs = b
                        .groups
                        .iter()
                        .enumerate()
                        .map(|(g, grp)| {
                            alloc(
                                "resident_blocks",
                                format!("block {} weights", b.index),
                                dtypes[g],
                                grp.padded,
                            )
                        })
                        .collect::<Result<Vec<_>>>()?;
                    resident.push(bufs);
                }
            }
            _ => {
                for s in 0..opts.slots {
                    let buffers = layout
                        .group_capacity
                        .iter()
                        .enumerate()
                        .map(|(g, &cap)| alloc("slots", format!("slot {s}"), dtypes[g], cap))
                        .collect::<Result<Vec<_>>>()?;
                    slots.push(Slot {
                        buffers,
                        loaded: backend.new_event(),
                        ready: backend.new_event(),
                        free: backend.new_event(),
                    });
                }
                if opts.strategy == Strategy::Sharded {
                    for (g, &cap) in layout.group_capacity.iter().enumerate() {
                        let bytes = cap / dp as u64 * layout.blocks.len() as u64;
                        store.push(alloc(
                            "resident_shards",
                            format!("shard store ({:?})", layout.groups[g]),
                            dtypes[g],
                            bytes,
                        )?);
                    }
                }
            }
        }
        let copy = match opts.strategy {
            Strategy::Sharded => None,
            _ => Some(backend.new_stream(&format!("copy-r{rank}"))?),
        };
        let gather = match opts.strategy {
            Strategy::Sharded | Strategy::OffloadSharded => {
                Some(backend.new_stream(&format!("gather-r{rank}"))?)
            }
            _ => None,
        };
        let mut p = Pipeline {
            backend,
            comm,
            layout,
            mapped,
            opts,
            copy,
            gather,
            slots,
            store,
            resident,
            in_flight: VecDeque::new(),
            issued: 0,
            consumed: 0,
            stats: PipelineStats::default(),
            _allocs: allocs,
        };
        p.load_stationary()?;
        Ok(p)
    }

    /// Loads what stays on the device: whole blocks (resident) or this rank's shards.
    fn load_stationary(&mut self) -> Result<()> {
        let rank = self.comm.rank();
        let stream = match (&self.opts.strategy, &self.copy) {
            (Strategy::Resident, Some(s)) => s,
            (Strategy::Sharded, _) => &self.backend.new_stream(&format!("load-r{rank}"))?,
            _ => return Ok(()),
        };
        for b in &self.layout.blocks {
            for (g, grp) in b.groups.iter().enumerate() {
                let (dst, runs) = if self.opts.strategy == Strategy::Resident {
                    (&self.resident[b.index][g], grp.pieces.clone())
                } else {
                    // Rank r's shard of block b lands at b × (capacity / dp) in the store.
                    let cap = self.layout.group_capacity[g] / self.layout.dp as u64;
                    let shift = |p: Piece| Piece {
                        dst: p.dst - rank as u64 * grp.shard + b.index as u64 * cap,
                        ..p
                    };
                    (
                        &self.store[g],
                        grp.shard_pieces(rank).into_iter().map(shift).collect(),
                    )
                };
                self.backend.copy_to_device(stream, dst, &self.mapped, runs);
            }
        }
        let done = self.backend.new_event();
        self.backend.record(stream, &done);
        self.backend
            .compute_wait(&done)
            .map_err(|e| self.rank_error(e))?;
        Ok(())
    }

    fn rank_error(&self, e: Error) -> Error {
        match e {
            Error::Rank { .. } => e,
            other => Error::Rank {
                rank: self.comm.rank(),
                msg: other.to_string(),
            },
        }
    }

    /// Enqueues the transfers that bring block `block` into the next slot.
    fn issue(&mut self, block: usize) {
        let k = self.slots.len();
        let s = (self.issued % k as u64) as usize;
        self.issued += 1;
        self.in_flight.push_back((block, s));
        let (rank, dp) = (self.comm.rank(), self.comm.size());
        let b = &self.layout.blocks[block];
        let slot = &self.slots[s];
        let be = &self.backend;
        if let Some(copy) = &self.copy {
            be.wait(copy, &slot.free);
            if let Some(h) = &self.opts.hook {
                let h = h.clone();
                be.host_fn(copy, Box::new(move || h(Stage::Copy)));
            }
            let span = self.span_begin(copy, Lane::Copy, block);
            for (g, grp) in b.groups.iter().enumerate() {
                let runs = match self.opts.strategy {
                    Strategy::OffloadSharded => grp.shard_pieces(rank),
                    _ => grp.pieces.clone(),
                };
                self.stats.bytes_copied += runs.iter().map(|p| p.len).sum::<u64>();
                be.copy_to_device(copy, &slot.buffers[g], &self.mapped, runs);
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
            for (g, grp) in b.groups.iter().enumerate() {
                let src = if self.opts.strategy == Strategy::Sharded {
                    let cap = self.layout.group_capacity[g] / dp as u64;
                    GatherSource::Buffer {
                        tensor: self.store[g].clone(),
                        offset: block as u64 * cap,
                    }
                } else {
                    GatherSource::InPlace
                };
                self.stats.bytes_gathered += grp.shard * (dp as u64 - 1);
                self.comm
                    .all_gather(gather, &slot.buffers[g], grp.shard, src);
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

    /// Runs one pass over every block in order, calling `f(block, weights)` for each.
    /// `next_pass` says whether another pass follows, so its first blocks can be
    /// prefetched while this pass's last blocks compute. Every rank of the group must
    /// make the same sequence of calls (lockstep by block index).
    pub fn pass(
        &mut self,
        next_pass: bool,
        mut f: impl FnMut(usize, &dyn Weights) -> Result<()>,
    ) -> Result<()> {
        let l = self.layout.blocks.len();
        if self.opts.strategy == Strategy::Resident {
            for i in 0..l {
                let w = BlockWeights::view(&self.resident[i], &self.layout.blocks[i])?;
                f(i, &w)?;
                self.stats.blocks_computed += 1;
            }
            return Ok(());
        }
        let k = self.slots.len() as u64;
        let start = self.consumed;
        let limit = start + l as u64 * if next_pass { 2 } else { 1 };
        for i in 0..l {
            let seq = start + i as u64;
            while self.issued < (seq + k).min(limit) {
                let block = (self.issued % l as u64) as usize;
                self.issue(block);
            }
            let (block, s) = self.in_flight.pop_front().expect("issued ahead");
            debug_assert_eq!(block, i);
            let stall = self
                .backend
                .compute_wait(&self.slots[s].ready)
                .map_err(|e| self.rank_error(e))?;
            self.stats.stall += stall;
            let w = BlockWeights::view(&self.slots[s].buffers, &self.layout.blocks[i])?;
            let r = f(i, &w);
            drop(w);
            self.backend.compute_record(&self.slots[s].free);
            self.consumed += 1;
            self.stats.blocks_computed += 1;
            r?;
        }
        Ok(())
    }

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}
