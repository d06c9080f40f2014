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

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Container, EnvVarSource, Event, HostPathVolumeSource, Pod, PodSecurityContext, PodSpec,
    Probe as ProbeSpec, Secret, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::process::Command;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{cluster, tools};

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
const NAMESPACE_LABEL: &str = "e2e.layerwise.dev/namespace";
/// Where a pod's service-account credentials are mounted when it has no projected volume.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

const PROBE_EVERY: Duration = Duration::from_millis(250);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const RESTART_BACKOFF: Duration = Duration::from_secs(1);

/// What the runner is given.
#[derive(Debug, Clone)]
pub struct Config {
    /// The namespace whose pods it runs.
    pub namespace: String,
    /// Fake node name to the folder that plays its host filesystem.
    pub node_roots: BTreeMap<String, PathBuf>,
    /// Where logs, service-account files and `emptyDir` folders go (made traversable by
    /// every user, for the containers' users).
    pub work: PathBuf,
}

/// One container that ended.
#[derive(Debug, Clone)]
pub struct Exit {
    pub pod: String,
    pub node: String,
    /// The container's `command[0]`.
    pub command: String,
    /// The exit code as the runtime reports it (128 + the signal's number when a signal
    /// ended it); `None` when it could not be read.
    pub code: Option<i32>,
    /// Whether the pod was being deleted (an expected stop) rather than the container dying
    /// or being killed by a failed probe.
    pub stopping: bool,
    /// Why it ended, when the runner ended it for a failed probe.
    pub reason: Option<String>,
    /// The tail of its log.
    pub log_tail: String,
}

/// A container the runner started, as the test sees it.
#[derive(Debug, Clone)]
pub struct Running {
    pub pod: String,
    pub node: String,
    pub ip: IpAddr,
    /// The container's name in podman.
    pub container: String,
    pub image: String,
    /// The host pid of the container's process.
    pub pid: u32,
    /// `command[1..]` and `args`, as the process got them.
    pub args: Vec<String>,
    /// The container's environment from the pod spec, resolved (the image's own comes too).
    pub env: Vec<(String, String)>,
    pub ready: bool,
}

#[derive(Default)]
struct State {
    running: BTreeMap<String, Running>,
    exits: Vec<Exit>,
    /// Pods the runner could not run, with the kubelet's reason and why.
    failures: Vec<String>,
}

/// The runner: a task watching pods, one supervisor task per pod.
pub struct NodeRunner {
    state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    namespace: String,
}

impl NodeRunner {
    /// Starts watching `config.namespace` with `client` (which must be allowed to patch pod
    /// status, delete pods and create events there). Removes first the containers of runners
    /// whose test process is gone.
    pub fn start(client: Client, config: Config) -> Result<NodeRunner> {
        std::fs::create_dir_all(&config.work)
            .with_context(|| format!("creating {}", config.work.display()))?;
        traversable(&config.work)?;
        remove_orphans()?;
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stop_rx) = watch::channel(false);
        let namespace = config.namespace.clone();
        let task = tokio::spawn(watch_pods(client, Arc::new(config), state.clone(), stop_rx));
        Ok(NodeRunner {
            state,
            stop,
            task,
            namespace,
        })
    }

    /// The containers running now.
    pub fn running(&self) -> Vec<Running> {
        let s = self.state.lock().expect("runner state");
        s.running.values().cloned().collect()
    }

    /// Every container that has ended so far.
    pub fn exits(&self) -> Vec<Exit> {
        self.state.lock().expect("runner state").exits.clone()
    }

    /// Pods the runner could not run, each with the kubelet's reason and why.
    pub fn failures(&self) -> Vec<String> {
        self.state.lock().expect("runner state").failures.clone()
    }

    /// Stops watching, stops what still runs, and removes every container it started (after
    /// the test has deleted what it wanted stopped cleanly).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        let label = format!("label={NAMESPACE_LABEL}={}", self.namespace);
        if let Ok(out) = podman(&["ps", "-aq", "--filter", &label]).await {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = podman(&["rm", "-f", "-t", "0", id]).await;
            }
        }
    }
}

/// Makes `dir` and the folders above it traversable by every user (a tempdir is its
/// creator's alone), so the containers' users reach what is mounted from under it.
fn traversable(dir: &Path) -> Result<()> {
    for d in dir
        .ancestors()
        .filter(|d| d.starts_with(std::env::temp_dir()))
    {
        if d == std::env::temp_dir() {
            break;
        }
        let mode = std::fs::metadata(d)?.permissions().mode();
        if mode & 0o011 != 0o011 {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("making {} traversable", d.display()))?;
        }
    }
    Ok(())
}

/// Removes the containers of runners whose test process has ended.
fn remove_orphans() -> Result<()> {
    let format = format!("{{{{.ID}}}} {{{{index .Labels \"{RUNNER_LABEL}\"}}}}");
    let filter = format!("label={RUNNER_LABEL}");
    let out = crate::images::podman_ok(&["ps", "-a", "--filter", &filter, "--format", &format])?;
    for line in out.lines() {
        let mut words = line.split_whitespace();
        let (Some(id), Some(pid)) = (words.next(), words.next()) else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = crate::images::podman(&["rm", "-f", "-t", "0", id]);
        }
    }
    Ok(())
}

/// `podman ARGS` with the project's containers.conf, without blocking the runtime.
async fn podman(args: &[&str]) -> Result<Output> {
    Command::new("podman")
        .args(args)
        .env(
            "CONTAINERS_CONF",
            tools::repo().join("images/containers.conf"),
        )
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("running podman (scripts/images installs it)")
}

