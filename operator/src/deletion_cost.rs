//! Scale-down steers away from busy pods: each running engine pod carries
//! `controller.kubernetes.io/pod-deletion-cost` from its queue ([`deletion_cost`]: the
//! requests it has queued or running), so the ReplicaSet removing pods takes the idlest
//! first (after pods that are not yet scheduled, running or ready, which it always takes
//! first) and a long video keeps its pod.
//!
//! The loads are the builtin autoscaler's scrape where it ran; otherwise this reads them
//! itself, only while two or more pods run (with one there is nothing to choose between).
//! A pod is patched only when its cost changed, and at most once per [`MIN_INTERVAL`]
//! (the time of its last patch rides in [`COST_AT`], so a restarted operator keeps the
//! bound too) — except just before a scale-down, when every changed cost is written first,
//! so the ReplicaSet ranks the pods by what they hold now. A pod whose load cannot be read
//! keeps the cost it had.
//!
//! [`deletion_cost`]: crate::autoscaler::deletion_cost

use std::sync::Arc;
use std::time::Duration;

use crds::DiffusionDeployment;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, warn};

use crate::autoscaler::{self, PodLoad};
use crate::context::Context;
use crate::resources;

pub use crate::autoscaler::{DELETION_COST as COST, DELETION_COST_AT as COST_AT};
/// The fewest seconds between two writes of one pod's cost, but for a scale-down.
pub const MIN_INTERVAL: Duration = Duration::from_secs(10);

/// Running engine pods with what reading their load gave.
pub type Loads = Vec<(Arc<Pod>, Result<PodLoad, String>)>;

/// The pods whose cost to write now, with the cost: those whose load was read and whose
/// cost differs from the one they carry, and (unless `scaling_down`) were last written at
/// least [`MIN_INTERVAL`] before `now`.
pub fn due(loads: &Loads, now: Timestamp, scaling_down: bool) -> Vec<(String, i32)> {
    loads
        .iter()
        .filter_map(|(pod, load)| {
            let cost = autoscaler::deletion_cost(load.as_ref().ok()?);
            let annotation = |k: &str| pod.annotations().get(k).and_then(|v| v.parse::<i64>().ok());
            if annotation(COST) == Some(i64::from(cost)) {
                return None;
            }
            let recent = annotation(COST_AT).is_some_and(|at| {
                now.as_second().saturating_sub(at) < MIN_INTERVAL.as_secs() as i64
            });
            (scaling_down || !recent).then(|| (pod.name_any(), cost))
        })
        .collect()
}

/// Keeps the deletion costs of `dd`'s running engine pods current (see the module's
/// words). `replicas` is what the reconcile is about to apply, `existing` the Deployment as
/// it is; `loads` the autoscaler's read, if it made one. Failures are logged, never
/// fatal: a cost left stale only makes a scale-down choose less well.
pub async fn keep(
    dd: &DiffusionDeployment,
    ctx: &Context,
    replicas: i32,
    existing: Option<&Deployment>,
    loads: Option<Loads>,
) {
    let ns = dd.namespace().unwrap_or_default();
    let scaling_down = existing
        .and_then(|d| d.spec.as_ref()?.replicas)
        .is_some_and(|now| replicas < now);
    let loads = match loads {
        Some(l) => l,
        None => {
            let pods = ctx.stores.pods_of(&ns, &resources::selector_labels(dd));
            let running = autoscaler::running(&pods);
            if running.len() < 2 {
                return;
            }
            let read = autoscaler::read(ctx.load.as_ref(), &running).await;
            running.into_iter().zip(read).collect()
        }
    };
    let now = Timestamp::now();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let writes = due(&loads, now, scaling_down)
        .into_iter()
        .map(|(name, cost)| {
            let pods = pods.clone();
            async move {
                let patch = json!({ "metadata": { "annotations": {
                COST: cost.to_string(),
                COST_AT: now.as_second().to_string(),
            } } });
                match pods
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => debug!(pod = %name, cost, "deletion cost written"),
                    // Gone meanwhile: nothing to rank.
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => {
                        warn!(pod = %name, error = %e, "could not write the pod's deletion cost")
                    }
                }
            }
        });
    futures::future::join_all(writes).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, cost: Option<i32>, at: Option<i64>) -> Arc<Pod> {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        let mut a = std::collections::BTreeMap::new();
        if let Some(c) = cost {
            a.insert(COST.to_string(), c.to_string());
        }
        if let Some(t) = at {
            a.insert(COST_AT.to_string(), t.to_string());
        }
        p.metadata.annotations = Some(a);
        Arc::new(p)
    }

    fn busy(running: u64) -> Result<PodLoad, String> {
        Ok(PodLoad { queued: 0, running })
    }

    #[test]
    fn only_changed_costs_are_written_and_not_too_often() {
        let now = Timestamp::from_second(1_000_000).unwrap();
        let t = now.as_second();
        let loads: Loads = vec![
            // Never written: written.
            (pod("new", None, None), busy(2)),
            // Unchanged: left alone.
            (pod("same", Some(1), Some(t - 100)), busy(1)),
            // Changed, last written long ago: written.
            (pod("old", Some(0), Some(t - 60)), busy(3)),
            // Changed, written 2 s ago: waits.
            (pod("recent", Some(0), Some(t - 2)), busy(1)),
            // Unreadable: keeps its cost.
            (pod("mute", Some(5), Some(t - 60)), Err("timed out".into())),
        ];
        assert_eq!(
            due(&loads, now, false),
            [("new".to_string(), 2), ("old".to_string(), 3)]
        );
        // Before a scale-down every changed cost is written, however recent.
        assert_eq!(
            due(&loads, now, true),
            [
                ("new".to_string(), 2),
                ("old".to_string(), 3),
                ("recent".to_string(), 1)
            ]
        );
    }
}
