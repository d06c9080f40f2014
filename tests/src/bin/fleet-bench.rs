//! `fleet-bench`: the operator at fleet scale, against the local control plane
//! (`scripts/bench-fleet` brings up a cluster of its own and runs this; not a test).
//!
//! It adds N fake GPU nodes of mixed shapes (kwok keeps them Ready) with their
//! DiffusionNodes, plays every node agent itself (a prepare request is answered with a warm
//! profile at once, one report at a time per node), starts the `layerwise-operator` binary
//! it is given (leader election on, metrics on a loopback port), creates D
//! DiffusionDeployments at once and reports:
//! - the time until every deployment has a plan, and how many turn Available (kwok runs
//!   their engine pods) and when;
//! - where the time to plan went, by stage (see [`print_stages`]);
//! - the operator's memory (VmRSS, and VmHWM, its peak), and the CPU it and the rest of the
//!   machine (etcd, kube-apiserver, the controller manager, the scheduler, kwok, this
//!   benchmark's fake agents) used: idle for 10 s before the deployments, and until the
//!   last plan;
//! - API requests per reconcile (the operator counts its own requests by verb and
//!   resource), while planning and in the steady state after;
//! - a restart: the time a new operator takes to lead and reconcile every deployment once.
//!
//! Loopback only: node N has InternalIP 127.3.x.y and podCIDR 127.(16+N/256).(N%256).0/24.
//!
//!   fleet-bench --operator PATH [--nodes 1000] [--deployments 100] [--resync-seconds 15]
//!               [--steady-seconds 45] [--json FILE]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use crds::{DiffusionDeployment, DiffusionNode, Profile};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use layerwise_e2e::cluster;
use layerwise_e2e::fixtures::dit_profile;
use layerwise_e2e::tools::{install_crds, kubeconfig};
use layerwise_engine::tools::loadgen::http;
use serde_json::json;
use tokio::process::{Child, Command};

const NS: &str = "fleet-bench";
const AGENT: &str = "fleet-bench-agent";
const GIB: u64 = 1 << 30;
/// Requests in flight while the fleet and the deployments are created.
const PARALLEL: usize = 32;
const WAIT: Duration = Duration::from_secs(600);

/// When each model (by its request id, `namespace/name`) first reached a fake agent, and
/// when the first report with its profile was written: with the plan's time, where a
/// deployment's wait went (the operator's ask, the agents' report, or the operator's plan).
#[derive(Default)]
struct Stages {
    /// When the deployments were created; nothing is timed before.
    t0: Option<Instant>,
    asked: BTreeMap<String, Duration>,
    reported: BTreeMap<String, Duration>,
    /// When the agents' own watch first showed a profile of the model: how far behind the
    /// write the apiserver's watch delivers it.
    seen: BTreeMap<String, Duration>,
}

type SharedStages = std::sync::Arc<std::sync::Mutex<Stages>>;

impl Stages {
    /// Notes now as the first time of `ids` in the map `of` picks, once timing started.
    fn mark<'a>(
        &mut self,
        of: fn(&mut Stages) -> &mut BTreeMap<String, Duration>,
        ids: impl IntoIterator<Item = &'a String>,
    ) {
        let Some(t0) = self.t0 else { return };
        let map = of(self);
        for id in ids {
            map.entry(id.clone()).or_insert_with(|| t0.elapsed());
        }
    }
}

/// A kind of node: `share` of the fleet in percent.
struct Shape {
    prefix: &'static str,
    share: usize,
    gpus: u32,
    device_gib: u64,
    product: &'static str,
    host_gib: u64,
}

const SHAPES: [Shape; 6] = [
    Shape {
        prefix: "h100",
        share: 30,
        gpus: 8,
        device_gib: 80,
        product: "NVIDIA-H100-80GB-HBM3",
        host_gib: 2048,
    },
    Shape {
        prefix: "a100",
        share: 25,
        gpus: 8,
        device_gib: 80,
        product: "NVIDIA-A100-SXM4-80GB",
        host_gib: 1024,
    },
    Shape {
        prefix: "l40s",
        share: 20,
        gpus: 4,
        device_gib: 48,
        product: "NVIDIA-L40S",
        host_gib: 512,
    },
    Shape {
        prefix: "h200",
        share: 10,
        gpus: 8,
        device_gib: 141,
        product: "NVIDIA-H200",
        host_gib: 2048,
    },
    Shape {
        prefix: "a10g",
        share: 10,
        gpus: 1,
        device_gib: 24,
        product: "NVIDIA-A10G",
        host_gib: 256,
    },
    Shape {
        prefix: "gb200",
        share: 5,
        gpus: 4,
        device_gib: 186,
        product: "NVIDIA-GB200",
        host_gib: 1024,
    },
];

