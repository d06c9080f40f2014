//! The whole system end to end, as a platform team would run it, on the local control plane:
//! the chart installed with `helm`, a DiffusionDeployment applied with `kubectl`, and every
//! pod the cluster schedules onto the fake GPU nodes run in a container from the project's
//! images (`scripts/images`) by the node runner (`layerwise_e2e::runner`), with the pod's
//! security context: the chart's operator and its agent DaemonSet (one agent per GPU node,
//! each with its own model folder made by `layerwise synth`), and a `layerwise serve` per
//! engine pod (the CPU engine image: the fake GPU nodes have no GPU), bound to the pod's
//! loopback IP. Every container is checked, from /proc, to run as the chart says: 65532,
//! read-only root, no capabilities, no new privileges, the runtime's seccomp filter.
//!
//! The scenario: the agents profile and warm the model, the operator plans and creates the
//! engine Deployment, the engines turn Ready and `Available` turns true; requests go to each
//! engine pod's address; a load above one replica's target queue grows the replicas, and
//! they shrink after the delay once it stops; a strategy change rolls the pods with requests
//! flowing and none failing; deleting the resource removes every object, prepare request
//! and engine process. The last line of its output is the summary `e2e: available_after=…`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use base64::Engine as _;
use crds::{DiffusionDeployment, DiffusionNode, ModelState};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, ResourceExt};
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::images;
use layerwise_e2e::runner::{self, NodeRunner};
use layerwise_e2e::scenario::{check_runner, path_str, synth};
use layerwise_e2e::tools::{self, ok, tool};
use layerwise_engine::tools::loadgen::http;
use serde_json::json;

/// How long any one step may take (cold processes on two shared cores).
const WAIT: Duration = Duration::from_secs(120);
const NAME: &str = "tiny";
/// The model's host path on every GPU node (under each fake node's root folder).
const MODEL_PATH: &str = "/models/tiny";
/// The text-to-video deployment: a tiny two-expert Wan 2.2 pipeline, two engine pods.
const WAN: &str = "wan";
const WAN_PATH: &str = "/models/wan-tiny";
const WAN_REPLICAS: usize = 2;
const MIN_REPLICAS: i32 = 2;
const MAX_REPLICAS: i32 = 4;
const TARGET_QUEUE: u32 = 2;
const SCALE_DOWN_DELAY_S: u64 = 5;
/// Clients kept busy during the load phase: MAX_REPLICAS × TARGET_QUEUE, so the autoscaler
/// wants the maximum.
const LOAD_CLIENTS: usize = (MAX_REPLICAS as usize) * (TARGET_QUEUE as usize);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The chart's default: one operator leads, the other stands by.
const OPERATOR_REPLICAS: usize = 2;
/// The chart's default port of the operator's /metrics, /healthz and /readyz.
const OPERATOR_PORT: u16 = 8080;
/// The images the pods run: the chart's operator and agent, and the CPU engine.
const IMAGES: [&str; 3] = ["operator", "agent", "engine"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn apply_prewarm_plan_serve_autoscale_roll_and_clean_up() -> Result<()> {
    phase("start");
    images::ensure(&IMAGES)?;
    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "e2e").await?;
    let release = format!("lw-{}", &ns[ns.len() - 8..]);
    let work = tempfile::Builder::new()
        .prefix("layerwise-e2e-")
        .tempdir()?;
    // The containers' user reaches the node roots and the runner's folders under it.
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755))?;

    // Every fake node gets a root folder; the GPU nodes get the model, each its own copy.
    let nodes: Api<Node> = Api::all(client.clone());
    let mut node_roots = BTreeMap::new();
    let mut gpu_nodes = Vec::new();
    for n in nodes
        .list(&ListParams::default().labels("type=kwok"))
        .await?
    {
        let root = work.path().join("nodes").join(n.name_any());
        // What every Linux node has that the chart's agent mounts.
        std::fs::create_dir_all(root.join("sys/fs/cgroup"))?;
        // The chart's model root: the agents mount it as it is, never creating it.
        std::fs::create_dir_all(root.join("models"))?;
        if n.labels().get("nvidia.com/gpu.present").map(String::as_str) == Some("true") {
            synth("tiny", &root.join(MODEL_PATH.trim_start_matches('/')))?;
            synth("wan-tiny", &root.join(WAN_PATH.trim_start_matches('/')))?;
            gpu_nodes.push(n.name_any());
        }
        node_roots.insert(n.name_any(), root);
    }
    ensure!(!gpu_nodes.is_empty(), "the test cluster has no GPU nodes");
    let runner = NodeRunner::start(
        client.clone(),
        runner::Config {
            namespace: ns.clone(),
            node_roots,
            work: work.path().join("pods"),
        },
    )?;

    let world = World {
        client: client.clone(),
        ns: ns.clone(),
        release: release.clone(),
        work: work.path().to_path_buf(),
        gpu_nodes,
    };
    phase("images built, models made");
    let result = world.scenario(&runner).await;
    phase("teardown");
    let teardown = world.teardown(runner).await;
    phase("done");
    if result.is_err() {
        // Keep the processes' logs for a look.
        let kept = work.keep();
        eprintln!("e2e: logs of every process are in {}", kept.display());
    }
    let summary = result?;
    teardown?;
    summary.print()?;
    Ok(())
}

