//! The node runner: a test-side kubelet for the fake (kwok) nodes, so that pods the cluster
//! schedules there run in real containers, from their images, under podman.
//!
//! It acts on pods annotated [`ANNOTATION`]`=node-runner` (kwok leaves those to it, see
//! `tests/cluster/node-runner-stages.yaml`) in one namespace, on nodes it was given a root
//! folder for. For each such pod, once kwok has given it an IP, it starts the pod's (one)
//! container with `podman run` (`images/containers.conf`: runc, cgroupfs) and applies what a
//! kubelet applies:
//! - the image, which must be in podman's local store (nothing is ever pulled: a missing image
//!   fails the pod with `ErrImageNeverPull`), its `command` as the entrypoint and its `args`;
//! - the `securityContext`, the container's over the pod's: `runAsUser`/`runAsGroup` and
//!   `supplementalGroups` as the process's ids, `runAsNonRoot` checked against them (or the
//!   image's user) before the start, `readOnlyRootFilesystem` (and no tmpfs in its place),
//!   `capabilities` dropped and added, `allowPrivilegeEscalation: false` as no-new-privileges,
//!   `seccompProfile` (RuntimeDefault: the runtime's profile; unset or Unconfined: none, as a
//!   kubelet without `--seccomp-default`). This kubelet does not allow privileged containers;
//! - the network is the host's, and the pod's network namespace is its loopback IP: a listen
//!   address `0.0.0.0:<port>` in an argument or an environment value becomes
//!   `<pod IP>:<port>`, and probes dial the pod IP;
//! - a fake node's host filesystem is its root folder: a `hostPath` volume is that path under
//!   the root (its `type` checked as a kubelet checks it), an `emptyDir` a fresh folder
//!   (mode 0777, as a kubelet makes it; `medium: Memory` is a folder too), each bind-mounted at
//!   its `mountPath` (and `subPath`), read-only where the mount says `readOnly`;
//! - the projected service-account volume (`kube-api-access-*`, or the default path when the
//!   pod has none and does not opt out of the token) holds, in place of the token, a
//!   `kubeconfig` impersonating the service account with its node's name in the user extra (as
//!   a pod-bound token carries it), with `ca.crt` and `namespace`; the file is the container
//!   user's, mode 0600, as a kubelet makes a token file, and `KUBECONFIG` names it;
//! - `env` takes literal values, the downward API's `fieldRef`s and Secrets' `secretKeyRef`s
//!   (read from the API when the container starts, as a kubelet does);
//! - probes (HTTP GET or TCP) dial the pod IP: the startup probe gates the others and restarts
//!   the container when its `failureThreshold × periodSeconds` runs out; the liveness probe,
//!   every `periodSeconds`, restarts it after `failureThreshold` failures in a row; the
//!   readiness probe turns the pod Ready and not Ready (every 250 ms rather than every
//!   `periodSeconds`, so that tests do not wait on it);
//! - an exited container is removed and started again after a back-off (`restartPolicy`);
//! - a deleted pod gets its `preStop` sleep, then `podman stop` with the rest of its grace
//!   period (SIGTERM, SIGKILL when it runs out); the runner removes the container and then
//!   deletes the pod object, as a kubelet does.
//!
//! What the runner cannot honour fails the pod visibly, as a kubelet would: the container's
//! status says `waiting` with the kubelet's reason (`ErrImageNeverPull`,
//! `CreateContainerConfigError`, `RunContainerError`) and a message, a Warning event is
//! posted, and [`NodeRunner::failures`] lists it for the test to fail on. Not applied: resource
//! requests and limits (no cgroup limits), `$(VAR)` expansion, and volume kinds other than the
//! three above (such a pod fails).
//!
//! Every container's output goes to `<work>/<pod>.log` (podman's `k8s-file` log, the CRI log
//! format); every exit is recorded for the test to check. Containers carry the labels
//! [`CLUSTER_LABEL`] and [`RUNNER_LABEL`]: `tests/cluster/down` removes a cluster's, and a new
//! runner removes those a dead test process left.

//!
//! One module per concern: the names it marks things with (`names`), what it shares and
//! shows (`state`), its handle (`node`), the pod watch (`watch`), one pod's supervision
//! (`supervise`), the pod spec as a launch (`launch`) and what it stages on the host
//! (`staging`), refusals (`refusal`), what it writes to the API (`status`), and podman and
//! the host (`host`). This file only declares them and re-exports the test's names.

mod host;
mod launch;
mod names;
mod node;
mod refusal;
mod secrets;
mod security;
mod staging;
mod state;
mod status;
mod supervise;
mod watch;

pub use host::tail;
pub use names::{ANNOTATION, ANNOTATION_VALUE, CLUSTER_LABEL, RUNNER_LABEL};
pub use node::NodeRunner;
pub use state::{Config, Exit, Running};
