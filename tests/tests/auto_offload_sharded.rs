//! `auto` chooses `offload-sharded` with the agent as the chart runs it by default
//! (unprivileged, non-root, no NVML): the chart is installed with `helm`, its agents run
//! under the node runner on two fake nodes of this test's own, and each node's accelerators
//! reach the operator only through the path an unprivileged agent has, the Node's GPU Feature
//! Discovery labels and `layerwise.dev/fast-peer-link`. The devices are too small for the
//! model to stay resident or sharded, so it must stream; on the node whose label says its
//! devices share a fast link the operator records `offload-sharded`, and on the node whose
//! label says they do not, it records another strategy (each rank copying whole blocks).
//!
//! The device memory is sized from the model the test makes (`layerwise synth`) with the
//! operator's own planner, the one the reconcile calls, on the same DiffusionDeployment file
//! the test applies: the smallest size in MiB at which streaming over a fast link fits and
//! staying resident does not. What the cluster then records is the chart, the agent's label
//! inventory, the DiffusionNode and the operator agreeing with that sizing.
//!
//! The install is also where the chart's other promises to an on-call engineer are checked
//! against the running binaries: `logFormat: json` reaches the operator and the agents as
//! `--log-format json` and every line they write is a JSON object, and the chart's monitors
//! (the PodMonitor set, which brings the operator's ServiceMonitor and the agents'
//! PodMonitor) select each operator and agent pod once, and each answers there with
//! exposition text that passes the format's rules and carries its `_build_info`.
//!
//! Its nodes are its own (not `type: kwok`, so the default fleet's tests do not count them),
//! with loopback addresses above the default fleet's, and the chart's agents are kept to them
//! by `agent.nodeSelector`; the test removes them, and their DiffusionNodes, when done.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use crds::{DiffusionDeployment, DiffusionNode, Plan};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use layerwise_core::exposition;
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::images;
use layerwise_e2e::monitors;
use layerwise_e2e::runner::{self, NodeRunner};
use layerwise_e2e::scenario::{check_runner, path_str, synth};
use layerwise_e2e::tools::{self, ok, tool};
use layerwise_engine::tools::loadgen::http;
use layerwise_operator::plan_cli::{self, LimitArgs, Link, NodeArgs, PlanArgs, WorkloadArgs};
use serde_json::json;

/// How long any one step may take (cold processes on two shared cores).
const WAIT: Duration = Duration::from_secs(180);
/// How long a scrape may take (Prometheus' default scrape timeout).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// The images the pods run (the engine image only writes the model).
const IMAGES: [&str; 3] = ["operator", "agent", "engine"];
const MODEL_PATH: &str = "/models/tiny";
/// The product the nodes' labels name: an SXM part, whose peer rate the planner knows.
const PRODUCT: &str = "NVIDIA-A100-SXM4-80GB";
/// Devices on each node: two, the fewest that can all-gather, so that `sharded` needs half
/// the model on each and streaming is the only way left.
const DEVICES: u32 = 2;
/// The chart's `operator.deviceOverheadMiB` here, and the planner's in the sizing: small,
/// so the device memory the labels advertise stays near the model's size.
const DEVICE_OVERHEAD_MIB: u64 = 64;
/// The chart's `operator.hostOverheadMiB` and `operator.maxSlots` here, and the planner's.
const HOST_OVERHEAD_MIB: u64 = 2048;
const MAX_SLOTS: u32 = 4;
/// The host memory the sizing assumes; the agents report the machine's own, which is more.
const HOST_MEMORY: &str = "8Gi";
/// The chart's operator replicas (its default), and one agent on each of the two nodes.
const OPERATORS: usize = 2;
const AGENTS: usize = 2;
/// Loopback numbers of this test's nodes: above any default fleet's (`up` allows 253).
const LINKED_N: u32 = 250;
const UNLINKED_N: u32 = 251;

