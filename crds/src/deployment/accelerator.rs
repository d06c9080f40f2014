//! Where it runs: the accelerator product and nodes to consider, the devices it may claim
//! by Dynamic Resource Allocation, and the rates the step-time model times it with.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The CRD's `spec.accelerator.rates`: core's type, which `layerwise bench` and
/// `engine/gpu-check` also print their measured rates in.
pub use layerwise_core::timing::AcceleratorRates;

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

impl Accelerator {
    /// The default accelerator resource.
    pub const DEFAULT_RESOURCE: &'static str = "nvidia.com/gpu";

    pub fn resource(&self) -> &str {
        self.resource_name
            .as_deref()
            .unwrap_or(Self::DEFAULT_RESOURCE)
    }
}
