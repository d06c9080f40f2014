//! `DiffusionDeployment`: one model served by a set of engine pods, sized by the operator.

// Several printer columns repeat `type_ = "integer"`, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvVar, LocalObjectReference, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use layerwise_core::Strategy;

use crate::common::{ModelLocation, StrategyChoice};

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

/// The `InferencePool` the operator keeps for a deployment: named after it, owned by it,
/// selecting its engine pods and targeting the engine's HTTP port. The cluster must serve
/// the InferencePool API (the inference extension's CRDs); where it does not, the
/// operator says so in the `InferencePool` condition and creates nothing.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolRouting {
    /// Whether the operator keeps the InferencePool; switching it off deletes it.
    #[serde(default)]
    pub enabled: bool,
    /// The endpoint picker (EPP) the gateway asks which engine pod takes a request: the
    /// InferencePool's `spec.endpointPickerRef`, as in the InferencePool v1 API. Unset: the
    /// pool names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// A reference to an endpoint picker, in the shape of the InferencePool v1 API's
/// `endpointPickerRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.kind) && self.kind != 'Service') || has(self.port)").message("endpointPickerRef.port is required when kind is Service (or unset, which means Service)"))]
pub struct EndpointPickerRef {
    /// API group of the picker object; the core group (`""`) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub group: Option<String>,
    /// Kind of the picker object; `Service` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
    )]
    pub kind: Option<String>,
    /// Name of the picker object, in the deployment's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The picker's port: for a Service, the Service port (not the target port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortNumber>,
    /// What the gateway does when the picker does not answer: `FailClose` (drop the
    /// request, the default) or `FailOpen` (send it to an engine pod of its choosing).
    #[serde(default)]
    pub failure_mode: FailureMode,
}

/// A port, as the InferencePool v1 API writes one.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PortNumber {
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("endpointPickerRef.port.number must be between 1 and 65535"))]
    pub number: i32,
}

/// How the gateway treats a picker that does not answer (the InferencePool v1 API's
/// `failureMode`).
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum FailureMode {
    FailOpen,
    #[default]
    FailClose,
}

impl FailureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::FailOpen => "FailOpen",
            FailureMode::FailClose => "FailClose",
        }
    }
}

/// The model to serve.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Model family: one the engine's registry runs (`dit`, `wan`); `kubectl apply`
    /// refuses any other.
    #[schemars(schema_with = "family_schema")]
    pub family: String,
    /// Where the pipeline folder is on the nodes. Immutable: a new model location is a new
    /// DiffusionDeployment.
    #[x_kube(validation = Rule::new("self == oldSelf").message("model location is immutable; create a new DiffusionDeployment for another model"))]
    pub location: ModelLocation,
}

/// `model.family`'s schema: the names of the engine's family registry, so the CRD lists
/// exactly the families this build runs (a new family reaches it through `crdgen`).
fn family_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": layerwise_engine::families::names(),
    })
}

/// Bounds on a single request; requests beyond them are refused by the engine, and the
/// planner reserves activation memory for a request at these bounds.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    #[serde(default = "default_side")]
    #[x_kube(validation = Rule::new("self >= 8 && self <= 16384").message("maxWidth must be between 8 and 16384"))]
    pub max_width: u64,
    #[serde(default = "default_side")]
    #[x_kube(validation = Rule::new("self >= 8 && self <= 16384").message("maxHeight must be between 8 and 16384"))]
    pub max_height: u64,
    /// Frames per request (1 for images).
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1024").message("maxFrames must be between 1 and 1024"))]
    pub max_frames: u64,
    #[serde(default = "default_steps")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1000").message("maxSteps must be between 1 and 1000"))]
    pub max_steps: u64,
    /// Images per request.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 64").message("maxBatch must be between 1 and 64"))]
    pub max_batch: u64,
    /// Whether requests may use classifier-free guidance (doubles the transformer's batch).
    #[serde(default = "yes")]
    pub guidance: bool,
    /// Most tokens of a prompt (a request's `max_sequence_length`), for text families: the
    /// planner reserves the text encoder's and the transformer's activations for a prompt
    /// this long, and the engine refuses longer ones.
    #[serde(default = "default_prompt_tokens")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 4096").message("maxPromptTokens must be between 1 and 4096"))]
    pub max_prompt_tokens: u64,
    /// The most seconds a request at these bounds should take: the planner splits its
    /// sequence over enough ranks (`sp`) that the step-time model predicts it within this,
    /// or, where no sp can, plans the fastest and says so (the `Planned` condition's
    /// reason `LatencyBoundNotMet`). Unset: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("maxLatencySeconds must be positive"))]
    pub max_latency_seconds: Option<f64>,
}

