use std::sync::Arc;

use crds::{DiffusionDeployment, DiffusionNode};
use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::ResourceExt;

use super::triggers::*;

fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    let mut n = Node::default();
    n.metadata.name = Some(name.into());
    n.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    n
}

fn dd(ns: &str, name: &str, selector: serde_json::Value) -> Arc<DiffusionDeployment> {
    Arc::new(
        serde_json::from_value(serde_json::json!({
            "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": { "name": name, "namespace": ns },
            "spec": {
                "model": { "family": "dit", "location": { "hostPath": "/models/m" } },
                "workload": { "maxWidth": 512, "maxHeight": 512 },
                "accelerator": { "nodeSelector": selector },
            },
        }))
        .unwrap(),
    )
}

fn dn(name: &str, asked_by: &[&str]) -> DiffusionNode {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
        "metadata": { "name": name },
        "spec": { "models": asked_by.iter().map(|id| serde_json::json!({
            "id": id, "family": "dit", "location": { "hostPath": "/models/m" },
        })).collect::<Vec<_>>() },
    }))
    .unwrap()
}

fn names(refs: Vec<ObjectRef<DiffusionDeployment>>) -> Vec<String> {
    refs.iter()
        .map(|r| format!("{}/{}", r.namespace.clone().unwrap_or_default(), r.name))
        .collect()
}

#[test]
fn a_node_concerns_the_deployments_it_matches_or_was_asked_by() {
    let dds = vec![
        dd("a", "any", serde_json::json!({})),
        dd("a", "h200", serde_json::json!({ "type": "h200" })),
        dd("b", "a100", serde_json::json!({ "type": "a100" })),
        dd("b", "l40", serde_json::json!({ "type": "l40" })),
    ];
    let n = node("n1", &[("type", "a100")]);
    let asked = dn("n1", &["b/l40"]);
    assert_eq!(
        names(node_refs(&dds, Some(&asked), &n)),
        ["a/any", "b/a100", "b/l40"]
    );
}

#[test]
fn a_diffusion_node_concerns_the_ids_it_names_and_with_new_inventory_its_nodes_matches() {
    let dds = vec![
        dd("a", "any", serde_json::json!({})),
        dd("b", "a100", serde_json::json!({ "type": "a100" })),
        dd("b", "l40", serde_json::json!({ "type": "l40" })),
    ];
    let d = dn("n1", &["c/gone"]);
    assert_eq!(names(dn_refs(&dds, None, &d)), ["c/gone"]);
    let n = node("n1", &[("type", "a100")]);
    assert_eq!(
        names(dn_refs(&dds, Some(&n), &d)),
        ["a/any", "b/a100", "c/gone"]
    );
}

#[tokio::test]
async fn only_changes_that_matter_trigger_and_the_first_list_does_not() {
    use watcher::Event::*;
    let labelled = |v: &str| node("n1", &[("type", v)]);
    let mut heartbeat = labelled("a100");
    heartbeat.metadata.resource_version = Some("99".into());
    let events = vec![
        Ok(Init),
        Ok(InitApply(labelled("a100"))),
        Ok(InitApply(node("n2", &[]))),
        Ok(InitDone),
        // Same facts (a heartbeat, a new resourceVersion): nothing.
        Ok(Apply(heartbeat)),
        // A label changes: its deployments.
        Ok(Apply(labelled("h200"))),
        Ok(Delete(node("n2", &[]))),
        // A relist that finds n1 changed again: triggered at InitDone.
        Ok(Init),
        Ok(InitApply(labelled("l40"))),
        Ok(InitDone),
    ];
    let mapped = changes(
        stream::iter(events),
        "Node",
        Baseline::New,
        node_facts,
        |_| 0,
        |n: &Node, wide| vec![ObjectRef::new(&format!("{}-{wide}", n.name_any())).within("ns")],
    );
    let got = names(mapped.collect().await);
    assert_eq!(got, ["ns/n1-true", "ns/n2-true", "ns/n1-true"]);
}

fn pod(name: &str, instance: &str, scheduled: Option<(&str, &str)>) -> Pod {
    let conditions = scheduled.map(|(status, message)| {
        let reason = if status == "False" {
            "Unschedulable"
        } else {
            ""
        };
        serde_json::json!([{ "type": "PodScheduled", "status": status, "reason": reason,
                             "message": message }])
    });
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": "ns", "labels": { INSTANCE: instance } },
        "status": { "phase": "Pending", "conditions": conditions },
    }))
    .unwrap()
}

