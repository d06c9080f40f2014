//! Rollouts and scale-downs against the real control plane (tests/cluster), each on fake
//! GPU nodes of its own so that what is free on them is the test's: a one-replica plan
//! change surges where a node has room for a second pod, and keeps a ready pod throughout;
//! where none has, the rollout goes on without a surge and `RolloutSurge` says why; and a
//! scale-down from 3 to 1 removes the two idle pods, keeping the busy one (its deletion
//! cost, from its queue).
//!
//! Also what the apiserver refuses of `spec.engine.rollout` (its CEL rules).

mod world;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use crds::{DiffusionDeployment, DiffusionNode};
use futures::future::BoxFuture;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use layerwise_e2e::cluster::wait_until;
use layerwise_e2e::shapes::Shape;
use layerwise_operator::autoscaler::{LoadSource, PodLoad};
use serde_json::json;
use world::{condition, deployment_manifest, profile, status_of, World, WAIT};

/// ~25 GiB: resident on one of the fake A100s.
fn small() -> crds::Profile {
    profile(57, 400 << 20)
}

/// Each pod's load, by pod name; idle unless set.
#[derive(Default)]
struct ByPod(Mutex<HashMap<String, PodLoad>>);

impl LoadSource for ByPod {
    fn load<'a>(&'a self, pod: &'a Pod) -> BoxFuture<'a, Result<PodLoad, String>> {
        let load = self
            .0
            .lock()
            .expect("not poisoned")
            .get(&pod.name_any())
            .copied()
            .unwrap_or_default();
        Box::pin(async move { Ok(load) })
    }
}

/// A fake node of the test's own with `gpus` 80 GiB A100s, reported by the fake agent;
/// its name.
async fn own_node(w: &World, tag: &str, octet: u8, gpus: u32) -> Result<String> {
    let prefix = format!("{tag}-{}", &w.ns[w.ns.len() - 6..]);
    let name = format!("{prefix}-0");
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            "labels": { "type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux" },
        },
        "spec": { "podCIDR": format!("127.1.{octet}.0/24"), "podCIDRs": [format!("127.1.{octet}.0/24")] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": format!("127.0.1.{octet}") }],
            "capacity": { "cpu": "96", "memory": "1000Gi", "pods": "110", "nvidia.com/gpu": gpus.to_string() },
            "allocatable": { "cpu": "96", "memory": "1000Gi", "pods": "110", "nvidia.com/gpu": gpus.to_string() },
        },
    }))?;
    Api::<Node>::all(w.client.clone())
        .create(&PostParams::default(), &node)
        .await
        .with_context(|| format!("creating fake node {name}"))?;
    w.extra_shapes.lock().expect("not poisoned").push(Shape {
        prefix,
        count: 1,
        resource: "nvidia.com/gpu".into(),
        devices: gpus,
        device_memory_mib: 81920,
        product: "NVIDIA-A100-SXM4-80GB".into(),
        cpu: "96".into(),
        memory: "1000Gi".into(),
    });
    Ok(name)
}

/// Removes the node [`own_node`] made and its DiffusionNode.
async fn remove_node(client: &Client, name: &str) -> Result<()> {
    for r in [
        Api::<Node>::all(client.clone())
            .delete(name, &DeleteParams::default())
            .await
            .map(|_| ()),
        Api::<DiffusionNode>::all(client.clone())
            .delete(name, &DeleteParams::default())
            .await
            .map(|_| ()),
    ] {
        match r {
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            other => other?,
        }
    }
    Ok(())
}

/// Runs `test` in a world with a controller reading `load`, on a node of `gpus` GPUs of
/// its own, and removes all of it after.
async fn on_own_node<F>(
    name: &str,
    octet: u8,
    gpus: u32,
    load: Arc<dyn LoadSource>,
    test: F,
) -> Result<()>
where
    F: for<'a> FnOnce(&'a World, &'a str) -> BoxFuture<'a, Result<()>>,
{
    let w = World::new(name, load, small()).await?;
    let node = match own_node(&w, name, octet, gpus).await {
        Ok(n) => n,
        Err(e) => {
            let _ = w.teardown().await;
            return Err(e);
        }
    };
    let result = test(&w, &node).await;
    let client = w.client.clone();
    let torn = w.teardown().await;
    let removed = remove_node(&client, &node).await;
    result.and(torn).and(removed)
}

/// A one-replica deployment on `node`, resident, one GPU a pod.
fn one_gpu_pods(name: &str, node: &str, replicas: i32) -> Result<DiffusionDeployment> {
    Ok(serde_json::from_value(deployment_manifest(
        name,
        json!({
            "replicas": replicas, "dp": 1, "sp": 1, "strategy": "resident",
            "accelerator": { "nodeSelector": { "kubernetes.io/hostname": node } },
        }),
    ))?)
}

/// The deployment's pods now: (uid, ready, being deleted).
async fn pods_of(client: &Client, ns: &str, name: &str) -> Result<Vec<(String, bool, bool)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/instance={name}"));
    Ok(pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .map(|p| {
            let ready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            (
                p.uid().unwrap_or_default(),
                ready,
                p.metadata.deletion_timestamp.is_some(),
            )
        })
        .collect())
}

