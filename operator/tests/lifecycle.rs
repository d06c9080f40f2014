//! Day two on an elastic fleet, against the real control plane (tests/cluster): nodes that
//! an autoscaler adds and removes, and an operator upgraded under running engines.
//!
//! - A node that joins (its Node, then its agent's DiffusionNode) becomes a candidate at
//!   once: a deployment that wants more replicas than its nodes hold asks the new node to
//!   warm its model, plans on it and its waiting replicas land there; a deployment whose
//!   nodes hold its replicas leaves the new node alone.
//! - A node that goes takes its DiffusionNode with it (the operator makes the Node its owner;
//!   kube-controller-manager's garbage collector removes it), and the plans that counted it
//!   are made again without it.
//! - An operator restarted with a new default engine image restarts no engine pod; the
//!   deployment annotated to follow the operator rolls onto the new image.
//!
//! The operators here resync only every five minutes, so whatever happens within a test's
//! wait comes from the watches, not from the periodic reconcile. The drain side of the
//! lifecycle (SIGTERM finishes running work) is the engine's, proven by its own process
//! tests (`engine/tests/server_process.rs`, `engine/tests/jobs_behind_a_service.rs`).

mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use crds::{DiffusionDeployment, DiffusionNode};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use layerwise_e2e::cluster::wait_until;
use layerwise_e2e::shapes::Shape;
use layerwise_operator::requests::model_id;
use serde_json::json;
use world::{
    deployment_manifest, engine_pods, event_reasons, profile, status_of, Fixed, Operator, Setup,
    World, WAIT,
};

/// ~25 GiB: resident on one 80 GiB GPU.
fn small() -> crds::Profile {
    profile(57, 400 << 20)
}

fn idle() -> Arc<Fixed> {
    Arc::new(Fixed(AtomicU64::new(0)))
}

/// Long enough that no wait of these tests sees a periodic reconcile.
const RESYNC: Duration = Duration::from_secs(300);

/// The instance type of the nodes this file adds to the fleet.
const JOINING: &str = "lw-join";

/// The shape the fake agent reports for the first `count` joining nodes: two 80 GiB GPUs
/// each.
fn joining(count: u32) -> Shape {
    Shape {
        prefix: JOINING.into(),
        count,
        resource: "nvidia.com/gpu".into(),
        devices: 2,
        device_memory_mib: 81920,
        product: "NVIDIA-H100-80GB-HBM3".into(),
        cpu: "32".into(),
        memory: "500Gi".into(),
    }
}

/// Adds joining node `i` to the fleet as an autoscaler would: a kwok Node with loopback
/// addresses (InternalIP 127.0.1.(210+i), pods in 127.1.(210+i).0/24) offering two GPUs;
/// returns once kwok has it Ready.
async fn join(client: &Client, i: u8) -> Result<Node> {
    let (name, o) = (format!("{JOINING}-{i}"), 210 + i);
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            "labels": {
                "type": "kwok-lifecycle", "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": JOINING,
            },
        },
        "spec": { "podCIDR": format!("127.1.{o}.0/24"), "podCIDRs": [format!("127.1.{o}.0/24")] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": format!("127.0.1.{o}") },
                          { "type": "Hostname", "address": name }],
            "capacity": { "cpu": "32", "memory": "500Gi", "pods": "110", "nvidia.com/gpu": "2" },
            "allocatable": { "cpu": "32", "memory": "500Gi", "pods": "110", "nvidia.com/gpu": "2" },
        },
    }))?;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(&PostParams::default(), &node)
        .await
        .with_context(|| format!("creating joining node {name}"))?;
    wait_until(&format!("{name} Ready"), WAIT, || async {
        let n = nodes.get(&name).await?;
        let ready = n.status.as_ref().and_then(|s| {
            s.conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.status == "True")
        });
        Ok(if ready == Some(true) {
            Ok(n)
        } else {
            Err(format!("Ready {ready:?}"))
        })
    })
    .await
}

/// Removes joining node `i` and its DiffusionNode, should either be there (a run that
/// failed half-way leaves them).
async fn remove(client: &Client, i: u8) -> Result<()> {
    let name = format!("{JOINING}-{i}");
    let gone = |r: kube::Result<()>| match r {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => other,
    };
    let dp = DeleteParams::default();
    gone(
        Api::<Node>::all(client.clone())
            .delete(&name, &dp)
            .await
            .map(|_| ()),
    )?;
    gone(
        Api::<DiffusionNode>::all(client.clone())
            .delete(&name, &dp)
            .await
            .map(|_| ()),
    )?;
    Ok(())
}

