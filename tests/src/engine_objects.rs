//! The engine objects the operator makes, built by the operator's own code
//! (`layerwise_operator::resources`) for a small DiffusionDeployment, so the chart's monitors
//! and the cluster's Pod Security admission are tested against what the operator really
//! applies rather than a copy of it.

use anyhow::{Context, Result};
use crds::{DiffusionDeployment, MemoryBreakdown, Plan};
use k8s_openapi::api::core::v1::{Pod, Service};
use layerwise_operator::resources::{self, EnginePods};
use serde_json::json;

/// A DiffusionDeployment `name` in `namespace` whose model is at `location` (the spec's
/// `model.location`: `{"hostPath": ...}` or `{"persistentVolumeClaim": {...}}`).
pub fn diffusion_deployment(
    name: &str,
    namespace: &str,
    location: serde_json::Value,
) -> Result<DiffusionDeployment> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "layerwise.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": { "name": name, "namespace": namespace, "uid": "0" },
        "spec": {
            "model": { "family": "dit", "location": location },
            "workload": { "maxWidth": 512, "maxHeight": 512 },
        },
    }))?)
}

/// A plan of two ranks on one node.
fn plan() -> Result<Plan> {
    Ok(serde_json::from_value(json!({
        "strategy": "offload-sharded", "dp": 2, "slots": 2, "fastPeerLink": true,
        "deviceBytesPerRank": 1u64 << 30, "hostBytesPerPod": 4u64 << 30,
        "deviceBreakdown": MemoryBreakdown::default(),
        "nodes": ["a100-0"], "reasons": [], "rejected": [],
    }))?)
}

/// One engine pod of `dd` as its Deployment's template makes it (named `<dd>-engine`), and
/// the engine Service in front of the pods.
pub fn engine_objects(dd: &DiffusionDeployment) -> Result<(Pod, Service)> {
    let deployment = resources::deployment(
        dd,
        &plan()?,
        1,
        "layerwise-engine:0",
        &EnginePods::default(),
        &[],
    );
    let template = deployment
        .spec
        .context("engine Deployment without a spec")?
        .template;
    let mut meta = template.metadata.unwrap_or_default();
    meta.name = Some(format!(
        "{}-engine",
        dd.metadata.name.as_deref().unwrap_or("dd")
    ));
    meta.namespace = dd.metadata.namespace.clone();
    let pod = Pod {
        metadata: meta,
        spec: template.spec,
        status: None,
    };
    Ok((pod, resources::service(dd)))
}