/// `podman ARGS`, which must succeed: its stdout, or an error with what it said.
async fn podman_ok(args: &[&str]) -> Result<String> {
    let out = podman(args).await?;
    anyhow::ensure!(
        out.status.success(),
        "podman {} failed ({}): {}",
        args.first().copied().unwrap_or_default(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Watches the namespace's pods and hands each of ours to a supervisor.
async fn watch_pods(
    client: Client,
    config: Arc<Config>,
    state: Arc<Mutex<State>>,
    mut stop: watch::Receiver<bool>,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    let mut events = std::pin::pin!(watcher(pods, watcher::Config::default()));
    // Pod UID to its supervisor's "delete" signal and task.
    let mut supervised: HashMap<String, (watch::Sender<bool>, JoinHandle<()>)> = HashMap::new();
    loop {
        let event = tokio::select! {
            _ = stop.changed() => break,
            e = events.next() => e,
        };
        let pods: Vec<Pod> = match event {
            Some(Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p))) => vec![p],
            Some(Ok(watcher::Event::Delete(p))) => {
                // Gone without us (a forced delete): the supervisor stops its container.
                if let Some((tx, _)) = p.uid().and_then(|u| supervised.get(&u)) {
                    let _ = tx.send(true);
                }
                continue;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "node runner: watching pods");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            None => break,
        };
        for pod in pods {
            if pod.annotations().get(ANNOTATION).map(String::as_str) != Some(ANNOTATION_VALUE) {
                continue;
            }
            let Some(uid) = pod.uid() else { continue };
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            let Some(node) = node.filter(|n| config.node_roots.contains_key(n)) else {
                continue;
            };
            if let Some((tx, _)) = supervised.get(&uid) {
                if pod.metadata.deletion_timestamp.is_some() {
                    let _ = tx.send(true);
                }
                continue;
            }
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok());
            if pod.metadata.deletion_timestamp.is_some() {
                // Deleted before it ever ran: nothing to stop.
                let _ = delete_now(&client, &pod).await;
                continue;
            }
            let Some(ip) = ip else { continue };
            let (tx, rx) = watch::channel(false);
            let task = tokio::spawn(supervise(
                client.clone(),
                config.clone(),
                state.clone(),
                pod,
                node,
                ip,
                rx,
            ));
            supervised.insert(uid, (tx, task));
        }
        supervised.retain(|_, (_, task)| !task.is_finished());
    }
    // Shut down: every container goes.
    for (tx, _) in supervised.values() {
        let _ = tx.send(true);
    }
    for (_, (_, task)) in supervised {
        let _ = tokio::time::timeout(Duration::from_secs(20), task).await;
    }
}

/// Why a pod cannot run: the kubelet's reason for it and a message.
#[derive(Debug)]
struct Refusal {
    reason: &'static str,
    message: String,
}

impl Refusal {
    fn config(message: impl Into<String>) -> Refusal {
        Refusal {
            reason: "CreateContainerConfigError",
            message: message.into(),
        }
    }
}

impl From<anyhow::Error> for Refusal {
    fn from(e: anyhow::Error) -> Refusal {
        Refusal::config(format!("{e:#}"))
    }
}

/// Fails with a [`Refusal::config`] unless `cond`.
macro_rules! refuse_unless {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(Refusal::config(format!($($msg)+)));
        }
    };
}

/// A probe as the runner runs it.
#[derive(Debug, Clone)]
struct Probe {
    /// The address it dials and, for HTTP, the path it GETs.
    addr: SocketAddr,
    http_path: Option<String>,
    period: Duration,
    initial_delay: Duration,
    failure_threshold: u32,
}

impl Probe {
    async fn passes(&self) -> bool {
        match &self.http_path {
            Some(path) => {
                layerwise_engine::tools::loadgen::http(self.addr, "GET", path, None, PROBE_TIMEOUT)
                    .await
                    .is_ok_and(|r| (200..400).contains(&r.status))
            }
            None => matches!(
                tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(self.addr))
                    .await,
                Ok(Ok(_))
            ),
        }
    }

    /// How long it may fail before the container counts as failed.
    fn window(&self) -> Duration {
        self.initial_delay + self.period * self.failure_threshold
    }
}

/// What a container runs as: the `podman run` options, image and arguments, and how the
/// runner watches and stops it.
struct Launch {
    container: String,
    image: String,
    command: String,
    /// `command[1..]` and `args`, rewritten.
    args: Vec<String>,
    /// The pod's `env`, resolved.
    env: Vec<(String, String)>,
    /// `podman run` options (before the image).
    options: Vec<String>,
    /// The user the spec asks for; `None`: the image's.
    run_as_user: Option<i64>,
    run_as_non_root: bool,
    readiness: Option<Probe>,
    liveness: Option<Probe>,
    startup: Option<Probe>,
    restart: RestartPolicy,
    pre_stop: Duration,
    grace: Duration,
    log: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    /// The pod's `restartPolicy` (`Always` when unset).
    fn of(spec: &PodSpec) -> RestartPolicy {
        match spec.restart_policy.as_deref().unwrap_or("Always") {
            "Always" => RestartPolicy::Always,
            "OnFailure" => RestartPolicy::OnFailure,
            _ => RestartPolicy::Never,
        }
    }

    /// Whether a container that ended with `code` (`None`: unknown) starts again.
    fn again(self, code: Option<i32>) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => code != Some(0),
            RestartPolicy::Never => false,
        }
    }
}

/// A Secret's key as a container's `secretKeyRef` names it: (Secret, key).
type SecretKey = (String, String);

/// The values of the Secrets' keys the pod's container takes into its environment, read as
/// a kubelet reads them when it starts the container. A key that is not there (yet) fails
/// the start, as `CreateContainerConfigError` does.
async fn secret_values(
    client: &Client,
    namespace: &str,
    pod: &Pod,
) -> Result<BTreeMap<SecretKey, String>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut values = BTreeMap::new();
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    for e in containers.flat_map(|c| c.env.iter().flatten()) {
        let Some(r) = e
            .value_from
            .as_ref()
            .and_then(|f| f.secret_key_ref.as_ref())
        else {
            continue;
        };
        let secret = secrets
            .get(&r.name)
            .await
            .with_context(|| format!("env {}: reading Secret {}", e.name, r.name))?;
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .with_context(|| format!("env {}: Secret {} has no key {}", e.name, r.name, r.key))?;
        let value = String::from_utf8(value.0.clone()).with_context(|| {
            format!(
                "env {}: Secret {} key {} is not text",
                e.name, r.name, r.key
            )
        })?;
        values.insert((r.name.clone(), r.key.clone()), value);
    }
    Ok(values)
}