/// Logs the start of a phase with the time since the test began (shown on failure, or with
/// `--nocapture`).
fn phase(what: &str) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed();
    eprintln!("e2e: {:>6.1}s {what}", t.as_secs_f64());
}

/// Every DiffusionDeployment's `spec.engine` here: pods the node runner runs, of the image
/// the operator gives them (the chart's `operator.engineImage`).
fn engine_yaml() -> String {
    format!(
        "  engine:\n    podAnnotations:\n      {}: {}\n",
        runner::ANNOTATION,
        runner::ANNOTATION_VALUE
    )
}

/// Checks that every container running now whose pod name starts with `prefix` runs from
/// image `image` (short name) with the chart's security context; returns how many there are.
fn check_containers(runner: &NodeRunner, prefix: &str, image: &str) -> Result<usize> {
    let tag = images::tag(image)?;
    let mut n = 0;
    for r in runner
        .running()
        .iter()
        .filter(|r| r.pod.starts_with(prefix))
    {
        ensure!(
            r.image == tag,
            "pod {} runs image {}, not {tag}",
            r.pod,
            r.image
        );
        images::check_chart_security(r.pid, &format!("pod {} ({})", r.pod, r.container))?;
        n += 1;
    }
    Ok(n)
}

struct World {
    client: Client,
    ns: String,
    release: String,
    work: PathBuf,
    gpu_nodes: Vec<String>,
}

struct Summary {
    available_after: Duration,
    scale_up: Duration,
    scale_down: Duration,
    requests: u64,
    failed: u64,
    retried: u64,
    /// Of the requests, video jobs (one through each Wan engine pod).
    videos: u64,
}

impl Summary {
    /// The summary line, on stderr for people and in `$LAYERWISE_E2E_SUMMARY` (when set) for
    /// the test command to print last.
    fn print(&self) -> Result<()> {
        let line = format!(
            "e2e: available_after={:.1} scale_up={:.1} scale_down={:.1} requests={} videos={} failed={}",
            self.available_after.as_secs_f64(),
            self.scale_up.as_secs_f64(),
            self.scale_down.as_secs_f64(),
            self.requests,
            self.videos,
            self.failed
        );
        eprintln!(
            "e2e: {} requests retried on another engine (connection refused or 503 while a pod stopped)",
            self.retried
        );
        eprintln!("{line}");
        if let Some(path) = std::env::var_os("LAYERWISE_E2E_SUMMARY") {
            std::fs::write(&path, format!("{line}\n"))
                .with_context(|| format!("writing {}", Path::new(&path).display()))?;
        }
        Ok(())
    }
}

impl World {
    fn dd_yaml(&self, strategy: &str) -> String {
        format!(
            r#"apiVersion: layerwise.dev/v1alpha1
kind: DiffusionDeployment
metadata:
  name: {NAME}
  namespace: {ns}
spec:
  model:
    family: dit
    location:
      hostPath: {MODEL_PATH}
  workload:
    maxWidth: 128
    maxHeight: 128
    maxSteps: 50
    maxBatch: 1
    guidance: true
  strategy: {strategy}
  dp: 2
  slots: 2
  autoscaling:
    mode: builtin
    minReplicas: {MIN_REPLICAS}
    maxReplicas: {MAX_REPLICAS}
    targetQueuePerReplica: {TARGET_QUEUE}
    scaleDownDelaySeconds: {SCALE_DOWN_DELAY_S}
{engine}"#,
            ns = self.ns,
            engine = engine_yaml(),
        )
    }

    fn wan_yaml(&self) -> String {
        format!(
            r#"apiVersion: layerwise.dev/v1alpha1
kind: DiffusionDeployment
metadata:
  name: {WAN}
  namespace: {ns}
spec:
  model:
    family: wan
    location:
      hostPath: {WAN_PATH}
  workload:
    maxWidth: 64
    maxHeight: 64
    maxFrames: 17
    maxSteps: 50
  strategy: offload-sharded
  dp: 2
  slots: 2
  replicas: {WAN_REPLICAS}
{engine}"#,
            ns = self.ns,
            engine = engine_yaml(),
        )
    }