/// The model of deployment `k`: four sizes, from resident anywhere to sharded on eight.
fn model(k: usize) -> Profile {
    match k % 4 {
        0 => dit_profile(28, 400 << 20, GIB, 320 << 20),
        1 => dit_profile(48, GIB, 2 * GIB, 320 << 20),
        2 => dit_profile(80, 2 * GIB, 2 * GIB, 320 << 20),
        _ => dit_profile(160, 3 * GIB, 4 * GIB, 320 << 20),
    }
}

struct Args {
    operator: PathBuf,
    nodes: usize,
    deployments: usize,
    resync_seconds: u64,
    steady_seconds: u64,
    json: Option<PathBuf>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        operator: PathBuf::new(),
        nodes: 1000,
        deployments: 100,
        resync_seconds: 15,
        steady_seconds: 45,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--operator" => a.operator = value()?.into(),
            "--nodes" => a.nodes = value()?.parse()?,
            "--deployments" => a.deployments = value()?.parse()?,
            "--resync-seconds" => a.resync_seconds = value()?.parse()?,
            "--steady-seconds" => a.steady_seconds = value()?.parse()?,
            "--json" => a.json = Some(value()?.into()),
            other => bail!("unknown argument {other}; see the module documentation"),
        }
    }
    ensure!(
        a.operator.is_file(),
        "--operator must name the layerwise-operator binary"
    );
    ensure!(a.nodes <= 256 * 4, "at most 1024 nodes (their podCIDRs)");
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let client = cluster::client().await?;
    install_crds(&client, Duration::from_secs(60)).await?;
    ensure_namespace(&client).await?;

    let t = Instant::now();
    let fleet = fleet(a.nodes);
    create_fleet(&client, &fleet).await?;
    println!(
        "fleet: {} nodes and DiffusionNodes of {} shapes in {:.1} s",
        fleet.len(),
        SHAPES.len(),
        t.elapsed().as_secs_f64()
    );
    // The agents start timing with the deployments (Planning::measure); nothing is asked
    // before.
    let stages = SharedStages::default();
    let agent = tokio::spawn(agent(client.clone(), fleet.clone(), stages.clone()));

    let mut op = Operator::start(&a, "fleet-bench-operator-0").await?;
    let led = op.wait_leading().await?;
    println!(
        "operator: leading and synced {:.2} s after start",
        led.as_secs_f64()
    );
    print_idle_cpu().await;

    let planning = Planning::measure(&client, &a, &op, &stages).await?;
    let steady = Steady::measure(&a, &op).await?;
    let restart = Restart::measure(&a, &mut op).await?;
    agent.abort();

    if let Some(path) = &a.json {
        let report = json_report(&a, fleet.len(), led, &planning, &steady, &restart);
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// Creates the benchmark's namespace unless it is there.
async fn ensure_namespace(client: &Client) -> Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    if nss.get_opt(NS).await?.is_none() {
        nss.create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": NS } }))?,
        )
        .await?;
    }
    Ok(())
}

/// What the control plane costs with nothing to do but keep the fleet: kwok's lease
/// renewals and node heartbeats for every node.
async fn print_idle_cpu() {
    let idle = Duration::from_secs(10);
    let (c0, t) = (control_plane_cpu(), Instant::now());
    tokio::time::sleep(idle).await;
    println!(
        "cpu before the deployments: {}",
        cpu_between(&c0, &control_plane_cpu(), t.elapsed().as_secs_f64())
    );
}

/// All deployments at once, until planned: what the report takes of it.
struct Planning {
    /// When each deployment got its plan, sorted.
    planned: Vec<Duration>,
    /// How many turned Available, and when the last of them did.
    available: usize,
    last_available: Duration,
    /// The engine ReplicaSets made by then (see [`engine_replica_sets`]).
    replica_sets: usize,
    /// The operator's CPU seconds while planning.
    cpu_seconds: f64,
    requests: Window,
    /// The operator's VmRSS and VmHWM once all were planned.
    memory: (u64, u64),
}

impl Planning {
    /// Creates every deployment at once, waits until they are planned (see
    /// [`wait_planned`]) and prints how long that took, where the time went, and what the
    /// operator and the rest of the machine used meanwhile.
    async fn measure(
        client: &Client,
        a: &Args,
        op: &Operator,
        stages: &SharedStages,
    ) -> Result<Planning> {
        let before = op.metrics().await?;
        let cpu0 = op.cpu_seconds()?;
        let cp0 = control_plane_cpu();
        let t0 = Instant::now();
        stages.lock().unwrap().t0 = Some(t0);
        // Watching before the first is created, so every deployment's first change is seen.
        let waiting = tokio::spawn({
            let client = client.clone();
            let count = a.deployments;
            async move { wait_planned(&client, count, t0).await }
        });
        create_deployments(client, a.deployments).await?;
        let plans = waiting.await??;
        let mut planned: Vec<Duration> = plans.by_name.values().copied().collect();
        planned.sort();
        let after = op.metrics().await?;
        let mem_planned = op.memory()?;
        let cpu_planning = op.cpu_seconds()? - cpu0;
        let wall_planning = t0.elapsed().as_secs_f64();
        // Until the last plan: what the rest of the machine did while the operator planned.
        let cp_planning = cpu_between(
            &cp0,
            &plans.cpu,
            planned.last().copied().unwrap_or_default().as_secs_f64(),
        );
        print_planned(a.deployments, &planned, &plans);
        print_slowest(&plans.slowest, stages);
        print_stages(stages, &plans.by_name);
        let replica_sets = engine_replica_sets(client).await?;
        println!(
            "rollouts: {replica_sets} engine ReplicaSets for {} deployments",
            a.deployments
        );
        let planning = Window::between(&before, &after);
        planning.print("while planning");
        print_planning_cpu(cpu_planning, wall_planning);
        println!("cpu until the last plan, the rest of the machine: {cp_planning}");
        print_memory(mem_planned);
        Ok(Planning {
            planned,
            available: plans.available,
            last_available: plans.last_available,
            replica_sets,
            cpu_seconds: cpu_planning,
            requests: planning,
            memory: mem_planned,
        })
    }
}

