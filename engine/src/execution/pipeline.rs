//! The block pipeline of one rank: copy, gather and compute as three streams of work
//! joined by events. While block i computes, blocks i+1 .. i+K-1 are being copied and
//! gathered into the other slots; a slot is refilled only after the compute that reads
//! it has recorded its `free` event. One implementation for every backend.
//!
//! A model streams one or more groups of blocks (see [`crate::layout`]) through the same
//! K slots. A pass runs over one group; when the next pass is known (and over which
//! group), its first blocks are issued while this pass's last blocks compute, so the
//! switch from one group to another (a text encoder to a transformer, one expert to the
//! other) costs no stall.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor};
use safetensors::Dtype;

use super::backend::{Backend, Collective, GatherSource};
use super::budget::{Allocation, DeviceBudget};
use super::staging::{block_copy_bytes, Ring};
use super::trace::{Lane, Trace};
use super::weights::Weights;
use crate::checkpoint::Mapped;
use crate::layout::{BlockLayout, GroupLayout, Piece, SlotShape};
use crate::memory::{GroupBytes, Placement};
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
    /// Bytes copied through the staging ring (all of `bytes_copied` when it is on).
    pub bytes_staged: u64,
    /// Page-locked host bytes this rank holds for staging (its ring; 0 without one).
    pub pinned_host_bytes: u64,
}

/// The views of one block's tensors in device memory, converted to the compute dtype on
/// request: a tensor stored in that dtype is used in place, with no cast and no copy; an
/// fp8 weight is dequantized with its scale from the same slot, right before compute.
pub struct BlockWeights {
    tensors: HashMap<String, Tensor>,
    /// fp8 weights' scales, by the weight's name.
    scales: HashMap<String, Tensor>,
    dtype: DType,
}

impl BlockWeights {
    /// Views of `block`'s tensors in `buffers`; `region_of` maps the block's regions to
    /// the buffers (identity for a block's own resident buffers).
    fn view(
        buffers: &[Tensor],
        region_of: &[usize],
        block: &BlockLayout,
        dtype: DType,
    ) -> Result<BlockWeights> {
        let mut tensors = HashMap::with_capacity(block.tensors.len());
        let mut scales = HashMap::new();
        for t in &block.tensors {
            let buf = &buffers[region_of[t.region]];
            let esz = buf.dtype().size_in_bytes() as u64;
            let numel: usize = t.shape.iter().product();
            let v = buf
                .narrow(0, (t.offset / esz) as usize, numel)?
                .reshape(t.shape.as_slice())?;
            match &t.scales {
                Some(w) => scales.insert(w.clone(), v),
                None => tensors.insert(t.name.clone(), v),
            };
        }
        Ok(BlockWeights {
            tensors,
            scales,
            dtype,
        })
    }
}

impl Weights for BlockWeights {
    fn get(&self, name: &str) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::bug(format!("block weights: no tensor `{name}` in this block"))
        })?;
        if t.dtype() == DType::F8E4M3 {
            let scale = self
                .scales
                .get(name)
                .ok_or_else(|| Error::bug(format!("block weights: fp8 `{name}` has no scale")))?;
            return super::dtype::dequantize(t, scale, self.dtype);
        }
        // candle's to_dtype hands back the same storage when the dtype already matches.
        Ok(t.to_dtype(self.dtype)?)
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
    /// The dtype blocks' weights are handed to compute in ([`super::dtype`]).
    pub dtype: DType,
    /// Stage the copies from the host through a ring of this many buffers
    /// ([`super::staging`]) instead of copying from the mapping (`--host-memory pin`).
    pub staging: Option<usize>,
}

/// The groups of blocks a model streams, for one dp: each group's layout, mapped
/// component and pipeline component name, which groups stay whole on the device (the
/// components a plan keeps resident), and the slot shape that fits a block of any group
/// that streams.
#[derive(Clone)]
pub struct Streamed {
    pub layouts: Arc<Vec<GroupLayout>>,
    pub mapped: Vec<Mapped>,
    /// Per group, the component it belongs to (`text_encoder`, `transformer`, ...).
    pub components: Vec<String>,
    /// Per group, whether its blocks stay whole on the device under a streaming strategy.
    pub resident: Vec<bool>,
    /// Blocks of every other group that stay on the device too, spread evenly
    /// ([`crate::memory::resident_block_mask`]).
    pub resident_blocks: usize,
    /// Per group, blocks kept in place of `resident_blocks`
    /// (`--resident-blocks-by-component`).
    pub resident_blocks_by_group: Vec<Option<u64>>,
    pub shape: SlotShape,
}