    /// A text-to-video deployment beside the image one: the agents profile it (family and
    /// components), the operator plans it and passes the workload's bounds and the job key of
    /// its Secret, and a video job goes into each engine pod and is polled to an MP4 that
    /// ffprobe reads through the other pod (which sends the requests on to the job's owner, as
    /// when a Service picks another replica). Then it is deleted.
    async fn videos(&self, runner: &NodeRunner, counters: &Counters) -> Result<()> {
        let dds: Api<DiffusionDeployment> = Api::namespaced(self.client.clone(), &self.ns);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        self.kubectl_apply(&self.wan_yaml())?;
        wait_until("the Wan deployment Available", WAIT, || async {
            check_runner(runner)?;
            let dd = dds.get(WAN).await?;
            Ok(if condition(&dd, "Available") == Some(true) {
                Ok(())
            } else {
                Err(format!("{:?}", dd.status.map(|s| s.conditions)))
            })
        })
        .await?;
        let id = format!("{}/{WAN}", self.ns);
        let dns: Api<DiffusionNode> = Api::all(self.client.clone());
        for node in &self.gpu_nodes {
            let dn = dns.get(node).await?;
            let profile = dn
                .status
                .as_ref()
                .and_then(|s| s.model(&id))
                .and_then(|m| m.profile.clone())
                .with_context(|| format!("no Wan profile on {node}"))?;
            let parts: Vec<(&str, usize)> = profile
                .components
                .iter()
                .map(|c| (c.name.as_str(), c.blocks))
                .collect();
            ensure!(
                profile.family == "wan"
                    && parts
                        == [
                            ("text_encoder", 2),
                            ("transformer", 2),
                            ("transformer_2", 2),
                            ("vae", 0)
                        ],
                "the Wan profile on {node}: family {}, components {parts:?}",
                profile.family
            );
        }
        let dd = dds.get(WAN).await?;
        let engines = Engines::new(pods, &dd);
        let ready = self.engines_ready(&engines, WAN_REPLICAS).await?;
        let mut keys = std::collections::BTreeSet::new();
        for r in runner
            .running()
            .iter()
            .filter(|r| ready.iter().any(|(p, _)| *p == r.pod))
        {
            ensure!(
                r.env
                    .iter()
                    .any(|(k, v)| k == "LAYERWISE_MAX_FRAMES" && v == "17"),
                "engine {} runs without the workload's frame bound: {:?}",
                r.pod,
                r.env
            );
            let env = |name: &str| {
                r.env
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            };
            ensure!(
                env("LAYERWISE_POD_IP") == Some(r.ip.to_string()),
                "engine {} does not know its pod IP {}: {:?}",
                r.pod,
                r.ip,
                r.env
            );
            keys.insert(env("LAYERWISE_JOB_KEY").unwrap_or_default());
        }
        // One key from the deployment's Secret, the same in every pod.
        ensure!(
            keys.len() == 1 && keys.iter().all(|k| k.len() == 64),
            "the Wan engines' job keys: {} distinct, lengths {:?}",
            keys.len(),
            keys.iter().map(String::len).collect::<Vec<_>>()
        );
        let forwarded_before = forwarded(&ready).await?;
        for (i, (pod, addr)) in ready.iter().enumerate() {
            let (other, fetch) = &ready[(i + 1) % ready.len()];
            let outcome = video(*addr, *fetch, i as u64).await;
            counters.count(
                outcome.with_context(|| format!("video into {pod}, fetched through {other}")),
            );
            counters.videos.fetch_add(1, Ordering::Relaxed);
        }
        ensure!(
            counters.failed.load(Ordering::Relaxed) == 0,
            "video requests failed: {}",
            counters.errors()
        );
        let sent_on = forwarded(&ready).await? - forwarded_before;
        ensure!(
            sent_on > 0,
            "the Wan engines forwarded no request to a job's owner"
        );
        eprintln!("e2e: {sent_on} video requests forwarded to the pod that owns the job");
        ok(
            tool(
                "kubectl",
                &[
                    "delete",
                    "-n",
                    &self.ns,
                    "diffusiondeployment",
                    WAN,
                    "--timeout=120s",
                ],
                None,
            )?,
            "kubectl delete the Wan deployment",
        )?;
        wait_until("the Wan engines gone", WAIT, || async {
            check_runner(runner)?;
            let left = engines.all().await?.len();
            Ok(if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} Wan engine pods"))
            })
        })
        .await
    }

    /// The operator pods whose /metrics say they lead, each scraped as a monitor of the
    /// chart's operator metrics Service would: at the container port its target port names.
    async fn operator_leaders(&self, runner: &NodeRunner) -> Result<Vec<String>> {
        let prefix = format!("{}-layerwise-operator-", self.release);
        let services: Api<Service> = Api::namespaced(self.client.clone(), &self.ns);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        let service = services
            .get(&format!("{}-layerwise-operator-metrics", self.release))
            .await
            .context("the chart's operator metrics Service")?;
        let target = service
            .spec
            .and_then(|s| s.ports)
            .and_then(|p| p.into_iter().find(|p| p.name.as_deref() == Some("metrics")))
            .and_then(|p| p.target_port)
            .context("the operator metrics Service has no `metrics` port with a target port")?;
        let mut leaders = Vec::new();
        for r in runner
            .running()
            .iter()
            .filter(|r| r.pod.starts_with(&prefix))
        {
            let pod = pods.get(&r.pod).await?;
            let port = match &target {
                IntOrString::Int(p) => *p,
                IntOrString::String(name) => pod
                    .spec
                    .iter()
                    .flat_map(|s| &s.containers)
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .map(|p| p.container_port)
                    .with_context(|| format!("operator pod {} has no port {name}", r.pod))?,
            };
            ensure!(
                port == i32::from(OPERATOR_PORT),
                "the Service's target port resolves to {port} on {}, the chart's port is {OPERATOR_PORT}",
                r.pod
            );
            let addr = SocketAddr::new(r.ip, port as u16);
            let m = http(addr, "GET", "/metrics", None, REQUEST_TIMEOUT).await?;
            ensure!(
                m.status == 200,
                "GET /metrics of {}: HTTP {}",
                r.pod,
                m.status
            );
            if String::from_utf8_lossy(&m.body)
                .lines()
                .any(|l| l == "layerwise_operator_leader 1")
            {
                leaders.push(r.pod.clone());
            }
        }
        Ok(leaders)
    }

    fn kubectl_apply(&self, yaml: &str) -> Result<()> {
        ok(
            tool("kubectl", &["apply", "-f", "-"], Some(yaml))?,
            "kubectl apply",
        )?;
        Ok(())
    }

    async fn scenario(&self, runner: &NodeRunner) -> Result<Summary> {
        let dds: Api<DiffusionDeployment> = Api::namespaced(self.client.clone(), &self.ns);
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &self.ns);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);

        phase("helm install");
        // 1. The chart, as a user installs it (CRDs are already there), with the pods handed
        //    to the node runner, a short resync so the test is quick, and the CPU engine
        //    image. The agent as the chart runs it by default: unprivileged, non-root.
        let values = self.work.join("values.yaml");
        std::fs::write(
            &values,
            format!(
                "operator:\n  watchNamespace: {ns}\n  resyncSeconds: 1\n  engineImage:\n    repository: layerwise-engine\n  podAnnotations:\n    {a}: {v}\n\
                 agent:\n  reinventorySeconds: 2\n  prewarm:\n    memoryFloor: \"0\"\n  podAnnotations:\n    {a}: {v}\n",
                ns = self.ns,
                a = runner::ANNOTATION,
                v = runner::ANNOTATION_VALUE
            ),
        )?;
        let chart = tools::repo().join("charts/layerwise");
        ok(
            tool(
                "helm",
                &[
                    "install",
                    &self.release,
                    path_str(&chart)?,
                    "--namespace",
                    &self.ns,
                    "--skip-crds",
                    "-f",
                    path_str(&values)?,
                ],
                None,
            )?,
            "helm install",
        )?;
        // The operator's two replicas and one agent per GPU node run and are ready; of the
        // operators, exactly one leads (its /metrics, on the chart's metrics port, says so).
        let want = self.gpu_nodes.len() + OPERATOR_REPLICAS;
        wait_until("the operators and the agents ready", WAIT, || async {
            check_runner(runner)?;
            let ready = runner.running().iter().filter(|r| r.ready).count();
            Ok(if ready == want {
                Ok(())
            } else {
                Err(format!("{ready} of {want} ready: {:?}", runner.running()))
            })
        })
        .await?;
        // Each from its image, with the chart's security context.
        let operators = check_containers(
            runner,
            &format!("{}-layerwise-operator-", self.release),
            "operator",
        )?;
        let agents = check_containers(
            runner,
            &format!("{}-layerwise-agent-", self.release),
            "agent",
        )?;
        ensure!(
            (operators, agents) == (OPERATOR_REPLICAS, self.gpu_nodes.len()),
            "{operators} operator and {agents} agent containers"
        );
        wait_until("one operator leads", WAIT, || async {
            check_runner(runner)?;
            let leaders = self.operator_leaders(runner).await?;
            Ok(if leaders.len() == 1 {
                Ok(())
            } else {
                Err(format!("leaders: {leaders:?}"))
            })
        })
        .await?;

        phase("apply the DiffusionDeployment");
        // 2. Apply the DiffusionDeployment; the agents profile and warm, the operator plans,
        //    the engines come up and the resource turns Available.
        let applied = Instant::now();
        self.kubectl_apply(&self.dd_yaml("offload-sharded"))?;
        let id = format!("{}/{NAME}", self.ns);
        let dns: Api<DiffusionNode> = Api::all(self.client.clone());
        wait_until("the model warm on every GPU node", WAIT, || async {
            check_runner(runner)?;
            // While the nodes profile, the steps after ModelProfiled are not reached: they
            // read Unknown, not a value of some other generation.
            if let Some(s) = dds.get(NAME).await?.status {
                let of = |t: &str| s.conditions.iter().find(|c| c.type_ == t);
                if of("ModelProfiled").is_some_and(|c| c.status == "False") {
                    for t in ["Planned", "Available", "Ready"] {
                        let status = of(t).map(|c| c.status.as_str());
                        let want = if t == "Ready" { "False" } else { "Unknown" };
                        ensure!(
                            status == Some(want),
                            "{t} is {status:?} while profiling: {s:?}"
                        );
                    }
                }
            }
            let mut states = Vec::new();
            for node in &self.gpu_nodes {
                let dn = dns.get_opt(node).await?;
                let state = dn
                    .as_ref()
                    .and_then(|d| d.status.as_ref())
                    .and_then(|s| s.model(&id))
                    .map(|m| (m.state, m.profile.is_some()));
                states.push(state);
            }
            Ok(
                if states.iter().all(|s| *s == Some((ModelState::Warm, true))) {
                    Ok(())
                } else {
                    Err(format!("{states:?}"))
                },
            )
        })
        .await?;
        let available_after = wait_until("Available", WAIT, || async {
            check_runner(runner)?;
            let dd = dds.get(NAME).await?;
            Ok(if condition(&dd, "Available") == Some(true) {
                Ok(applied.elapsed())
            } else {
                Err(format!("{:?}", dd.status.map(|s| s.conditions)))
            })
        })
        .await?;
        // The summary condition GitOps tools and `kubectl wait` read follows.
        let resource = format!("diffusiondeployment/{NAME}");
        ok(
            tool(
                "kubectl",
                &[
                    "wait",
                    "--for=condition=Ready",
                    "--timeout=120s",
                    "-n",
                    &self.ns,
                    &resource,
                ],
                None,
            )?,
            "kubectl wait --for=condition=Ready",
        )?;
        let dd = dds.get(NAME).await?;
        for (c, want) in [("Reconciling", false), ("Stalled", false)] {
            ensure!(
                condition(&dd, c) == Some(want),
                "{c} is not {want}: {:?}",
                dd.status
            );
        }
        let plan = dd.status.as_ref().and_then(|s| s.plan.clone());
        let plan = plan.context("Available without a plan")?;
        // The unprivileged agents report the nodes' fast peer link (from the Node's label,
        // without NVML), so the plan has one.
        ensure!(
            (
                plan.strategy.as_str(),
                plan.dp,
                plan.slots,
                plan.fast_peer_link
            ) == ("offload-sharded", 2, 2, true),
            "plan {plan:?}"
        );
        for c in ["ModelProfiled", "Planned", "CacheWarm"] {
            ensure!(
                condition(&dd, c) == Some(true),
                "{c} is not true: {:?}",
                dd.status
            );
        }
        let engines = Engines::new(pods.clone(), &dd);

        phase("a request to each engine");
        // 3. A request through each engine pod's own address.
        let counters = Arc::new(Counters::default());
        let ready = self.engines_ready(&engines, MIN_REPLICAS as usize).await?;
        for (i, (pod, addr)) in ready.iter().enumerate() {
            let png = generate(*addr, i as u64, 4)
                .await
                .with_context(|| format!("a request to engine pod {pod} at {addr}"))?;
            ensure!(
                png.starts_with(b"\x89PNG"),
                "{pod} answered something that is not a PNG"
            );
            counters.ok.fetch_add(1, Ordering::Relaxed);
        }
        let runs = runner.running();
        for r in runs
            .iter()
            .filter(|r| ready.iter().any(|(p, _)| *p == r.pod))
        {
            ensure!(
                r.args
                    .windows(2)
                    .any(|w| w == ["--strategy", "offload-sharded"])
                    && r.args
                        .windows(2)
                        .any(|w| w[0] == "--listen" && w[1].starts_with(&r.ip.to_string())),
                "engine {} runs with {:?}",
                r.pod,
                r.args
            );
        }
        let engine_containers = check_containers(runner, NAME, "engine")?;
        ensure!(
            engine_containers >= MIN_REPLICAS as usize,
            "{engine_containers} engine containers"
        );

        phase("a video through each Wan engine");
        // 3b. Text to video: a second deployment, of a tiny Wan 2.2, beside the image one.
        self.videos(runner, &counters).await?;

        phase("load");
        // 4. A load above one replica's target queue: the replicas grow to the maximum.
        let load = Load::start(engines.clone(), counters.clone(), LOAD_CLIENTS, 10);
        let started = Instant::now();
        let grown = wait_until("scaled up and every replica ready", WAIT, || async {
            check_runner(runner)?;
            let d = deployments.get(NAME).await?;
            let (want, ready) = replicas(&d);
            Ok(if want == MAX_REPLICAS && ready == MAX_REPLICAS {
                Ok(started.elapsed())
            } else {
                Err(format!("{ready} of {want} ready"))
            })
        })
        .await;
        // Let the new replicas take part of the load before it stops.
        tokio::time::sleep(Duration::from_secs(2)).await;
        load.stop().await?;
        let scale_up = grown?;
        let spread = engines.ready().await?.len();
        ensure!(
            spread == MAX_REPLICAS as usize,
            "{spread} engines ready after scaling up"
        );

        phase("load stopped");
        // 5. The load stops: after the delay, back to the minimum, extra engines gone.
        let stopped = Instant::now();
        let scale_down = wait_until("scaled down to the minimum", WAIT, || async {
            check_runner(runner)?;
            let d = deployments.get(NAME).await?;
            let (want, _) = replicas(&d);
            let pods = engines.all().await?.len();
            Ok(if want == MIN_REPLICAS && pods == MIN_REPLICAS as usize {
                Ok(stopped.elapsed())
            } else {
                Err(format!("{want} wanted, {pods} pods"))
            })
        })
        .await?;
        ensure!(
            scale_down >= Duration::from_secs(SCALE_DOWN_DELAY_S),
            "scaled down after {scale_down:?}, before the {SCALE_DOWN_DELAY_S}s delay"
        );

        phase("strategy change");
        // 6. A different strategy: a rolling re-plan while requests flow, none failing.
        let trickle = Load::start(engines.clone(), counters.clone(), 2, 4);
        self.kubectl_apply(&self.dd_yaml("offload"))?;
        let rolled = wait_until("rolled to the offload plan", WAIT, || async {
            check_runner(runner)?;
            let d = deployments.get(NAME).await?;
            let plan = d
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .and_then(|a| a.get("layerwise.dev/plan").cloned())
                .unwrap_or_default();
            let st = d.status.clone().unwrap_or_default();
            let done = plan == "offload dp=2 slots=2"
                && st.observed_generation == d.metadata.generation
                && st.updated_replicas == Some(MIN_REPLICAS)
                && st.replicas == Some(MIN_REPLICAS)
                && st.ready_replicas == Some(MIN_REPLICAS);
            let engines_new = runner
                .running()
                .iter()
                .filter(|r| r.args.windows(2).any(|w| w == ["--strategy", "offload"]) && r.ready)
                .count();
            Ok(if done && engines_new == MIN_REPLICAS as usize {
                Ok(())
            } else {
                Err(format!(
                    "plan {plan:?}, status {st:?}, {engines_new} offload engines ready"
                ))
            })
        })
        .await;
        // Keep the requests flowing a moment on the new pods, then stop.
        tokio::time::sleep(Duration::from_secs(1)).await;
        trickle.stop().await?;
        rolled?;
        ensure!(
            counters.failed.load(Ordering::Relaxed) == 0,
            "requests failed: {}",
            counters.errors()
        );
        // The operator records the finished roll at its next reconcile, which the
        // Deployment's change triggers.
        wait_until("Progressing False after the roll", WAIT, || async {
            let dd = dds.get(NAME).await?;
            Ok(if condition(&dd, "Progressing") == Some(false) {
                Ok(())
            } else {
                Err(format!("still progressing after the roll: {:?}", dd.status))
            })
        })
        .await?;

        phase("delete");
        // 7. Delete: the resource, its Deployment, Service, pods, engine processes and
        //    prepare requests all go.
        let engine_pods: Vec<String> = runner
            .running()
            .iter()
            .filter(|r| r.args.first().map(String::as_str) == Some("serve"))
            .map(|r| r.pod.clone())
            .collect();
        ok(
            tool(
                "kubectl",
                &[
                    "delete",
                    "-n",
                    &self.ns,
                    "diffusiondeployment",
                    NAME,
                    "--timeout=120s",
                ],
                None,
            )?,
            "kubectl delete",
        )?;
        let services: Api<Service> = Api::namespaced(self.client.clone(), &self.ns);
        wait_until("everything the resource made gone", WAIT, || async {
            check_runner(runner)?;
            let mut left = Vec::new();
            if dds.get_opt(NAME).await?.is_some() {
                left.push("DiffusionDeployment".to_string());
            }
            if deployments.get_opt(NAME).await?.is_some() {
                left.push("Deployment".into());
            }
            if services.get_opt(NAME).await?.is_some() {
                left.push("Service".into());
            }
            let pods = engines.all().await?.len();
            if pods > 0 {
                left.push(format!("{pods} engine pods"));
            }
            let procs = runner
                .running()
                .iter()
                .filter(|r| r.args.first().map(String::as_str) == Some("serve"))
                .count();
            if procs > 0 {
                left.push(format!("{procs} engine processes"));
            }
            for node in &self.gpu_nodes {
                let dn = dns.get(node).await?;
                if dn.spec.models.iter().any(|m| m.id == id) {
                    left.push(format!("prepare request on {node}"));
                }
                if dn.status.as_ref().and_then(|s| s.model(&id)).is_some() {
                    left.push(format!("model status on {node}"));
                }
            }
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(left.join(", "))
            })
        })
        .await?;
        // Every engine process stopped cleanly when its pod went, and none died on its own.
        let exits = runner.exits();
        let bad: Vec<_> = exits
            .iter()
            .filter(|e| !e.stopping || (e.command == "layerwise" && e.code != Some(0)))
            .collect();
        ensure!(bad.is_empty(), "processes that ended badly: {bad:#?}");
        for pod in &engine_pods {
            ensure!(
                exits.iter().any(|e| &e.pod == pod && e.code == Some(0)),
                "engine pod {pod} has no clean exit recorded"
            );
        }

        Ok(Summary {
            available_after,
            scale_up,
            scale_down,
            requests: counters.ok.load(Ordering::Relaxed) + counters.failed.load(Ordering::Relaxed),
            failed: counters.failed.load(Ordering::Relaxed),
            retried: counters.retried.load(Ordering::Relaxed),
            videos: counters.videos.load(Ordering::Relaxed),
        })
    }

    /// Waits for at least `n` ready engines and returns them.
    async fn engines_ready(
        &self,
        engines: &Engines,
        n: usize,
    ) -> Result<Vec<(String, SocketAddr)>> {
        wait_until(&format!("{n} engines ready"), WAIT, || async {
            let ready = engines.ready().await?;
            Ok(if ready.len() >= n {
                Ok(ready)
            } else {
                Err(format!("{} ready", ready.len()))
            })
        })
        .await
    }

    /// Removes what the test made, best effort; the first error is returned.
    async fn teardown(&self, runner: NodeRunner) -> Result<()> {
        let mut errors: Vec<anyhow::Error> = Vec::new();
        tools::delete_diffusion_deployments(&self.client, &self.ns, WAIT, &mut errors).await;
        if let Err(e) = tools::helm_uninstall(&self.release, &self.ns) {
            errors.push(e);
        }
        runner.shutdown().await;
        // Pods the runner no longer stops would wait for a kubelet forever.
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        let _ = pods
            .delete_collection(
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
                &ListParams::default(),
            )
            .await;
        tools::finish_teardown(&self.client, &self.ns, errors).await
    }
}

