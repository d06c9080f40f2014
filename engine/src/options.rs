//! The engine flags that `generate`, `bench` and `serve` share, declared once: the
//! contract's run flags (where the checkpoint is, how many ranks and slots, the device
//! memory: what a plan sets, [`RunArgs`]) and the backend's own (the device, how weights
//! reach it, the compute dtype, how long a rank may wait). Each command adds its own flags
//! beside them with `#[command(flatten)]`.

use std::time::Duration;

use clap::Args;

use crate::contract::{ResidentBlocks, RunArgs};
use crate::execution::cuda::{DeviceChoice, HostMode};
use crate::execution::dtype::ComputeDtype;
use crate::execution::rank::EngineOptions;
use crate::Strategy;

/// How the engine runs a model, whatever the command: the plan's part and the backend's.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// How the backend runs: nothing a plan decides, so not part of the contract.
#[derive(Args, Debug, Clone)]
pub struct BackendArgs {
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

impl EngineArgs {
    /// The engine options these flags describe, for `strategy` with `resident_blocks`
    /// blocks of each streamed group kept on the device.
    pub fn options(&self, strategy: Strategy, resident_blocks: ResidentBlocks) -> EngineOptions {
        self.backend.options(&self.run, strategy, resident_blocks)
    }
}

impl BackendArgs {
    /// The engine options `run` and these flags describe, for `strategy` with
    /// `resident_blocks` blocks of each streamed group kept on the device.
    pub fn options(
        &self,
        run: &RunArgs,
        strategy: Strategy,
        resident_blocks: ResidentBlocks,
    ) -> EngineOptions {
        EngineOptions {
            strategy,
            dp: run.dp,
            sp: run.sp,
            slots: run.slots,
            device_memory: run.device_memory_mib.map_or(u64::MAX, |m| m << 20),
            overhead: run.device_overhead_mib << 20,
            resident_components: run
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
