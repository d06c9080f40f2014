//! The engine pods: the container's settings and the pod-level ones a model may add
//! (spread, pull secrets, runtime class, a PodDisruptionBudget, how a rollout replaces them).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvVar, LocalObjectReference, ResourceRequirements, TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use super::rollout::Rollout;

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
    /// How a change to the pod template (a new plan, image or setting) replaces the engine
    /// pods. Unset: one extra pod at a time and none taken away first, where a planned
    /// node has room for it (see [`Rollout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
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
