//! What the engine is asked to run: [`EngineOptions`], from the strategy and the dp × sp
//! topology to the device memory budget, the blocks kept on the device and the test hooks.
//! Every caller (the CLI, the server, the tests) builds one, and the rank loop reads it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::contract::ResidentBlocks;
use crate::contract::SlotsChoice;
use crate::decode::DecoderBytes;
use crate::execution::cuda::{DeviceChoice, HostMode};
use crate::execution::dtype::ComputeDtype;
use crate::execution::pipeline::Hook;
use crate::execution::trace::Trace;
use crate::memory;
use crate::Strategy;

/// How the engine runs.
#[derive(Clone)]
pub struct EngineOptions {
    pub strategy: Strategy,
    /// Requests served at once: groups of `sp` ranks, each on its own request.
    pub dp: usize,
    /// Ranks per group, splitting each request's sequence ([`layerwise_core::topology`]).
    /// The run uses `dp × sp` devices, and the weights shard over all of them.
    pub sp: usize,
    /// K, or `auto`: as many as the device memory holds (on the CPU, `device_memory`).
    pub slots: SlotsChoice,
    /// Device memory per rank, in bytes, for everything: weights, `activations` and
    /// `overhead` (the CPU backend enforces it like a GPU would). The engine refuses to
    /// start when the memory model's need is larger.
    pub device_memory: u64,
    /// Device bytes each rank keeps free for the largest request it accepts
    /// ([`crate::checkpoint::ActivationCost::checked_bytes`] of its bounds).
    pub activations: u64,
    /// Device bytes each rank keeps free for the runtime (context, kernels, allocator).
    pub overhead: u64,
    /// Components whose blocks stay whole on every device under a streaming strategy.
    pub resident_components: Vec<String>,
    /// Blocks of each other streamed group that stay on the device, spread evenly.
    pub resident_blocks: ResidentBlocks,
    /// Blocks kept of each group of the components named, in place of `resident_blocks`
    /// for them (`--resident-blocks-by-component`).
    pub resident_blocks_by_component: BTreeMap<String, u64>,
    /// How weights reach the device from the mapped checkpoint. The CPU takes `auto`
    /// (copy from the mapping) and `pin` (stage through the ring, as a GPU that cannot
    /// register the mapping does).
    pub host: HostMode,
    /// Buffers in each rank's staging ring when copies stage through one
    /// ([`memory::STAGING_BUFFERS`], the planner's figure, unless a test asks otherwise).
    pub staging_buffers: usize,
    /// Longest any rank may wait on a transfer or a peer before failing.
    pub timeout: Duration,
    pub hook: Option<Hook>,
    /// Decode latents into pixels on the ranks.
    pub decode: bool,
    /// Device bytes each rank's device keeps for a decoder beside the ranks (`serve`
    /// decoding on the device, [`crate::decode`]): its weights, loaded before the ranks
    /// start, and its decode peak, kept free. Counted in `device_memory`; zero when
    /// nothing decodes beside the ranks on their devices.
    pub decoder: DecoderBytes,
    /// Bytes one decode may hold at its peak (the plan's `--decode-budget`): each
    /// decoder splits an output's decode by the largest setting within it.
    pub decode_budget: u64,
    /// Record copy, gather and compute spans here.
    pub trace: Option<Arc<Trace>>,
    /// Where the ranks compute: the CPU backend, CUDA GPUs (the `cuda` feature), or
    /// whichever is there.
    pub device: DeviceChoice,
    /// The dtype blocks compute in ([`crate::execution::dtype`]).
    pub compute_dtype: ComputeDtype,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            strategy: Strategy::OffloadSharded,
            dp: 1,
            sp: 1,
            slots: SlotsChoice::default(),
            device_memory: u64::MAX,
            activations: 0,
            overhead: 0,
            resident_components: Vec::new(),
            resident_blocks: ResidentBlocks::default(),
            resident_blocks_by_component: BTreeMap::new(),
            host: HostMode::Auto,
            staging_buffers: memory::STAGING_BUFFERS as usize,
            timeout: Duration::from_secs(120),
            hook: None,
            decode: true,
            decoder: DecoderBytes::default(),
            decode_budget: crate::decode::DEFAULT_DECODE_BUDGET,
            trace: None,
            device: DeviceChoice::Cpu,
            compute_dtype: ComputeDtype::Auto,
        }
    }
}
