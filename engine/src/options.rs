//! The engine flags that `generate`, `bench` and `serve` share, declared once: where the
//! checkpoint is, how many ranks and slots, the device and its memory, and how long a
//! rank may wait. Each command adds its own flags beside them with `#[command(flatten)]`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::execution::cuda::plan::{BlocksByComponent, ResidentBlocks};
use crate::execution::cuda::{DeviceChoice, HostMode, SlotsChoice};
use crate::execution::dtype::ComputeDtype;
use crate::execution::rank::EngineOptions;
use crate::{bounds, Strategy};

/// How the engine runs a model, whatever the command.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// The diffusers pipeline folder.
    #[arg(long, env = "LAYERWISE_MODEL")]
    pub model: PathBuf,
    /// Requests served at once: data-parallel groups of `--sp` ranks (threads of this
    /// process, one device each). The process uses dp × sp devices.
    #[arg(long, env = "LAYERWISE_DP", default_value_t = 1)]
    pub dp: usize,
    /// Ranks per request (Ulysses sequence parallelism): each computes its share of the
    /// request's latent tokens, and all-to-alls around attention give each rank every
    /// token of its share of the heads. The weights stream over all dp × sp ranks. For
    /// the video families (wan, cosmos3), at most their attention (key/value) heads.
    #[arg(long, env = "LAYERWISE_SP", default_value_t = 1)]
    pub sp: usize,
    /// Device slots per rank: K ≥ 2, or `auto` (as many as fit: on a GPU in its free
    /// memory, on the CPU in `--device-memory-mib`, which auto then needs).
    #[arg(long, env = "LAYERWISE_SLOTS", default_value = "2")]
    pub slots: SlotsChoice,
    /// Device memory per rank in MiB for everything: weights, the activations of the
    /// largest request (`serve`: at its bounds) and `--device-overhead-mib`. The engine
    /// refuses to start when the memory model needs more (the CPU backend enforces it as
    /// a GPU would).
    #[arg(long, env = bounds::ENV_DEVICE_MEMORY_MIB)]
    pub device_memory_mib: Option<u64>,
    /// Device memory per rank in MiB kept for the runtime (context, kernels, allocator
    /// slack), out of `--device-memory-mib`.
    #[arg(long, env = bounds::ENV_DEVICE_OVERHEAD_MIB, default_value_t = 0)]
    pub device_overhead_mib: u64,
    /// Components whose blocks stay whole on every device under a streaming strategy
    /// (comma-separated, e.g. `text_encoder`): copied once at start, never streamed. The
    /// operator passes the plan's choice.
    #[arg(long, env = bounds::ENV_RESIDENT_COMPONENTS, value_delimiter = ',')]
    pub resident_components: Vec<String>,
    /// How weights reach the device: `auto` (on a GPU: the mapped checkpoint registered
    /// read-only, else a private writable mapping of it registered, else a staging ring),
    /// `register` (one of the two registrations, or fail), `pin` (a ring of a few pinned
    /// buffers per rank, filled ahead of the copies; never a pinned copy of the model) or
    /// `pageable`. The CPU backend reads the mapping under `auto`, stages through the ring
    /// under `pin`, and refuses the other two.
    #[arg(long, env = "LAYERWISE_HOST_MEMORY", default_value = "auto")]
    pub host_memory: HostMode,
    /// Seconds any rank may wait on a transfer, a peer or a step before failing.
    #[arg(long, env = "LAYERWISE_TIMEOUT_SECONDS", default_value_t = 120)]
    pub timeout_seconds: u64,
    /// Where ranks compute: `cpu`, `cuda` (GPUs 0..dp×sp; needs a build with the `cuda`
    /// feature) or `auto` (CUDA when usable, else the CPU, saying why).
    #[arg(long, env = "LAYERWISE_DEVICE", default_value = "auto")]
    pub device: DeviceChoice,
    /// The dtype blocks compute in: `auto` (the checkpoint's on a GPU, bf16 or f16
    /// tensor-core math; f32 on the CPU), `f32`, `bf16` or `f16`. The sampler and the
    /// decoder stay f32; outputs are bit-identical across strategies for each dtype.
    #[arg(long, env = "LAYERWISE_COMPUTE_DTYPE", default_value = "auto")]
    pub compute_dtype: ComputeDtype,
}

/// `--resident-blocks` of the commands that run one configuration (`generate`, `serve`);
/// `bench` takes a list of them instead, one row each.
#[derive(Args, Debug, Clone)]
pub struct ResidentBlocksArgs {
    /// Blocks of each streamed group that stay on every device, spread evenly through the
    /// group, copied once and never streamed: a number, or `auto` (as many as
    /// `--device-memory-mib` holds after the slots, the activations and the overhead).
    #[arg(long, env = bounds::ENV_RESIDENT_BLOCKS, default_value = "0")]
    pub resident_blocks: ResidentBlocks,
    /// Blocks kept of each group of the components named, in place of
    /// `--resident-blocks` for them: `component=n` pairs, comma-separated (e.g.
    /// `transformer=20,text_encoder=0`, what the operator's plan writes). A component the
    /// model does not stream is refused.
    #[arg(long, env = bounds::ENV_RESIDENT_BLOCKS_BY_COMPONENT, default_value = "")]
    pub resident_blocks_by_component: BlocksByComponent,
}

impl EngineArgs {
    /// The engine options these flags describe, for `strategy` with `resident_blocks`
    /// blocks of each streamed group kept on the device.
    pub fn options(&self, strategy: Strategy, resident_blocks: ResidentBlocks) -> EngineOptions {
        EngineOptions {
            strategy,
            dp: self.dp,
            sp: self.sp,
            slots: self.slots,
            device_memory: self.device_memory_mib.map_or(u64::MAX, |m| m << 20),
            overhead: self.device_overhead_mib << 20,
            resident_components: self
                .resident_components
                .iter()
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect(),
            resident_blocks,
            host: self.host_memory,
            timeout: Duration::from_secs(self.timeout_seconds),
            device: self.device,
            compute_dtype: self.compute_dtype,
            ..EngineOptions::default()
        }
    }
}