/// How long the `count` deployments took to plan (`planned`, sorted) and how many turned
/// Available.
fn print_planned(count: usize, planned: &[Duration], plans: &Plans) {
    let available = plans.available;
    println!(
        "planned: all {} in {:.2} s (first {:.2} s, median {:.2} s, 90th percentile {:.2} s); {available} Available, the last after {:.2} s",
        count,
        planned.last().copied().unwrap_or_default().as_secs_f64(),
        planned.first().copied().unwrap_or_default().as_secs_f64(),
        planned[planned.len() / 2].as_secs_f64(),
        planned[planned.len() * 9 / 10].as_secs_f64(),
        plans.last_available.as_secs_f64()
    );
}

/// Where the tail's time went: what the slowest deployments waited on before their plan.
fn print_slowest(slowest: &Slowest, stages: &SharedStages) {
    for (name, at, waited) in slowest {
        let (asked, reported) = {
            let st = stages.lock().unwrap();
            let id = format!("{NS}/{name}");
            let secs = |t: Option<&Duration>| {
                t.map_or("never".to_string(), |t| format!("{:.1} s", t.as_secs_f64()))
            };
            (secs(st.asked.get(&id)), secs(st.reported.get(&id)))
        };
        println!(
            "  slow: {name} planned after {:.2} s (first ask seen {asked}, first profile reported {reported}); waited on {}",
            at.as_secs_f64(),
            if waited.is_empty() {
                "nothing reported".to_string()
            } else {
                waited.join(", ")
            }
        );
    }
}

/// The engine ReplicaSets in the namespace. Each change of an engine Deployment's pod
/// template makes one (and replaces its pods): more than one per deployment means plans
/// were rolled while they settled.
async fn engine_replica_sets(client: &Client) -> Result<usize> {
    Ok(
        Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(client.clone(), NS)
            .list_metadata(&ListParams::default())
            .await?
            .items
            .len(),
    )
}

