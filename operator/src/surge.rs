//! Whether a rollout may surge: a surge pod needs its own accelerators and host memory on a
//! node the plan places pods on, beside the pods that still run there. Where `spec.engine.
//! rollout` asks for a surge and no planned node has room for one more pod, the engine
//! Deployment rolls without one (`maxSurge: 0`, at least one pod taken away at a time; see
//! [`crate::resources::rollout`]) and the `RolloutSurge` condition says why, instead of a
//! rollout that waits on a pod no node can take.
//!
//! Room is judged from what the operator's stores hold: the Nodes' allocatable resources and
//! what the engine pods on them request. Pods of other workloads are not in those stores, so
//! the scheduler has the last word: a surge pod it turns away during a rollout makes the
//! rollout go on without a surge too. The strategy is chosen when no rollout is under way
//! (so the one a template change starts with is the one chosen with it) and kept while one
//! is, so the pods a surge itself starts never switch it.

use std::collections::BTreeSet;
use std::sync::Arc;

use crds::{DiffusionDeployment, Plan};
use k8s_openapi::api::apps::v1::{Deployment, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::events::EventType;
use kube::ResourceExt;
use layerwise_core::bytesize::parse_bytes;

use crate::conditions as cond;
use crate::context::Context;
use crate::report::Report;
use crate::resources::{self, rollout};

/// The condition reason where no planned node has room for a surge pod.
pub const NO_ROOM: &str = "NoRoomForSurge";

/// What one more pod of a plan needs on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    /// The accelerators' extended resource and how many; `None` where the pods claim their
    /// devices by DRA (no extended resource to count: the scheduler decides).
    pub devices: Option<(String, u64)>,
    /// Host memory the pod requests.
    pub memory: u64,
}

impl Need {
    /// What a pod of `plan` requests, for a deployment of `dd`.
    pub fn of(dd: &DiffusionDeployment, plan: &Plan) -> Need {
        Need {
            devices: plan.resource_claim_template.is_none().then(|| {
                (
                    dd.spec.accelerator.resource().to_string(),
                    u64::from(plan.devices()),
                )
            }),
            memory: plan.host_bytes_per_pod,
        }
    }

    fn describe(&self) -> String {
        let memory = format!("{:.1} GiB memory", gib(self.memory));
        match &self.devices {
            Some((resource, n)) => format!("{n} {resource} and {memory}"),
            None => memory,
        }
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// What `resource` (a quantity name such as `memory` or `nvidia.com/gpu`) comes to in a
/// request or allocatable map; 0 when absent or unreadable.
fn quantity(
    map: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >,
    resource: &str,
) -> u64 {
    map.and_then(|m| m.get(resource))
        .and_then(|q| parse_bytes(&q.0).ok())
        .unwrap_or(0)
}

/// What `pod` requests of `resource` (its containers' requests summed); nothing once it
/// has finished.
fn requested(pod: &Pod, resource: &str) -> u64 {
    let done = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if done {
        return 0;
    }
    pod.spec.as_ref().map_or(0, |s| {
        s.containers
            .iter()
            .map(|c| {
                quantity(
                    c.resources.as_ref().and_then(|r| r.requests.as_ref()),
                    resource,
                )
            })
            .sum()
    })
}

/// Whether one more pod needing `need` fits on one of `nodes` beside `pods` (those the
/// operator knows of; each counted on the node it is bound to): the node that has room,
/// or what each node lacks.
pub fn room(nodes: &[Arc<Node>], pods: &[Arc<Pod>], need: &Need) -> Result<String, Vec<String>> {
    let mut short = Vec::new();
    for node in nodes {
        let name = node.name_any();
        if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
            short.push(format!("{name}: cordoned"));
            continue;
        }
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let on_node: Vec<&Arc<Pod>> = pods
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&name))
            .collect();
        let free = |resource: &str| {
            let used: u64 = on_node.iter().map(|p| requested(p, resource)).sum();
            (
                quantity(allocatable, resource).saturating_sub(used),
                quantity(allocatable, resource),
            )
        };
        let mut lacks = Vec::new();
        if let Some((resource, n)) = &need.devices {
            let (free, all) = free(resource);
            if free < *n {
                lacks.push(format!("{free} of {all} {resource} free"));
            }
        }
        let (free_memory, all_memory) = free("memory");
        if free_memory < need.memory {
            lacks.push(format!(
                "{:.1} of {:.1} GiB memory free",
                gib(free_memory),
                gib(all_memory)
            ));
        }
        if lacks.is_empty() {
            return Ok(name);
        }
        short.push(format!("{name}: {}", lacks.join(", ")));
    }
    Err(short)
}

/// Whether the Deployment `d` is rolling: its controller has not seen its spec yet, or not
/// every pod runs its template, or old pods are still there, or some are unavailable.
pub fn rolling(d: &Deployment) -> bool {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let Some(s) = d.status.as_ref() else {
        return true;
    };
    s.observed_generation < d.metadata.generation
        || s.updated_replicas.unwrap_or(0) < want
        || s.replicas.unwrap_or(0) > want
        || s.unavailable_replicas.unwrap_or(0) > 0
}

