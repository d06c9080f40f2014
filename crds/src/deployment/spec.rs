//! The `DiffusionDeployment` kind itself: its spec (what a platform team writes), the
//! schema rules that span its fields, and the printer columns `kubectl get` shows. The
//! parts of the spec and the status live in the sibling modules.

// Several printer columns repeat `type_ = "integer"`, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::accelerator::Accelerator;
use super::autoscaling::Autoscaling;
use super::engine::EngineSpec;
use super::model::{ModelSpec, Workload};
use super::routing::InferencePoolRouting;
use super::status::DiffusionDeploymentStatus;
use crate::common::StrategyChoice;

/// A diffusion model served on the cluster. The operator profiles the checkpoint on candidate
/// nodes, plans strategy, dp, slots and memory from the profile, the nodes' accelerators and
/// the workload bounds, and runs the engine as a Deployment plus a Service.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "layerwise.dev",
    version = "v1alpha1",
    kind = "DiffusionDeployment",
    namespaced,
    status = "DiffusionDeploymentStatus",
    shortname = "dd",
    category = "layerwise",
    doc = "A diffusion model served on the cluster, sized and run by the layerwise operator",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Strategy",
        type_ = "string",
        json_path = ".status.plan.strategy",
        description = "Planned strategy"
    ),
    printcolumn(
        name = "DP",
        type_ = "integer",
        json_path = ".status.plan.dp",
        description = "Requests a pod serves at once (groups of sp ranks)"
    ),
    printcolumn(
        name = "SP",
        type_ = "integer",
        json_path = ".status.plan.sp",
        description = "Ranks (accelerators) that split one request's sequence"
    ),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".status.replicas",
        description = "Engine pods wanted"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        description = "Engine pods ready"
    ),
    printcolumn(
        name = "Queue",
        type_ = "integer",
        json_path = ".status.queueDepth",
        description = "Requests queued or running"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.strategy) || self.strategy != 'sharded' || (has(self.dp) ? self.dp : 2) * (has(self.sp) ? self.sp : 2) >= 2").message("strategy sharded needs dp × sp of at least 2 ranks per pod (use resident for one device)"))]
#[x_kube(validation = Rule::new("!has(self.strategy) || self.strategy != 'offload-sharded' || (has(self.dp) ? self.dp : 2) * (has(self.sp) ? self.sp : 2) >= 2").message("strategy offload-sharded needs dp × sp of at least 2 ranks per pod (use offload for one device)"))]
#[x_kube(validation = Rule::new("!has(self.autoscaling) || !has(self.replicas) || self.autoscaling.mode != 'external' || (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)").message("in external autoscaling mode replicas must lie within [minReplicas, maxReplicas]"))]
pub struct DiffusionDeploymentSpec {
    /// The model: its family and where its files are on the nodes.
    pub model: ModelSpec,
    /// The largest request the deployment must serve; the planner sizes activations for it.
    #[serde(default)]
    pub workload: Workload,
    /// `auto` (the planner chooses) or one of resident, sharded, offload, offload-sharded.
    #[serde(default)]
    pub strategy: StrategyChoice,
    /// Fixed requests a pod serves at once: groups of `sp` ranks each, so a pod uses
    /// dp × sp accelerators; the planner chooses when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("dp must be at least 1"))]
    #[schemars(range(max = 64))]
    pub dp: Option<u32>,
    /// Fixed ranks (accelerators) that split one request's latent sequence (Ulysses
    /// sequence parallelism; the `wan` and `cosmos3` families), 1 for none. Unset: the
    /// planner chooses the fewest whose activations fit the device and whose predicted
    /// latency meets `workload.maxLatencySeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 16").message("sp must be between 1 and 16"))]
    pub sp: Option<u32>,
    /// Fixed device slots per rank (K), at least 2: one block computing while the next
    /// arrives (the engine refuses fewer). The planner grows K beyond 2 when memory allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 2 && self <= 16").message("slots must be between 2 and 16"))]
    pub slots: Option<u32>,
    /// Which accelerators, and on which nodes.
    #[serde(default)]
    pub accelerator: Accelerator,
    /// Engine pods when autoscaling is off, or (mode `external`) what HPA/KEDA sets through
    /// the `/scale` subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: Option<i32>,
    /// Queue-based scaling; off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// The engine container and extra pod settings.
    #[serde(default)]
    pub engine: EngineSpec,
    /// Routing through the Gateway API inference extension: an `InferencePool`
    /// (`inference.networking.k8s.io/v1`) over the engine pods, kept by the operator. Off
    /// when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolRouting>,
}