/// The operator's CPU while planning, beside the machine's load average.
fn print_planning_cpu(cpu_planning: f64, wall_planning: f64) {
    println!(
        "cpu: the operator used {cpu_planning:.1} s of CPU in {wall_planning:.1} s while planning ({:.0}% of one core; the machine's load average {})",
        100.0 * cpu_planning / wall_planning.max(1e-9),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// The operator's VmRSS and VmHWM (see [`Operator::memory`]).
fn print_memory(memory: (u64, u64)) {
    println!(
        "memory: VmRSS {:.1} MiB, VmHWM {:.1} MiB",
        memory.0 as f64 / 1048576.0,
        memory.1 as f64 / 1048576.0
    );
}

/// The steady state: every deployment looked at every resync period.
struct Steady {
    requests: Window,
    /// The operator's VmRSS and VmHWM at its end.
    memory: (u64, u64),
}

impl Steady {
    /// Lets a resync period pass, then measures `--steady-seconds` of it.
    async fn measure(a: &Args, op: &Operator) -> Result<Steady> {
        tokio::time::sleep(Duration::from_secs(a.resync_seconds)).await;
        let s0 = op.metrics().await?;
        tokio::time::sleep(Duration::from_secs(a.steady_seconds)).await;
        let s1 = op.metrics().await?;
        let steady = Window::between(&s0, &s1);
        steady.print("steady");
        let mem_steady = op.memory()?;
        print_memory(mem_steady);
        Ok(Steady {
            requests: steady,
            memory: mem_steady,
        })
    }
}

/// A restart: a new operator's time to lead and reconcile every deployment once.
struct Restart {
    /// From the new process's start until every deployment was reconciled.
    reconciled_all: Duration,
    /// Its requests in that first pass.
    requests: Window,
    /// Its VmRSS and VmHWM then.
    memory: (u64, u64),
}

impl Restart {
    /// SIGTERM to `op` (the lease is released), then a new process that leads and
    /// reconciles all, stopped once measured.
    async fn measure(a: &Args, op: &mut Operator) -> Result<Restart> {
        op.stop().await?;
        let t = Instant::now();
        let mut op2 = Operator::start(a, "fleet-bench-operator-1").await?;
        let led2 = op2.wait_leading().await?;
        let restart = op2.wait_reconciled(a.deployments, t).await?;
        let cold = Window::between(&Metrics::default(), &restart.1);
        println!(
            "restart: leading {:.2} s after start, every deployment reconciled after {:.2} s",
            led2.as_secs_f64(),
            restart.0.as_secs_f64()
        );
        cold.print("first pass after a restart");
        let mem_restart = op2.memory()?;
        op2.stop().await?;
        Ok(Restart {
            reconciled_all: restart.0,
            requests: cold,
            memory: mem_restart,
        })
    }
}

/// The `--json` report of a run over `nodes` nodes whose first operator led after `led`.
fn json_report(
    a: &Args,
    nodes: usize,
    led: Duration,
    planning: &Planning,
    steady: &Steady,
    restart: &Restart,
) -> serde_json::Value {
    let planned = &planning.planned;
    json!({
        "nodes": nodes,
        "deployments": a.deployments,
        "resync_seconds": a.resync_seconds,
        "operator_lead_seconds": led.as_secs_f64(),
        "engine_replica_sets": planning.replica_sets,
        "operator_cpu_seconds_planning": planning.cpu_seconds,
        "all_planned_seconds": planned.last().copied().unwrap_or_default().as_secs_f64(),
        "median_planned_seconds": planned[planned.len() / 2].as_secs_f64(),
        "available": planning.available,
        "last_available_seconds": planning.last_available.as_secs_f64(),
        "planning": planning.requests.json(),
        "steady": steady.requests.json(),
        "restart_reconciled_all_seconds": restart.reconciled_all.as_secs_f64(),
        "restart": restart.requests.json(),
        "rss_bytes": { "planned": planning.memory.0, "steady": steady.memory.0, "restart": restart.memory.0 },
        "hwm_bytes": steady.memory.1.max(planning.memory.1),
    })
}

/// Where the deployments' time to plan went, by stage (median, 90th percentile and
/// largest, in seconds): created to their first ask reaching an agent, that ask to the first
/// report of the model's profile written, that report to the plan, and that report to the
/// agents' own watch showing it.
fn print_stages(stages: &SharedStages, planned: &BTreeMap<String, Duration>) {
    let st = stages.lock().unwrap();
    let (mut ask, mut report, mut plan) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = Vec::new();
    for (name, at) in planned {
        let id = format!("{NS}/{name}");
        let (Some(a), Some(r)) = (st.asked.get(&id), st.reported.get(&id)) else {
            continue;
        };
        ask.push(a.as_secs_f64());
        report.push(r.saturating_sub(*a).as_secs_f64());
        plan.push(at.saturating_sub(*r).as_secs_f64());
        if let Some(s) = st.seen.get(&id) {
            seen.push(s.saturating_sub(*r).as_secs_f64());
        }
    }
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => "none".to_string(),
            n => format!(
                "median {:.1} s, 90th percentile {:.1} s, largest {:.1} s",
                v[n / 2],
                v[n * 9 / 10],
                v[n - 1]
            ),
        }
    };
    println!(
        "stages of {} deployments: created to first ask {}; ask to first profile reported {}; report to plan {}; report to the agents' watch showing it {}",
        ask.len(),
        summary(&mut ask),
        summary(&mut report),
        summary(&mut plan),
        summary(&mut seen)
    );
}

/// One fake node: its name, shape and index.
#[derive(Clone)]
struct FakeNode {
    name: String,
    shape: usize,
    index: usize,
}

fn fleet(n: usize) -> Vec<FakeNode> {
    let mut out = Vec::with_capacity(n);
    for (s, shape) in SHAPES.iter().enumerate() {
        let count = if s == SHAPES.len() - 1 {
            n - out.len()
        } else {
            n * shape.share / 100
        };
        for i in 0..count {
            let index = out.len();
            out.push(FakeNode {
                name: format!("fleet-{}-{i}", shape.prefix),
                shape: s,
                index,
            });
        }
    }
    out
}

fn node_object(n: &FakeNode) -> serde_json::Value {
    let s = &SHAPES[n.shape];
    let cidr = format!("127.{}.{}.0/24", 16 + n.index / 256, n.index % 256);
    let ip = format!("127.3.{}.{}", n.index / 250, n.index % 250 + 1);
    let allocatable = json!({
        "cpu": "96", "memory": format!("{}Gi", s.host_gib), "pods": "110",
        "nvidia.com/gpu": s.gpus.to_string(),
    });
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": n.name,
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            // With the deprecated beta OS and architecture labels a kubelet sets at
            // registration: without them kube-controller-manager adds them node by node for
            // minutes, and each addition is a label change that concerns deployments.
            "labels": {
                "kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "layerwise.dev/fleet-bench": "true",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": s.prefix,
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": s.gpus.to_string(),
                "nvidia.com/gpu.product": s.product,
                "nvidia.com/gpu.memory": (s.device_gib * 1024).to_string(),
            },
        },
        "spec": { "podCIDR": cidr, "podCIDRs": [cidr] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": n.name }],
            "capacity": allocatable, "allocatable": allocatable,
        },
    })
}

