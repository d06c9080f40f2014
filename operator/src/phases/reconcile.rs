//! The reconcile of a deployment that is not being deleted: its phases in order, and one
//! place that records how it ended (committed, stopped, or abandoned on an API error).

use std::ops::ControlFlow;

use crds::DiffusionDeployment;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use tracing::debug;

use crate::conditions as cond;
use crate::context::Context;
use crate::error::Result;
use crate::inference_pool;
use crate::report::Report;

use super::deploy::deploy;
use super::observe::{observe, unscheduled};
use super::phase::Phase;
use super::plan::{plan, profiles};
use super::prepare::{claim_devices, devices, locate, prepare};
use super::scale::replicas;
use super::stage::staged;

/// The value of a phase, or the reconcile stops with its reason.
macro_rules! proceed {
    ($phase:expr) => {
        match $phase {
            ControlFlow::Continue(v) => v,
            ControlFlow::Break(stop) => return Ok(ControlFlow::Break(stop)),
        }
    };
}

/// Reconciles a deployment that is not being deleted.
pub async fn apply(dd: &DiffusionDeployment, ctx: &Context) -> Result<Action> {
    let mut report = Report::new(dd, Timestamp::now());
    match phases(dd, ctx, &mut report).await {
        Ok(ControlFlow::Continue(())) => {
            report.commit(ctx, dd).await?;
            Ok(Action::requeue(ctx.settings.resync))
        }
        Ok(ControlFlow::Break(stop)) => {
            debug!(reason = stop.reason(), "reconcile stops");
            ctx.telemetry.metrics.stopped(stop.reason());
            report.stop(&stop);
            report.commit(ctx, dd).await?;
            Ok(stop
                .retry(ctx.settings.resync)
                .map_or_else(Action::await_change, Action::requeue))
        }
        Err(err) => {
            report.abandon(ctx, dd).await;
            Err(err)
        }
    }
}

async fn phases(dd: &DiffusionDeployment, ctx: &Context, r: &mut Report) -> Result<Phase<()>> {
    let located = proceed!(locate(dd, ctx).await?);
    let devices = proceed!(devices(dd, ctx).await?);
    let asked = proceed!(prepare(dd, ctx, &located, devices.as_ref(), r).await?);
    // A staged model: the later phases see the published copy as a folder on the nodes.
    let view = proceed!(staged(dd, &asked, r));
    let dd = view.as_ref().unwrap_or(dd);
    let profiled = proceed!(profiles(dd, &asked, r));
    let (plan, warm, template) = proceed!(plan(dd, ctx, &profiled, devices.as_ref(), r));
    if r.old.plan.as_ref() != Some(&plan) || !r.was_true(cond::PLANNED) {
        r.record(ctx, dd).await?;
    }
    if let Some(template) = &template {
        claim_devices(dd, ctx, template, r).await?;
    }
    let (replicas, existing, loads) = replicas(dd, ctx, r).await?;
    crate::deletion_cost::keep(dd, ctx, replicas, existing.as_ref(), loads).await;
    let applied = deploy(dd, ctx, &plan, replicas, existing, &warm, r).await?;
    let unplaced = unscheduled(dd, ctx, replicas, &applied);
    observe(&plan, replicas, &warm, &applied, &unplaced, r);
    inference_pool::reconcile(dd, ctx, r).await?;
    Ok(ControlFlow::Continue(()))
}
