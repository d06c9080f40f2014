//! The replicas phase: the spec's count, or the builtin autoscaler's from the load the engine
//! pods report when scraped.

use std::time::Duration;

use crds::{AutoscalingMode, DiffusionDeployment};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tracing::warn;

use crate::autoscaler::{self, Bounds, Observed};
use crate::conditions as cond;
use crate::context::Context;
use crate::deletion_cost::Loads;
use crate::error::{kube, Result};
use crate::report::Report;
use crate::requests::model_id;

use super::observe::engine_pods;

/// The replicas wanted: the spec's, or the builtin autoscaler's from the engine pods' load.
/// Returns them with the Deployment as it is now and, where the autoscaler read them, the
/// running pods' loads.
pub(super) async fn replicas(
    dd: &DiffusionDeployment,
    ctx: &Context,
    r: &mut Report,
) -> Result<(i32, Option<Deployment>, Option<Loads>)> {
    let mut loads = None;
    let spec = &dd.spec;
    let existing = engine_deployment(dd, ctx).await?;
    let running = existing.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let builtin = spec
        .autoscaling
        .as_ref()
        .filter(|a| a.mode == AutoscalingMode::Builtin);
    if builtin.is_none() {
        r.clear(cond::SCRAPE_FAILED);
    }
    let replicas = match (&spec.autoscaling, builtin) {
        (None, _) => spec.replicas.unwrap_or(1),
        (Some(a), None) => spec
            .replicas
            .unwrap_or(a.min_replicas)
            .clamp(a.min_replicas, a.max_replicas),
        (_, Some(a)) => {
            let bounds = Bounds {
                min: a.min_replicas,
                max: a.max_replicas,
                target: a.target_queue_per_replica,
                delay: Duration::from_secs(u64::from(a.scale_down_delay_seconds)),
            };
            let (observed, read) = scrape(dd, ctx, r).await;
            loads = Some(read);
            let current = running.unwrap_or_else(|| spec.replicas.unwrap_or(a.min_replicas));
            let step = autoscaler::step(
                current,
                observed,
                &bounds,
                r.old.scale_down_pending_since.as_ref().map(|t| t.0),
                r.now,
            );
            // Status keeps whole seconds: round up so the stored wait never shortens the delay.
            r.status.scale_down_pending_since = step.pending_since.map(|t| Time(ceil_second(t)));
            if running.is_some() && step.replicas != current {
                let note = format!(
                    "scaled from {current} to {} replicas: {} requests queued or running, target {} per replica",
                    step.replicas, observed.load, a.target_queue_per_replica
                );
                r.event(EventType::Normal, "Scaled", "Scale", note);
            }
            step.replicas
        }
    };
    if running.is_some() && running != Some(replicas) {
        r.status.last_scale_time = Some(Time(r.now));
        if builtin.is_none() {
            let note = format!(
                "scaled from {} to {replicas} replicas (spec)",
                running.unwrap_or_default()
            );
            r.event(EventType::Normal, "Scaled", "Scale", note);
        }
    }
    Ok((replicas, existing, loads))
}

/// The deployment's engine Deployment, from the store; from the API only when the store
/// has not yet seen this process's last apply of it, so a reconcile never takes an older
/// template for the one in force.
async fn engine_deployment(dd: &DiffusionDeployment, ctx: &Context) -> Result<Option<Deployment>> {
    let (ns, name) = (dd.namespace().unwrap_or_default(), dd.name_any());
    let stored = ctx.stores.engine(&ns, &name);
    let wrote = ctx
        .applied
        .version(
            &dd.uid().unwrap_or_default(),
            <Deployment as k8s_openapi::Resource>::KIND,
        )
        .and_then(|v| v.parse::<i64>().ok());
    let behind = match (wrote, &stored) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(w), Some(d)) => d.metadata.generation.unwrap_or(0) < w,
    };
    if !behind {
        return Ok(stored.map(|d| (*d).clone()));
    }
    Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&name)
        .await
        .map_err(kube(format!("reading Deployment of {}", model_id(dd))))
}

/// Reads the load of the deployment's running engine pods. A pod that does not answer is
/// not counted as idle: the result says the read is incomplete (so replicas hold), the
/// `ScrapeFailed` condition names the pods, the metric counts them and the log says why.
async fn scrape(dd: &DiffusionDeployment, ctx: &Context, r: &mut Report) -> (Observed, Loads) {
    let id = model_id(dd);
    let running = autoscaler::running(&engine_pods(dd, ctx));
    let loads = autoscaler::read(ctx.load.as_ref(), &running).await;
    let mut load = 0;
    let mut failed = Vec::new();
    for (pod, result) in running.iter().zip(&loads) {
        match result {
            Ok(l) => load += l.total(),
            Err(why) => failed.push(format!("{}: {why}", pod.name_any())),
        }
    }
    r.status.queue_depth = load;
    if failed.is_empty() {
        let msg = format!("read the load of all {} running engine pods", running.len());
        r.set(cond::SCRAPE_FAILED, false, "AllPodsReported", msg);
    } else {
        failed.sort();
        warn!(deployment = %id, pods = ?failed, "engine pods' load unreadable: replicas held");
        ctx.telemetry
            .metrics
            .scrape_failed(&id, failed.len() as u64);
        let msg = format!(
            "could not read the load of {} of {} running engine pods, so replicas are not reduced: {}",
            failed.len(),
            running.len(),
            failed.join("; ")
        );
        if r.was(cond::SCRAPE_FAILED) != Some(("ScrapeFailed", msg.as_str())) {
            r.event(EventType::Warning, "ScrapeFailed", "Scale", msg.clone());
        }
        r.set(cond::SCRAPE_FAILED, true, "ScrapeFailed", msg);
    }
    let observed = Observed {
        load,
        complete: failed.is_empty(),
    };
    (observed, running.into_iter().zip(loads).collect())
}

/// `t` rounded up to a whole second (what a `Time` in status keeps).
fn ceil_second(t: Timestamp) -> Timestamp {
    if t.subsec_nanosecond() == 0 {
        t
    } else {
        Timestamp::from_second(t.as_second() + 1).unwrap_or(t)
    }
}
