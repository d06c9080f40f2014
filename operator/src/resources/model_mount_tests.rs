//! How engine pods mount a model and where the engine opens it: a Hugging Face hub cache
//! repository (a `revision`) is mounted whole, by hostPath or claim, and the engine opens its
//! snapshot under the mount with the mount as its only root, so the snapshot's links into
//! `blobs/` resolve and cannot lead elsewhere.

use super::tests::plan;
use super::*;
use crds::DiffusionDeployment;
use k8s_openapi::api::core::v1::PodSpec;
use serde_json::json;

fn dd(location: serde_json::Value) -> DiffusionDeployment {
    serde_json::from_value(json!({
        "apiVersion": "layerwise.dev/v1alpha1",
        "kind": "DiffusionDeployment",
        "metadata": { "name": "dit", "namespace": "ns" },
        "spec": { "model": { "family": "wan", "location": location } },
    }))
    .unwrap()
}

fn pod(d: &DiffusionDeployment) -> PodSpec {
    let dep = deployment(d, &plan(), 1, "engine:test", &EnginePods::default(), &[]);
    dep.spec.unwrap().template.spec.unwrap()
}

/// The value after `flag` on the engine's command line.
fn flag(pod: &PodSpec, flag: &str) -> Option<String> {
    let args = pod.containers[0].args.clone().unwrap_or_default();
    args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone())
}

/// The model volume and its mount in the engine container.
fn model_mount(pod: &PodSpec) -> (k8s_openapi::api::core::v1::Volume, VolumeMountView) {
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "model")
        .unwrap()
        .clone();
    let m = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "model")
        .unwrap();
    (
        v,
        VolumeMountView {
            path: m.mount_path.clone(),
            sub_path: m.sub_path.clone(),
            read_only: m.read_only == Some(true),
        },
    )
}

#[derive(Debug, PartialEq)]
struct VolumeMountView {
    path: String,
    sub_path: Option<String>,
    read_only: bool,
}

#[test]
fn a_hub_cache_repository_by_host_path_is_mounted_whole_and_its_snapshot_opened() {
    let repo = "/models/hub/models--org--dit";
    let p = pod(&dd(json!({ "hostPath": repo, "revision": "main" })));
    let (volume, mount) = model_mount(&p);
    assert_eq!(volume.host_path.unwrap().path, repo);
    assert_eq!(
        mount,
        VolumeMountView {
            path: MODEL_MOUNT.into(),
            sub_path: None,
            read_only: true
        }
    );
    assert_eq!(
        flag(&p, "--model").as_deref(),
        Some("/model/snapshots/main")
    );
    assert_eq!(flag(&p, "--model-roots").as_deref(), Some(MODEL_MOUNT));
}

#[test]
fn a_hub_cache_repository_in_a_claim_is_mounted_whole_and_its_snapshot_opened() {
    let commit = "4f1d2c3b4a5968778695a4b3c2d1e0f9a8b7c6d5";
    let p = pod(&dd(json!({
        "persistentVolumeClaim": { "claimName": "hub", "subPath": "models--org--dit" },
        "revision": commit,
    })));
    let (volume, mount) = model_mount(&p);
    let claim = volume.persistent_volume_claim.unwrap();
    assert_eq!(
        (claim.claim_name.as_str(), claim.read_only),
        ("hub", Some(true))
    );
    assert_eq!(
        mount,
        VolumeMountView {
            path: MODEL_MOUNT.into(),
            sub_path: Some("models--org--dit".into()),
            read_only: true
        }
    );
    assert_eq!(
        flag(&p, "--model"),
        Some(format!("/model/snapshots/{commit}"))
    );
    assert_eq!(flag(&p, "--model-roots").as_deref(), Some(MODEL_MOUNT));
}

/// Without a revision the folder is the pipeline: what the engine opens is the mount, and
/// a snapshot folder given this way is mounted alone, its links into `../../blobs/` leading
/// outside the roots (the engine refuses them: engine/tests/hub_cache.rs).
#[test]
fn without_a_revision_the_mount_is_the_pipeline() {
    let p = pod(&dd(
        json!({ "hostPath": "/models/hub/models--org--dit/snapshots/4f1d2c3b" }),
    ));
    let (volume, _) = model_mount(&p);
    assert_eq!(
        volume.host_path.unwrap().path,
        "/models/hub/models--org--dit/snapshots/4f1d2c3b"
    );
    assert_eq!(flag(&p, "--model").as_deref(), Some(MODEL_MOUNT));
    assert_eq!(flag(&p, "--model-roots").as_deref(), Some(MODEL_MOUNT));
}
