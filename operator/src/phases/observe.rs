//! What runs: the engine pods the scheduler turns away, and the status the report records
//! of the plan, the replicas and their readiness.

use std::sync::Arc;

use crds::{DiffusionDeployment, Plan};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::events::EventType;
use kube::ResourceExt;

use crate::conditions as cond;
use crate::context::Context;
use crate::report::Report;
use crate::resources::{self};
use crate::stores;

/// The deployment's engine pods, from the operator's store of them (no request).
pub(super) fn engine_pods(dd: &DiffusionDeployment, ctx: &Context) -> Vec<Arc<Pod>> {
    ctx.stores.pods_of(
        &dd.namespace().unwrap_or_default(),
        &resources::selector_labels(dd),
    )
}

/// The engine pods the scheduler could not place, each with the scheduler's reason (`<pod>:
/// <message>`, sorted). Looked at only while fewer pods are ready than wanted. A pod the
/// scheduler turns away (or places after all) reconciles its deployment (see
/// [`crate::stores`]), so the message follows the scheduler's.
pub(super) fn unscheduled(
    dd: &DiffusionDeployment,
    ctx: &Context,
    replicas: i32,
    applied: &Deployment,
) -> Vec<String> {
    let ready = applied
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    if ready >= replicas {
        return Vec::new();
    }
    let mut unplaced: Vec<String> = engine_pods(dd, ctx)
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some(format!("{}: {}", p.name_any(), stores::unschedulable(p)?)))
        .collect();
    unplaced.sort();
    unplaced
}

/// Status from what runs. `unplaced` are the engine pods the scheduler could not place
/// ([`unscheduled`]): named in `Available` and `Progressing` (reason `Unschedulable`), with
/// a warning event when that is news. The plan fits the nodes' allocatable capacity, so
/// what keeps them out is what else runs there (or a taint, or a quota), which only the
/// scheduler's reason says.
pub(super) fn observe(
    plan: &Plan,
    replicas: i32,
    warm: &[String],
    applied: &Deployment,
    unplaced: &[String],
    r: &mut Report,
) {
    let ds = applied.status.clone().unwrap_or_default();
    let ready = ds.ready_replicas.unwrap_or(0);
    let updated = ds.updated_replicas.unwrap_or(0);
    r.status.replicas = replicas;
    r.status.ready_replicas = ready;
    // Available means a request sent now is served: a deployment scaled to zero is not.
    let available = ready >= 1;
    let unschedulable = !unplaced.is_empty();
    let mut pods_msg = format!("{ready} of {replicas} engine pods ready");
    if unschedulable {
        pods_msg = format!(
            "{pods_msg}; {} cannot be scheduled: {}",
            unplaced.len(),
            unplaced.join("; ")
        );
    }
    let reason = if available {
        "EnginesReady"
    } else if replicas == 0 {
        "ScaledToZero"
    } else if unschedulable {
        "Unschedulable"
    } else {
        "NoEngineReady"
    };
    r.set(cond::AVAILABLE, available, reason, &pods_msg);
    let rolling = updated < replicas
        || ready < replicas
        || ds.observed_generation < applied.metadata.generation;
    let reason = if unschedulable {
        "Unschedulable"
    } else if rolling {
        "RollingOut"
    } else {
        "RolloutComplete"
    };
    if unschedulable && r.was(cond::PROGRESSING) != Some((reason, pods_msg.as_str())) {
        r.event(EventType::Warning, reason, "Deploy", pods_msg.clone());
    }
    r.set(cond::PROGRESSING, rolling, reason, &pods_msg);
    let all_warm = warm.len() == plan.nodes.len();
    let warm_msg = format!(
        "model warm in the page cache of {} of {} planned nodes",
        warm.len(),
        plan.nodes.len()
    );
    let reason = if all_warm { "Warm" } else { "Warming" };
    r.set(cond::CACHE_WARM, all_warm, reason, warm_msg);
    r.set(cond::DEGRADED, false, "AsPlanned", "running as planned");
    if available && !r.was_true(cond::AVAILABLE) {
        r.event(EventType::Normal, "Available", "Deploy", pods_msg);
    }
}
