//! The labels of a DiffusionDeployment's objects and those it owns beside the Deployment:
//! the PodDisruptionBudget of its pods and the Secret with its job-id key.

use std::collections::BTreeMap;

use crds::DiffusionDeployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::{Resource, ResourceExt};

/// Labels that select a deployment's engine pods.
pub fn selector_labels(dd: &DiffusionDeployment) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "layerwise-engine".to_string(),
        ),
        (crate::stores::INSTANCE.to_string(), dd.name_any()),
    ])
}

/// The selector as a string, for the `/scale` subresource and list calls.
pub fn selector_string(dd: &DiffusionDeployment) -> String {
    selector_labels(dd)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) fn labels(dd: &DiffusionDeployment) -> BTreeMap<String, String> {
    let mut l = selector_labels(dd);
    let (key, value) = crate::stores::MANAGED_BY;
    l.insert(key.into(), value.into());
    l
}

/// Metadata of an object the DiffusionDeployment owns: same name and namespace, its
/// labels, and a controller owner reference so deleting it collects the object.
pub(crate) fn owned_meta(dd: &DiffusionDeployment) -> ObjectMeta {
    ObjectMeta {
        name: Some(dd.name_any()),
        namespace: dd.namespace(),
        labels: Some(labels(dd)),
        owner_references: dd.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    }
}

/// The PodDisruptionBudget of `dd`'s engine pods, when its spec asks for one: same name,
/// owned by the DiffusionDeployment, selecting the engine pods.
pub fn disruption_budget(dd: &DiffusionDeployment) -> Option<PodDisruptionBudget> {
    let budget = dd.spec.engine.disruption_budget.as_ref()?;
    Some(PodDisruptionBudget {
        metadata: owned_meta(dd),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: budget.min_available.clone(),
            max_unavailable: budget.max_unavailable.clone(),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(dd)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

/// The key in the job-key Secret that holds the key.
pub const JOB_KEY: &str = "job-key";

/// The Secret that holds a deployment's job-id key (`<name>-job-key`).
pub fn job_key_secret_name(dd: &DiffusionDeployment) -> String {
    format!("{}-job-key", dd.name_any())
}

/// The Secret with a deployment's job-id key, `key` (the same in every engine pod of the
/// deployment, so any of them can check an id another made and send the request to its
/// owner). Immutable, and owned by the DiffusionDeployment so that deleting it collects the
/// Secret; the controller creates it once and never rewrites it.
pub fn job_key_secret(dd: &DiffusionDeployment, key: String) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(job_key_secret_name(dd)),
            ..owned_meta(dd)
        },
        immutable: Some(true),
        type_: Some("Opaque".into()),
        string_data: Some(BTreeMap::from([(JOB_KEY.to_string(), key)])),
        ..Default::default()
    }
}