/// The security settings of the container: its own over the pod's.
struct Security {
    user: Option<i64>,
    group: Option<i64>,
    non_root: bool,
}

/// Translates the pod's and container's security contexts into `podman run` options,
/// refusing what this kubelet does not do.
fn security(
    pod_sc: Option<&PodSecurityContext>,
    sc: Option<&SecurityContext>,
    options: &mut Vec<String>,
) -> Result<Security, Refusal> {
    let pod_sc = pod_sc.cloned().unwrap_or_default();
    let sc = sc.cloned().unwrap_or_default();
    refuse_unless!(
        sc.privileged != Some(true),
        "privileged containers are not allowed on this node"
    );
    refuse_unless!(
        pod_sc.fs_group.is_none() && pod_sc.fs_group_change_policy.is_none(),
        "securityContext.fsGroup is not supported by the node runner"
    );
    refuse_unless!(
        sc.se_linux_options.is_none() && pod_sc.se_linux_options.is_none(),
        "securityContext.seLinuxOptions: this node has no SELinux"
    );
    refuse_unless!(
        pod_sc.sysctls.as_ref().is_none_or(Vec::is_empty),
        "securityContext.sysctls are not supported by the node runner"
    );
    refuse_unless!(
        sc.proc_mount.as_deref().unwrap_or("Default") == "Default",
        "securityContext.procMount {:?} is not supported",
        sc.proc_mount
    );
    let user = sc.run_as_user.or(pod_sc.run_as_user);
    let group = sc.run_as_group.or(pod_sc.run_as_group);
    match (user, group) {
        (Some(u), Some(g)) => options.push(format!("--user={u}:{g}")),
        (Some(u), None) => options.push(format!("--user={u}")),
        (None, Some(_)) => {
            return Err(Refusal::config(
                "runAsGroup without runAsUser is not supported by the node runner",
            ))
        }
        (None, None) => {}
    }
    for g in pod_sc.supplemental_groups.iter().flatten() {
        options.push(format!("--group-add={g}"));
    }
    if sc.read_only_root_filesystem == Some(true) {
        // A kubelet mounts nothing writable in the root's place.
        options.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    if let Some(caps) = &sc.capabilities {
        for c in caps.drop.iter().flatten() {
            options.push(format!("--cap-drop={c}"));
        }
        for c in caps.add.iter().flatten() {
            options.push(format!("--cap-add={c}"));
        }
    }
    if sc.allow_privilege_escalation == Some(false) {
        options.push("--security-opt=no-new-privileges".into());
    }
    let seccomp = sc
        .seccomp_profile
        .as_ref()
        .or(pod_sc.seccomp_profile.as_ref());
    match seccomp.map(|p| p.type_.as_str()) {
        // The runtime's default profile, which podman applies unless told otherwise.
        Some("RuntimeDefault") => {}
        // A kubelet without --seccomp-default runs containers unconfined.
        None | Some("Unconfined") => options.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => {
            return Err(Refusal::config(format!(
                "seccompProfile {other} is not supported by the node runner"
            )))
        }
    }
    let apparmor = sc
        .app_armor_profile
        .as_ref()
        .or(pod_sc.app_armor_profile.as_ref());
    refuse_unless!(
        apparmor.is_none_or(|p| p.type_ != "Localhost"),
        "appArmorProfile Localhost is not supported by the node runner"
    );
    Ok(Security {
        user,
        group,
        non_root: sc.run_as_non_root.or(pod_sc.run_as_non_root) == Some(true),
    })
}

/// The probe `spec` of `container`, dialing `ip`.
fn probe(
    container: &Container,
    ip: IpAddr,
    spec: Option<&ProbeSpec>,
    which: &str,
) -> Result<Option<Probe>, Refusal> {
    let Some(spec) = spec else { return Ok(None) };
    let named = |port: &IntOrString| -> Result<u16, Refusal> {
        let port = match port {
            IntOrString::Int(p) => *p,
            IntOrString::String(named) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(named))
                .map(|p| p.container_port)
                .ok_or_else(|| {
                    Refusal::config(format!("{which} probe: port {named} is not declared"))
                })?,
        };
        u16::try_from(port)
            .map_err(|_| Refusal::config(format!("{which} probe: port {port} is out of range")))
    };
    let (port, http_path) = if let Some(get) = &spec.http_get {
        refuse_unless!(
            get.scheme.as_deref().unwrap_or("HTTP") == "HTTP"
                && get.host.is_none()
                && get.http_headers.as_ref().is_none_or(Vec::is_empty),
            "{which} probe: only plain HTTP GETs of the pod IP are supported by the node runner"
        );
        (
            named(&get.port)?,
            Some(get.path.clone().unwrap_or_else(|| "/".into())),
        )
    } else if let Some(tcp) = &spec.tcp_socket {
        refuse_unless!(
            tcp.host.is_none(),
            "{which} probe: a TCP probe of another host"
        );
        (named(&tcp.port)?, None)
    } else {
        return Err(Refusal::config(format!(
            "{which} probe: only httpGet and tcpSocket probes are supported by the node runner"
        )));
    };
    let secs =
        |v: Option<i32>, default: i32| Duration::from_secs(v.unwrap_or(default).max(0) as u64);
    Ok(Some(Probe {
        addr: SocketAddr::new(ip, port),
        http_path,
        period: secs(spec.period_seconds, 10).max(Duration::from_secs(1)),
        initial_delay: secs(spec.initial_delay_seconds, 0),
        failure_threshold: spec.failure_threshold.unwrap_or(3).max(1) as u32,
    }))
}