fn running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// Running pods by node, and how many are not running.
async fn placement(client: &Client, ns: &str, name: &str) -> Result<(BTreeMap<String, u32>, u32)> {
    let mut on = BTreeMap::new();
    let mut waiting = 0;
    for p in engine_pods(client, ns, name).await? {
        if running(&p) {
            *on.entry(node_of(&p)).or_default() += 1;
        } else {
            waiting += 1;
        }
    }
    Ok((on, waiting))
}

/// Waits until the deployment's plan runs on `nodes` and its pods are `want`: running
/// pods by node, and pods waiting to be placed.
async fn placed(
    w: &World,
    name: &str,
    nodes: &[&str],
    want: (BTreeMap<String, u32>, u32),
) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    wait_until(
        &format!("{name} planned on {nodes:?} with pods {want:?}"),
        WAIT,
        || async {
            let plan = status_of(&api, name).await?.plan.map(|p| p.nodes);
            let got = placement(&w.client, &w.ns, name).await?;
            let planned = plan.as_ref().is_some_and(|p| p.iter().eq(nodes.iter()));
            Ok(if planned && got == want {
                Ok(())
            } else {
                Err(format!("plan on {plan:?}, pods {got:?}"))
            })
        },
    )
    .await
}

fn on(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
    pairs.iter().map(|(n, c)| (n.to_string(), *c)).collect()
}

/// Waits until `node`'s DiffusionNode is owned by it (by uid), as the operator makes it.
async fn owned(client: &Client, node: &Node) -> Result<()> {
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    let name = node.name_any();
    let owned = wait_until(&format!("{name} owned by its Node"), WAIT, || async {
        // The agent may not have made it yet.
        let Some(dn) = dns.get_opt(&name).await? else {
            return Ok(Err("no DiffusionNode yet".to_string()));
        };
        let uid = node.metadata.uid.as_ref();
        let owners = dn.owner_references();
        Ok(
            if owners
                .iter()
                .any(|o| o.kind == "Node" && Some(&o.uid) == uid)
            {
                Ok(())
            } else {
                Err(format!("owners {owners:?}"))
            },
        )
    })
    .await;
    // By the second: the Node's creationTimestamp has no finer grain.
    if let Some(made) = &node.metadata.creation_timestamp {
        let took = k8s_openapi::jiff::Timestamp::now()
            .duration_since(made.0)
            .as_secs_f64();
        eprintln!("{name}'s DiffusionNode owned by its Node {took:.1} s after the Node was made");
    }
    owned
}