/// The DiffusionNode status the agent of `n` reports, with `models` prepared.
fn agent_status(n: &FakeNode, models: &[serde_json::Value]) -> serde_json::Value {
    let s = &SHAPES[n.shape];
    json!({
        "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
        "metadata": { "name": n.name },
        "status": {
            "accelerators": [{
                "resourceName": "nvidia.com/gpu", "product": s.product, "count": s.gpus,
                "memoryBytes": s.device_gib * GIB, "fastPeerLink": s.gpus > 1,
            }],
            "hostMemoryBytes": s.host_gib * GIB,
            "models": models,
            "modelCount": models.len(),
        },
    })
}

async fn create_fleet(client: &Client, fleet: &[FakeNode]) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    futures::stream::iter(fleet.iter().map(|n| {
        let (nodes, dns) = (nodes.clone(), dns.clone());
        async move {
            let pp = PatchParams::apply(AGENT).force();
            nodes
                .patch(&n.name, &pp, &Patch::Apply(node_object(n)))
                .await
                .with_context(|| format!("creating Node {}", n.name))?;
            let dn = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
                             "metadata": { "name": n.name }, "spec": { "models": [] } });
            dns.patch(&n.name, &pp, &Patch::Apply(dn)).await?;
            dns.patch_status(&n.name, &pp, &Patch::Apply(agent_status(n, &[])))
                .await
                .with_context(|| format!("reporting DiffusionNode {}", n.name))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(PARALLEL)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// Plays every node's agent: a DiffusionNode whose requests differ from what it reports is
/// answered with every requested model warm and profiled. Each node has one writer, as a
/// real agent's node loop is: its reports go out one at a time, the latest requests when
/// the last write is answered (concurrent writes of one node could land out of order and
/// take back a profile already reported), and all nodes answer concurrently.
async fn agent(client: Client, fleet: Vec<FakeNode>, stages: SharedStages) {
    let by_name: BTreeMap<String, FakeNode> =
        fleet.into_iter().map(|n| (n.name.clone(), n)).collect();
    let dns: Api<DiffusionNode> = Api::all(client);
    let mut writers: BTreeMap<String, tokio::sync::watch::Sender<Vec<String>>> = BTreeMap::new();
    let events = watcher(dns.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let Ok(dn) = event else { continue };
        let Some(n) = by_name.get(&dn.name_any()) else {
            continue;
        };
        let requested: Vec<String> = dn.spec.models.iter().map(|m| m.id.clone()).collect();
        {
            let mut st = stages.lock().unwrap();
            st.mark(|s| &mut s.asked, &requested);
            st.mark(
                |s| &mut s.seen,
                dn.status.iter().flat_map(|s| &s.models).map(|m| &m.id),
            );
        }
        let reported: Vec<&str> = dn
            .status
            .as_ref()
            .map(|s| s.models.iter().map(|m| m.id.as_str()).collect())
            .unwrap_or_default();
        if requested == reported {
            continue;
        }
        let writer = writers.entry(n.name.clone()).or_insert_with(|| {
            // The fleet was created reporting no model.
            let (tx, rx) = tokio::sync::watch::channel(Vec::new());
            tokio::spawn(report(dns.clone(), n.clone(), rx, stages.clone()));
            tx
        });
        writer.send_if_modified(|latest| {
            let changed = *latest != requested;
            if changed {
                latest.clone_from(&requested);
            }
            changed
        });
    }
}

/// One node's writer: reports the latest requested models, one write at a time (a failed
/// write is tried again unless newer requests came meanwhile). Ends with the agent.
async fn report(
    dns: Api<DiffusionNode>,
    n: FakeNode,
    mut requested: tokio::sync::watch::Receiver<Vec<String>>,
    stages: SharedStages,
) {
    let pp = PatchParams::apply(AGENT).force();
    while requested.changed().await.is_ok() {
        loop {
            let ids = requested.borrow_and_update().clone();
            let models: Vec<serde_json::Value> = ids
                .iter()
                .map(|id| {
                    let k = id
                        .rsplit_once("m-")
                        .and_then(|(_, k)| k.parse::<usize>().ok())
                        .unwrap_or(0);
                    let p = model(k);
                    json!({ "id": id, "state": "Warm", "profile": p,
                            "residentBytes": p.total_bytes, "totalBytes": p.total_bytes })
                })
                .collect();
            let status = agent_status(&n, &models);
            match dns.patch_status(&n.name, &pp, &Patch::Apply(status)).await {
                Ok(_) => {
                    stages.lock().unwrap().mark(|s| &mut s.reported, &ids);
                    break;
                }
                Err(e) => {
                    eprintln!("agent: reporting {}: {e}", n.name);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if requested.has_changed().unwrap_or(true) {
                        break;
                    }
                }
            }
        }
    }
}

async fn create_deployments(client: &Client, count: usize) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), NS);
    futures::stream::iter((0..count).map(|k| {
        let api = api.clone();
        async move {
            let mut spec = json!({
                "model": { "family": "dit", "location": { "hostPath": format!("/models/m-{k}") } },
                "workload": { "maxWidth": 1024, "maxHeight": 1024, "maxSteps": 50, "guidance": true },
            });
            // The largest models take any GPU node; the others keep to one instance type
            // each (the 162 GiB one to those with the memory for it).
            if k % 4 != 3 {
                let choices: &[usize] = if k % 4 == 2 {
                    &[0, 1, 2, 3, 5]
                } else {
                    &[0, 1, 2, 3, 4, 5]
                };
                let shape = &SHAPES[choices[(k / 4) % choices.len()]];
                spec["accelerator"] =
                    json!({ "nodeSelector": { "node.kubernetes.io/instance-type": shape.prefix } });
            }
            // Mostly fixed replicas; some scaled from outside, some by the builtin autoscaler
            // (whose scrapes of kwok's pods fail: they hold their replicas).
            match k % 10 {
                0 => spec["autoscaling"] = json!({ "minReplicas": 1, "maxReplicas": 4 }),
                1 | 2 => {
                    spec["autoscaling"] =
                        json!({ "mode": "external", "minReplicas": 1, "maxReplicas": 6 })
                }
                _ => spec["replicas"] = json!(1 + k % 3),
            }
            let dd = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
                             "metadata": { "name": format!("m-{k}") }, "spec": spec });
            api.patch(
                &format!("m-{k}"),
                &PatchParams::apply(AGENT).force(),
                &Patch::Apply(dd),
            )
            .await
            .with_context(|| format!("creating DiffusionDeployment m-{k}"))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(PARALLEL)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// What the slowest deployments waited on: name, when planned, and each not-True
/// condition's `type reason` seen before the plan, with when it was first seen.
type Slowest = Vec<(String, Duration, Vec<String>)>;

/// CPU seconds by part of the machine (see [`control_plane_cpu`]).
type Cpu = BTreeMap<&'static str, f64>;

/// What [`wait_planned`] saw, each time counted from the deployments' creation.
struct Plans {
    /// When each deployment got its plan, by name.
    by_name: BTreeMap<String, Duration>,
    /// How many turned Available, and when the last of them did.
    available: usize,
    last_available: Duration,
    /// The five slowest to plan.
    slowest: Slowest,
    /// The CPU each part of the machine had used when the last deployment was planned.
    cpu: Cpu,
}

/// When each deployment got its plan; then how many turned Available, and when the last of
/// them did (within two minutes of the last plan: kwok runs the engine pods, but a plan's
/// nodes may lack free GPUs for all of them); the five slowest to plan; and the CPU each
/// part of the machine had used when the last deployment was planned.
/// Follows a watch of the deployments, so each time is when the change reached the
/// apiserver's watch cache, and the benchmark adds no LISTs of its own to what the control
/// plane serves while the operator is measured.
async fn wait_planned(client: &Client, count: usize, t0: Instant) -> Result<Plans> {
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), NS);
    let mut progress = Progress::default();
    let events = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            event = events.next() => {
                let dd = match event {
                    Some(Ok(dd)) => dd,
                    Some(Err(e)) => {
                        eprintln!("watching the deployments: {e}");
                        continue;
                    }
                    None => bail!("the watch of the deployments ended"),
                };
                progress.saw(dd, t0.elapsed(), count);
            }
            _ = tick.tick() => {}
        }
        let now = t0.elapsed();
        let settled = progress
            .all_planned
            .is_some_and(|t| now > t + Duration::from_secs(120));
        if progress.available.len() == count || settled {
            return Ok(progress.plans());
        }
        if progress.all_planned.is_none() && now > WAIT {
            let stuck = progress.stuck();
            bail!(
                "after {now:?}: {} of {count} planned; {stuck:?}",
                progress.planned.len()
            );
        }
    }
}