fn default_side() -> u64 {
    1024
}
fn one() -> u64 {
    1
}
fn default_steps() -> u64 {
    50
}
fn yes() -> bool {
    true
}
fn default_prompt_tokens() -> u64 {
    layerwise_core::bounds::DEFAULT_MAX_PROMPT_TOKENS
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            max_width: 1024,
            max_height: 1024,
            max_frames: 1,
            max_steps: 50,
            max_batch: 1,
            guidance: true,
            max_prompt_tokens: default_prompt_tokens(),
            max_latency_seconds: None,
        }
    }
}

/// The accelerator to run on and the nodes to consider.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.dra) || !has(self.resourceName)").message("resourceName (an extended resource) and dra (devices by Dynamic Resource Allocation) are two ways to ask for devices: set one"))]
pub struct Accelerator {
    /// Extended resource name of the device; `nvidia.com/gpu` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub resource_name: Option<String>,
    /// Only nodes with these labels are candidates.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations for the engine pods (accelerator nodes are often tainted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// What the accelerators sustain, for the planner's step-time model: each figure set
    /// here replaces the default the planner holds for the product the nodes report
    /// (`layerwise_core::timing::PRODUCT_RATES`). Unset: those defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<AcceleratorRates>,
    /// Devices by Dynamic Resource Allocation (`resource.k8s.io/v1`) instead of an extended
    /// resource: the planner reads the nodes' devices from the ResourceSlices their DRA
    /// driver publishes, and the engine pods claim theirs through a ResourceClaimTemplate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<DeviceAllocation>,
}

/// How the engine pods get their devices by Dynamic Resource Allocation. Name a
/// DeviceClass and the operator generates the ResourceClaimTemplate of each plan (its dp ×
/// sp devices of the class, each with at least the plan's device memory, all sharing one
/// value of `linkAttribute` where the plan's ranks all-gather over a fast link); or name a
/// ResourceClaimTemplate of the deployment's namespace, which the pods then use as it is
/// and whose device count fixes the ranks of a pod.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.deviceClassName) != has(self.resourceClaimTemplateName)").message("dra names exactly one of deviceClassName (the operator generates the ResourceClaimTemplate) and resourceClaimTemplateName (the pods use that template)"))]
pub struct DeviceAllocation {
    /// The DeviceClass whose devices the engine pods claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub device_class_name: Option<String>,
    /// A ResourceClaimTemplate in the deployment's namespace, used as it is: one request of
    /// an exact count of devices of one DeviceClass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub resource_claim_template_name: Option<String>,
    /// The device attribute (a qualified name) whose equal values mean the devices share a
    /// fast peer link; `resource.kubernetes.io/pcieRoot` (the standard attribute: devices
    /// under one PCIe root) when unset. A pod's ranks all-gather only over devices that
    /// share a value; devices without the attribute are counted without a fast link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 317),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-zA-Z0-9]([-_a-zA-Z0-9]*[a-zA-Z0-9])?$"
        )
    )]
    pub link_attribute: Option<String>,
}

impl DeviceAllocation {
    /// The standard attribute of devices under one PCIe root.
    pub const DEFAULT_LINK_ATTRIBUTE: &'static str = "resource.kubernetes.io/pcieRoot";

    /// The attribute whose equal values mean a fast link.
    pub fn link_attribute(&self) -> &str {
        self.link_attribute
            .as_deref()
            .unwrap_or(Self::DEFAULT_LINK_ATTRIBUTE)
    }
}

/// Sustained figures of one accelerator (not data-sheet peaks): what the planner predicts
/// step times from when it chooses the blocks and components to keep on the device.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorRates {
    /// Dense FLOP/s one device sustains in the compute dtype, in TFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("deviceTflops must be positive"))]
    pub device_tflops: Option<f64>,
    /// Host-to-device copy rate of one device, in GB/s (10^9 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("hostToDeviceGBps must be positive"))]
    #[serde(rename = "hostToDeviceGBps")]
    pub host_to_device_gbps: Option<f64>,
    /// All-gather rate each rank receives over the peer link, in GB/s (10^9 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("peerGBps must be positive"))]
    #[serde(rename = "peerGBps")]
    pub peer_gbps: Option<f64>,
}

impl AcceleratorRates {
    /// `defaults` with each figure set here in its place.
    pub fn over(&self, defaults: layerwise_core::timing::Rates) -> layerwise_core::timing::Rates {
        layerwise_core::timing::Rates {
            device_flops: self
                .device_tflops
                .map_or(defaults.device_flops, |t| t * 1e12),
            host_to_device: self
                .host_to_device_gbps
                .map_or(defaults.host_to_device, |g| g * 1e9),
            peer: self.peer_gbps.map_or(defaults.peer, |g| g * 1e9),
            overlap: defaults.overlap,
        }
    }
}

