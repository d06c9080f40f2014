//! The engine pod's volumes and the container's mounts of them: the model (its hostPath, or
//! its claim read-only) at [`MODEL_MOUNT`], a scratch `/tmp` under a read-only root, and for
//! pods of more than one rank a memory-backed `/dev/shm` sized for NCCL; and the pipeline
//! folder the engine opens under that mount ([`model_path`]).

use std::path::{Path, PathBuf};

use crds::{DiffusionDeploymentSpec, Plan};
use k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, HostPathVolumeSource, PersistentVolumeClaimVolumeSource, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use layerwise_core::checkpoint::hf_cache;

/// Where the model volume is mounted in the engine container.
pub const MODEL_MOUNT: &str = "/model";

/// The pipeline folder the engine opens: the mount itself, or, for a Hugging Face hub cache
/// repository (`spec.model.location.revision`), its snapshot at that revision. The mount is
/// the whole repository either way, so the snapshot's links into `blobs/` resolve inside the
/// engine's model roots (the mount); a ref (`main`) the engine follows through `refs/`
/// ([`layerwise_core::checkpoint::hf_cache`]).
pub fn model_path(spec: &DiffusionDeploymentSpec) -> PathBuf {
    let mount = Path::new(MODEL_MOUNT);
    match &spec.model.location.revision {
        Some(rev) => mount.join(hf_cache::SNAPSHOTS).join(rev),
        None => mount.to_path_buf(),
    }
}

/// The pod's volumes and the container's mounts of them, for `spec`'s model.
pub(super) fn volumes(spec: &DiffusionDeploymentSpec) -> (Vec<Volume>, Vec<VolumeMount>) {
    let (model, sub_path) = model_volume(spec);
    let volumes = vec![
        model,
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
    ];
    let mounts = vec![
        VolumeMount {
            name: "model".into(),
            mount_path: MODEL_MOUNT.into(),
            read_only: Some(true),
            sub_path,
            ..Default::default()
        },
        VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..Default::default()
        },
    ];
    (volumes, mounts)
}

/// The model's volume (its hostPath, or its claim read-only) and the sub-path mounted.
fn model_volume(spec: &DiffusionDeploymentSpec) -> (Volume, Option<String>) {
    match (
        &spec.model.location.host_path,
        &spec.model.location.persistent_volume_claim,
    ) {
        (Some(path), _) => (
            Volume {
                name: "model".into(),
                host_path: Some(HostPathVolumeSource {
                    path: path.clone(),
                    type_: Some("Directory".into()),
                }),
                ..Default::default()
            },
            None,
        ),
        (None, pvc) => {
            let pvc = pvc.clone().unwrap_or_default();
            (
                Volume {
                    name: "model".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: pvc.claim_name,
                        read_only: Some(true),
                    }),
                    ..Default::default()
                },
                pvc.sub_path,
            )
        }
    }
}

/// Shared memory NCCL's shared-memory transport may take per rank: the buffers of its three
/// protocols (about 9 MiB by default) for a send and a receive connection on each of up to
/// 16 channels.
pub const SHM_BYTES_PER_RANK: u64 = 16 * 2 * (9 << 20);
/// What the container runtime's own `/dev/shm` holds, kept for everything else in the pod.
const SHM_BASE_BYTES: u64 = 64 << 20;

/// `/dev/shm` for a pod of `plan` with more than one rank: a memory-backed emptyDir (the
/// runtime's 64 MiB is less than NCCL's shared-memory transport can need between ranks of
/// one pod). Its pages count against the pod's memory limit as they are written, which
/// leaves room for them beside the model's page cache. `None` for a single rank: nothing to
/// share.
pub(super) fn shm(plan: &Plan) -> Option<(Volume, VolumeMount)> {
    let ranks = plan.devices();
    if ranks <= 1 {
        return None;
    }
    let bytes = SHM_BASE_BYTES + SHM_BYTES_PER_RANK * ranks as u64;
    Some((
        Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity(bytes.to_string())),
            }),
            ..Default::default()
        },
        VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..Default::default()
        },
    ))
}