fn condition(dd: &DiffusionDeployment, type_: &str) -> Option<bool> {
    dd.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status == "True")
}

/// (spec.replicas, status.readyReplicas) of a Deployment.
fn replicas(d: &Deployment) -> (i32, i32) {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
    let ready = d
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    (want, ready)
}

/// The engine pods of the deployment: what a Service's endpoints would hold (Ready and not
/// terminating), read from the API because loopback pods get no endpoints.
#[derive(Clone)]
struct Engines {
    pods: Api<Pod>,
    selector: String,
    /// The ready list as the load's clients last read it, and when: shared, like a load
    /// balancer's view of the endpoints, so the clients are not listing pods all the time.
    routes: Arc<tokio::sync::Mutex<(Option<Instant>, Vec<Route>)>>,
}

/// An engine pod's name and address.
type Route = (String, SocketAddr);

/// How stale the clients' view of the ready engines may get.
const ROUTES_TTL: Duration = Duration::from_millis(250);

impl Engines {
    fn new(pods: Api<Pod>, dd: &DiffusionDeployment) -> Engines {
        let selector = dd
            .status
            .as_ref()
            .map(|s| s.selector.clone())
            .unwrap_or_default();
        Engines {
            pods,
            selector,
            routes: Default::default(),
        }
    }

