//! What shapes one rank's pipeline ([`PipelineOptions`]), the test hook that slows its
//! transfers ([`Hook`]), and what it counts ([`PipelineStats`]).

use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;

use crate::execution::trace::Trace;
use crate::Strategy;

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
    /// Blocks of passes this rank ran that no rank of the pod computed (a step cache
    /// skipped them): neither copied nor gathered.
    pub blocks_skipped: u64,
    /// Blocks issued ahead of a First-Block Cache vote that then said no: moved, unread.
    pub blocks_dropped: u64,
    /// Bytes copied through the staging ring (all of `bytes_copied` when it is on).
    pub bytes_staged: u64,
    /// Page-locked host bytes this rank holds for staging (its ring; 0 without one).
    pub pinned_host_bytes: u64,
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
    /// The dtype blocks' weights are handed to compute in ([`crate::execution::dtype`]).
    pub dtype: DType,
    /// Stage the copies from the host through a ring of this many buffers
    /// ([`crate::execution::staging`]) instead of copying from the mapping (`--host-memory pin`).
    pub staging: Option<usize>,
}
