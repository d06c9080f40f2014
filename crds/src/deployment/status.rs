//! What the operator observed and decided: the status, the plan it chose (strategy, dp,
//! slots, memory and its breakdown, each component's placement) and why.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::{Deserialize, Serialize};

use layerwise_core::Strategy;

/// What the operator has observed and decided.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DiffusionDeploymentStatus {
    /// The spec generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// ModelProfiled, Planned, CacheWarm, Available, Progressing, Degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The plan in force (kept when a later spec is infeasible, since its pods still run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
    /// The engine image the pods run: recorded when they are first made (the operator's
    /// default then, or `spec.engine.image`) and kept across operator upgrades. It changes
    /// only with `spec.engine.image`, or while the annotation
    /// `layerwise.dev/engine-image-follows-operator` is `"true"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_image: Option<String>,
    /// Engine pods wanted.
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Requests queued or running over all engine pods, at the last scrape.
    #[serde(default)]
    pub queue_depth: u64,
    /// Label selector of the engine pods (for the `/scale` subresource).
    #[serde(default)]
    pub selector: String,
    /// When load first fell below the current replica count (builtin autoscaling); the
    /// scale-down happens once it has stayed there for the delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_pending_since: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
}

/// How a replica runs, and why.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// The strategy the planner chose (never `auto`).
    pub strategy: Strategy,
    /// Requests a pod serves at once: groups of `sp` ranks (the pod's accelerators are
    /// dp × sp).
    pub dp: u32,
    /// Ranks of a group, which split one request's latent sequence (1: none).
    #[serde(default = "one_u32")]
    pub sp: u32,
    /// What the step-time model predicts a request at the workload's bounds takes under
    /// this plan, in seconds (none where nothing streams and no bound was asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_latency_seconds: Option<f64>,
    /// Whether `predictedLatencySeconds` meets `workload.maxLatencySeconds`; unset where
    /// the workload sets no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_bound_met: Option<bool>,
    /// The ResourceClaimTemplate the engine pods claim their devices through, where they
    /// get them by Dynamic Resource Allocation (`spec.accelerator.dra`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claim_template: Option<String>,
    /// Device slots per rank (K); 0 for resident.
    pub slots: u32,
    /// Whether the ranks of a pod all-gather over a fast peer link.
    pub fast_peer_link: bool,
    /// Peak device bytes one rank needs.
    pub device_bytes_per_rank: u64,
    /// Host bytes one pod needs of its own (its memory request): pinned buffers and
    /// runtime.
    pub host_bytes_per_pod: u64,
    /// Host bytes a node holds once for all the pods of this model on it: the page-cache
    /// copy of the model they all map.
    #[serde(default)]
    pub host_bytes_per_node: u64,
    /// What `deviceBytesPerRank` is made of.
    pub device_breakdown: MemoryBreakdown,
    /// Nodes the plan fits on (pods are restricted to them).
    pub nodes: Vec<String>,
    /// Blocks of each streamed component that stay on every device (spread evenly
    /// through it, copied once and never streamed), chosen by predicted request time
    /// among the counts that fit (see `reasons`).
    #[serde(default)]
    pub resident_blocks: u64,
    /// Blocks kept of each group of the components named here, in place of
    /// `residentBlocks` (the engine's `--resident-blocks-by-component`): the planner keeps
    /// blocks where they save the most predicted time (a transformer's, which run every
    /// step, before a text encoder's, which run once per request).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resident_blocks_by_component: BTreeMap<String, u64>,
    /// Each component with streamed blocks (text encoder, transformers) and whether its
    /// blocks stay whole on every device or stream through the slots.
    #[serde(default)]
    pub components: Vec<ComponentPlan>,
    /// Whose step-time figures timed the plan: the product the nodes report, the product
    /// table's row used, and whether that row is a fallback for a product the table lacks
    /// (then `predictedLatencySeconds` is an A100's guess: set `spec.accelerator.rates`
    /// from `engine/gpu-check`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<PlanRates>,
    /// Why this plan, in words.
    pub reasons: Vec<String>,
    /// Alternatives considered and why they lost, in words.
    pub rejected: Vec<String>,
}

/// Whose figures the step-time model timed a plan with.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PlanRates {
    /// The accelerator product the plan's node reports.
    pub product: String,
    /// The product table's row whose figures were used (`layerwise_core::timing::PRODUCT_RATES`).
    pub figures: String,
    /// Whether the table has no row for `product`, so `figures` stand in for it.
    pub fallback: bool,
    /// Whether `spec.accelerator.rates` replaced any of the row's figures.
    pub overridden: bool,
}

impl PlanRates {
    /// Where rates from the product table came from; `None` for rates given another way.
    pub fn of(from: &layerwise_core::timing::RatesFrom) -> Option<PlanRates> {
        match from {
            layerwise_core::timing::RatesFrom::Product {
                reported,
                figures,
                fallback,
                overridden,
            } => Some(PlanRates {
                product: reported.clone(),
                figures: (*figures).to_string(),
                fallback: *fallback,
                overridden: *overridden,
            }),
            layerwise_core::timing::RatesFrom::Given(_) => None,
        }
    }
}

/// Where one component's blocks live under a plan.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ComponentPlan {
    /// Its folder in the pipeline (`text_encoder`, `transformer`, `transformer_2`).
    pub name: String,
    pub placement: ComponentPlacement,
    /// Bytes of its blocks.
    pub block_bytes: u64,
}

/// Whether a component's blocks stay on the device or stream.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ComponentPlacement {
    /// Whole on every device, copied once at start.
    Resident,
    /// Block by block through the rank's slots, every pass.
    Streamed,
}

fn one_u32() -> u32 {
    1
}

impl Plan {
    /// Accelerators one pod uses: dp groups × sp ranks.
    pub fn devices(&self) -> u32 {
        self.dp.max(1).saturating_mul(self.sp.max(1))
    }

    /// The components kept whole on the device although the strategy streams: what the
    /// engine's `--resident-components` takes.
    pub fn resident_components(&self) -> Vec<String> {
        if !self.strategy.streams() {
            return Vec::new();
        }
        self.components
            .iter()
            .filter(|c| c.placement == ComponentPlacement::Resident)
            .map(|c| c.name.clone())
            .collect()
    }
}

/// Device bytes of one rank by purpose.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct MemoryBreakdown {
    /// Block weights kept on the device: whole blocks of the components that stay
    /// resident (all of them for `resident`), and 1/dp of every other block for `sharded`.
    pub block_weights: u64,
    /// K slots of one full (padded) block of any streamed component each.
    pub slots: u64,
    /// Weights outside the blocks (prologues, epilogues), always resident.
    pub resident_weights: u64,
    /// Activations of the largest allowed request.
    pub activations: u64,
    /// Runtime overhead per device.
    pub overhead: u64,
    /// The VAE decoder where the engine decodes on the device (a GPU): its weights and
    /// the decode of the largest allowed output, beside the rank; 0 where it decodes on
    /// the host.
    #[serde(default)]
    pub decoder: u64,
}

impl MemoryBreakdown {
    pub fn total(&self) -> u64 {
        self.block_weights
            + self.slots
            + self.resident_weights
            + self.activations
            + self.overhead
            + self.decoder
    }
}