    /// The ready engines as the clients see them (at most [`ROUTES_TTL`] old).
    async fn routes(&self) -> Result<Vec<Route>> {
        let mut r = self.routes.lock().await;
        if r.0.is_none_or(|t| t.elapsed() > ROUTES_TTL) {
            *r = (Some(Instant::now()), self.ready().await?);
        }
        Ok(r.1.clone())
    }

    async fn all(&self) -> Result<Vec<Pod>> {
        Ok(self
            .pods
            .list(&ListParams::default().labels(&self.selector))
            .await?
            .items)
    }

    async fn ready(&self) -> Result<Vec<Route>> {
        let mut out = Vec::new();
        for p in self.all().await? {
            let st = p.status.as_ref();
            let ready = st
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let ip = st.and_then(|s| s.pod_ip.as_deref());
            if let (true, None, Some(ip)) = (ready, &p.metadata.deletion_timestamp, ip) {
                out.push((p.name_any(), SocketAddr::new(ip.parse()?, 8080)));
            }
        }
        out.sort();
        Ok(out)
    }
}

#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
    videos: AtomicU64,
    errors: std::sync::Mutex<Vec<String>>,
}

impl Counters {
    /// Counts one request's outcome, keeping what went wrong.
    fn count(&self, outcome: Result<()>) {
        match outcome {
            Ok(()) => self.ok.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                self.errors.lock().expect("errors").push(format!("{e:#}"));
                self.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
    }

    fn errors(&self) -> String {
        self.errors.lock().expect("errors").join("; ")
    }
}

/// Closed-loop clients: each sends a request, waits for the answer, sends the next.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(engines: Engines, counters: Arc<Counters>, clients: usize, steps: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..clients)
            .map(|c| {
                let (engines, counters, stop) = (engines.clone(), counters.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let seed = (c as u64) << 32 | n;
                        n += 1;
                        counters.count(send(&engines, &counters, seed, steps).await);
                    }
                })
            })
            .collect();
        Load { stop, tasks }
    }

    async fn stop(self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await?;
        }
        Ok(())
    }
}