/// Builds the container for the pod's (only) container: stages its volumes and resolves its
/// environment.
fn launch(
    config: &Config,
    pod: &Pod,
    node: &str,
    ip: IpAddr,
    secrets: &BTreeMap<SecretKey, String>,
) -> Result<Launch, Refusal> {
    let (spec, container) = one_container(pod)?;
    let image = container
        .image
        .clone()
        .ok_or_else(|| Refusal::config("the container has no image"))?;
    let (staging, mut options) = Staging::new(config, pod, spec, container, node, ip)?;
    let mut env = staging.environment(secrets)?;
    staging.mount_volumes(&mut options, &mut env)?;
    for (k, v) in &env {
        options.push(format!("--env={k}={v}"));
    }
    if let Some(dir) = &container.working_dir {
        options.push(format!("--workdir={dir}"));
    }
    let (entry, args) = command_line(container, ip);
    if let Some(entry) = &entry {
        options.push(format!("--entrypoint={entry}"));
    }

    let restart = RestartPolicy::of(spec);
    let pre_stop = pre_stop(container)?;
    let grace =
        Duration::from_secs(spec.termination_grace_period_seconds.unwrap_or(30).max(0) as u64);
    let log = config.work.join(format!("{}.log", staging.name));
    options.push(format!("--log-opt=path={}", log.display()));
    options.extend(labels(&config.namespace));
    Ok(Launch {
        container: staging.container_name(),
        image,
        command: entry.unwrap_or_default(),
        args,
        env,
        options,
        run_as_user: staging.sec.user,
        run_as_non_root: staging.sec.non_root,
        readiness: probe(
            container,
            ip,
            container.readiness_probe.as_ref(),
            "readiness",
        )?,
        liveness: probe(container, ip, container.liveness_probe.as_ref(), "liveness")?,
        startup: probe(container, ip, container.startup_probe.as_ref(), "startup")?,
        restart,
        pre_stop,
        grace,
        log,
    })
}

/// The pod's spec and its one container, refusing the pod-level features this kubelet does
/// not have.
fn one_container(pod: &Pod) -> Result<(&PodSpec, &Container), Refusal> {
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| Refusal::config("pod without spec"))?;
    let [container]: &[Container; 1] = spec
        .containers
        .as_slice()
        .try_into()
        .map_err(|_| Refusal::config("the node runner runs pods of one container"))?;
    refuse_unless!(
        spec.init_containers.as_ref().is_none_or(Vec::is_empty),
        "init containers are not supported by the node runner"
    );
    refuse_unless!(
        spec.host_network != Some(true) && spec.host_pid != Some(true) && spec.host_ipc != Some(true),
        "hostNetwork, hostPID and hostIPC are not supported by the node runner (every pod has its own loopback IP)"
    );
    refuse_unless!(
        spec.share_process_namespace != Some(true),
        "shareProcessNamespace is not supported by the node runner"
    );
    refuse_unless!(
        container.env_from.as_ref().is_none_or(Vec::is_empty),
        "envFrom is not supported by the node runner"
    );
    Ok((spec, container))
}

/// What staging a container reads: the pod, its one container, where it runs, the folder
/// the runner keeps for it, and the ids its processes run as.
struct Staging<'a> {
    config: &'a Config,
    spec: &'a PodSpec,
    container: &'a Container,
    name: String,
    uid: String,
    node: &'a str,
    ip: IpAddr,
    /// The node's root folder: its host filesystem.
    root: &'a Path,
    /// `<work>/<pod>`: its volumes and service-account files.
    pod_dir: PathBuf,
    sec: Security,
}

impl<'a> Staging<'a> {
    /// Makes the pod's folder and starts its `podman run` options: the host network, no
    /// pulls, the CRI log, and the security settings.
    fn new(
        config: &'a Config,
        pod: &Pod,
        spec: &'a PodSpec,
        container: &'a Container,
        node: &'a str,
        ip: IpAddr,
    ) -> Result<(Staging<'a>, Vec<String>), Refusal> {
        let name = pod.name_any();
        let uid = pod.uid().unwrap_or_default();
        let root = &config.node_roots[node];
        let pod_dir = config.work.join(&name);
        std::fs::create_dir_all(&pod_dir).map_err(anyhow::Error::from)?;
        traversable(&pod_dir)?;

        let mut options: Vec<String> = vec![
            "--network=host".into(),
            format!("--hostname={name}"),
            "--pull=never".into(),
            "--log-driver=k8s-file".into(),
        ];
        let sec = security(
            spec.security_context.as_ref(),
            container.security_context.as_ref(),
            &mut options,
        )?;
        let staging = Staging {
            config,
            spec,
            container,
            name,
            uid,
            node,
            ip,
            root,
            pod_dir,
            sec,
        };
        Ok((staging, options))
    }

    /// The container's name in podman: the pod's and the start of its UID.
    fn container_name(&self) -> String {
        let uid = &self.uid;
        format!("{}-{}", self.name, &uid[..uid.len().min(8)])
    }

