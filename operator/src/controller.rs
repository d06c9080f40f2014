//! The DiffusionDeployment controller (kube-rs/controller-rs shape): the controller's wiring
//! while this replica leads ([`lead`]), `reconcile` with its finalizer and metrics, and the
//! cleanup that withdraws prepare requests. What a reconcile shares is [`crate::context`]. The
//! reconcile's phases are in [`crate::phases`]; who leads, in [`crate::leader`].

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crds::DiffusionDeployment;
use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tracing::{debug, warn};

use crate::autoscaler::LoadSource;
use crate::backoff::Backoff;
use crate::context::{Context, Settings, MANAGER};
use crate::error::{Error, Result};
use crate::phases;
use crate::report::Report;
use crate::requests::{model_id, Change, Requests};
use crate::settle::settle;
use crate::stores::{self, Applied};
use crate::telemetry::Telemetry;

/// Removes this deployment's prepare requests from DiffusionNodes before it goes.
pub const FINALIZER: &str = "layerwise.dev/prepare-requests";
/// A deployment's Node and DiffusionNode triggers are gathered into one reconcile once they
/// have been quiet this long...
const SETTLE_QUIET: Duration = Duration::from_secs(1);
/// ...or this long after the first of them, so a deployment that matches a busy fleet is
/// still planned (see [`crate::settle`]).
const SETTLE_LONGEST: Duration = Duration::from_secs(3);
/// How long any trigger of a deployment waits for the next before it reconciles (a
/// debounce: it restarts with each trigger).
const DEBOUNCE: Duration = Duration::from_secs(1);

/// Runs the controller until `stop` resolves: the DiffusionDeployment watch, its owned
/// Deployments, the Node and DiffusionNode stores and the reconciles their changes cause.
/// Marks `telemetry` synced once the stores hold their first list.
pub async fn lead(
    client: Client,
    settings: Settings,
    load: Arc<dyn LoadSource>,
    telemetry: Arc<Telemetry>,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let dds: Api<DiffusionDeployment> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let reporter = Reporter {
        controller: MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let controller = Controller::new(dds, watcher::Config::default());
    let watches = stores::watch(&client, controller.store(), settings.namespace.as_deref());
    let (stores, sync) = (watches.stores, watches.synced);
    let requests = Requests::new(client.clone(), stores.diffusion_nodes.clone(), MANAGER);
    let owners = crate::node_owner::run(client.clone(), stores.clone());
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        settings,
        load,
        stores: stores.clone(),
        telemetry: telemetry.clone(),
        job_keys: Mutex::new(HashSet::new()),
        no_budget: Mutex::new(HashSet::new()),
        no_pool: Mutex::new(HashSet::new()),
        applied: Applied::default(),
        requests,
        backoff: Backoff::default(),
    });
    let run = controller
        // The engine Deployments and Services, from the stores' own watches.
        .owns_stream(watches.engines)
        .owns_stream(watches.services)
        // Agents report a deployment's profiles node by node, within a second or so of each
        // other; one reconcile after they settle plans on all of them at once, instead of
        // recording a plan per report.
        .reconcile_on(settle(watches.triggers, SETTLE_QUIET, SETTLE_LONGEST))
        // A deployment's own changes and its engine Deployment's come in bursts too (status
        // writes, a rollout's steps); one reconcile per burst. The settled triggers above
        // come at most every SETTLE_LONGEST, so this debounce never starves them.
        .with_config(kube::runtime::controller::Config::default().debounce(DEBOUNCE))
        .graceful_shutdown_on(stop)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(deployment = %obj, "reconciled"),
                Err(err) => debug!(error = %err, "reconcile did not run"),
            }
        });
    let synced = async move {
        tokio::join!(sync, async {
            while let Err(err) = stores.ready().await {
                warn!(error = %err, "waiting for the Node and DiffusionNode stores");
            }
            telemetry.synced();
        });
    };
    tokio::select! {
        () = run => {}
        () = async { tokio::join!(synced, owners); } => {}
    }
}

pub async fn reconcile(dd: Arc<DiffusionDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let key = backoff_key(&dd);
    // At debug, with the runtime's span: which object and what caused this reconcile.
    debug!("reconcile starts");
    let result = async {
        ctx.stores.ready().await?;
        let ns = dd
            .namespace()
            .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
        let api: Api<DiffusionDeployment> = Api::namespaced(ctx.client.clone(), &ns);
        finalizer(&api, FINALIZER, dd, |event| async {
            match event {
                Finalizer::Apply(dd) => phases::apply(&dd, &ctx).await,
                Finalizer::Cleanup(dd) => cleanup(&dd, &ctx).await,
            }
        })
        .await
        .map_err(|e| Error::Finalizer(Box::new(e)))
    }
    .await;
    let label = result.as_ref().err().map(Error::metric_label);
    ctx.telemetry.metrics.reconciled(started.elapsed(), label);
    if result.is_ok() {
        ctx.backoff.succeeded(&key);
    }
    result
}

/// Retries a failing deployment after its own backoff (see [`crate::backoff`]).
pub fn error_policy(dd: Arc<DiffusionDeployment>, err: &Error, ctx: Arc<Context>) -> Action {
    let wait = ctx.backoff.failed(&backoff_key(&dd));
    warn!(deployment = %dd.name_any(), error = %err, label = err.metric_label(), retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

/// A deployment's key in the backoff: its uid, so a deployment deleted and made again
/// under the same name starts afresh.
fn backoff_key(dd: &DiffusionDeployment) -> String {
    dd.uid().unwrap_or_else(|| dd.name_any())
}

async fn cleanup(dd: &DiffusionDeployment, ctx: &Context) -> Result<Action> {
    let id = model_id(dd);
    let mut withdrawn: Vec<String> = ctx
        .stores
        .diffusion_nodes
        .state()
        .iter()
        .filter(|dn| ctx.requests.asked(dn, &id).is_some())
        .map(|dn| dn.name_any())
        .collect();
    futures::future::try_join_all(
        withdrawn
            .iter()
            .map(|node| ctx.requests.change(node, Change::Withdraw(id.clone()))),
    )
    .await?;
    ctx.telemetry.metrics.forget(&id);
    if let Some(uid) = dd.uid() {
        ctx.job_keys.lock().expect("not poisoned").remove(&uid);
        ctx.no_budget.lock().expect("not poisoned").remove(&uid);
        ctx.no_pool.lock().expect("not poisoned").remove(&uid);
        ctx.applied.forget(&uid);
        ctx.backoff.succeeded(&uid);
    }
    if !withdrawn.is_empty() {
        withdrawn.sort();
        let mut report = Report::new(dd, k8s_openapi::jiff::Timestamp::now());
        report.event(
            EventType::Normal,
            "PrepareWithdrawn",
            "Cleanup",
            format!(
                "withdrew the prepare requests from {}",
                withdrawn.join(", ")
            ),
        );
        report.abandon(ctx, dd).await;
    }
    Ok(Action::await_change())
}