/// One request through the ready engines, as a load balancer sends it: to the next ready pod,
/// and to another one when the first refuses the connection or answers 503 because it is
/// stopping (the request never started there).
async fn send(engines: &Engines, counters: &Counters, seed: u64, steps: u64) -> Result<()> {
    let mut last = String::new();
    for attempt in 0..5u64 {
        let ready = engines.routes().await?;
        if ready.is_empty() {
            last = "no engine ready".into();
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let (pod, addr) = &ready[((seed + attempt) % ready.len() as u64) as usize];
        match generate(*addr, seed, steps).await {
            Ok(_) => return Ok(()),
            Err(Refused::Retry(why)) => {
                counters.retried.fetch_add(1, Ordering::Relaxed);
                last = format!("{pod}: {why}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(Refused::Fail(why)) => bail!("{pod} at {addr}: {why}"),
        }
    }
    bail!("no engine took the request after 5 tries; last: {last}")
}

enum Refused {
    /// Not started on that engine: another may take it.
    Retry(String),
    Fail(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Retry(s) | Refused::Fail(s) => f.write_str(s),
        }
    }
}

impl std::fmt::Debug for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Refused {}

/// Requests the engines at `routes` sent on to the engine that owns the job, so far.
async fn forwarded(routes: &[Route]) -> Result<u64> {
    let mut total = 0;
    for (pod, addr) in routes {
        let r = http(*addr, "GET", "/metrics", None, REQUEST_TIMEOUT).await?;
        ensure!(r.status == 200, "GET /metrics of {pod}: HTTP {}", r.status);
        total += String::from_utf8_lossy(&r.body)
            .lines()
            .find_map(|l| l.strip_prefix("layerwise_job_requests_forwarded_total{outcome=\"ok\"} "))
            .map_or(Ok(0), |n| n.trim().parse::<u64>())
            .with_context(|| format!("the forwarded count of {pod}"))?;
    }
    Ok(total)
}

/// One 128×128 image from the engine at `addr`: the PNG bytes.
async fn generate(addr: SocketAddr, seed: u64, steps: u64) -> Result<Vec<u8>, Refused> {
    let body = json!({ "class_label": seed % 10, "seed": seed, "steps": steps, "size": "128x128" })
        .to_string();
    let r = match http(
        addr,
        "POST",
        "/v1/images/generations",
        Some(body.as_bytes()),
        REQUEST_TIMEOUT,
    )
    .await
    {
        Ok(r) => r,
        Err(e) if e.to_string().contains("Connection refused") => {
            return Err(Refused::Retry(e.to_string()))
        }
        Err(e) => return Err(Refused::Fail(e.to_string())),
    };
    let text = String::from_utf8_lossy(&r.body).into_owned();
    match r.status {
        200 => {}
        503 if text.contains("shutting down") => return Err(Refused::Retry(text)),
        s => return Err(Refused::Fail(format!("HTTP {s}: {text}"))),
    }
    let v = r.json().map_err(|e| Refused::Fail(e.to_string()))?;
    let b64 = v["data"][0]["b64_json"]
        .as_str()
        .ok_or_else(|| Refused::Fail(format!("no data[0].b64_json in {text}")))?;
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| Refused::Fail(format!("b64_json: {e}")))
}

/// One video job into the engine at `addr`, polled through its progress to completion and
/// downloaded at `fetch` (the same job, whichever engine answers): 9 frames of 48×32 from a
/// prompt; the MP4 must hold what was asked for.
async fn video(addr: SocketAddr, fetch: SocketAddr, seed: u64) -> Result<()> {
    const STEPS: u64 = 12;
    let body = json!({
        "prompt": format!("a red fox running through fresh snow, take {seed}"),
        "size": "48x32", "frames": 9, "fps": 8, "steps": STEPS, "seed": seed,
    })
    .to_string();
    let r = http(
        addr,
        "POST",
        "/v1/videos",
        Some(body.as_bytes()),
        REQUEST_TIMEOUT,
    )
    .await?;
    let text = String::from_utf8_lossy(&r.body).into_owned();
    ensure!(
        r.status == 202,
        "POST /v1/videos: HTTP {}: {text}",
        r.status
    );
    let id = r.json()?["id"]
        .as_str()
        .with_context(|| format!("no id in {text}"))?
        .to_string();
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut steps_seen = Vec::new();
    let last = loop {
        let r = http(
            fetch,
            "GET",
            &format!("/v1/videos/{id}"),
            None,
            REQUEST_TIMEOUT,
        )
        .await?;
        ensure!(
            r.status == 200,
            "GET /v1/videos/{id} at {fetch}: HTTP {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json()?;
        ensure!(v["id"] == id.as_str(), "asked for video {id}, got {v}");
        let steps = v["steps_done"].as_u64().context("steps_done")?;
        if steps_seen.last() != Some(&steps) {
            steps_seen.push(steps);
        }
        match v["status"].as_str() {
            Some("completed") | Some("failed") => break v,
            _ => {}
        }
        ensure!(Instant::now() < deadline, "video {id} still running: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    ensure!(last["status"] == "completed", "video {id}: {last}");
    ensure!(
        (
            last["progress"].as_u64(),
            last["steps_done"].as_u64(),
            last["frames_decoded"].as_u64()
        ) == (Some(100), Some(STEPS), Some(9)),
        "video {id} reported {last}"
    );
    ensure!(
        steps_seen.windows(2).all(|w| w[0] < w[1]) && steps_seen.len() >= 2,
        "video {id}: steps done as polled: {steps_seen:?}"
    );
    let r = http(
        fetch,
        "GET",
        &format!("/v1/videos/{id}/content"),
        None,
        REQUEST_TIMEOUT,
    )
    .await?;
    ensure!(
        r.status == 200,
        "GET /v1/videos/{id}/content: HTTP {}",
        r.status
    );
    let file = tempfile::Builder::new().suffix(".mp4").tempfile()?;
    std::fs::write(file.path(), &r.body)?;
    let probe = std::process::Command::new("ffprobe")
        .args(["-v", "error", "-select_streams", "v:0", "-count_frames"])
        .args([
            "-show_entries",
            "stream=codec_name,width,height,nb_read_frames",
        ])
        .args(["-of", "csv=p=0"])
        .arg(file.path())
        .output()
        .context("running ffprobe")?;
    let read = String::from_utf8_lossy(&probe.stdout).trim().to_string();
    ensure!(
        read == "h264,48,32,9",
        "video {id}: ffprobe read {read:?} ({})",
        String::from_utf8_lossy(&probe.stderr)
    );
    Ok(())
}
