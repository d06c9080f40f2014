//! Routing through the Gateway API inference extension: the `InferencePool` the operator
//! keeps for a deployment, its endpoint picker, and what happens when the picker fails.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

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