/// One of the test's two nodes.
struct TestNode {
    name: String,
    /// What its `layerwise.dev/fast-peer-link` label says.
    link: bool,
    n: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_streams_offload_sharded_over_a_labelled_fast_link_with_the_agent_unprivileged(
) -> Result<()> {
    images::ensure(&IMAGES)?;
    let client = cluster::client().await?;
    tools::install_crds(&client, WAIT).await?;
    monitors::install()?;
    let ns = cluster::create_namespace(&client, "offload-sharded").await?;
    // The namespace's unique tail (its time in hex) names the release and the nodes.
    let suffix = ns.rsplit('-').next().unwrap_or(&ns).to_string();
    let release = format!("lw-{suffix}");
    let nodes = [
        TestNode {
            name: format!("stream-link-{suffix}"),
            link: true,
            n: LINKED_N,
        },
        TestNode {
            name: format!("stream-nolink-{suffix}"),
            link: false,
            n: UNLINKED_N,
        },
    ];
    let work = tempfile::Builder::new()
        .prefix("layerwise-offload-sharded-")
        .tempdir()?;
    // The containers' user reaches the node roots and the runner's folders under it.
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755))?;

    let result = async {
        let mut roots = BTreeMap::new();
        for node in &nodes {
            let root = work.path().join("nodes").join(&node.name);
            // What every Linux node has that the chart's agent mounts, and its model root.
            std::fs::create_dir_all(root.join("sys/fs/cgroup"))?;
            synth("tiny", &root.join(MODEL_PATH.trim_start_matches('/')))?;
            roots.insert(node.name.clone(), root);
        }
        let first_root = roots.values().next().context("no node roots")?.clone();
        let model = first_root.join(MODEL_PATH.trim_start_matches('/'));
        let dd_file = work.path().join("deployments.yaml");
        std::fs::write(&dd_file, dd_yaml("sizing", &ns, &nodes[0].name))?;
        let device_mib = streaming_device_mib(&model, &dd_file)?;
        eprintln!("offload-sharded: {DEVICES} devices of {device_mib} MiB each on both nodes");

        for node in &nodes {
            create_node(&client, node, &ns, device_mib).await?;
        }
        let runner = NodeRunner::start(
            client.clone(),
            runner::Config {
                namespace: ns.clone(),
                node_roots: roots,
                work: work.path().join("pods"),
            },
        )?;
        let scenario = scenario(&client, &ns, &release, &nodes, work.path(), &runner).await;
        // The operator removes its finalizers: the deployments go while it still runs.
        let mut errors = Vec::new();
        tools::delete_diffusion_deployments(&client, &ns, WAIT, &mut errors).await;
        if let Err(e) = tools::helm_uninstall(&release, &ns) {
            errors.push(e);
        }
        runner.shutdown().await;
        scenario?;
        errors.into_iter().next().map_or(Ok(()), Err)
    }
    .await;

    let mut errors = Vec::new();
    // Pods the runner no longer stops would wait for a kubelet forever.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let _ = pods.delete_collection(&now, &ListParams::default()).await;
    let (node_api, dns): (Api<Node>, Api<DiffusionNode>) =
        (Api::all(client.clone()), Api::all(client.clone()));
    for node in &nodes {
        for deleted in [
            node_api.delete(&node.name, &now).await.map(|_| ()),
            dns.delete(&node.name, &now).await.map(|_| ()),
        ] {
            match deleted {
                Ok(()) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => errors.push(anyhow::Error::from(e).context(node.name.clone())),
            }
        }
    }
    let teardown = tools::finish_teardown(&client, &ns, errors).await;
    if result.is_err() {
        eprintln!(
            "offload-sharded: logs of every process are in {}",
            work.keep().display()
        );
    }
    result?;
    teardown
}