    /// The container's environment from the spec: literal values (listen addresses on the
    /// pod IP), the Secrets' keys read for it, and the downward API's fields.
    fn environment(
        &self,
        secrets: &BTreeMap<SecretKey, String>,
    ) -> Result<Vec<(String, String)>, Refusal> {
        let mut env: Vec<(String, String)> = Vec::new();
        for e in self.container.env.iter().flatten() {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => listen_on(self.ip, v),
                (None, Some(from)) if from.secret_key_ref.is_some() => {
                    let r = from.secret_key_ref.as_ref().expect("matched");
                    secrets
                        .get(&(r.name.clone(), r.key.clone()))
                        .cloned()
                        .ok_or_else(|| Refusal::config(format!("env {} not read", e.name)))?
                }
                (None, Some(from)) => self.field(&e.name, from)?,
                (None, None) => String::new(),
            };
            env.push((e.name.clone(), value));
        }
        Ok(env)
    }

    /// The downward API's value for env `var`, which `from` takes from a field of the pod.
    fn field(&self, var: &str, from: &EnvVarSource) -> Result<String, Refusal> {
        let field = from
            .field_ref
            .as_ref()
            .map(|f| f.field_path.as_str())
            .ok_or_else(|| {
                Refusal::config(format!(
                    "env {var} comes from a source the node runner lacks"
                ))
            })?;
        Ok(match field {
            "spec.nodeName" => self.node.to_string(),
            "metadata.name" => self.name.clone(),
            "metadata.namespace" => self.config.namespace.clone(),
            "metadata.uid" => self.uid.clone(),
            "status.podIP" => self.ip.to_string(),
            "spec.serviceAccountName" => self.spec.service_account_name.clone().unwrap_or_default(),
            other => {
                return Err(Refusal::config(format!(
                    "env {var} from unknown field {other}"
                )))
            }
        })
    }

    /// Stages every volume the container mounts and adds its `--mount`, then the service
    /// account's default mount when no projected volume took its place; where credentials
    /// are mounted, `KUBECONFIG` goes into `env`.
    fn mount_volumes(
        &self,
        options: &mut Vec<String>,
        env: &mut Vec<(String, String)>,
    ) -> Result<(), Refusal> {
        let mut token_mounted = false;
        for m in self.container.volume_mounts.iter().flatten() {
            let volume = self
                .spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .ok_or_else(|| Refusal::config(format!("mount of unknown volume {}", m.name)))?;
            let dir = if let Some(h) = &volume.host_path {
                self.host_path(h)?
            } else if holds_token(volume) {
                token_mounted = true;
                let dir = self.pod_dir.join("volumes").join(&volume.name);
                service_account_files(self.config, self.spec, self.node, &dir, &self.sec)?;
                env.push((
                    "KUBECONFIG".into(),
                    format!("{}/kubeconfig", m.mount_path.trim_end_matches('/')),
                ));
                dir
            } else if volume.empty_dir.is_some() {
                self.empty_dir(&volume.name)?
            } else {
                return Err(Refusal::config(format!(
                    "volume {} is of a kind the node runner does not mount",
                    volume.name
                )));
            };
            options.push(bind_mount(dir, m)?);
        }
        if !token_mounted && self.spec.automount_service_account_token != Some(false) {
            // No projected volume (no ServiceAccount admission): the default path.
            let dir = self.pod_dir.join("volumes").join("serviceaccount");
            service_account_files(self.config, self.spec, self.node, &dir, &self.sec)?;
            options.push(format!(
                "--mount=type=bind,source={},destination={SERVICE_ACCOUNT_DIR},ro",
                dir.display()
            ));
            env.push((
                "KUBECONFIG".into(),
                format!("{SERVICE_ACCOUNT_DIR}/kubeconfig"),
            ));
        }
        Ok(())
    }

    /// A `hostPath` volume's folder under the node's root, checked (or made) as its `type`
    /// says.
    fn host_path(&self, h: &HostPathVolumeSource) -> Result<PathBuf, Refusal> {
        let node = self.node;
        let dir = self.root.join(h.path.trim_start_matches('/'));
        match h.type_.as_deref().unwrap_or("") {
            "DirectoryOrCreate" => std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?,
            "Directory" => refuse_unless!(
                dir.is_dir(),
                "hostPath {} is not a directory on {node}",
                h.path
            ),
            "File" => {
                refuse_unless!(dir.is_file(), "hostPath {} is not a file on {node}", h.path)
            }
            "" => {}
            other => {
                return Err(Refusal::config(format!(
                    "hostPath type {other} is not supported by the node runner"
                )))
            }
        }
        Ok(dir)
    }

    /// A fresh `emptyDir` folder, open to every user as a kubelet makes it.
    fn empty_dir(&self, volume: &str) -> Result<PathBuf, Refusal> {
        let dir = self.pod_dir.join("volumes").join(volume);
        std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
            .map_err(anyhow::Error::from)?;
        Ok(dir)
    }
}

/// Whether `volume` is the projected one that carries the service account's token.
fn holds_token(volume: &Volume) -> bool {
    volume
        .projected
        .as_ref()
        .and_then(|p| p.sources.as_ref())
        .is_some_and(|s| s.iter().any(|s| s.service_account_token.is_some()))
}

/// The `--mount` option binding `dir` (or its `subPath`, made if missing) where `m` says.
fn bind_mount(mut dir: PathBuf, m: &VolumeMount) -> Result<String, Refusal> {
    if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
        dir = dir.join(sub);
        std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?;
    }
    let dir = dir.to_str().context("a volume path is not UTF-8")?;
    refuse_unless!(
        !dir.contains([':', ',']) && !m.mount_path.contains([':', ',']),
        "mount {} at {}: paths with ':' or ',' are not supported",
        m.name,
        m.mount_path
    );
    let ro = if m.read_only == Some(true) { ",ro" } else { "" };
    Ok(format!(
        "--mount=type=bind,source={dir},destination={}{ro}",
        m.mount_path
    ))
}

/// `v` with a listen address on every interface (`0.0.0.0:<port>`) moved to the pod's IP,
/// the pod's network namespace here.
fn listen_on(ip: IpAddr, v: &str) -> String {
    match v.strip_prefix("0.0.0.0:") {
        Some(port) => format!("{ip}:{port}"),
        None => v.to_string(),
    }
}

/// The container's entrypoint (`command[0]`), and `command[1..]` then `args` as its
/// arguments, with listen addresses on the pod IP.
fn command_line(container: &Container, ip: IpAddr) -> (Option<String>, Vec<String>) {
    let mut command = container.command.clone().unwrap_or_default().into_iter();
    let entry = command.next();
    let args = command
        .chain(container.args.iter().flatten().cloned())
        .map(|a| listen_on(ip, &a))
        .collect();
    (entry, args)
}

/// The length of the container's `preStop` sleep (the one hook action the runner does).
fn pre_stop(container: &Container) -> Result<Duration, Refusal> {
    let hook = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref());
    let Some(h) = hook else {
        return Ok(Duration::ZERO);
    };
    let s = h.sleep.as_ref().ok_or_else(|| {
        Refusal::config("preStop: only the sleep action is supported by the node runner")
    })?;
    Ok(Duration::from_secs(s.seconds.max(0) as u64))
}