/// The model ids a DiffusionNode is asked to prepare.
async fn asked_of(client: &Client, node: &str) -> Result<BTreeSet<String>> {
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    Ok(dns
        .get_opt(node)
        .await?
        .map(|d| d.spec.models.into_iter().map(|m| m.id).collect())
        .unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_takes_waiting_replicas_and_a_leaving_node_takes_its_diffusion_node(
) -> Result<()> {
    let client = layerwise_e2e::cluster::client().await?;
    for i in [0, 1] {
        remove(&client, i).await?;
    }
    let w = World::bare("joins", small()).await?;
    let setup = Setup {
        resync: RESYNC,
        // The smallest prepare set, so a node is asked only when the replicas need it.
        prepare_nodes: 1,
        ..Setup::default()
    };
    let result = match w.operator(idle(), setup).await {
        Ok(op) => {
            let result = joins_and_leaves(&w).await;
            w.teardown_with(vec![op]).await.and(result)
        }
        Err(e) => w.teardown().await.and(Err(e)),
    };
    let mut removed = Ok(());
    for i in [0, 1] {
        removed = removed.and(remove(&client, i).await);
    }
    result.and(removed)
}

async fn joins_and_leaves(w: &World) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let first = join(client, 0).await?;
    w.extra_shapes.lock().unwrap().push(joining(1));
    // Its agent reports, and the operator makes the Node own the DiffusionNode.
    owned(client, &first).await?;
    let (n0, n1) = (format!("{JOINING}-0"), format!("{JOINING}-1"));
    // One replica a GPU, on the joining nodes only.
    let spec = |replicas: i32| {
        json!({ "replicas": replicas, "dp": 1, "sp": 1, "strategy": "resident",
                "accelerator": { "nodeSelector": { "node.kubernetes.io/instance-type": JOINING } } })
    };
    // `content` fits on the one node there is; `waiting` wants three replicas where the
    // node has one GPU left for it.
    let content = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(deployment_manifest("content", spec(1)))?,
        )
        .await?;
    placed(w, "content", &[&n0], (on(&[(&n0, 1)]), 0)).await?;
    let waiting = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(deployment_manifest("waiting", spec(3)))?,
        )
        .await?;
    placed(w, "waiting", &[&n0], (on(&[(&n0, 1)]), 2)).await?;
    let (content_id, waiting_id) = (model_id(&content), model_id(&waiting));

    // A node joins, as an autoscaler adds one: its Node, then its agent's DiffusionNode.
    let t = Instant::now();
    let second = join(client, 1).await?;
    w.extra_shapes.lock().unwrap()[0] = joining(2);
    let what = format!("{n1} asked to warm {waiting_id}");
    let asking = wait_until(&what, WAIT, || async {
        let asked = asked_of(client, &n1).await?;
        Ok(if asked.contains(&waiting_id) {
            Ok(asked)
        } else {
            Err(format!("asked for {asked:?}"))
        })
    });
    let (asked, owned_second) = tokio::join!(asking, owned(client, &second));
    let asked = asked?;
    eprintln!(
        "{n1} asked to warm the model {:?} after it joined",
        t.elapsed()
    );
    placed(w, "waiting", &[&n0, &n1], (on(&[(&n0, 1), (&n1, 2)]), 0)).await?;
    eprintln!(
        "the waiting replicas placed {:?} after the node joined",
        t.elapsed()
    );
    // Nothing else moved: `content` still runs where it did, and was never asked to
    // warm on the new node (its one node holds its one replica).
    placed(w, "content", &[&n0], (on(&[(&n0, 1)]), 0)).await?;
    let asked_now = asked_of(client, &n1).await?;
    ensure!(
        !asked.contains(&content_id) && !asked_now.contains(&content_id),
        "{n1} asked to warm {content_id}, whose node holds its replica: {asked_now:?}"
    );

    // The node goes, as an autoscaler removes it: its agent stops with it, and the garbage
    // collector takes its DiffusionNode once the operator has made the Node its owner.
    owned_second?;
    w.extra_shapes.lock().unwrap()[0] = joining(1);
    // The fake agent's round under way may still report the node; a real agent stops
    // with its node.
    let round = w.agent_rounds.load(Ordering::SeqCst);
    wait_until("the fake agent done with the node", WAIT, || async {
        let now = w.agent_rounds.load(Ordering::SeqCst);
        Ok(if now >= round + 2 {
            Ok(())
        } else {
            Err(format!("{} rounds", now - round))
        })
    })
    .await?;
    let t = Instant::now();
    Api::<Node>::all(client.clone())
        .delete(&n1, &DeleteParams::default())
        .await?;
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    wait_until(&format!("{n1}'s DiffusionNode collected"), WAIT, || async {
        Ok(match dns.get_opt(&n1).await? {
            None => Ok(()),
            Some(dn) => Err(format!("still there, owners {:?}", dn.owner_references())),
        })
    })
    .await?;
    eprintln!(
        "{n1}'s DiffusionNode collected {:?} after its Node went",
        t.elapsed()
    );
    // The plan that counted it is made again without it; its replicas wait once more.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    wait_until(
        "the waiting plan made again without the node",
        WAIT,
        || async {
            let plan = status_of(&api, "waiting").await?.plan.map(|p| p.nodes);
            let d = deployments.get("waiting").await?;
            let pinned = layerwise_operator::resources::scheduling_of(&d).map(|s| s.1);
            Ok(
                if plan == Some(vec![n0.clone()]) && pinned == Some(vec![n0.clone()]) {
                    Ok(())
                } else {
                    Err(format!("plan on {plan:?}, pods pinned to {pinned:?}"))
                },
            )
        },
    )
    .await?;
    eprintln!(
        "planned again without {n1} {:?} after its Node went",
        t.elapsed()
    );
    ensure!(
        event_reasons(client, ns)
            .await?
            .iter()
            .any(|r| r == "Planned"),
        "no Planned event"
    );
    Ok(())
}