/// The chart installed with the agent as it runs by default, the two deployments applied,
/// and the strategy each records.
async fn scenario(
    client: &Client,
    ns: &str,
    release: &str,
    nodes: &[TestNode],
    work: &Path,
    runner: &NodeRunner,
) -> Result<()> {
    // The chart's agent defaults (unprivileged, non-root, no NVML) untouched: only which
    // nodes it runs on, the node runner's annotation, and a quick resync. The operators run
    // on the test's nodes too: the node runner runs pods there only.
    let values = work.join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "logFormat: json\noperator:\n  watchNamespace: {ns}\n  resyncSeconds: 1\n  deviceOverheadMiB: {DEVICE_OVERHEAD_MIB}\n  hostOverheadMiB: {HOST_OVERHEAD_MIB}\n  maxSlots: {MAX_SLOTS}\n  nodeSelector:\n    {FLEET_LABEL}: {ns}\n  podAnnotations:\n    {a}: {v}\n\
             agent:\n  reinventorySeconds: 2\n  nodeSelector:\n    {FLEET_LABEL}: {ns}\n  prewarm:\n    memoryFloor: \"0\"\n  podAnnotations:\n    {a}: {v}\n\
             monitoring:\n  podMonitor:\n    enabled: true\n",
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
                release,
                path_str(&chart)?,
                "--namespace",
                ns,
                "--skip-crds",
                "-f",
                path_str(&values)?,
            ],
            None,
        )?,
        "helm install",
    )?;
    // The chart's operators and one agent on each of the test's nodes, none privileged.
    let want = OPERATORS + AGENTS;
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
    let agents: Vec<_> = runner
        .running()
        .into_iter()
        .filter(|r| r.pod.starts_with(&format!("{release}-layerwise-agent-")))
        .collect();
    ensure!(agents.len() == AGENTS, "agents: {agents:?}");
    for a in &agents {
        // Non-root, no capabilities, no new privileges, read-only root: no way to NVML.
        images::check_chart_security(a.pid, &format!("agent pod {}", a.pod))?;
    }

    check_json_logs(runner, release, &work.join("pods"))?;
    check_scrapes(client, ns, release, runner).await?;

    let mut yaml = String::new();
    for node in nodes {
        yaml.push_str(&dd_yaml(&node.name, ns, &node.name));
    }
    ok(
        tool("kubectl", &["apply", "-f", "-"], Some(&yaml))?,
        "kubectl apply",
    )?;
    let dds: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    for node in nodes {
        let plan = wait_until(&format!("a plan for {}", node.name), WAIT, || async {
            check_runner(runner)?;
            let dd = dds.get(&node.name).await?;
            Ok(match dd.status.as_ref().and_then(|s| s.plan.clone()) {
                Some(plan) => Ok(plan),
                None => Err(format!("{:?}", dd.status)),
            })
        })
        .await?;
        check_plan(node, &plan)?;
        // What the node's agent reported, from the labels alone.
        let dn = dns.get(&node.name).await?;
        let accelerators = dn.status.as_ref().map(|s| s.accelerators.clone());
        let reported = accelerators
            .iter()
            .flatten()
            .map(|a| (a.count, a.fast_peer_link))
            .collect::<Vec<_>>();
        ensure!(
            reported == [(DEVICES, node.link)],
            "{}: the agent reported {accelerators:?}",
            node.name
        );
        eprintln!(
            "offload-sharded: {} (fast-peer-link={}) planned {} dp={} slots={} fastPeerLink={}",
            node.name,
            node.link,
            plan.strategy.as_str(),
            plan.dp,
            plan.slots,
            plan.fast_peer_link
        );
    }
    Ok(())
}

/// The chart's `logFormat: json` reached the operator and the agents as `--log-format json`,
/// which they took: every line each has written so far is a JSON object with a level.
fn check_json_logs(runner: &NodeRunner, release: &str, logs: &Path) -> Result<()> {
    let prefix = format!("{release}-layerwise-");
    for r in runner
        .running()
        .iter()
        .filter(|r| r.pod.starts_with(&prefix))
    {
        ensure!(
            r.args.windows(2).any(|w| w == ["--log-format", "json"]),
            "pod {}: args {:?}",
            r.pod,
            r.args
        );
        let text = runner::tail(&logs.join(format!("{}.log", r.pod)), 1 << 20);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        ensure!(!lines.is_empty(), "pod {} has logged nothing", r.pod);
        for line in lines {
            let value: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("pod {}: a log line that is not JSON: {line}", r.pod))?;
            ensure!(
                value["level"].is_string(),
                "pod {}: a log line without a level: {line}",
                r.pod
            );
        }
    }
    Ok(())
}