/// The `--label` options of every container the runner starts in `namespace`.
fn labels(namespace: &str) -> [String; 3] {
    [
        format!(
            "--label={CLUSTER_LABEL}={}",
            cluster::cluster_dir().display()
        ),
        format!("--label={RUNNER_LABEL}={}", std::process::id()),
        format!("--label={NAMESPACE_LABEL}={namespace}"),
    ]
}

/// Writes the service account's credentials into `dir`: a kubeconfig impersonating it on
/// `node` (what its pod-bound token would be), the cluster's CA and the namespace. The
/// kubeconfig is the container user's, mode 0600, as a kubelet makes the token file.
fn service_account_files(
    config: &Config,
    spec: &PodSpec,
    node: &str,
    dir: &Path,
    sec: &Security,
) -> Result<(), Refusal> {
    use base64::Engine as _;
    std::fs::create_dir_all(dir).map_err(anyhow::Error::from)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(anyhow::Error::from)?;
    let sa = spec.service_account_name.as_deref().unwrap_or("default");
    let user = format!("system:serviceaccount:{}:{sa}", config.namespace);
    let kc = tools::impersonating_kubeconfig_on_node(&user, node)?;
    let ca = kc
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.certificate_authority_data.clone())
        .unwrap_or_default();
    let ca = base64::engine::general_purpose::STANDARD
        .decode(ca.trim())
        .map_err(|e| Refusal::config(format!("the cluster's CA: {e}")))?;
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_json::to_vec(&kc).map_err(anyhow::Error::from)?)
        .map_err(anyhow::Error::from)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(anyhow::Error::from)?;
    let owner = sec.user.map(|u| u as u32);
    let group = sec.group.map(|g| g as u32).or(owner);
    std::os::unix::fs::chown(&path, owner, group)
        .with_context(|| format!("chown {}", path.display()))?;
    std::fs::write(dir.join("ca.crt"), ca).map_err(anyhow::Error::from)?;
    std::fs::write(dir.join("namespace"), &config.namespace).map_err(anyhow::Error::from)?;
    Ok(())
}

/// Checks that the image is in the local store and that its user satisfies `runAsNonRoot`.
async fn check_image(l: &Launch) -> Result<(), Refusal> {
    let out = podman(&["image", "inspect", "--format", "{{.Config.User}}", &l.image])
        .await
        .map_err(Refusal::from)?;
    if !out.status.success() {
        return Err(Refusal {
            reason: "ErrImageNeverPull",
            message: format!(
                "Container image {:?} is not present on the node and the node runner never pulls (build it with scripts/images)",
                l.image
            ),
        });
    }
    if l.run_as_non_root {
        let image_user = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let uid = match l.run_as_user {
            Some(u) => u,
            None => {
                let user = image_user.split(':').next().unwrap_or_default();
                match user {
                    "" => 0,
                    u => u.parse::<i64>().map_err(|_| {
                        Refusal::config(format!(
                            "container has runAsNonRoot and image has non-numeric user ({u}), cannot verify user is non-root"
                        ))
                    })?,
                }
            }
        };
        refuse_unless!(
            uid != 0,
            "container has runAsNonRoot and image will run as root"
        );
    }
    Ok(())
}