/// What the watch of the deployments has shown so far, each time counted from their
/// creation.
#[derive(Default)]
struct Progress {
    /// When each deployment was first seen planned.
    planned: BTreeMap<String, Duration>,
    /// When each deployment was first seen Available.
    available: BTreeMap<String, Duration>,
    /// For each deployment, its not-True conditions' `type reason` seen before its plan,
    /// with when each was first seen.
    waited: BTreeMap<String, BTreeMap<String, Duration>>,
    /// Each deployment as last seen.
    latest: BTreeMap<String, DiffusionDeployment>,
    /// When the last of them was planned.
    all_planned: Option<Duration>,
    /// The CPU each part of the machine had used then.
    cpu_planned: Cpu,
}

impl Progress {
    /// Notes what `dd` shows at `now`; once all `count` are planned, when, and the CPU used.
    fn saw(&mut self, dd: DiffusionDeployment, now: Duration, count: usize) {
        let st = dd.status.clone().unwrap_or_default();
        let is = |t: &str| {
            st.conditions
                .iter()
                .any(|c| c.type_ == t && c.status == "True")
        };
        if st.plan.is_some() && is("Planned") {
            self.planned.entry(dd.name_any()).or_insert(now);
        } else {
            let seen = self.waited.entry(dd.name_any()).or_default();
            for c in st.conditions.iter().filter(|c| c.status != "True") {
                seen.entry(format!("{} {}", c.type_, c.reason))
                    .or_insert(now);
            }
        }
        if is("Available") {
            self.available.entry(dd.name_any()).or_insert(now);
        }
        self.latest.insert(dd.name_any(), dd);
        if self.planned.len() == count && self.all_planned.is_none() {
            self.all_planned = Some(now);
            self.cpu_planned = control_plane_cpu();
        }
    }