/// As Prometheus would scrape them: the chart's monitors select each operator pod (through
/// its metrics Service's ServiceMonitor) and each agent pod (its PodMonitor) exactly once,
/// and each answers at the target with exposition text that passes the format's rules and
/// carries its binary's `_build_info`.
async fn check_scrapes(
    client: &Client,
    ns: &str,
    release: &str,
    runner: &NodeRunner,
) -> Result<()> {
    let targets = monitors::targets(client, ns).await?;
    let prefix = format!("{release}-layerwise-");
    let mut scraped = 0;
    for r in runner
        .running()
        .iter()
        .filter(|r| r.pod.starts_with(&prefix))
    {
        let of: Vec<&monitors::Target> = targets.iter().filter(|t| t.pod == r.pod).collect();
        let [t] = of[..] else {
            bail!("pod {} is scraped by {of:?}", r.pod);
        };
        let (kind, info) = if r.pod.starts_with(&format!("{prefix}operator-")) {
            ("ServiceMonitor/", "layerwise_operator_build_info{")
        } else {
            ("PodMonitor/", "layerwise_agent_build_info{")
        };
        ensure!(t.monitor.starts_with(kind), "pod {}: {t:?}", r.pod);
        let m = http(t.addr, "GET", &t.path, None, SCRAPE_TIMEOUT).await?;
        ensure!(m.status == 200, "{t:?}: HTTP {}", m.status);
        let body = String::from_utf8_lossy(&m.body);
        let wrong = exposition::lint(&body);
        ensure!(wrong.is_empty(), "{t:?}: {wrong:#?}");
        ensure!(
            body.lines().any(|l| l.starts_with(info)),
            "{t:?}: no {info}..}} sample"
        );
        scraped += 1;
    }
    ensure!(
        scraped == OPERATORS + AGENTS,
        "{scraped} of the chart's pods scraped, want {OPERATORS} operators and {AGENTS} agents"
    );
    Ok(())
}

/// The recorded plan streams, all-gathering over the link where the node has one, and
/// copying whole blocks on each rank where it has none.
fn check_plan(node: &TestNode, plan: &Plan) -> Result<()> {
    let strategy = plan.strategy.as_str();
    ensure!(
        !matches!(strategy, "resident" | "sharded"),
        "{}: the model does not fit on its devices, yet the plan is {plan:?}",
        node.name
    );
    if node.link {
        ensure!(
            (strategy, plan.dp, plan.fast_peer_link) == ("offload-sharded", DEVICES, true),
            "{}: a fast peer link, yet the plan is {plan:?}",
            node.name
        );
    } else {
        ensure!(
            strategy != "offload-sharded" && !plan.fast_peer_link,
            "{}: no fast peer link, yet the plan is {plan:?}",
            node.name
        );
    }
    Ok(())
}

/// The label that keeps the chart's agents on this test's nodes.
const FLEET_LABEL: &str = "e2e.layerwise.dev/fleet";

