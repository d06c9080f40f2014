//! The command's flags (clap derive; doc comments are the `--help` text): the checkpoint,
//! the node as its agent would report it, the workload as `spec.workload` and what the
//! spec fixes, and the operator's allowances, which its run shares.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::planner::Limits;

/// The planner's allowances beside the model's own bytes: the same flags, and the same
/// defaults, as the operator's run.
#[derive(Args, Debug, Clone)]
pub struct LimitArgs {
    /// Device memory per rank kept for the runtime (MiB).
    #[arg(long, env = "LAYERWISE_DEVICE_OVERHEAD_MIB", default_value_t = 1024)]
    pub device_overhead_mib: u64,
    /// Host memory per pod beside the model (MiB).
    #[arg(long, env = "LAYERWISE_HOST_OVERHEAD_MIB", default_value_t = 2048)]
    pub host_overhead_mib: u64,
    /// The most device slots per rank the planner grows K to.
    #[arg(long, env = "LAYERWISE_MAX_SLOTS", default_value_t = 4)]
    pub max_slots: u32,
}

impl LimitArgs {
    /// The planner's [`Limits`] these flags set.
    pub fn limits(&self) -> Limits {
        Limits {
            device_overhead: self.device_overhead_mib << 20,
            host_overhead: self.host_overhead_mib << 20,
            max_slots: self.max_slots,
            ..Limits::default()
        }
    }
}

/// Prints the plan the operator would record for a model, a node and a workload.
#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// The checkpoint: a pipeline folder (profiled from its headers, as the node agent
    /// does; no weight is read) or a profile JSON file (`layerwise inspect DIR --json`).
    #[arg(long, value_name = "DIR|FILE")]
    pub model: PathBuf,
    /// A file holding a DiffusionDeployment (YAML or JSON): its model, accelerator,
    /// workload, strategy, dp, sp, slots and engine fields, which the flags below override.
    #[arg(long, short = 'f', value_name = "FILE")]
    pub deployment: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Print the record as JSON (the plan as the operator writes it into
    /// `status.plan`, with the node, the step time and the outputs per hour beside it).
    #[arg(long)]
    pub json: bool,
}

/// The node: what its agent would report.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// The accelerator product, as NVML names it (`H100`, `NVIDIA L40S`, `A100-SXM4-80GB`):
    /// it selects the step-time model's rates (`layerwise_core::timing::PRODUCT_RATES`).
    #[arg(long, value_name = "PRODUCT")]
    pub gpu: String,
    /// Accelerators on the node.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Memory of each accelerator, as a Kubernetes quantity (`80Gi`, `81559Mi`, `48G`;
    /// `GiB`, `MiB`, `TiB` and `KiB` read as `Gi`, `Mi`, `Ti` and `Ki`).
    #[arg(long, value_name = "SIZE")]
    pub device_memory: String,
    /// Host memory pods may use on the node, as a quantity (`1Ti`, `512GiB`).
    #[arg(long, value_name = "SIZE")]
    pub host_memory: String,
    /// Whether the accelerators all-gather over a fast peer link (NVLink, xGMI) or not.
    /// Unset: as the product's rates say (a peer rate above its host-to-device rate).
    #[arg(long, value_enum)]
    pub link: Option<Link>,
    /// The node's name in the plan.
    #[arg(long, default_value = "node")]
    pub node_name: String,
    /// Dense TFLOP/s one accelerator sustains (`spec.accelerator.rates.deviceTflops`).
    #[arg(long)]
    pub device_tflops: Option<f64>,
    /// Host-to-device GB/s of one accelerator (`spec.accelerator.rates.hostToDeviceGBps`).
    #[arg(long)]
    pub host_to_device_gbps: Option<f64>,
    /// All-gather GB/s each rank receives (`spec.accelerator.rates.peerGBps`).
    #[arg(long)]
    pub peer_gbps: Option<f64>,
}

/// A peer link, or none.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// A fast peer link (NVLink, NVSwitch, xGMI).
    #[value(alias = "fast")]
    Nvlink,
    /// None: the devices reach each other over PCIe.
    #[value(alias = "pcie")]
    None,
}

/// The workload: `spec.workload` and what the spec fixes, each overriding the file's.
#[derive(Args, Debug, Clone, Default)]
pub struct WorkloadArgs {
    /// The widest request, in pixels (`workload.maxWidth`).
    #[arg(long)]
    pub max_width: Option<u64>,
    /// The tallest request, in pixels.
    #[arg(long)]
    pub max_height: Option<u64>,
    /// Frames per request (1 for images).
    #[arg(long)]
    pub max_frames: Option<u64>,
    /// Denoising steps per request.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Images per request.
    #[arg(long)]
    pub max_batch: Option<u64>,
    /// Whether requests may use classifier-free guidance.
    #[arg(long, value_name = "BOOL")]
    pub guidance: Option<bool>,
    /// The most tokens of a prompt, for text families.
    #[arg(long)]
    pub max_prompt_tokens: Option<u64>,
    /// The most seconds a request should take (the planner grows sp to meet it).
    #[arg(long)]
    pub max_latency_seconds: Option<f64>,
    /// `auto` (the planner chooses), `resident`, `sharded`, `offload` or `offload-sharded`.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Requests a pod serves at once (groups of sp ranks).
    #[arg(long)]
    pub dp: Option<u32>,
    /// Ranks that split one request's sequence.
    #[arg(long)]
    pub sp: Option<u32>,
    /// Device slots per rank (K).
    #[arg(long)]
    pub slots: Option<u32>,
}