impl Accelerator {
    /// The default accelerator resource.
    pub const DEFAULT_RESOURCE: &'static str = "nvidia.com/gpu";

    pub fn resource(&self) -> &str {
        self.resource_name
            .as_deref()
            .unwrap_or(Self::DEFAULT_RESOURCE)
    }
}

/// Queue-based scaling of the engine pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("minReplicas must not exceed maxReplicas"))]
#[x_kube(validation = Rule::new("(has(self.mode) && self.mode == 'external') || self.minReplicas >= 1").message("builtin autoscaling needs minReplicas of at least 1: it scales by the engines' queue, and with no engine running there is no queue to read (use mode external with a scaler that wakes from zero)"))]
pub struct Autoscaling {
    #[serde(default = "one_i32")]
    #[x_kube(validation = Rule::new("self >= 0").message("minReplicas must not be negative"))]
    pub min_replicas: i32,
    #[x_kube(validation = Rule::new("self >= 1").message("maxReplicas must be at least 1"))]
    pub max_replicas: i32,
    /// Requests (queued + running) one replica should carry; desired replicas =
    /// ceil(load / target).
    #[serde(default = "four")]
    #[x_kube(validation = Rule::new("self >= 1").message("targetQueuePerReplica must be at least 1"))]
    pub target_queue_per_replica: u32,
    /// How long load must stay low before replicas are removed.
    #[serde(default = "five_minutes")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 86400").message("scaleDownDelaySeconds must be between 0 and 86400"))]
    pub scale_down_delay_seconds: u32,
    /// `builtin`: the operator scales from the engines' queue depth. `external`: HPA or KEDA
    /// drives `spec.replicas` through the `/scale` subresource.
    #[serde(default)]
    pub mode: AutoscalingMode,
}

fn one_i32() -> i32 {
    1
}
fn four() -> u32 {
    4
}
fn five_minutes() -> u32 {
    300
}

/// Who decides the replica count.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "kebab-case")]
pub enum AutoscalingMode {
    #[default]
    Builtin,
    External,
}

/// The engine container and extra pod settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Engine image; the operator's default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
    /// Extra arguments appended to the planned ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Resources beside the accelerators and memory the plan sets (for example cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Extra device memory per rank to keep free for the runtime (bytes); the operator's
    /// default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_overhead_bytes: Option<u64>,
    /// Secrets (in this namespace) to pull this model's `image` with, beside the ones the
    /// operator gives every engine pod (the chart's `imagePullSecrets`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// RuntimeClass of the engine pods (for example `nvidia` where the NVIDIA container
    /// toolkit is a RuntimeClass rather than the default runtime); the operator's default
    /// (the chart's `enginePods.runtimeClassName`) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runtime_class_name: Option<String>,
    /// How the engine pods spread over zones or nodes. A constraint with no `labelSelector`
    /// counts this deployment's engine pods. The pods stay on the plan's nodes whatever a
    /// constraint says: `DoNotSchedule` over them can leave pods pending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(validation = Rule::new("self.all(c, c.maxSkew >= 1)").message("topologySpreadConstraints: maxSkew must be at least 1"))]
    #[x_kube(validation = Rule::new("self.all(c, c.whenUnsatisfiable in ['DoNotSchedule', 'ScheduleAnyway'])").message("topologySpreadConstraints: whenUnsatisfiable must be DoNotSchedule or ScheduleAnyway"))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// A PodDisruptionBudget for the engine pods, created and owned by the operator
    /// (deleted again when this is removed). None when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disruption_budget: Option<DisruptionBudget>,
}

/// How many engine pods a voluntary disruption (a node drain) must leave, or may take:
/// exactly one of the two, a number or a percentage as in a PodDisruptionBudget.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.minAvailable) != has(self.maxUnavailable)").message("disruptionBudget takes exactly one of minAvailable and maxUnavailable"))]
pub struct DisruptionBudget {
    /// Engine pods that must stay available (a number, or a percentage such as `50%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')").message("minAvailable must be a number of at least 0 or a percentage such as 50%"))]
    pub min_available: Option<IntOrString>,
    /// Engine pods a disruption may take (a number, or a percentage such as `25%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')").message("maxUnavailable must be a number of at least 0 or a percentage such as 25%"))]
    pub max_unavailable: Option<IntOrString>,
}

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
    /// Why this plan, in words.
    pub reasons: Vec<String>,
    /// Alternatives considered and why they lost, in words.
    pub rejected: Vec<String>,
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
