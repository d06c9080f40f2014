//! One pod's supervision: prepare its launch, start its container, run its probes,
//! restart it after a back-off and stop it as a kubelet stops it when the pod is deleted.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;

use super::host::{alive, podman, podman_ok, stop, tail, wait};
use super::launch::{launch, Launch, PROBE_EVERY, RESTART_BACKOFF};
use super::refusal::{refuse_unless, Refusal};
use super::secrets::secret_values;
use super::state::{Config, Exit, Running, State};
use super::status::{delete_now, fail, set_ready};

/// Checks that the image is in the local store and that its user satisfies `runAsNonRoot`.
pub(super) async fn check_image(l: &Launch) -> Result<(), Refusal> {
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

/// How a container's run ended.
pub(super) enum Ended {
    /// The pod was deleted.
    Deleted,
    /// The process exited by itself.
    Exited,
    /// A probe failed: the runner killed it, for this reason.
    Killed(String),
}

/// Runs one pod's container until the pod is deleted (then stops it as a kubelet would and
/// deletes the pod) or the runner shuts down.
pub(super) async fn supervise(
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
pub(super) async fn prepare(
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
pub(super) struct Supervisor {
    pub(super) client: Client,
    pub(super) state: Arc<Mutex<State>>,
    /// The runner's namespace's pods, for the status patches.
    pub(super) pods: Api<Pod>,
    pub(super) pod: Pod,
    pub(super) name: String,
    pub(super) node: String,
    pub(super) ip: IpAddr,
    /// Changes when the pod is being deleted (or the runner shuts down).
    pub(super) deleted: watch::Receiver<bool>,
    /// The container's name in the pod spec.
    pub(super) container_name: String,
    pub(super) launch: Launch,
    pub(super) restarts: i32,
}

/// One run of the container: its process and when it started.
pub(super) struct Run {
    pub(super) pid: u32,
    pub(super) started: Timestamp,
    pub(super) started_at: Instant,
}

/// Where a run's probes stand.
pub(super) struct Probing {
    /// Ready as last recorded in the pod's status.
    pub(super) ready: bool,
    pub(super) startup_done: bool,
    pub(super) liveness_failures: u32,
    pub(super) liveness_next: Instant,
}

impl Supervisor {
    /// Starts the container, watches it until it ends, and starts it again after a
    /// back-off while the restart policy says so, until the pod is deleted (its object goes
    /// once the container is stopped and removed).
    pub(super) async fn run(mut self) {
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
    pub(super) async fn start_run(&mut self) -> Option<Run> {
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
    pub(super) fn running_status(
        &self,
        run: &Run,
        ready: bool,
        has_started: bool,
    ) -> serde_json::Value {
        json!({
            "name": self.container_name, "image": self.launch.image, "imageID": "", "ready": ready,
            "started": has_started, "restartCount": self.restarts,
            "containerID": format!("podman://{}", self.launch.container),
            "state": { "running": { "startedAt": run.started.to_string() } }
        })
    }

    /// Probes the running container every [`PROBE_EVERY`] until the pod is deleted, the
    /// process exits or a probe fails; follows readiness in the pod's status meanwhile.
    pub(super) async fn watch_run(&mut self, run: &Run) -> Ended {
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
    pub(super) async fn startup(&self, run: &Run, probing: &mut Probing) -> Option<Ended> {
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
    pub(super) async fn liveness(&self, run: &Run, probing: &mut Probing) -> Option<Ended> {
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
    pub(super) async fn readiness(&self, run: &Run, probing: &mut Probing) {
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
    pub(super) async fn end_run(&self, run: &Run, ended: &Ended) -> Option<i32> {
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
    pub(super) async fn back_off(&mut self, run: &Run, code: Option<i32>) -> bool {
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
    pub(super) fn ended_status(
        &self,
        run: &Run,
        code: Option<i32>,
        again: bool,
    ) -> serde_json::Value {
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

/// `podman run -d` of the container; returns the host pid of its process.
pub(super) async fn start(l: &Launch) -> Result<u32> {
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
