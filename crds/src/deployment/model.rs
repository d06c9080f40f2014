//! What is served: the model (its family and where its files are) and the workload
//! bounds the planner sizes activations for, with their defaults.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use layerwise_core::bounds;

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
/// planner reserves activation memory for a request at these bounds. Each bound's range is
/// the engine's own for its flag (`layerwise_core::bounds::WIDTH_RANGE` and the rest), so
/// `kubectl apply` and `layerwise serve` refuse the same values.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    #[serde(default = "default_side")]
    #[x_kube(validation = Rule::new(bounds::WIDTH_RANGE.cel()).message(bounds::WIDTH_RANGE.cel_message().as_str()))]
    pub max_width: u64,
    #[serde(default = "default_side")]
    #[x_kube(validation = Rule::new(bounds::HEIGHT_RANGE.cel()).message(bounds::HEIGHT_RANGE.cel_message().as_str()))]
    pub max_height: u64,
    /// Frames per request (1 for images).
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new(bounds::FRAMES_RANGE.cel()).message(bounds::FRAMES_RANGE.cel_message().as_str()))]
    pub max_frames: u64,
    #[serde(default = "default_steps")]
    #[x_kube(validation = Rule::new(bounds::STEPS_RANGE.cel()).message(bounds::STEPS_RANGE.cel_message().as_str()))]
    pub max_steps: u64,
    /// Images per request.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new(bounds::N_RANGE.cel()).message(bounds::N_RANGE.cel_message().as_str()))]
    pub max_batch: u64,
    /// Whether requests may use classifier-free guidance (doubles the transformer's batch).
    #[serde(default = "yes")]
    pub guidance: bool,
    /// Most tokens of a prompt (a request's `max_sequence_length`), for text families: the
    /// planner reserves the text encoder's and the transformer's activations for a prompt
    /// this long, and the engine refuses longer ones.
    #[serde(default = "default_prompt_tokens")]
    #[x_kube(validation = Rule::new(bounds::PROMPT_TOKENS_RANGE.cel()).message(bounds::PROMPT_TOKENS_RANGE.cel_message().as_str()))]
    pub max_prompt_tokens: u64,
    /// The most seconds a request at these bounds should take: the planner splits its
    /// sequence over enough ranks (`sp`) that the step-time model predicts it within this,
    /// or, where no sp can, plans the fastest and says so (the `Planned` condition's
    /// reason `LatencyBoundNotMet`). Unset: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("maxLatencySeconds must be positive"))]
    pub max_latency_seconds: Option<f64>,
    /// The step cache every request runs with unless it turns it off or asks for less
    /// skipping (unset: none, and requests may not ask for one): the planner reserves the
    /// tensors it holds and times the steps it computes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<super::cache::WorkloadCache>,
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
            cache: None,
        }
    }
}
