//! `DiffusionNode`: one per node, named after it. The operator writes the spec (which models
//! to prepare); the node agent writes the status (what the node has, and each model's
//! profile and page-cache state).

// Several printer columns repeat `type_ = "integer"`, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use kube::KubeSchema;
use layerwise_core::profile::Profile;
use serde::{Deserialize, Serialize};

use crate::common::ModelLocation;

/// The models a node should prepare: one entry per DiffusionDeployment that asked, keyed by
/// its id. The operator changes only the entries it names (a JSON patch that tests each
/// entry it replaces or removes at its index first), so other writers' entries stay.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "layerwise.dev",
    version = "v1alpha1",
    kind = "DiffusionNode",
    status = "DiffusionNodeStatus",
    shortname = "dn",
    category = "layerwise",
    doc = "A node's accelerators, memory and prepared models, reported by the layerwise node agent",
    printcolumn(
        name = "Accelerators",
        type_ = "string",
        json_path = ".status.accelerators[0].product"
    ),
    printcolumn(
        name = "Count",
        type_ = "integer",
        json_path = ".status.accelerators[0].count"
    ),
    printcolumn(name = "Models", type_ = "integer", json_path = ".status.modelCount"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DiffusionNodeSpec {
    /// Models to profile and warm into the page cache, one entry per requesting deployment.
    #[serde(default)]
    #[schemars(length(max = 128))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["id"]))]
    pub models: Vec<ModelRequest>,
}

/// One model a node is asked to prepare.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelRequest {
    /// Who asked: `<namespace>/<DiffusionDeployment name>`.
    #[schemars(length(max = 317))]
    pub id: String,
    /// Model family (for example `dit`).
    #[schemars(length(max = 63))]
    pub family: String,
    /// Where the model's files are on this node.
    pub location: ModelLocation,
}

/// What the node has, written only by its agent.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DiffusionNodeStatus {
    /// Accelerator kinds on the node.
    #[serde(default)]
    pub accelerators: Vec<AcceleratorInventory>,
    /// Physical host memory.
    #[serde(default)]
    pub host_memory_bytes: u64,
    /// The memory limit of the cgroup pods run under, when the node has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_memory_limit_bytes: Option<u64>,
    /// Per requested model: profile, residency, state.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["id"]))]
    pub models: Vec<NodeModelStatus>,
    /// Number of entries in `models` (a printer column).
    #[serde(default)]
    pub model_count: u32,
    /// When the agent last wrote this status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

impl DiffusionNodeStatus {
    /// Host bytes pods may use: the smaller of physical memory and the cgroup limit.
    pub fn usable_host_bytes(&self) -> u64 {
        self.cgroup_memory_limit_bytes
            .map_or(self.host_memory_bytes, |l| l.min(self.host_memory_bytes))
    }

    /// The status of the model requested as `id`, if the agent has reported it.
    pub fn model(&self, id: &str) -> Option<&NodeModelStatus> {
        self.models.iter().find(|m| m.id == id)
    }
}

/// One kind of accelerator on a node.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorInventory {
    /// Extended resource name, e.g. `nvidia.com/gpu`.
    pub resource_name: String,
    /// Product name, e.g. `NVIDIA-H200`.
    pub product: String,
    pub count: u32,
    /// Memory of each device.
    pub memory_bytes: u64,
    /// Whether the devices reach each other over a fast peer link (NVLink and the like);
    /// without one the planner prefers `offload` to the all-gathering strategies.
    #[serde(default)]
    pub fast_peer_link: bool,
}

/// The state of one requested model on a node.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NodeModelStatus {
    /// The request's id (`<namespace>/<name>`).
    pub id: String,
    #[serde(default)]
    pub state: ModelState,
    /// The checkpoint profile read from the headers, once profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<Profile>,
    /// Bytes of the model's files in the page cache.
    #[serde(default)]
    pub resident_bytes: u64,
    /// Bytes of the model's files.
    #[serde(default)]
    pub total_bytes: u64,
    /// What went wrong, naming the file or field at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The copy in the node model cache, for a source the agent stages (`s3`): how far the
    /// download is, and where the published copy is once complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<StagingStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiled_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmed_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

/// A model's copy in the node model cache.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StagingStatus {
    pub state: StagingState,
    /// Bytes of the copy on the node's disk (chunks resumed after a restart count).
    #[serde(default)]
    pub bytes: u64,
    /// Bytes of the model in the store (0 until listed).
    #[serde(default)]
    pub total_bytes: u64,
    /// Download rate over the last seconds.
    #[serde(default)]
    pub bytes_per_second: u64,
    /// Seconds left at that rate, while downloading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    /// The published copy's folder on the node (what engine pods mount read-only), once
    /// `Staged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Why the last try failed (`CacheFull`, `AccessDenied`, `NoSuchBucket`,
    /// `ObjectNotFound`, `ObjectChanged`, `IntegrityMismatch`, `StoreUnavailable`,
    /// `CacheIo`, `CredentialsUnavailable`), while `Retrying` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The failure's message, naming the source, object or file (never a credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Tries so far that failed.
    #[serde(default)]
    pub failures: u32,
}

/// Where a node is with copying a model into its cache.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum StagingState {
    /// Listing the store and making room.
    #[default]
    Listing,
    Downloading,
    /// Checking sizes, checksums and headers before publishing.
    Verifying,
    /// Published whole: the copy is complete.
    Staged,
    /// The last try failed with a fault that may pass by itself (an object replaced
    /// mid-download, the store unreachable); the next starts after a short backoff.
    Retrying,
    /// The last try failed with a fault a person must fix (credentials, a missing bucket or
    /// object, a corrupt object, a full cache); tried again after a longer backoff.
    Failed,
}

/// Where a node is with a model.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum ModelState {
    #[default]
    Pending,
    /// Copying the model into the node model cache (see `staging`).
    Staging,
    Profiling,
    Warming,
    Warm,
    Failed,
}
