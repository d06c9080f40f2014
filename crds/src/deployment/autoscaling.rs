//! How many pods: queue-based scaling of the engine pods, builtin or by an external
//! autoscaler through `/scale`.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

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