impl Streamed {
    /// The groups of `layouts` (mapped from `mapped`, belonging to `components`), with the
    /// groups of `resident_components` kept whole on the device, `resident_blocks` of every
    /// other group kept, or of the components `by_component` names, their count. Names no
    /// component of the model: an error that lists the ones it has.
    pub fn new(
        layouts: Vec<GroupLayout>,
        mapped: Vec<Mapped>,
        components: Vec<String>,
        resident_components: &[String],
        resident_blocks: usize,
        by_component: &std::collections::BTreeMap<String, u64>,
    ) -> Result<Streamed> {
        if layouts.len() != mapped.len() || layouts.len() != components.len() || layouts.is_empty()
        {
            return Err(Error::bug(format!(
                "groups: {} block layouts for {} mapped components ({} named)",
                layouts.len(),
                mapped.len(),
                components.len()
            )));
        }
        let dp = layouts[0].dp;
        if layouts.iter().any(|l| l.dp != dp) {
            return Err(Error::bug("dp: block layouts for different dp"));
        }
        let named = resident_components
            .iter()
            .map(|c| ("resident-components", c))
            .chain(
                by_component
                    .keys()
                    .map(|c| ("resident-blocks-by-component", c)),
            );
        for (field, c) in named {
            if !components.contains(c) {
                let mut names = components.clone();
                names.dedup();
                return Err(Error::invalid(
                    field,
                    format!(
                        "`{c}` is not a streamed component of this model (it has {})",
                        names.join(", ")
                    ),
                ));
            }
        }
        let resident: Vec<bool> = components
            .iter()
            .map(|c| resident_components.contains(c))
            .collect();
        let resident_blocks_by_group: Vec<Option<u64>> = components
            .iter()
            .map(|c| by_component.get(c).copied())
            .collect();
        // A group with no more blocks than are kept is whole: it needs no slot.
        let whole: Vec<bool> = layouts
            .iter()
            .zip(&resident)
            .zip(&resident_blocks_by_group)
            .map(|((l, &r), n)| r || n.unwrap_or(resident_blocks as u64) >= l.blocks.len() as u64)
            .collect();
        let shape = SlotShape::of(&layouts, &whole);
        Ok(Streamed {
            layouts: Arc::new(layouts),
            mapped,
            components,
            resident,
            resident_blocks,
            resident_blocks_by_group,
            shape,
        })
    }

    pub fn dp(&self) -> usize {
        self.layouts[0].dp
    }

    /// Each group's block bytes, for the memory model.
    pub fn bytes(&self) -> Vec<GroupBytes> {
        self.layouts
            .iter()
            .zip(&self.components)
            .map(|(l, c)| GroupBytes::of(c, l))
            .collect()
    }

    /// Where `strategy` with K = `slots` puts these groups' weights.
    pub fn placement(&self, strategy: Strategy, slots: usize) -> Placement {
        Placement {
            strategy,
            dp: self.dp() as u64,
            slots: slots as u64,
            resident: self.resident.clone(),
            resident_blocks: self.resident_blocks as u64,
            resident_blocks_by_group: self.resident_blocks_by_group.clone(),
        }
    }

    /// Which blocks of group `g` stay on the device under `strategy` (all of them for a
    /// group kept whole), by the memory model's one rule.
    pub fn kept(&self, strategy: Strategy, g: usize) -> Vec<bool> {
        self.placement(strategy, 0)
            .kept(g, self.layouts[g].blocks.len())
    }

    /// The largest padded block over every group.
    pub fn largest_padded_block(&self) -> u64 {
        self.layouts
            .iter()
            .map(GroupLayout::largest_padded_block)
            .max()
            .unwrap_or(0)
    }
}

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

/// The device buffers of what stays on the device, by group; every group and block has
/// an entry (empty if unused).
struct Stationary {
    /// Per group, per block, per region: the whole weights of a block that stays (every
    /// block under `resident`); none for a block that streams.
    resident: Vec<Vec<Vec<Tensor>>>,
    /// `sharded`: per group, per region, the store of this rank's shards of the blocks
    /// that stream.
    store: Vec<Vec<Tensor>>,
}

/// Device buffers of one rank, each charged to its budget as it is allocated; the
/// charges are the pipeline's to hold.
struct Allocator<'a, B: Backend> {
    backend: &'a B,
    budget: &'a Arc<DeviceBudget>,
    allocs: Vec<Allocation>,
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
            .alloc(super::dtype::candle_dtype(dtype)?, bytes)
    }

    /// The buffers of what stays on the device (see [`Stationary`]); `kept` says, per
    /// group, per block, whether it stays.
    fn stationary(
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
    fn slots(
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

/// One rank's weights and the machinery that moves them.
pub struct Pipeline<B: Backend, C: Collective<B>> {
    backend: Arc<B>,
    comm: C,
    streamed: Streamed,
    opts: PipelineOptions,
    copy: Option<B::Stream>,
    gather: Option<B::Stream>,
    slots: Vec<Slot<B::Event>>,
    /// `sharded`: per group, per region, this rank's shard of every block (empty for a
    /// group that stays whole).
    store: Vec<Vec<Tensor>>,
    /// Per group, per block that stays on the device (every block under `resident`), per
    /// region, the full weights; empty for a block that streams.
    resident: Vec<Vec<Vec<Tensor>>>,
    /// Per group, per block, whether it stays on the device.
    kept: Vec<Vec<bool>>,
    /// Blocks issued but not yet computed: (group, block, slot).
    in_flight: VecDeque<(usize, usize, usize)>,
    issued: u64,
    stats: PipelineStats,
    /// The staging ring, when copies from the host stage through one.
    ring: Option<Ring<B>>,
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
    fn store_index(&self, group: usize, block: usize) -> usize {
        self.kept[group][..block].iter().filter(|k| !**k).count()
    }

    /// `e` as a failure of this rank; an error that names its rank already (an
    /// abandoned collective among them, which keeps its type) is left as it is.
    fn rank_error(&self, e: Error) -> Error {
        match e {
            Error::Rank { .. } | Error::Abandoned(_) => e,
            other => Error::Rank {
                rank: self.comm.rank(),
                msg: other.to_string(),
            },
        }
    }

    /// Enqueues the transfers that bring block `block` of group `group` into the next slot.
    fn issue(&mut self, group: usize, block: usize) {
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

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}
