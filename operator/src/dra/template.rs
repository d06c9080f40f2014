//! What the operator builds for DRA: the ResourceClaimTemplate a plan's pods claim their
//! devices through, named after its own contents, and applying it (deleting the earlier ones
//! once no engine pod claims through them).

use std::collections::BTreeSet;

use crds::DiffusionDeployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClaim, DeviceConstraint, DeviceRequest, DeviceSelector,
    ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};

use crate::context::{Context, MANAGER};
use crate::error::{kube, Result};
use crate::requests::model_id;
use crate::resources::DEVICE_CLAIM as CLAIM;

use super::inventory::Inventory;

/// FNV-1a of `bytes`: stable across processes, so every replica names a template alike.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}

/// The ResourceClaimTemplate for `devices` devices of `inv`'s class with at least
/// `memory_bytes` each (where the devices publish memory), sharing one value of the link
/// attribute where `linked`; named `<deployment>-<hash of its spec>`, owned by `dd`.
pub fn template(
    dd: &DiffusionDeployment,
    inv: &Inventory,
    devices: u32,
    memory_bytes: u64,
    linked: bool,
) -> ResourceClaimTemplate {
    let selectors = inv.memory_published.then(|| {
        vec![DeviceSelector {
            cel: Some(CELDeviceSelector {
                expression: format!(
                    "device.capacity[device.driver].memory.compareTo(quantity('{memory_bytes}')) >= 0"
                ),
            }),
        }]
    });
    let constraints = (linked && devices >= 2).then(|| {
        vec![DeviceConstraint {
            requests: Some(vec![CLAIM.into()]),
            match_attribute: Some(inv.link_attribute.clone()),
            ..Default::default()
        }]
    });
    let spec = ResourceClaimTemplateSpec {
        metadata: None,
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: CLAIM.into(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: inv.class.clone(),
                        allocation_mode: Some("ExactCount".into()),
                        count: Some(i64::from(devices)),
                        selectors,
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                constraints,
                ..Default::default()
            }),
        },
    };
    let hash = fnv(&serde_json::to_vec(&spec).expect("a template spec serializes"));
    let base = dd.name_any();
    let base = &base[..base.len().min(200)];
    let meta = crate::resources::owned_meta(dd);
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(format!("{base}-{:08x}", hash as u32)),
            ..meta
        },
        spec,
    }
}

/// The template the pods of `plan` claim their devices through: its dp × sp devices, each
/// with the plan's device memory, sharing a fast link where the plan's nodes have one.
pub fn for_plan(
    dd: &DiffusionDeployment,
    inv: &Inventory,
    plan: &crds::Plan,
) -> ResourceClaimTemplate {
    template(
        dd,
        inv,
        plan.devices(),
        plan.device_bytes_per_rank,
        plan.fast_peer_link,
    )
}

/// Applies the generated `wanted` template and deletes the deployment's earlier ones that
/// no engine pod claims through any more.
pub async fn apply_template(
    dd: &DiffusionDeployment,
    ctx: &Context,
    wanted: &ResourceClaimTemplate,
    pods: &[Pod],
) -> Result<Vec<String>> {
    let id = model_id(dd);
    let ns = dd.namespace().unwrap_or_default();
    let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    let name = wanted.name_any();
    let mut obj =
        serde_json::to_value(wanted).map_err(|source| crate::error::Error::Serialize {
            what: "ResourceClaimTemplate",
            source,
        })?;
    obj["apiVersion"] = "resource.k8s.io/v1".into();
    obj["kind"] = "ResourceClaimTemplate".into();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .map_err(kube(format!(
        "applying ResourceClaimTemplate {name} of {id}"
    )))?;
    let claimed: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| {
            p.spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
        })
        .filter_map(|c| c.resource_claim_template_name.as_deref())
        .collect();
    let selector = crate::resources::selector_string(dd);
    let ours = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(kube(format!("listing ResourceClaimTemplates of {id}")))?;
    let mut deleted = Vec::new();
    for t in ours.items {
        let n = t.name_any();
        let owned = t
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == dd.metadata.uid.as_ref());
        if n == name || !owned || claimed.contains(n.as_str()) {
            continue;
        }
        match api.delete(&n, &DeleteParams::default()).await {
            Ok(_) => deleted.push(n),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(kube(format!("deleting ResourceClaimTemplate {n} of {id}"))(
                    e,
                ))
            }
        }
    }
    Ok(deleted)
}