/// The pods of a rollout's new template the scheduler turned away: only while pods of more
/// than one template (label `pod-template-hash`) are there, so a scale-up's pods that wait
/// for a node do not count.
fn turned_away(pods: &[Arc<Pod>]) -> Vec<String> {
    let live: Vec<&Arc<Pod>> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    let templates: BTreeSet<&str> = live
        .iter()
        .filter_map(|p| p.labels().get("pod-template-hash").map(String::as_str))
        .collect();
    if templates.len() < 2 {
        return Vec::new();
    }
    let mut out: Vec<String> = live
        .iter()
        .filter_map(|p| {
            Some(format!(
                "{}: {}",
                p.name_any(),
                crate::stores::unschedulable(p)?
            ))
        })
        .collect();
    out.sort();
    out
}

/// What the choice came to: the rolling update and, where it was made now, the condition.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub update: RollingUpdateDeployment,
    /// `(surges, reason, message)` of `RolloutSurge`; `None`: it stands as it was.
    pub condition: Option<(bool, &'static str, String)>,
}

/// Chooses the rolling update of a deployment whose spec asks for `asked`: `fallback` (no
/// surge) where a surge cannot be placed. `existing` is the engine Deployment now, `room`
/// the surge pod's room ([`room`]; asked only when a choice is made), `pods` this
/// deployment's engine pods.
pub fn choose(
    asked: RollingUpdateDeployment,
    fallback: RollingUpdateDeployment,
    replicas: i32,
    existing: Option<&Deployment>,
    pods: &[Arc<Pod>],
    room: impl FnOnce() -> Result<String, Vec<String>>,
    need: &Need,
) -> Choice {
    let no_surge = |why: String| {
        Choice {
        update: fallback.clone(),
        condition: Some((false, NO_ROOM, format!(
            "{why}: rollouts take a pod away before its replacement starts (maxSurge 0, maxUnavailable {})",
            fallback.max_unavailable.as_ref().map_or_else(|| "1".to_string(), show)
        ))),
    }
    };
    if !rollout::surges(&asked, replicas) {
        return Choice {
            update: asked,
            condition: Some((
                false,
                "SurgeNotAsked",
                "spec.engine.rollout.maxSurge comes to no pod: rollouts take pods away first (maxUnavailable)".into(),
            )),
        };
    }
    let under_way = existing
        .filter(|d| rolling(d))
        .and_then(|d| d.spec.as_ref()?.strategy.as_ref()?.rolling_update.clone());
    if let Some(current) = under_way {
        let away = turned_away(pods);
        if rollout::surges(&current, replicas) && !away.is_empty() {
            return no_surge(format!(
                "the scheduler turned away the rollout's surge pod ({})",
                away.join("; ")
            ));
        }
        return Choice {
            update: current,
            condition: None,
        };
    }
    match room() {
        Ok(node) => Choice {
            update: asked,
            condition: Some((
                true,
                "RoomForSurge",
                format!("{node} has room for a surge pod ({})", need.describe()),
            )),
        },
        Err(short) => no_surge(format!(
            "no planned node has room for a surge pod ({}): {}",
            need.describe(),
            short.join("; ")
        )),
    }
}

fn show(v: &k8s_openapi::apimachinery::pkg::util::intstr::IntOrString) -> String {
    match v {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
    }
}

/// Sets the rolling update of `desired` (the engine Deployment about to be applied for
/// `plan`, with `replicas` pods) as [`choose`] says, and `RolloutSurge` with it; a warning
/// event when a deployment's rollouts stop surging.
pub fn steer(
    dd: &DiffusionDeployment,
    ctx: &Context,
    plan: &Plan,
    replicas: i32,
    desired: &mut Deployment,
    existing: Option<&Deployment>,
    r: &mut Report,
) {
    let engine = &dd.spec.engine;
    let need = Need::of(dd, plan);
    let ns = dd.namespace().unwrap_or_default();
    let mine = ctx.stores.pods_of(&ns, &resources::selector_labels(dd));
    let room = || {
        let nodes: Vec<Arc<Node>> = plan
            .nodes
            .iter()
            .filter_map(|n| ctx.stores.node(n))
            .collect();
        room(&nodes, &ctx.stores.pods.state(), &need)
    };
    let choice = choose(
        rollout::spec_update(engine),
        rollout::without_surge(engine, replicas),
        replicas,
        existing,
        &mine,
        room,
        &need,
    );
    if let Some((surges, reason, message)) = choice.condition {
        if reason == NO_ROOM && r.was(cond::ROLLOUT_SURGE).map(|w| w.0) != Some(NO_ROOM) {
            r.event(EventType::Warning, NO_ROOM, "Deploy", message.clone());
        }
        r.set(cond::ROLLOUT_SURGE, surges, reason, message);
    }
    if let Some(spec) = desired.spec.as_mut() {
        spec.strategy = Some(rollout::strategy(choice.update));
    }
}

#[cfg(test)]
#[path = "surge_tests.rs"]
mod tests;