/// Ready pods not being deleted.
fn serving(pods: &[(String, bool, bool)]) -> Vec<String> {
    pods.iter()
        .filter(|(_, ready, gone)| *ready && !*gone)
        .map(|(uid, ..)| uid.clone())
        .collect()
}

/// Waits until exactly one pod of `name` serves, and none other is left; its uid.
async fn one_serving(client: &Client, ns: &str, name: &str, not: Option<&str>) -> Result<String> {
    wait_until("one pod serving, no other left", WAIT, || async {
        let pods = pods_of(client, ns, name).await?;
        let up = serving(&pods);
        Ok(match up.as_slice() {
            [uid] if pods.len() == 1 && Some(uid.as_str()) != not => Ok(uid.clone()),
            _ => Err(format!("{pods:?}")),
        })
    })
    .await
}

/// The rolling update the engine Deployment carries: (maxSurge, maxUnavailable).
async fn rolling_update(client: &Client, ns: &str, name: &str) -> Result<(String, String)> {
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(name)
        .await?;
    let u = d
        .spec
        .and_then(|s| s.strategy?.rolling_update)
        .context("no rolling update")?;
    let show = |v: Option<k8s_openapi::apimachinery::pkg::util::intstr::IntOrString>| {
        serde_json::to_value(v)
            .map(|v| v.to_string())
            .unwrap_or_default()
    };
    Ok((show(u.max_surge), show(u.max_unavailable)))
}

