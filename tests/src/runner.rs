//! The node runner: a test-side kubelet for the fake (kwok) nodes, so that pods the cluster
//! schedules there run as real processes of this workspace's binaries.
//!
//! It acts on pods annotated [`ANNOTATION`]`=node-runner` (kwok leaves those to it, see
//! `tests/cluster/node-runner-stages.yaml`) in one namespace, on nodes it was given a root
//! folder for. For each such pod, once kwok has given it an IP, it starts the container's
//! `command` with the container's `args` and `env`, the way a kubelet would, within what a
//! process without its own mount and network namespaces can do:
//! - the image is not pulled: `command[0]` names one of the workspace's binaries;
//! - the pod's network namespace is its IP: a listen address `0.0.0.0:<port>` in an argument
//!   or an environment value becomes `<pod IP>:<port>`, and probes dial the pod IP;
//! - a fake node's host filesystem is its root folder: a `hostPath` volume is that path under
//!   the root, an `emptyDir` a fresh folder, and an argument or environment value under a
//!   container mount path is rewritten to the folder behind it. Programs that resolve host
//!   paths they read from the API (the agent's model requests) get the root in
//!   [`HOST_ROOT_ENV`];
//! - `env` takes literal values, the downward API's `fieldRef`s and Secrets' `secretKeyRef`s
//!   (read from the API when the process starts, as a kubelet does); the service account's
//!   identity is a kubeconfig impersonating it with its node's name in the user extra, as a
//!   pod-bound token carries it (unless the pod opts out of the token), in place of the
//!   projected token volume;
//! - the pod turns Ready when the readiness probe (HTTP GET) passes, and not Ready when it
//!   fails or the process exits; an exited process is restarted (`restartPolicy: Always`);
//! - a deleted pod gets its `preStop` sleep, then SIGTERM, then SIGKILL after the rest of
//!   its grace period; the runner then deletes the pod object, as a kubelet does.
//!
//! Every process's output goes to `<work>/<pod>.log`; every exit is recorded for the test to
//! check.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::tools;

/// The pod annotation that hands a pod to the runner (kwok then leaves its readiness and
/// deletion alone).
pub const ANNOTATION: &str = "e2e.layerwise.dev/kubelet";
/// The annotation's value.
pub const ANNOTATION_VALUE: &str = "node-runner";
/// The environment variable that tells a process where its fake node's host filesystem is.
pub const HOST_ROOT_ENV: &str = "LAYERWISE_AGENT_MODEL_ROOT";

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
    /// `command[0]` to the binary that runs it.
    pub binaries: BTreeMap<String, PathBuf>,
    /// Where logs, kubeconfigs and `emptyDir` folders go.
    pub work: PathBuf,
}

/// One process that ended.
#[derive(Debug, Clone)]
pub struct Exit {
    pub pod: String,
    pub node: String,
    pub command: String,
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// Whether the pod was being deleted (an expected stop) rather than the process dying.
    pub stopping: bool,
    /// The tail of its log.
    pub log_tail: String,
}

/// A process the runner started, as the test sees it.
#[derive(Debug, Clone)]
pub struct Running {
    pub pod: String,
    pub node: String,
    pub ip: IpAddr,
    pub args: Vec<String>,
    /// The container's environment as the process got it (the pod's `env`, resolved).
    pub env: Vec<(String, String)>,
    pub ready: bool,
}

#[derive(Default)]
struct State {
    running: BTreeMap<String, Running>,
    exits: Vec<Exit>,
    /// Pods whose process failed to start, with why.
    failures: Vec<String>,
}

