//! The seam between the pipeline and the hardware. The pipeline is written once against
//! these two traits; the CPU backend implements them with threads, the CUDA backend (a
//! cargo feature) with streams, events and NCCL.
//!
//! Semantics follow CUDA: work enqueued on a stream is asynchronous to the host and
//! ordered only by events. Compute runs on the rank's own thread (the compute stream):
//! `compute_wait` makes compute hold for an event and `compute_record` marks compute's
//! progress for the copy and gather streams to wait on.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use super::host_buffer::{HostBuffer, Staged};
use crate::checkpoint::Mapped;
use crate::layout::Piece;
use crate::Result;

/// Where this rank's shard comes from in an all-gather.
#[derive(Clone)]
pub enum GatherSource {
    /// Already in place in the destination, at `rank × shard` (offload-sharded).
    InPlace,
    /// In another device buffer at a byte offset (sharded: the resident shard store).
    Buffer { tensor: Tensor, offset: u64 },
}

pub trait Backend: Send + Sync + 'static {
    type Stream: Send;
    type Event: Clone + Send + Sync;

    /// The device compute runs on.
    fn device(&self) -> &Device;
    fn new_stream(&self, name: &str) -> Result<Self::Stream>;
    fn new_event(&self) -> Self::Event;
    fn record(&self, stream: &Self::Stream, event: &Self::Event);
    fn wait(&self, stream: &Self::Stream, event: &Self::Event);
    /// Holds compute until `event`; returns how long compute stalled.
    fn compute_wait(&self, event: &Self::Event) -> Result<Duration>;
    /// Marks compute's progress so far.
    fn compute_record(&self, event: &Self::Event);
    /// At the end of a run: the stall that [`Self::compute_wait`] could not report yet
    /// (a device measures stalls with timing events read back a few blocks late).
    fn drain_stall(&self) -> Result<Duration> {
        Ok(Duration::ZERO)
    }
    /// Opens a measured phase on this device ([`crate::measure`]): the heap's watch on
    /// the CPU, where tensors are heap memory; a device overrides it with its own
    /// allocator's high-water mark.
    fn phase(&self) -> crate::measure::Phase {
        crate::measure::Phase::heap()
    }
    /// A zeroed 1-D device buffer of `bytes` bytes of `dtype`. Accounting is the caller's.
    fn alloc(&self, dtype: DType, bytes: u64) -> Result<Tensor>;
    /// Enqueues host→device copies of `runs` of the mapped checkpoint into `dst`
    /// (`dst` offsets of the runs are byte offsets into `dst`).
    fn copy_to_device(&self, stream: &Self::Stream, dst: &Tensor, src: &Mapped, runs: Vec<Piece>);
    /// A host buffer of `bytes` bytes for the staging ring: page-locked on a GPU, plain
    /// page-aligned memory on the CPU.
    fn alloc_staging(&self, bytes: u64) -> Result<HostBuffer>;
    /// Enqueues host→device copies of `runs` of the staging buffer `src` into `dst`.
    fn copy_staged(
        &self,
        stream: &Self::Stream,
        dst: &Tensor,
        src: Arc<HostBuffer>,
        runs: Vec<Staged>,
    );
    /// Enqueues a host function (instrumentation, test hooks, the staging ring's fills).
    fn host_fn(&self, stream: &Self::Stream, f: Box<dyn FnOnce() + Send>);
}

/// Collectives across the dp ranks of one process.
pub trait Collective<B: Backend>: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Enqueues on `stream` an all-gather into `dst`: afterwards bytes
    /// `[q × shard, (q+1) × shard)` of `dst` hold rank q's shard, for every q.
    fn all_gather(&self, stream: &B::Stream, dst: &Tensor, shard: u64, src: GatherSource);
}