/// Changes the plan: resident to offload, a new pod template.
async fn change_plan(api: &Api<DiffusionDeployment>, name: &str) -> Result<()> {
    let patch = json!({ "spec": { "strategy": "offload" } });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Waits for `RolloutSurge` with `status` and `reason`; its message.
async fn surge_condition(
    api: &Api<DiffusionDeployment>,
    name: &str,
    status: &str,
    reason: &str,
) -> Result<String> {
    wait_until(&format!("RolloutSurge {status} {reason}"), WAIT, || async {
        let s = status_of(api, name).await?;
        Ok(match condition(&s, "RolloutSurge") {
            Some((st, r, msg)) if st == status && r == reason => Ok(msg),
            other => Err(format!("{other:?}")),
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_replica_plan_change_with_room_surges_and_keeps_a_pod_ready() -> Result<()> {
    on_own_node("surge", 210, 2, Arc::new(ByPod::default()), |w, node| {
        Box::pin(surge(w, node))
    })
    .await
}

async fn surge(w: &World, node: &str) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &one_gpu_pods("one", node, 1)?)
        .await?;
    let first = one_serving(client, ns, "one", None).await?;
    // One GPU of two taken: room for the surge pod.
    let msg = surge_condition(&api, "one", "True", "RoomForSurge").await?;
    ensure!(msg.contains(node), "{msg}");
    ensure!(rolling_update(client, ns, "one").await? == ("1".into(), "0".into()));

    // Sample the ready pods every 100 ms while the plan changes and the pod is replaced.
    let stop = Arc::new(AtomicBool::new(false));
    let fewest = Arc::new(AtomicU32::new(u32::MAX));
    let samples = Arc::new(AtomicU32::new(0));
    let sampler = {
        let (client, ns) = (client.clone(), ns.to_string());
        let (stop, fewest, samples) = (stop.clone(), fewest.clone(), samples.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let Ok(pods) = pods_of(&client, &ns, "one").await {
                    fewest.fetch_min(serving(&pods).len() as u32, Ordering::SeqCst);
                    samples.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let t = Instant::now();
    change_plan(&api, "one").await?;
    let replaced = one_serving(client, ns, "one", Some(&first)).await;
    stop.store(true, Ordering::SeqCst);
    sampler.await?;
    replaced?;
    let (fewest, samples) = (
        fewest.load(Ordering::SeqCst),
        samples.load(Ordering::SeqCst),
    );
    eprintln!(
        "rolled in {:?}: {samples} samples, fewest ready pods {fewest}",
        t.elapsed()
    );
    ensure!(samples >= 5, "only {samples} samples");
    ensure!(
        fewest >= 1,
        "no pod was ready at some sample ({samples} samples)"
    );
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get("one")
        .await?;
    let args = d.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap()
        .join(" ");
    ensure!(args.contains("--strategy offload"), "{args}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_room_for_a_surge_the_rollout_takes_a_pod_away_first_and_says_so() -> Result<()> {
    on_own_node("nosurge", 211, 1, Arc::new(ByPod::default()), |w, node| {
        Box::pin(no_room(w, node))
    })
    .await
}

async fn no_room(w: &World, node: &str) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &one_gpu_pods("full", node, 1)?)
        .await?;
    let first = one_serving(client, ns, "full", None).await?;
    // The node's one GPU runs the pod: no room for a second.
    let msg = surge_condition(&api, "full", "False", "NoRoomForSurge").await?;
    ensure!(
        msg.contains(&format!("{node}: 0 of 1 nvidia.com/gpu free"))
            && msg.contains("maxSurge 0, maxUnavailable 1"),
        "{msg}"
    );
    ensure!(rolling_update(client, ns, "full").await? == ("0".into(), "1".into()));
    // The plan changes: the rollout finishes instead of waiting on a pod no node takes.
    change_plan(&api, "full").await?;
    one_serving(client, ns, "full", Some(&first)).await?;
    let reasons = world::event_reasons(client, ns).await?;
    ensure!(reasons.iter().any(|r| r == "NoRoomForSurge"), "{reasons:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_removes_the_idle_pods_and_keeps_the_busy_one() -> Result<()> {
    let load = Arc::new(ByPod::default());
    let source: Arc<dyn LoadSource> = load.clone();
    on_own_node("drain", 212, 4, source, move |w, node| {
        Box::pin(scale_down(w, node, load))
    })
    .await
}

async fn scale_down(w: &World, node: &str, load: Arc<ByPod>) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &one_gpu_pods("three", node, 3)?)
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels("app.kubernetes.io/instance=three");
    let running = wait_until("three pods ready", WAIT, || async {
        let all = pods.list(&lp).await?.items;
        let up = serving(&pods_of(client, ns, "three").await?);
        Ok(if up.len() == 3 && all.len() == 3 {
            Ok(all)
        } else {
            Err(format!("{} ready of {}", up.len(), all.len()))
        })
    })
    .await?;
    // The busy pod: the newest, which a ReplicaSet would otherwise remove first.
    let busy = running
        .iter()
        .max_by_key(|p| {
            (
                p.metadata.creation_timestamp.clone().map(|t| t.0),
                p.name_any(),
            )
        })
        .unwrap();
    let (busy_name, busy_uid) = (busy.name_any(), busy.uid().unwrap());
    load.0.lock().unwrap().insert(
        busy_name.clone(),
        PodLoad {
            queued: 2,
            running: 1,
        },
    );
    // Its cost follows its queue; the idle ones cost 0.
    wait_until("the deletion costs", WAIT, || async {
        let costs: Vec<(String, Option<String>)> = pods
            .list(&lp)
            .await?
            .items
            .iter()
            .map(|p| {
                let cost = p
                    .annotations()
                    .get("controller.kubernetes.io/pod-deletion-cost")
                    .cloned();
                (p.name_any(), cost)
            })
            .collect();
        let want = |name: &str| if name == busy_name { "3" } else { "0" };
        Ok(
            if costs.iter().all(|(n, c)| c.as_deref() == Some(want(n))) {
                Ok(())
            } else {
                Err(format!("{costs:?}"))
            },
        )
    })
    .await?;
    api.patch(
        "three",
        &PatchParams::default(),
        &Patch::Merge(&json!({ "spec": { "replicas": 1 } })),
    )
    .await?;
    let kept = one_serving(client, ns, "three", None).await?;
    ensure!(
        kept == busy_uid,
        "kept pod {kept}, not the busy {busy_name} ({busy_uid})"
    );
    Ok(())
}

#[tokio::test]
async fn rollout_bounds_are_refused_by_the_schema() -> Result<()> {
    let w = World::bare("rolloutcel", small()).await?;
    let result = refused(&w).await;
    let torn = w.teardown().await;
    result.and(torn)
}

async fn refused(w: &World) -> Result<()> {
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    for (bad, says) in [
        (
            json!({ "maxSurge": 0 }),
            "maxSurge and maxUnavailable must not both be 0",
        ),
        (
            json!({ "maxSurge": "0%", "maxUnavailable": 0 }),
            "maxSurge and maxUnavailable must not both be 0",
        ),
        (
            json!({ "maxSurge": -1 }),
            "rollout.maxSurge must be a number of at least 0",
        ),
        (
            json!({ "maxSurge": "one" }),
            "rollout.maxSurge must be a number of at least 0",
        ),
        (
            json!({ "maxUnavailable": "150%" }),
            "rollout.maxUnavailable must be a number of at least 0 or a percentage from 0% to 100%",
        ),
        (
            json!({ "maxUnavailable": -2 }),
            "rollout.maxUnavailable must be",
        ),
    ] {
        let dd: DiffusionDeployment = serde_json::from_value(deployment_manifest(
            "refused",
            json!({ "engine": { "rollout": bad.clone() } }),
        ))?;
        let err = api
            .create(&PostParams::default(), &dd)
            .await
            .err()
            .with_context(|| format!("{bad} was accepted"))?;
        ensure!(err.to_string().contains(says), "{bad}: {err}");
    }
    for good in [
        json!({ "maxSurge": 0, "maxUnavailable": 1 }),
        json!({ "maxSurge": "25%", "maxUnavailable": "100%" }),
        json!({ "maxSurge": 2 }),
    ] {
        let dd: DiffusionDeployment = serde_json::from_value(deployment_manifest(
            "accepted",
            json!({ "engine": { "rollout": good.clone() } }),
        ))?;
        api.create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &dd,
        )
        .await
        .with_context(|| format!("{good} was refused"))?;
    }
    Ok(())
}