    /// What the wait found: the plans, the Available count, and what the five slowest
    /// waited on, in the order each reason was first seen.
    fn plans(mut self) -> Plans {
        let mut by_time: Vec<(String, Duration)> =
            self.planned.iter().map(|(n, t)| (n.clone(), *t)).collect();
        by_time.sort_by_key(|(_, t)| *t);
        let slowest = by_time
            .iter()
            .rev()
            .take(5)
            .map(|(name, at)| {
                let seen = self.waited.remove(name).unwrap_or_default();
                let mut seen: Vec<(String, Duration)> = seen.into_iter().collect();
                seen.sort_by_key(|(_, t)| *t);
                let seen = seen
                    .into_iter()
                    .map(|(why, t)| format!("{why} (from {:.1} s)", t.as_secs_f64()))
                    .collect();
                (name.clone(), *at, seen)
            })
            .collect();
        let last = self.available.values().max().copied().unwrap_or_default();
        Plans {
            by_name: self.planned,
            available: self.available.len(),
            last_available: last,
            slowest,
            cpu: self.cpu_planned,
        }
    }

    /// Up to five deployments not planned yet, each with its False conditions.
    fn stuck(&self) -> Vec<String> {
        self.latest
            .values()
            .filter(|d| !self.planned.contains_key(&d.name_any()))
            .map(|d| {
                let reasons: Vec<String> = d
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .filter(|c| c.status == "False")
                    .map(|c| format!("{} {}: {}", c.type_, c.reason, c.message))
                    .collect();
                format!("{}: {}", d.name_any(), reasons.join("; "))
            })
            .take(5)
            .collect()
    }
}

/// What the operator's /metrics say, the parts this benchmark reads.
#[derive(Default, Clone)]
struct Metrics {
    reconciles: f64,
    /// "verb resource" to requests.
    requests: BTreeMap<String, f64>,
}

/// The difference between two readings.
struct Window {
    reconciles: f64,
    requests: BTreeMap<String, f64>,
}

impl Window {
    fn between(a: &Metrics, b: &Metrics) -> Window {
        let requests = b
            .requests
            .iter()
            .map(|(k, v)| (k.clone(), v - a.requests.get(k).copied().unwrap_or(0.0)))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        Window {
            reconciles: b.reconciles - a.reconciles,
            requests,
        }
    }

    /// Requests other than watches (each watch is one long-lived request).
    fn calls(&self) -> f64 {
        self.requests
            .iter()
            .filter(|(k, _)| !k.starts_with("watch "))
            .map(|(_, v)| v)
            .sum()
    }

    fn print(&self, what: &str) {
        let per = self.calls() / self.reconciles.max(1.0);
        println!(
            "requests {what}: {:.0} reconciles, {:.0} API requests (watches aside), {per:.2} per reconcile",
            self.reconciles,
            self.calls()
        );
        let mut top: Vec<(&String, &f64)> = self.requests.iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(a.1));
        let top: Vec<String> = top.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        println!("  by verb and resource: {}", top.join(", "));
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "reconciles": self.reconciles,
            "requests": self.calls(),
            "requests_per_reconcile": self.calls() / self.reconciles.max(1.0),
            "by_verb_and_resource": self.requests,
        })
    }
}

/// A running `layerwise-operator`.
struct Operator {
    child: Child,
    addr: SocketAddr,
    started: Instant,
}

