use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStatus};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::json;

use super::*;

const GPU: &str = "nvidia.com/gpu";
const GIB: u64 = 1 << 30;

fn node(name: &str, gpus: u32, memory_gib: u64) -> Arc<Node> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": name },
            "status": { "allocatable": { GPU: gpus.to_string(), "memory": format!("{memory_gib}Gi") } },
        }))
        .unwrap(),
    )
}

fn pod(name: &str, node: Option<&str>, gpus: u32, memory_gib: u64) -> Arc<Pod> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": name, "labels": { "pod-template-hash": "a" } },
            "spec": { "nodeName": node, "containers": [{ "name": "engine", "resources": { "requests": {
                GPU: gpus.to_string(), "memory": format!("{memory_gib}Gi") } } }] },
            "status": { "phase": "Running" },
        }))
        .unwrap(),
    )
}

fn need(gpus: u64, memory_gib: u64) -> Need {
    Need {
        devices: Some((GPU.into(), gpus)),
        memory: memory_gib * GIB,
    }
}

#[test]
fn a_surge_pod_needs_free_devices_and_memory_on_one_node() {
    let nodes = [node("a", 2, 100), node("b", 1, 100)];
    // a: one of two GPUs taken; b: its only GPU taken.
    let pods = [pod("p0", Some("a"), 1, 10), pod("p1", Some("b"), 1, 10)];
    assert_eq!(room(&nodes, &pods, &need(1, 10)), Ok("a".into()));
    // Two GPUs a pod: neither has them.
    let short = room(&nodes, &pods, &need(2, 10)).unwrap_err();
    assert_eq!(
        short,
        [
            format!("a: 1 of 2 {GPU} free"),
            format!("b: 0 of 1 {GPU} free")
        ]
    );
    // Memory counts too; a pod not yet bound to a node holds nothing.
    let pods = [pod("p0", Some("a"), 1, 95), pod("p2", None, 1, 95)];
    let short = room(&nodes[..1], &pods, &need(1, 10)).unwrap_err();
    assert_eq!(short, ["a: 5.0 of 100.0 GiB memory free"]);
    // A cordoned node has no room whatever it holds.
    let mut cordoned = (*node("c", 8, 100)).clone();
    cordoned.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        unschedulable: Some(true),
        ..Default::default()
    });
    let short = room(&[Arc::new(cordoned)], &[], &need(1, 1)).unwrap_err();
    assert_eq!(short, ["c: cordoned"]);
}

fn update(surge: i32, unavailable: i32) -> RollingUpdateDeployment {
    RollingUpdateDeployment {
        max_surge: Some(IntOrString::Int(surge)),
        max_unavailable: Some(IntOrString::Int(unavailable)),
    }
}

fn deployment(current: RollingUpdateDeployment, rolling: bool) -> Deployment {
    Deployment {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            generation: Some(2),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            strategy: Some(rollout::strategy(current)),
            ..Default::default()
        }),
        status: Some(DeploymentStatus {
            observed_generation: Some(2),
            replicas: Some(if rolling { 2 } else { 1 }),
            updated_replicas: Some(1),
            ..Default::default()
        }),
    }
}

#[test]
fn with_room_the_rollout_surges_and_without_it_takes_a_pod_away_first() {
    let n = need(1, 10);
    let fits = choose(
        update(1, 0),
        update(0, 1),
        1,
        None,
        &[],
        || Ok("a".into()),
        &n,
    );
    assert_eq!(fits.update, update(1, 0));
    let (ok, reason, msg) = fits.condition.unwrap();
    assert!(
        ok && reason == "RoomForSurge" && msg.contains("a has room"),
        "{msg}"
    );

    let at_rest = deployment(update(1, 0), false);
    let full = || Err(vec![format!("b: 0 of 1 {GPU} free")]);
    let c = choose(update(1, 0), update(0, 1), 1, Some(&at_rest), &[], full, &n);
    assert_eq!(c.update, update(0, 1));
    let (ok, reason, msg) = c.condition.unwrap();
    assert!(!ok && reason == NO_ROOM, "{reason}");
    assert!(
        msg.contains("1 nvidia.com/gpu and 10.0 GiB memory")
            && msg.contains("b: 0 of 1 nvidia.com/gpu free")
            && msg.contains("maxSurge 0, maxUnavailable 1"),
        "{msg}"
    );
}

#[test]
fn a_rollout_under_way_keeps_its_strategy_until_its_surge_pod_is_turned_away() {
    let n = need(1, 10);
    let rolling = deployment(update(1, 0), true);
    let never = || -> Result<String, Vec<String>> { panic!("room is not judged mid-rollout") };
    // The surge pod took the room: the rollout keeps surging, the condition stands.
    let c = choose(
        update(1, 0),
        update(0, 1),
        1,
        Some(&rolling),
        &[],
        never,
        &n,
    );
    assert_eq!((c.update, c.condition), (update(1, 0), None));
    // The scheduler turned the new template's pod away: no surge from now on.
    let old = pod("old", Some("b"), 1, 10);
    let mut new = (*pod("new", None, 1, 10)).clone();
    new.metadata.labels = Some(BTreeMap::from([("pod-template-hash".into(), "b".into())]));
    new.status = Some(
        serde_json::from_value(json!({ "phase": "Pending", "conditions": [
        { "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
          "message": "0/5 nodes are available: 1 Insufficient nvidia.com/gpu" }] }))
        .unwrap(),
    );
    let pods = [old, Arc::new(new)];
    let c = choose(
        update(1, 0),
        update(0, 1),
        1,
        Some(&rolling),
        &pods,
        never,
        &n,
    );
    assert_eq!(c.update, update(0, 1));
    let (_, reason, msg) = c.condition.unwrap();
    assert_eq!(reason, NO_ROOM);
    assert!(msg.contains("new: 0/5 nodes are available"), "{msg}");
    // A scale-up's waiting pod (one template) is not a surge turned away.
    let mut one = (*pods[1]).clone();
    one.metadata.labels = Some(BTreeMap::from([("pod-template-hash".into(), "a".into())]));
    let c = choose(
        update(1, 0),
        update(0, 1),
        1,
        Some(&rolling),
        &[pods[0].clone(), Arc::new(one)],
        never,
        &n,
    );
    assert_eq!(c.update, update(1, 0));
}

#[test]
fn a_spec_without_surge_is_rolled_as_written() {
    let c = choose(
        update(0, 1),
        update(0, 1),
        3,
        None,
        &[],
        || Ok("a".into()),
        &need(1, 1),
    );
    assert_eq!(c.update, update(0, 1));
    assert_eq!(c.condition.unwrap().1, "SurgeNotAsked");
}
