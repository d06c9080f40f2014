//! What the runner writes back to the API, as a kubelet would: the pod's status and
//! readiness, the events of a refusal, and the pod's final delete.

use std::sync::Mutex;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::refusal::Refusal;
use super::state::State;

/// Marks the pod's container as unable to run, as a kubelet does: a waiting state with the
/// reason and message, not Ready, and a Warning event.
pub(super) async fn refuse(client: &Client, pod: &Pod, node: &str, refusal: &Refusal) {
    let name = pod.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
    let container = pod.spec.as_ref().map(|s| s.containers[0].clone());
    let (container_name, image) = container
        .map(|c| (c.name, c.image.unwrap_or_default()))
        .unwrap_or_default();
    let status = json!({
        "name": container_name, "image": image, "imageID": "", "ready": false,
        "started": false, "restartCount": 0,
        "state": { "waiting": { "reason": refusal.reason, "message": refusal.message } }
    });
    if let Err(e) = set_ready(&pods, &name, false, status).await {
        tracing::warn!(error = %e, pod = %name, "node runner: recording a refusal");
    }
    let events: Api<Event> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
    let now = Timestamp::now().to_string();
    let event = json!({
        "metadata": { "generateName": format!("{name}.") },
        "involvedObject": {
            "apiVersion": "v1", "kind": "Pod", "name": name, "namespace": pod.namespace(),
            "uid": pod.uid(), "fieldPath": format!("spec.containers{{{container_name}}}"),
        },
        "reason": "Failed",
        "message": format!("Error: {}: {}", refusal.reason, refusal.message),
        "type": "Warning",
        "source": { "component": "kubelet", "host": node },
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    });
    match serde_json::from_value::<Event>(event) {
        Ok(event) => {
            if let Err(e) = events.create(&PostParams::default(), &event).await {
                tracing::warn!(error = %e, pod = %name, "node runner: posting an event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "node runner: building an event"),
    }
}

/// Records a pod the runner cannot run, for the test and in the pod's status.
pub(super) async fn fail(
    client: &Client,
    state: &Mutex<State>,
    pod: &Pod,
    node: &str,
    refusal: &Refusal,
) {
    state.lock().expect("runner state").failures.push(format!(
        "pod {}: {}: {}",
        pod.name_any(),
        refusal.reason,
        refusal.message
    ));
    refuse(client, pod, node, refusal).await;
}

/// Sets the pod's Ready and ContainersReady conditions and its container's status.
pub(super) async fn set_ready(
    pods: &Api<Pod>,
    name: &str,
    ready: bool,
    container: serde_json::Value,
) -> Result<()> {
    let now = Timestamp::now().to_string();
    let status = if ready { "True" } else { "False" };
    let reason = if ready {
        None
    } else {
        Some("ContainersNotReady")
    };
    let patch = json!({
        "status": {
            "conditions": [
                { "type": "Ready", "status": status, "reason": reason, "lastTransitionTime": now },
                { "type": "ContainersReady", "status": status, "reason": reason, "lastTransitionTime": now },
            ],
            "containerStatuses": [container],
        }
    });
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .with_context(|| format!("setting pod {name} ready={ready}"))?;
    Ok(())
}

/// Deletes the pod object at once (what a kubelet does once its containers stopped).
pub(super) async fn delete_now(client: &Client, pod: &Pod) -> Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(&pod.name_any(), &dp).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}
