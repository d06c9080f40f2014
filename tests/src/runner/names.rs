//! The names the runner reads and writes on pods and containers: the annotation that hands
//! a pod to it, the labels its containers carry (so a later run can find and remove them),
//! and the service-account mount path.

use crate::cluster;

/// The pod annotation that hands a pod to the runner (kwok then leaves its readiness and
/// deletion alone).
pub const ANNOTATION: &str = "e2e.layerwise.dev/kubelet";
/// The annotation's value.
pub const ANNOTATION_VALUE: &str = "node-runner";
/// The label of every container the runner starts: the cluster's state folder.
pub const CLUSTER_LABEL: &str = "e2e.layerwise.dev/cluster";
/// The label of every container the runner starts: the pid of the test process.
pub const RUNNER_LABEL: &str = "e2e.layerwise.dev/runner-pid";
/// The label of every container the runner starts: the pod's namespace.
pub(super) const NAMESPACE_LABEL: &str = "e2e.layerwise.dev/namespace";
/// Where a pod's service-account credentials are mounted when it has no projected volume.
pub(super) const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The `--label` options of every container the runner starts in `namespace`.
pub(super) fn labels(namespace: &str) -> [String; 3] {
    [
        format!(
            "--label={CLUSTER_LABEL}={}",
            cluster::cluster_dir().display()
        ),
        format!("--label={RUNNER_LABEL}={}", std::process::id()),
        format!("--label={NAMESPACE_LABEL}={namespace}"),
    ]
}