impl Operator {
    async fn start(a: &Args, pod: &str) -> Result<Operator> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = std::fs::File::create(std::env::temp_dir().join(format!("{pod}.log")))?;
        let child = Command::new(&a.operator)
            .env("KUBECONFIG", kubeconfig())
            .env("LAYERWISE_LISTEN", addr.to_string())
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", NS)
            .env("LAYERWISE_LEADER_ELECT", "true")
            .env("LAYERWISE_MODEL_ROOTS", "/models")
            .env("LAYERWISE_RESYNC_SECONDS", a.resync_seconds.to_string())
            .env(
                "LAYERWISE_LOG",
                std::env::var("LAYERWISE_FLEET_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", a.operator.display()))?;
        Ok(Operator {
            child,
            addr,
            started: Instant::now(),
        })
    }

    /// Waits until it leads with its stores synced; returns how long that took.
    async fn wait_leading(&mut self) -> Result<Duration> {
        loop {
            if let Ok(r) = http(self.addr, "GET", "/readyz", None, Duration::from_secs(2)).await {
                if r.status == 200 && String::from_utf8_lossy(&r.body).starts_with("leading") {
                    return Ok(self.started.elapsed());
                }
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("the operator exited: {status}");
            }
            ensure!(self.started.elapsed() < WAIT, "the operator did not lead");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until it has reconciled `count` times (a new operator's first pass over every
    /// deployment); returns how long after `since` that was, and its metrics then.
    async fn wait_reconciled(&self, count: usize, since: Instant) -> Result<(Duration, Metrics)> {
        loop {
            let m = self.metrics().await?;
            if m.reconciles >= count as f64 {
                return Ok((since.elapsed(), m));
            }
            ensure!(
                since.elapsed() < WAIT,
                "the new operator did not reconcile every deployment"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn metrics(&self) -> Result<Metrics> {
        let r = http(self.addr, "GET", "/metrics", None, Duration::from_secs(10)).await?;
        ensure!(r.status == 200, "/metrics: HTTP {}", r.status);
        let mut m = Metrics::default();
        for line in String::from_utf8_lossy(&r.body).lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if series == "layerwise_operator_reconciles_total" {
                m.reconciles = value;
            } else if let Some(labels) =
                series.strip_prefix("layerwise_operator_api_requests_total{")
            {
                let label = |name: &str| {
                    labels
                        .split(',')
                        .find_map(|l| l.strip_prefix(&format!("{name}=\"")))
                        .map(|v| v.trim_end_matches(['"', '}']).to_string())
                        .unwrap_or_default()
                };
                m.requests
                    .insert(format!("{} {}", label("verb"), label("resource")), value);
            }
        }
        Ok(m)
    }

    /// VmRSS and VmHWM in bytes.
    fn memory(&self) -> Result<(u64, u64)> {
        let pid = self.child.id().context("the operator has exited")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .unwrap_or(0)
        };
        Ok((field("VmRSS:"), field("VmHWM:")))
    }

    /// CPU time the operator has used (user + system), seconds.
    fn cpu_seconds(&self) -> Result<f64> {
        let pid = self.child.id().context("the operator has exited")?;
        Ok(process_cpu(&pid.to_string())
            .context("reading the operator's /proc stat")?
            .1)
    }

    /// SIGTERM, then waits for it to exit.
    async fn stop(&mut self) -> Result<()> {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .context("the operator did not stop within 30 s of SIGTERM")??;
        ensure!(status.success(), "the operator exited with {status}");
        Ok(())
    }
}

/// A process's command name (`comm`, at most 15 characters) and the CPU time it has used
/// (user + system), seconds; `pid` is a /proc entry ("self" for this process).
fn process_cpu(pid: &str) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    // Fields after the command (which may hold spaces) start at the state, field 3; utime
    // and stime are fields 14 and 15, so 11 and 12 counted from the state.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((comm, (ticks(11) + ticks(12)) as f64 / hz))
}

/// CPU seconds used so far by each part of the machine's control plane (the processes of
/// these names) and by this benchmark (its fake agents and watches).
fn control_plane_cpu() -> Cpu {
    const PARTS: [(&str, &str); 5] = [
        ("etcd", "etcd"),
        ("kube-apiserver", "apiserver"),
        ("kube-controller", "controller-manager"),
        ("kube-scheduler", "scheduler"),
        ("kwok", "kwok"),
    ];
    let mut out: Cpu = PARTS.iter().map(|(_, n)| (*n, 0.0)).collect();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some((comm, secs)) = process_cpu(pid) {
            if let Some((_, part)) = PARTS.iter().find(|(c, _)| *c == comm) {
                *out.entry(part).or_default() += secs;
            }
        }
    }
    out.insert("benchmark", process_cpu("self").map_or(0.0, |(_, s)| s));
    out
}

/// What each part used between two samples of [`control_plane_cpu`], as a line.
fn cpu_between(a: &Cpu, b: &Cpu, wall: f64) -> String {
    let mut total = 0.0;
    let parts: Vec<String> = b
        .iter()
        .map(|(k, v)| {
            let used = v - a.get(k).copied().unwrap_or(0.0);
            total += used;
            format!("{k} {used:.1} s")
        })
        .collect();
    format!(
        "{} in {wall:.1} s ({:.2} cores)",
        parts.join(", "),
        total / wall.max(1e-9)
    )
}