/// Creates `node` as kwok's fake node with the labels GPU Feature Discovery writes and the
/// fast-peer-link label, and waits until kwok has it Ready.
async fn create_node(client: &Client, node: &TestNode, ns: &str, device_mib: u64) -> Result<()> {
    let n = node.n;
    let object: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {
                "kwok.x-k8s.io/node": "fake",
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                FLEET_LABEL: ns,
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": DEVICES.to_string(),
                "nvidia.com/gpu.product": PRODUCT,
                "nvidia.com/gpu.memory": device_mib.to_string(),
                "layerwise.dev/fast-peer-link": node.link.to_string(),
            },
        },
        "spec": {
            "podCIDR": format!("127.1.{n}.0/24"),
            "podCIDRs": [format!("127.1.{n}.0/24")],
        },
    }))?;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("creating node {}", node.name))?;
    // The status is kwok's to keep, but its addresses and capacity are the test's.
    let capacity = json!({
        "cpu": "16",
        "memory": "64Gi",
        "pods": "110",
        "nvidia.com/gpu": DEVICES.to_string(),
    });
    let status = json!({ "status": {
        "addresses": [
            { "type": "InternalIP", "address": format!("127.0.1.{n}") },
            { "type": "Hostname", "address": node.name },
        ],
        "capacity": capacity,
        "allocatable": capacity,
    } });
    nodes
        .patch_status(
            &node.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .with_context(|| format!("the status of node {}", node.name))?;
    wait_until(&format!("node {} Ready", node.name), WAIT, || async {
        let node = nodes.get(&node.name).await?;
        let ready = node
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .any(|c| c.type_ == "Ready" && c.status == "True");
        Ok(if ready {
            Ok(())
        } else {
            Err(format!("{:?}", node.status))
        })
    })
    .await
}

/// A DiffusionDeployment of the tiny model with the strategy left to the operator, on
/// `node` alone.
fn dd_yaml(name: &str, ns: &str, node: &str) -> String {
    format!(
        r#"---
apiVersion: layerwise.dev/v1alpha1
kind: DiffusionDeployment
metadata:
  name: {name}
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
  strategy: auto
  replicas: 1
  accelerator:
    nodeSelector:
      kubernetes.io/hostname: {node}
"#
    )
}

/// The device memory, in MiB as GPU Feature Discovery's label gives it, at which the model
/// must stream: the smallest at which the operator's planner, on `deployment`'s spec with
/// `auto` and a fast link, plans `offload-sharded`, checked there to refuse `resident` (the
/// model does not fit) and to choose something other than `offload-sharded` without the link.
fn streaming_device_mib(model: &Path, deployment: &Path) -> Result<u64> {
    let plan = |mib: u64, link: Link, strategy: Option<&str>| {
        let args = PlanArgs {
            model: model.to_path_buf(),
            deployment: Some(deployment.to_path_buf()),
            node: NodeArgs {
                gpu: PRODUCT.into(),
                gpus: DEVICES,
                device_memory: format!("{mib}Mi"),
                host_memory: HOST_MEMORY.into(),
                link: Some(link),
                node_name: "sizing".into(),
                device_tflops: None,
                host_to_device_gbps: None,
                peer_gbps: None,
            },
            workload: WorkloadArgs {
                strategy: strategy.map(str::to_string),
                ..WorkloadArgs::default()
            },
            limits: LimitArgs {
                device_overhead_mib: DEVICE_OVERHEAD_MIB,
                host_overhead_mib: HOST_OVERHEAD_MIB,
                max_slots: MAX_SLOTS,
            },
            json: false,
        };
        plan_cli::plan(&args).map(|p| p.outcome.ok().map(|r| r.plan.strategy.as_str()))
    };
    let profile = plan_cli::inputs::profile(model)?;
    let weights: u64 = profile.components.iter().map(|c| c.bytes).sum();
    let top = DEVICE_OVERHEAD_MIB + (weights >> 20) + 64;
    for mib in DEVICE_OVERHEAD_MIB..=top {
        if plan(mib, Link::Nvlink, None)? != Some("offload-sharded") {
            continue;
        }
        ensure!(
            plan(mib, Link::Nvlink, Some("resident"))?.is_none(),
            "at {mib} MiB the model fits resident, yet auto chose offload-sharded"
        );
        let unlinked = plan(mib, Link::None, None)?;
        ensure!(
            unlinked.is_some() && unlinked != Some("offload-sharded"),
            "at {mib} MiB without a link the planner gives {unlinked:?}"
        );
        return Ok(mib);
    }
    bail!("no device memory up to {top} MiB makes auto stream the model with offload-sharded")
}