/// Marks the pod's container as unable to run, as a kubelet does: a waiting state with the
/// reason and message, not Ready, and a Warning event.
async fn refuse(client: &Client, pod: &Pod, node: &str, refusal: &Refusal) {
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

/// How a container's run ended.
enum Ended {
    /// The pod was deleted.
    Deleted,
    /// The process exited by itself.
    Exited,
    /// A probe failed: the runner killed it, for this reason.
    Killed(String),
}

/// Runs one pod's container until the pod is deleted (then stops it as a kubelet would and
/// deletes the pod) or the runner shuts down.
async fn supervise(
    client: Client,
    config: Arc<Config>,
    state: Arc<Mutex<State>>,
    pod: Pod,
    node: String,
    ip: IpAddr,
    mut deleted: watch::Receiver<bool>,
) {
    let name = pod.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    let launch = match prepare(&client, &config, &pod, &node, ip).await {
        Ok(l) => l,
        Err(refusal) => {
            fail(&client, &state, &pod, &node, &refusal).await;
            let _ = deleted.changed().await;
            let _ = delete_now(&client, &pod).await;
            return;
        }
    };
    // The launch accepted the pod: it has its one container.
    let container = pod.spec.as_ref().map(|s| s.containers[0].clone());
    let container_name = container.map(|c| c.name).unwrap_or_default();
    let supervisor = Supervisor {
        client,
        state,
        pods,
        pod,
        name,
        node,
        ip,
        deleted,
        container_name,
        launch,
        restarts: 0,
    };
    supervisor.run().await;
}

/// What a pod's container needs before its first start: the Secrets its environment takes,
/// the launch, and its image in the local store.
async fn prepare(
    client: &Client,
    config: &Config,
    pod: &Pod,
    node: &str,
    ip: IpAddr,
) -> Result<Launch, Refusal> {
    let secrets = secret_values(client, &config.namespace, pod).await?;
    let launch = launch(config, pod, node, ip, &secrets)?;
    check_image(&launch).await?;
    Ok(launch)
}

/// One pod's supervision once its container can start: what each run of the container
/// reads, and the restarts counted across runs.
struct Supervisor {
    client: Client,
    state: Arc<Mutex<State>>,
    /// The runner's namespace's pods, for the status patches.
    pods: Api<Pod>,
    pod: Pod,
    name: String,
    node: String,
    ip: IpAddr,
    /// Changes when the pod is being deleted (or the runner shuts down).
    deleted: watch::Receiver<bool>,
    /// The container's name in the pod spec.
    container_name: String,
    launch: Launch,
    restarts: i32,
}

/// One run of the container: its process and when it started.
struct Run {
    pid: u32,
    started: Timestamp,
    started_at: Instant,
}

/// Where a run's probes stand.
struct Probing {
    /// Ready as last recorded in the pod's status.
    ready: bool,
    startup_done: bool,
    liveness_failures: u32,
    liveness_next: Instant,
}

impl Supervisor {
    /// Starts the container, watches it until it ends, and starts it again after a
    /// back-off while the restart policy says so, until the pod is deleted (its object goes
    /// once the container is stopped and removed).
    async fn run(mut self) {
        loop {
            let Some(run) = self.start_run().await else {
                return;
            };
            let ended = self.watch_run(&run).await;
            let code = self.end_run(&run, &ended).await;
            if matches!(ended, Ended::Deleted) {
                let _ = delete_now(&self.client, &self.pod).await;
                return;
            }
            if !self.back_off(&run, code).await {
                return;
            }
        }
    }

    /// Starts the container and records it running; `None` when podman could not start it
    /// (the pod has failed and, once deleted, is gone).
    async fn start_run(&mut self) -> Option<Run> {
        let pid = match start(&self.launch).await {
            Ok(pid) => pid,
            Err(e) => {
                let refusal = Refusal {
                    reason: "RunContainerError",
                    message: format!("{e:#}"),
                };
                fail(&self.client, &self.state, &self.pod, &self.node, &refusal).await;
                let _ = podman(&["rm", "-f", "-t", "0", &self.launch.container]).await;
                let _ = self.deleted.changed().await;
                let _ = delete_now(&self.client, &self.pod).await;
                return None;
            }
        };
        self.state.lock().expect("runner state").running.insert(
            self.name.clone(),
            Running {
                pod: self.name.clone(),
                node: self.node.clone(),
                ip: self.ip,
                container: self.launch.container.clone(),
                image: self.launch.image.clone(),
                pid,
                args: self.launch.args.clone(),
                env: self.launch.env.clone(),
                ready: false,
            },
        );
        let run = Run {
            pid,
            started: Timestamp::now(),
            started_at: Instant::now(),
        };
        let status = self.running_status(&run, false, false);
        if let Err(e) = set_ready(&self.pods, &self.name, false, status).await {
            // The runner's own fault: the test fails on it rather than waiting.
            let why = format!("pod {}: recording its container running: {e:#}", self.name);
            self.state.lock().expect("runner state").failures.push(why);
        }
        Some(run)
    }

    /// The container's status while it runs.
    fn running_status(&self, run: &Run, ready: bool, has_started: bool) -> serde_json::Value {
        json!({
            "name": self.container_name, "image": self.launch.image, "imageID": "", "ready": ready,
            "started": has_started, "restartCount": self.restarts,
            "containerID": format!("podman://{}", self.launch.container),
            "state": { "running": { "startedAt": run.started.to_string() } }
        })
    }

    /// Probes the running container every [`PROBE_EVERY`] until the pod is deleted, the
    /// process exits or a probe fails; follows readiness in the pod's status meanwhile.
    async fn watch_run(&mut self, run: &Run) -> Ended {
        let mut probing = Probing {
            ready: false,
            startup_done: self.launch.startup.is_none(),
            liveness_failures: 0,
            liveness_next: Instant::now(),
        };
        let mut probe_tick = tokio::time::interval(PROBE_EVERY);
        loop {
            tokio::select! {
                _ = self.deleted.changed() => return Ended::Deleted,
                _ = probe_tick.tick() => {}
            }
            if !alive(run.pid) {
                return Ended::Exited;
            }
            if !probing.startup_done {
                if let Some(ended) = self.startup(run, &mut probing).await {
                    return ended;
                }
                continue;
            }
            if let Some(ended) = self.liveness(run, &mut probing).await {
                return ended;
            }
            self.readiness(run, &mut probing).await;
        }
    }

    /// The startup probe, which holds back the others until it passes; the run ends when
    /// its window runs out.
    async fn startup(&self, run: &Run, probing: &mut Probing) -> Option<Ended> {
        let p = self.launch.startup.as_ref().expect("startup probe");
        if run.started_at.elapsed() >= p.initial_delay && p.passes().await {
            probing.startup_done = true;
            probing.liveness_next = Instant::now();
            let status = self.running_status(run, false, true);
            let _ = set_ready(&self.pods, &self.name, false, status).await;
        } else if run.started_at.elapsed() > p.window() {
            return Some(Ended::Killed(format!(
                "startup probe failed for {:?}",
                p.window()
            )));
        }
        None
    }

    /// The liveness probe, every `periodSeconds`; the run ends after `failureThreshold`
    /// failures in a row.
    async fn liveness(&self, run: &Run, probing: &mut Probing) -> Option<Ended> {
        let p = self.launch.liveness.as_ref()?;
        if run.started_at.elapsed() >= p.initial_delay && Instant::now() >= probing.liveness_next {
            probing.liveness_next = Instant::now() + p.period;
            if p.passes().await {
                probing.liveness_failures = 0;
            } else {
                probing.liveness_failures += 1;
                if probing.liveness_failures >= p.failure_threshold {
                    return Some(Ended::Killed(format!(
                        "liveness probe failed {} times",
                        probing.liveness_failures
                    )));
                }
            }
        }
        None
    }

    /// The readiness probe (none: ready): a change goes into the pod's status, then into
    /// what the test sees once recorded.
    async fn readiness(&self, run: &Run, probing: &mut Probing) {
        let now_ready = match &self.launch.readiness {
            None => true,
            Some(p) => run.started_at.elapsed() >= p.initial_delay && p.passes().await,
        };
        if now_ready != probing.ready
            && set_ready(
                &self.pods,
                &self.name,
                now_ready,
                self.running_status(run, now_ready, true),
            )
            .await
            .is_ok()
        {
            probing.ready = now_ready;
            if let Some(r) = self
                .state
                .lock()
                .expect("runner state")
                .running
                .get_mut(&self.name)
            {
                r.ready = probing.ready;
            }
        }
    }

    /// Ends the run as `ended` says: not ready unless it exited by itself, stopped as a
    /// kubelet stops a container (or waited on once exited), removed, and its exit recorded.
    /// Returns the exit code.
    async fn end_run(&self, run: &Run, ended: &Ended) -> Option<i32> {
        let launch = &self.launch;
        let stopping = matches!(ended, Ended::Deleted);
        if !matches!(ended, Ended::Exited) {
            let status = self.running_status(run, false, true);
            let _ = set_ready(&self.pods, &self.name, false, status).await;
        }
        let code = match ended {
            Ended::Exited => wait(&launch.container).await,
            Ended::Deleted | Ended::Killed(_) => {
                stop(&launch.container, run.pid, launch.pre_stop, launch.grace).await
            }
        };
        let _ = podman(&["rm", "-f", "-t", "0", &launch.container]).await;
        let exit = Exit {
            pod: self.name.clone(),
            node: self.node.clone(),
            command: launch.command.clone(),
            code,
            stopping,
            reason: match ended {
                Ended::Killed(why) => Some(why.clone()),
                _ => None,
            },
            log_tail: tail(&launch.log, 2048),
        };
        let mut s = self.state.lock().expect("runner state");
        s.running.remove(&self.name);
        s.exits.push(exit);
        code
    }

    /// After the container ended on its own or for a failed probe: not ready, then started
    /// again after a back-off when the policy says so, unless the pod is deleted meanwhile.
    /// Returns whether to start it again; when not, the pod has been deleted and its object
    /// is gone.
    async fn back_off(&mut self, run: &Run, code: Option<i32>) -> bool {
        self.restarts += 1;
        let again = self.launch.restart.again(code);
        let status = self.ended_status(run, code, again);
        let _ = set_ready(&self.pods, &self.name, false, status).await;
        if !again {
            let _ = self.deleted.changed().await;
            let _ = delete_now(&self.client, &self.pod).await;
            return false;
        }
        tokio::select! {
            _ = self.deleted.changed() => {
                let _ = delete_now(&self.client, &self.pod).await;
                false
            }
            _ = tokio::time::sleep(RESTART_BACKOFF) => true,
        }
    }

    /// The container's status once a run ended with `code`: waiting in CrashLoopBackOff
    /// when it starts `again`, terminated for good otherwise.
    fn ended_status(&self, run: &Run, code: Option<i32>, again: bool) -> serde_json::Value {
        let (container_name, image, restarts) =
            (&self.container_name, &self.launch.image, self.restarts);
        let terminated = json!({ "exitCode": code.unwrap_or(137),
            "startedAt": run.started.to_string(), "finishedAt": Timestamp::now().to_string() });
        if again {
            json!({
                "name": container_name, "image": image, "imageID": "", "ready": false,
                "started": false, "restartCount": restarts,
                "state": { "waiting": { "reason": "CrashLoopBackOff" } },
                "lastState": { "terminated": terminated }
            })
        } else {
            json!({
                "name": container_name, "image": image, "imageID": "", "ready": false,
                "started": false, "restartCount": restarts - 1,
                "state": { "terminated": terminated }
            })
        }
    }
}

/// Records a pod the runner cannot run, for the test and in the pod's status.
async fn fail(client: &Client, state: &Mutex<State>, pod: &Pod, node: &str, refusal: &Refusal) {
    state.lock().expect("runner state").failures.push(format!(
        "pod {}: {}: {}",
        pod.name_any(),
        refusal.reason,
        refusal.message
    ));
    refuse(client, pod, node, refusal).await;
}

/// `podman run -d` of the container; returns the host pid of its process.
async fn start(l: &Launch) -> Result<u32> {
    let mut args: Vec<&str> = vec!["run", "-d", "--replace", "--name", &l.container];
    args.extend(l.options.iter().map(String::as_str));
    args.push(&l.image);
    args.extend(l.args.iter().map(String::as_str));
    podman_ok(&args).await?;
    let pid = podman_ok(&["inspect", "--format", "{{.State.Pid}}", &l.container]).await?;
    pid.trim()
        .parse()
        .with_context(|| format!("the pid of {}: {pid:?}", l.container))
}

/// Whether the container's process still runs (its monitor reaps it when it ends).
fn alive(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The container's exit code once it has stopped.
async fn wait(container: &str) -> Option<i32> {
    podman_ok(&["wait", container])
        .await
        .ok()
        .and_then(|code| code.trim().parse().ok())
}

/// A kubelet's stop: the preStop sleep, then SIGTERM and SIGKILL when the rest of the grace
/// period runs out. Returns the exit code.
async fn stop(container: &str, pid: u32, pre_stop: Duration, grace: Duration) -> Option<i32> {
    let began = Instant::now();
    // The container keeps serving through the preStop sleep (it may also exit by itself).
    while began.elapsed() < pre_stop && alive(pid) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if alive(pid) {
        let left = grace.saturating_sub(began.elapsed());
        let secs = left.as_secs() + u64::from(left.subsec_nanos() > 0);
        if let Err(e) = podman_ok(&["stop", "-t", &secs.to_string(), container]).await {
            tracing::warn!(error = %e, container, "node runner: stopping");
        }
    }
    wait(container).await
}

/// Sets the pod's Ready and ContainersReady conditions and its container's status.
async fn set_ready(
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
async fn delete_now(client: &Client, pod: &Pod) -> Result<()> {
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

/// The last `max` bytes of a container's log, without the CRI log format's timestamp,
/// stream and tag before each line.
pub fn tail(path: &Path, max: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes);
    let mut out = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_, stream, tag, rest) = (parts.next(), parts.next(), parts.next(), parts.next());
        match (stream, tag, rest) {
            (Some("stdout" | "stderr"), Some("P"), Some(rest)) => out.push_str(rest),
            (Some("stdout" | "stderr"), Some(_), Some(rest)) => {
                out.push_str(rest);
                out.push('\n');
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    let mut from = out.len().saturating_sub(max);
    while !out.is_char_boundary(from) {
        from += 1;
    }
    out[from..].to_string()
}