#[tokio::test]
async fn an_engine_pod_reconciles_its_deployment_only_when_the_scheduler_turns_it_away_or_places_it_after_all(
) {
    use watcher::Event::*;
    let full = Some((
        "False",
        "0/5 nodes are available: 1 Insufficient nvidia.com/gpu",
    ));
    let events = vec![
        Ok(Init),
        Ok(InitApply(pod("a-1", "a", None))),
        Ok(InitDone),
        // New pods, placed or not yet looked at: nothing (their Deployment's status
        // tells their deployment).
        Ok(Apply(pod("b-1", "b", None))),
        Ok(Apply(pod("b-1", "b", Some(("True", ""))))),
        Ok(Apply(pod("c-1", "c", None))),
        // Turned away: its deployment; again with the same reason: nothing.
        Ok(Apply(pod("c-1", "c", full))),
        Ok(Apply(pod("c-1", "c", full))),
        // Another reason: again.
        Ok(Apply(pod("c-1", "c", Some(("False", "0/5 nodes: taint"))))),
        // Placed after all: its deployment.
        Ok(Apply(pod("c-1", "c", Some(("True", ""))))),
        // A placed pod goes: nothing; one that goes while turned away: its deployment.
        Ok(Delete(pod("b-1", "b", Some(("True", ""))))),
        Ok(Apply(pod("d-1", "d", full))),
        Ok(Delete(pod("d-1", "d", full))),
        // Turned away when first seen: its deployment.
        Ok(Apply(pod("e-1", "e", full))),
    ];
    let mapped = changes(
        stream::iter(events),
        "Pod",
        Baseline::Facts(UNSEEN_POD),
        unscheduled_facts,
        |_| 0,
        |p: &Pod, _| pod_refs(p),
    );
    let got = names(mapped.collect().await);
    assert_eq!(got, ["ns/c", "ns/c", "ns/c", "ns/d", "ns/d", "ns/e"]);
}

#[test]
fn a_trimmed_pod_keeps_what_the_scrape_and_the_unschedulable_check_read() {
    let mut p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "e-1", "namespace": "ns", "labels": { INSTANCE: "e" },
                      "annotations": { "x": "y" }, "managedFields": [{ "manager": "k" }],
                      "deletionTimestamp": "2026-01-01T00:00:00Z" },
        "spec": { "containers": [{ "name": "engine", "image": "layerwise-engine:0.1.0" }] },
        "status": { "phase": "Running", "podIP": "127.1.0.5", "conditions": [
            { "type": "Ready", "status": "True" },
            { "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
              "message": "0/5 nodes are available" }],
            "containerStatuses": [{ "name": "engine", "image": "i", "imageID": "",
                "ready": true, "restartCount": 0 }] },
    }))
    .unwrap();
    trim_pod(&mut p);
    assert!(p.spec.is_none() && p.annotations().is_empty() && p.managed_fields().is_empty());
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(pod_refs(&p), [ObjectRef::new("e").within("ns")]);
    let st = p.status.as_ref().unwrap();
    assert_eq!(st.phase.as_deref(), Some("Running"));
    assert_eq!(st.pod_ip.as_deref(), Some("127.1.0.5"));
    assert!(st.container_statuses.is_none());
    assert_eq!(st.conditions.as_ref().unwrap().len(), 1);
    assert_eq!(unschedulable(&p), Some("0/5 nodes are available"));
}

#[test]
fn a_bound_pod_keeps_its_node_requests_and_deletion_cost() {
    let mut p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "e-2", "namespace": "ns", "annotations": {
            "x": "y", "controller.kubernetes.io/pod-deletion-cost": "3",
            "layerwise.dev/deletion-cost-at": "1700000000" } },
        "spec": { "nodeName": "a100-0", "containers": [{ "name": "engine", "image": "i",
            "args": ["serve"], "resources": { "requests": { "nvidia.com/gpu": "2" },
                                              "limits": { "nvidia.com/gpu": "2" } } }] },
    }))
    .unwrap();
    trim_pod(&mut p);
    let keys: Vec<&String> = p.annotations().keys().collect();
    assert_eq!(
        keys,
        [
            "controller.kubernetes.io/pod-deletion-cost",
            "layerwise.dev/deletion-cost-at"
        ]
    );
    let spec = p.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some("a100-0"));
    let c = &spec.containers[0];
    assert!(c.image.is_none() && c.args.is_none());
    let r = c.resources.as_ref().unwrap();
    assert_eq!(r.requests.as_ref().unwrap()["nvidia.com/gpu"].0, "2");
    assert!(r.limits.is_none());
}

#[test]
fn trimming_keeps_what_placement_reads() {
    let mut n: Node = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "n", "labels": { "a": "b" }, "annotations": { "x": "y" },
                      "managedFields": [{ "manager": "kubelet" }] },
        "spec": { "podCIDR": "127.1.1.0/24", "unschedulable": true },
        "status": { "allocatable": { "nvidia.com/gpu": "8" }, "capacity": { "cpu": "1" },
                    "images": [{ "names": ["x"] }], "conditions": [{ "type": "Ready", "status": "True" }] },
    }))
    .unwrap();
    let facts = node_facts(&n);
    trim_node(&mut n);
    assert_eq!(node_facts(&n), facts, "trimming changes no fact");
    assert!(n.annotations().is_empty() && n.managed_fields().is_empty());
    let st = n.status.as_ref().unwrap();
    assert!(st.images.is_none() && st.conditions.is_none() && st.capacity.is_none());
    assert_eq!(st.allocatable.as_ref().unwrap()["nvidia.com/gpu"].0, "8");
    assert_eq!(n.spec.as_ref().unwrap().unschedulable, Some(true));
    assert!(n.spec.as_ref().unwrap().pod_cidr.is_none());
}