/// The runner: a task watching pods, one supervisor task per pod.
pub struct NodeRunner {
    state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl NodeRunner {
    /// Starts watching `config.namespace` with `client` (which must be allowed to patch pod
    /// status and delete pods there).
    pub fn start(client: Client, config: Config) -> Result<NodeRunner> {
        std::fs::create_dir_all(&config.work)
            .with_context(|| format!("creating {}", config.work.display()))?;
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(watch_pods(client, Arc::new(config), state.clone(), stop_rx));
        Ok(NodeRunner { state, stop, task })
    }

    /// The processes running now.
    pub fn running(&self) -> Vec<Running> {
        let s = self.state.lock().expect("runner state");
        s.running.values().cloned().collect()
    }

    /// Every process that has ended so far.
    pub fn exits(&self) -> Vec<Exit> {
        self.state.lock().expect("runner state").exits.clone()
    }

    /// Pods the runner could not start, with why.
    pub fn failures(&self) -> Vec<String> {
        self.state.lock().expect("runner state").failures.clone()
    }

    /// Stops watching and kills whatever still runs (after the test has deleted what it
    /// wanted stopped cleanly).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
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
                // Gone without us (a forced delete): the supervisor stops its process.
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
    // Shut down: every process goes, without waiting for grace periods.
    for (tx, _) in supervised.values() {
        let _ = tx.send(true);
    }
    for (_, (_, task)) in supervised {
        let _ = tokio::time::timeout(Duration::from_secs(20), task).await;
    }
}

/// What a container runs as: binary, arguments, environment, the readiness probe's address
/// and path, and its stop timings.
struct Launch {
    binary: PathBuf,
    command: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    probe: Option<(SocketAddr, String)>,
    pre_stop: Duration,
    grace: Duration,
    log: PathBuf,
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

/// Builds the process for the pod's (only) container.
fn launch(
    config: &Config,
    pod: &Pod,
    node: &str,
    ip: IpAddr,
    secrets: &BTreeMap<SecretKey, String>,
) -> Result<Launch> {
    let name = pod.name_any();
    let spec = pod.spec.as_ref().context("pod without spec")?;
    let [container]: &[Container; 1] = spec
        .containers
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("pod {name}: the runner runs pods of one container"))?;
    let command = container
        .command
        .as_ref()
        .and_then(|c| c.first())
        .with_context(|| format!("pod {name}: container has no command"))?
        .clone();
    let binary = config
        .binaries
        .get(&command)
        .with_context(|| format!("pod {name}: no binary for command {command:?}"))?
        .clone();
    let root = &config.node_roots[node];
    let pod_dir = config.work.join(&name);
    std::fs::create_dir_all(&pod_dir)?;

    // Mount path -> the folder behind it.
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for m in container.volume_mounts.iter().flatten() {
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .with_context(|| format!("pod {name}: mount of unknown volume {}", m.name))?;
        let mut dir = if let Some(h) = &volume.host_path {
            let dir = root.join(h.path.trim_start_matches('/'));
            match h.type_.as_deref() {
                Some("DirectoryOrCreate") => std::fs::create_dir_all(&dir)?,
                Some("Directory") if !dir.is_dir() => {
                    bail!(
                        "pod {name}: hostPath {} is not a directory on {node}",
                        h.path
                    )
                }
                _ => {}
            }
            dir
        } else if volume
            .projected
            .as_ref()
            .and_then(|p| p.sources.as_ref())
            .is_some_and(|s| s.iter().any(|s| s.service_account_token.is_some()))
        {
            // The service account token: its identity is the kubeconfig given below.
            continue;
        } else if volume.empty_dir.is_some() {
            let dir = pod_dir.join("volumes").join(&volume.name);
            std::fs::create_dir_all(&dir)?;
            dir
        } else {
            bail!(
                "pod {name}: volume {} is of a kind the runner does not mount",
                volume.name
            )
        };
        if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            dir = dir.join(sub);
        }
        mounts.push((m.mount_path.trim_end_matches('/').to_string(), dir));
    }
    mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    let rewrite = |v: &str| -> String {
        if let Some(port) = v.strip_prefix("0.0.0.0:") {
            return format!("{ip}:{port}");
        }
        for (path, dir) in &mounts {
            if v == path {
                return dir.display().to_string();
            }
            if let Some(rest) = v.strip_prefix(&format!("{path}/")) {
                return dir.join(rest).display().to_string();
            }
        }
        v.to_string()
    };