/// Engine pods of `name`: uid and image of each.
async fn engines(w: &World, name: &str) -> Result<BTreeMap<String, String>> {
    Ok(engine_pods(&w.client, &w.ns, name)
        .await?
        .into_iter()
        .map(|p| {
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.iter().find(|c| c.name == "engine"))
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            (p.uid().unwrap_or_default(), image)
        })
        .collect())
}

fn upgrade_setup(image: &str) -> Setup {
    Setup {
        resync: RESYNC,
        engine_image: image.into(),
        ..Setup::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_upgrade_restarts_no_engine_pod_until_the_deployment_opts_in() -> Result<()> {
    let w = World::bare("upgrade", small()).await?;
    let mut ops = Vec::new();
    let result = upgrade(&w, &mut ops).await;
    let torn = w.teardown_with(ops).await;
    result.and(torn)
}

async fn upgrade(w: &World, ops: &mut Vec<Operator>) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let (v1, v2) = ("layerwise:1.0.0", "layerwise:1.1.0");
    ops.push(w.operator(idle(), upgrade_setup(v1)).await?);
    let spec = json!({ "replicas": 2, "dp": 1, "sp": 1,
        "accelerator": { "nodeSelector": { "node.kubernetes.io/instance-type": "a100" } } });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("pinned", spec))?,
    )
    .await?;
    let before = wait_until("two engine pods of the first version", WAIT, || async {
        let pods = engines(w, "pinned").await?;
        let running = placement(&w.client, &w.ns, "pinned").await?;
        let image = status_of(&api, "pinned").await?.engine_image;
        Ok(
            if pods.len() == 2
                && pods.values().all(|i| i == v1)
                && running.0.values().sum::<u32>() == 2
                && image.as_deref() == Some(v1)
            {
                Ok(pods)
            } else {
                Err(format!(
                    "pods {pods:?}, running {running:?}, status.engineImage {image:?}"
                ))
            },
        )
    })
    .await?;

    // The operator is upgraded: the old one stops, the new one's default image differs.
    let mut old = ops.pop().expect("the first operator");
    old.shut_down();
    tokio::time::timeout(WAIT, &mut old.task)
        .await
        .context("the first operator did not stop")???;
    let new = w.operator(idle(), upgrade_setup(v2)).await?;
    ops.push(new);
    // Its first reconciles of the deployment (every deployment is reconciled as the
    // controller starts), and a while for any roll they would start to show.
    wait_until("the upgraded operator reconciled", WAIT, || async {
        let n = ops[0].reconciles();
        Ok(if n >= 2 {
            Ok(())
        } else {
            Err(format!("{n} reconciles"))
        })
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = engines(w, "pinned").await?;
    ensure!(
        after == before,
        "the upgrade alone replaced engine pods: {before:?} became {after:?}"
    );
    let s = status_of(&api, "pinned").await?;
    ensure!(
        s.engine_image.as_deref() == Some(v1),
        "status.engineImage {:?}",
        s.engine_image
    );

    // The deployment opts in: its pods roll onto the upgraded operator's image.
    api.patch(
        "pinned",
        &PatchParams::default(),
        &Patch::Merge(json!({ "metadata": { "annotations": {
            layerwise_operator::resources::image::FOLLOW_OPERATOR: "true" } } })),
    )
    .await?;
    let t = Instant::now();
    wait_until(
        "the engine pods rolled onto the new image",
        WAIT,
        || async {
            let pods = engines(w, "pinned").await?;
            let running = placement(&w.client, &w.ns, "pinned").await?;
            let image = status_of(&api, "pinned").await?.engine_image;
            Ok(
                if pods.len() == 2
                    && pods.values().all(|i| i == v2)
                    && pods.keys().all(|uid| !before.contains_key(uid))
                    && running.0.values().sum::<u32>() == 2
                    && image.as_deref() == Some(v2)
                {
                    Ok(())
                } else {
                    Err(format!(
                        "pods {pods:?}, running {running:?}, status.engineImage {image:?}"
                    ))
                },
            )
        },
    )
    .await?;
    eprintln!("rolled onto {v2} {:?} after the annotation", t.elapsed());
    ensure!(
        event_reasons(&w.client, &w.ns)
            .await?
            .iter()
            .any(|r| r == "EngineImageChanged"),
        "no EngineImageChanged event"
    );
    Ok(())
}
