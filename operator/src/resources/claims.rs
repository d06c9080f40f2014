//! The engine container's resources: the plan's accelerators and host memory, taken as an
//! extended resource or, where the plan names a ResourceClaimTemplate, through the pod's
//! claim on its devices.

use std::collections::BTreeMap;

use crds::{DiffusionDeploymentSpec, Plan};
use k8s_openapi::api::core::v1::{PodResourceClaim, ResourceClaim, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// The name of an engine pod's claim on its devices (where it claims them by Dynamic
/// Resource Allocation), and of the one device request of the templates the operator
/// generates ([`crate::dra`]).
pub const DEVICE_CLAIM: &str = "accelerators";

/// The engine container's resources: the spec's, with the plan's accelerators and memory
/// in place of anything it says for them. Where the pods claim their devices by DRA
/// (the plan names a ResourceClaimTemplate), the container takes the pod's claim instead
/// of an extended resource.
pub(super) fn engine_resources(
    spec: &DiffusionDeploymentSpec,
    plan: &Plan,
) -> ResourceRequirements {
    let engine = &spec.engine;
    let resource = spec.accelerator.resource().to_string();
    let claimed = plan.resource_claim_template.is_some();
    // The plan's accelerators and memory win over anything the spec says for them.
    let mut res = engine.resources.clone().unwrap_or_default();
    // The request is what the pod needs of its own; the model's page-cache copy is one per
    // node, shared by its pods (the planner checks the node holds it). The limit leaves room
    // for the mapped pages a pod faults in itself (a cold cache), which are charged to it.
    // dp groups of sp ranks, one accelerator each.
    let accel = Quantity(plan.devices().to_string());
    let requests = res.requests.get_or_insert_with(BTreeMap::new);
    requests
        .entry("cpu".into())
        .or_insert_with(|| Quantity("1".into()));
    requests.insert(
        "memory".into(),
        Quantity(plan.host_bytes_per_pod.to_string()),
    );
    if claimed {
        requests.remove(&resource);
    } else {
        requests.insert(resource.clone(), accel.clone());
    }
    let limits = res.limits.get_or_insert_with(BTreeMap::new);
    limits.insert(
        "memory".into(),
        Quantity(
            plan.host_bytes_per_pod
                .saturating_add(plan.host_bytes_per_node)
                .to_string(),
        ),
    );
    if claimed {
        limits.remove(&resource);
        res.claims = Some(vec![ResourceClaim {
            name: DEVICE_CLAIM.into(),
            request: None,
        }]);
    } else {
        limits.insert(resource, accel);
    }
    res
}

/// The pod's claim on its devices, where the plan names the ResourceClaimTemplate it
/// claims them through.
pub(super) fn device_claims(plan: &Plan) -> Option<Vec<PodResourceClaim>> {
    let template = plan.resource_claim_template.as_ref()?;
    Some(vec![PodResourceClaim {
        name: DEVICE_CLAIM.into(),
        resource_claim_template_name: Some(template.clone()),
        resource_claim_name: None,
    }])
}