    let args: Vec<String> = container
        .command
        .iter()
        .flatten()
        .skip(1)
        .chain(container.args.iter().flatten())
        .map(|a| rewrite(a))
        .collect();

    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
        ("HOME".into(), pod_dir.display().to_string()),
        (HOST_ROOT_ENV.into(), root.display().to_string()),
    ];
    if let Some((_, tmp)) = mounts.iter().find(|(p, _)| p == "/tmp") {
        env.push(("TMPDIR".into(), tmp.display().to_string()));
    }
    if spec.automount_service_account_token != Some(false) {
        let sa = spec.service_account_name.as_deref().unwrap_or("default");
        let user = format!("system:serviceaccount:{}:{sa}", config.namespace);
        // A pod-bound token: the apiserver sees the pod's node in the user extra.
        let kc = tools::impersonating_kubeconfig_on_node(&user, node)?;
        let path = pod_dir.join("kubeconfig");
        std::fs::write(&path, serde_json::to_vec(&kc)?)?;
        env.push(("KUBECONFIG".into(), path.display().to_string()));
    }
    if container.env_from.is_some() {
        bail!("pod {name}: envFrom is not supported by the runner");
    }
    for e in container.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => rewrite(v),
            (None, Some(from)) if from.secret_key_ref.is_some() => {
                let r = from.secret_key_ref.as_ref().expect("matched");
                secrets
                    .get(&(r.name.clone(), r.key.clone()))
                    .cloned()
                    .with_context(|| format!("pod {name}: env {} not read", e.name))?
            }
            (None, Some(from)) => {
                let field = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .with_context(|| {
                        format!(
                            "pod {name}: env {} comes from a source the runner lacks",
                            e.name
                        )
                    })?;
                match field {
                    "spec.nodeName" => node.to_string(),
                    "metadata.name" => name.clone(),
                    "metadata.namespace" => config.namespace.clone(),
                    "status.podIP" => ip.to_string(),
                    other => bail!("pod {name}: env {} from unknown field {other}", e.name),
                }
            }
            (None, None) => String::new(),
        };
        env.push((e.name.clone(), value));
    }

    let probe = match container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
    {
        None => None,
        Some(get) => {
            use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
            let port = match &get.port {
                IntOrString::Int(p) => *p,
                IntOrString::String(named) => container
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(named))
                    .map(|p| p.container_port)
                    .with_context(|| format!("pod {name}: probe port {named} is not declared"))?,
            };
            Some((
                SocketAddr::new(ip, u16::try_from(port)?),
                get.path.clone().unwrap_or_else(|| "/".into()),
            ))
        }
    };
    let pre_stop = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.sleep.as_ref())
        .map_or(Duration::ZERO, |s| {
            Duration::from_secs(s.seconds.max(0) as u64)
        });
    let grace =
        Duration::from_secs(spec.termination_grace_period_seconds.unwrap_or(30).max(0) as u64);
    Ok(Launch {
        binary,
        command,
        args,
        env,
        probe,
        pre_stop,
        grace,
        log: config.work.join(format!("{name}.log")),
    })
}

