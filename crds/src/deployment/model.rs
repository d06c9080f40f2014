//! What is served: the model (its family and where its files are) and the workload
//! bounds the planner sizes activations for, with their defaults.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::common::ModelLocation;

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