/// Runs one pod's process until the pod is deleted (then stops it as a kubelet would and
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
    let launch = match secret_values(&client, &config.namespace, &pod)
        .await
        .and_then(|secrets| launch(&config, &pod, &node, ip, &secrets))
    {
        Ok(l) => l,
        Err(e) => {
            state
                .lock()
                .expect("runner state")
                .failures
                .push(format!("{e:#}"));
            return;
        }
    };
    let container = pod.spec.as_ref().map(|s| s.containers[0].clone());
    let (container_name, image) = container
        .map(|c| (c.name, c.image.unwrap_or_default()))
        .unwrap_or_default();
    let mut restarts = 0;
    loop {
        let mut child = match spawn(&launch) {
            Ok(c) => c,
            Err(e) => {
                state
                    .lock()
                    .expect("runner state")
                    .failures
                    .push(format!("pod {name}: starting {}: {e:#}", launch.command));
                return;
            }
        };
        state.lock().expect("runner state").running.insert(
            name.clone(),
            Running {
                pod: name.clone(),
                node: node.clone(),
                ip,
                args: launch.args.clone(),
                env: launch.env.clone(),
                ready: false,
            },
        );
        let started = Timestamp::now();
        let container_status = |ready: bool| {
            json!({
                "name": container_name, "image": image, "imageID": "", "ready": ready,
                "started": true, "restartCount": restarts,
                "state": { "running": { "startedAt": started.to_string() } }
            })
        };
        let _ = set_ready(&pods, &name, false, container_status(false)).await;
        let mut ready = false;
        let mut probe_tick = tokio::time::interval(PROBE_EVERY);
        let stopping = loop {
            tokio::select! {
                _ = deleted.changed() => break true,
                status = child.wait() => {
                    let _ = status;
                    break false;
                }
                _ = probe_tick.tick() => {
                    let now_ready = match &launch.probe {
                        None => true,
                        Some((addr, path)) => probe(*addr, path).await,
                    };
                    if now_ready != ready
                        && set_ready(&pods, &name, now_ready, container_status(now_ready))
                            .await
                            .is_ok()
                    {
                        ready = now_ready;
                        if let Some(r) = state.lock().expect("runner state").running.get_mut(&name) {
                            r.ready = ready;
                        }
                    }
                }
            }
        };
        let code = if stopping {
            let _ = set_ready(&pods, &name, false, container_status(false)).await;
            stop(&mut child, launch.pre_stop, launch.grace).await
        } else {
            child.wait().await.ok().and_then(|s| s.code())
        };
        let exit = Exit {
            pod: name.clone(),
            node: node.clone(),
            command: launch.command.clone(),
            code,
            stopping,
            log_tail: tail(&launch.log, 2048),
        };
        {
            let mut s = state.lock().expect("runner state");
            s.running.remove(&name);
            s.exits.push(exit);
        }
        if stopping {
            let _ = delete_now(&client, &pod).await;
            return;
        }
        // The process died on its own: not ready, then restarted after a back-off, unless
        // the pod is deleted meanwhile.
        restarts += 1;
        let terminated = json!({
            "name": container_name, "image": image, "imageID": "", "ready": false,
            "started": false, "restartCount": restarts,
            "state": { "waiting": { "reason": "CrashLoopBackOff" } },
            "lastState": { "terminated": { "exitCode": code.unwrap_or(137),
                "startedAt": started.to_string(), "finishedAt": Timestamp::now().to_string() } }
        });
        let _ = set_ready(&pods, &name, false, terminated).await;
        tokio::select! {
            _ = deleted.changed() => {
                let _ = delete_now(&client, &pod).await;
                return;
            }
            _ = tokio::time::sleep(RESTART_BACKOFF) => {}
        }
    }
}

fn spawn(l: &Launch) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&l.log)
        .with_context(|| format!("opening {}", l.log.display()))?;
    Command::new(&l.binary)
        .args(&l.args)
        .env_clear()
        .envs(l.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {}", l.binary.display()))
}

/// A kubelet's stop: the preStop sleep, SIGTERM, and SIGKILL when the rest of the grace
/// period runs out. Returns the exit code (`None` for a signal).
async fn stop(child: &mut Child, pre_stop: Duration, grace: Duration) -> Option<i32> {
    let started = Instant::now();
    // The process keeps serving through the preStop sleep (it may also exit by itself).
    if let Ok(status) = tokio::time::timeout(pre_stop, child.wait()).await {
        return status.ok().and_then(|s| s.code());
    }
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    let left = grace.saturating_sub(started.elapsed());
    match tokio::time::timeout(left, child.wait()).await {
        Ok(status) => status.ok().and_then(|s| s.code()),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    }
}

/// GET `path` at `addr`; ready on 2xx or 3xx, as a kubelet's HTTP probe.
async fn probe(addr: SocketAddr, path: &str) -> bool {
    layerwise_engine::tools::loadgen::http(addr, "GET", path, None, PROBE_TIMEOUT)
        .await
        .is_ok_and(|r| (200..400).contains(&r.status))
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

/// The last `max` bytes of a log file.
pub fn tail(path: &Path, max: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let from = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[from..]).into_owned()
}
