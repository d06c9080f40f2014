//! The DiffusionDeployment controller (kube-rs/controller-rs shape): `reconcile` asks the
//! candidate nodes to prepare the model, waits for their profiles, plans, records the plan,
//! applies the engine Deployment and Service, scales them, and reports it all in status and
//! events. A finalizer withdraws the prepare requests; owner references remove the rest.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crds::{
    AutoscalingMode, DiffusionDeployment, DiffusionDeploymentStatus, DiffusionNode, ModelState,
    NodeModelStatus, Profile,
};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::autoscaler::{self, Bounds, LoadSource};
use crate::conditions::{self as cond, set};
use crate::error::{kube, Error, Result};
use crate::planner::{self, Candidate, Limits, NodeShape, Overrides};
use crate::resources::{self, PLAN_ANNOTATION};

/// Removes this deployment's prepare requests from DiffusionNodes before it goes.
pub const FINALIZER: &str = "layerwise.dev/prepare-requests";
/// Field manager of everything the operator applies (except prepare requests, which each
/// deployment owns under its own manager so that they merge).
pub const MANAGER: &str = "layerwise-operator";
const API_VERSION: &str = "layerwise.dev/v1alpha1";

/// How the operator runs; the CLI fills it from flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Engine image for deployments that name none.
    pub engine_image: String,
    /// Planner allowances (overhead, slot cap).
    pub limits: Limits,
    /// How often a deployment is looked at again (the autoscaler's period).
    pub resync: Duration,
    /// Only this namespace's deployments, or all when `None`.
    pub namespace: Option<String>,
    /// Host folders models may be served from; empty: any. The engine pods mount the model's
    /// hostPath, so without this anyone who may create a DiffusionDeployment could read any
    /// host folder through an image of their choosing.
    pub model_roots: Vec<String>,
}

/// What every reconcile shares. No globals: tests build their own.
pub struct Context {
    pub client: Client,
    /// Publishes the events `kubectl describe` shows.
    pub recorder: Recorder,
    pub settings: Settings,
    /// Where the builtin autoscaler reads engine pods' load.
    pub load: Arc<dyn LoadSource>,
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    settings: Settings,
    load: Arc<dyn LoadSource>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (dds, deploys): (Api<DiffusionDeployment>, Api<Deployment>) = match &settings.namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let reporter = Reporter {
        controller: MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        settings,
        load,
    });
    Controller::new(dds, watcher::Config::default())
        .owns(deploys, watcher::Config::default())
        // A node's profile or warmth changing is news for the deployments that asked it.
        .watches(
            Api::<DiffusionNode>::all(client),
            watcher::Config::default(),
            |dn| {
                dn.spec
                    .models
                    .iter()
                    .filter_map(|m| {
                        m.id.split_once('/').map(|(ns, name)| {
                            ObjectRef::<DiffusionDeployment>::new(name).within(ns)
                        })
                    })
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(deployment = %obj, "reconciled"),
                Err(err) => debug!(error = %err, "reconcile did not run"),
            }
        })
        .await;
}

/// The id a deployment's prepare requests and node reports carry: `<namespace>/<name>`.
pub fn model_id(dd: &DiffusionDeployment) -> String {
    format!("{}/{}", dd.namespace().unwrap_or_default(), dd.name_any())
}

/// The field manager that owns one deployment's prepare requests (at most 128 characters,
/// stable across restarts).
pub fn request_manager(id: &str) -> String {
    let full = format!("{MANAGER}/{id}");
    if full.len() <= 128 {
        return full;
    }
    // FNV-1a: stable across Rust versions, unlike the std hasher.
    let hash = id.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    });
    format!("{MANAGER}/{hash:016x}")
}

pub async fn reconcile(dd: Arc<DiffusionDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let ns = dd
        .namespace()
        .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
    let api: Api<DiffusionDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, dd, |event| async {
        match event {
            Finalizer::Apply(dd) => apply(&dd, &ctx).await,
            Finalizer::Cleanup(dd) => cleanup(&dd, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

pub fn error_policy(dd: Arc<DiffusionDeployment>, err: &Error, _ctx: Arc<Context>) -> Action {
    warn!(deployment = %dd.name_any(), error = %err, label = err.metric_label(), "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

async fn publish(
    ctx: &Context,
    dd: &DiffusionDeployment,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    info!(deployment = %dd.name_any(), reason, "{note}");
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(truncate(note, 1000)),
        action: action.into(),
        secondary: None,
    };
    if let Err(err) = ctx.recorder.publish(&ev, &dd.object_ref(&())).await {
        warn!(deployment = %dd.name_any(), error = %err, "publishing event {reason}");
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// The reason condition `type_` had in `status` before this reconcile.
fn previous<'a>(status: &'a DiffusionDeploymentStatus, type_: &str) -> Option<(&'a str, &'a str)> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.reason.as_str(), c.message.as_str()))
}

/// Records that the deployment cannot go on: `condition` False and `Degraded` True with
/// `reason` and `msg`, a warning event when they are new, and the status written.
async fn degrade(
    ctx: &Context,
    dd: &DiffusionDeployment,
    (old, status): (&DiffusionDeploymentStatus, &mut DiffusionDeploymentStatus),
    condition: &str,
    reason: &str,
    msg: &str,
    now: Timestamp,
) -> Result<()> {
    if previous(old, condition) != Some((reason, msg)) {
        publish(ctx, dd, EventType::Warning, reason, "Plan", msg.to_string()).await;
    }
    let gen = dd.metadata.generation;
    set(
        &mut status.conditions,
        condition,
        false,
        reason,
        msg,
        gen,
        now,
    );
    set(
        &mut status.conditions,
        cond::DEGRADED,
        true,
        reason,
        msg,
        gen,
        now,
    );
    write_status(ctx, dd, status).await
}

async fn write_status(
    ctx: &Context,
    dd: &DiffusionDeployment,
    status: &DiffusionDeploymentStatus,
) -> Result<()> {
    let api: Api<DiffusionDeployment> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let patch =
        json!({ "apiVersion": API_VERSION, "kind": "DiffusionDeployment", "status": status });
    api.patch_status(
        &dd.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube(format!("writing status of {}", model_id(dd))))?;
    Ok(())
}

/// What a Node offers pods, from its allocatable resources.
#[derive(Debug, Clone, Copy)]
struct Offer {
    /// Accelerators of the requested resource.
    devices: u32,
    /// Memory, when the Node reports it.
    memory: Option<u64>,
}

/// Candidate nodes: DiffusionNodes named after Nodes that match the selector and offer the
/// accelerator, with what each Node has allocatable; then every other DiffusionNode (to
/// withdraw stale requests from).
async fn nodes(
    dd: &DiffusionDeployment,
    ctx: &Context,
) -> Result<(Vec<(DiffusionNode, Offer)>, Vec<DiffusionNode>)> {
    let acc = &dd.spec.accelerator;
    let resource = acc.resource();
    let selector = acc
        .node_selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let nodes = Api::<Node>::all(ctx.client.clone())
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(kube("listing nodes"))?;
    let offered: BTreeMap<String, Offer> = nodes
        .items
        .iter()
        .filter_map(|n| {
            let allocatable = n.status.as_ref()?.allocatable.as_ref()?;
            let q = allocatable.get(resource)?;
            let devices = q.0.parse::<u32>().ok().filter(|c| *c > 0)?;
            let memory = allocatable
                .get("memory")
                .and_then(|m| crds::quantity_bytes(&m.0));
            Some((n.name_any(), Offer { devices, memory }))
        })
        .collect();
    let all = Api::<DiffusionNode>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube("listing DiffusionNodes"))?;
    let (mut candidates, mut others) = (Vec::new(), Vec::new());
    for dn in all.items {
        match offered.get(&dn.name_any()) {
            Some(offer) => candidates.push((dn, *offer)),
            None => others.push(dn),
        }
    }
    candidates.sort_by_key(|(dn, _)| dn.name_any());
    Ok((candidates, others))
}

/// Adds this deployment's prepare request to `node` (server-side apply under the
/// deployment's own field manager, so requests of many deployments merge).
async fn add_request(
    ctx: &Context,
    id: &str,
    node: &str,
    request: &crds::ModelRequest,
) -> Result<()> {
    let api: Api<DiffusionNode> = Api::all(ctx.client.clone());
    let patch = json!({ "apiVersion": API_VERSION, "kind": "DiffusionNode", "metadata": { "name": node }, "spec": { "models": [request] } });
    api.patch(
        node,
        &PatchParams::apply(&request_manager(id)).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube(format!(
        "adding prepare request {id} to DiffusionNode {node}"
    )))?;
    Ok(())
}

/// Removes this deployment's prepare request from `dn`. A JSON patch that first tests the
/// entry's id, so a concurrent change fails it (and the next reconcile retries) instead of
/// removing someone else's entry; unlike withdrawing by apply, it leaves an empty list
/// rather than dropping the required spec when ours was the last request.
async fn withdraw(ctx: &Context, id: &str, dn: &DiffusionNode) -> Result<()> {
    let Some(i) = dn.spec.models.iter().position(|m| m.id == id) else {
        return Ok(());
    };
    let api: Api<DiffusionNode> = Api::all(ctx.client.clone());
    let ops = json!([
        { "op": "test", "path": format!("/spec/models/{i}/id"), "value": id },
        { "op": "remove", "path": format!("/spec/models/{i}") },
    ]);
    let patch: json_patch::Patch =
        serde_json::from_value(ops).map_err(|source| Error::Serialize {
            what: "withdraw patch",
            source,
        })?;
    api.patch(
        &dn.name_any(),
        &PatchParams::default(),
        &Patch::Json::<()>(patch),
    )
    .await
    .map_err(kube(format!(
        "withdrawing prepare request {id} from DiffusionNode {}",
        dn.name_any()
    )))?;
    Ok(())
}

/// What one candidate node's status of the model gives the planner: a profile of the family
/// the spec names, nothing yet, or why the node cannot serve it. The agent fails a checkpoint
/// of another family when it profiles it; a profile reported before the spec changed family
/// is refused here too, so no plan is ever made from it.
fn node_profile<'a>(family: &str, m: &'a NodeModelStatus) -> Result<Option<&'a Profile>, String> {
    match (&m.state, &m.profile) {
        (ModelState::Failed, _) => Err(m.error.clone().unwrap_or_else(|| "failed".into())),
        (_, Some(p)) if p.family != family => Err(format!(
            "the DiffusionDeployment names family `{family}`, but the checkpoint is a `{}` pipeline",
            p.family
        )),
        (_, Some(p)) => Ok(Some(p)),
        _ => Ok(None),
    }
}

async fn apply(dd: &DiffusionDeployment, ctx: &Context) -> Result<Action> {
    let now = Timestamp::now();
    let id = model_id(dd);
    let gen = dd.metadata.generation;
    let spec = &dd.spec;
    let old = dd.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = gen;
    status.selector = resources::selector_string(dd);
    let resource = spec.accelerator.resource().to_string();

    // 0. The model must lie inside the configured roots: nothing is asked of the nodes and
    //    no pod mounts it otherwise.
    if let Some(path) = &spec.model.location.host_path {
        let roots = &ctx.settings.model_roots;
        if !crds::common::within_roots(path, roots) {
            let msg = format!(
                "model hostPath `{path}` is outside the model roots this operator serves from ({}); move the model under one of them, or add its folder to the chart's agent.modelRoots",
                roots.join(", ")
            );
            let reason = "ModelOutsideRoots";
            degrade(
                ctx,
                dd,
                (&old, &mut status),
                cond::PLANNED,
                reason,
                &msg,
                now,
            )
            .await?;
            return Ok(Action::await_change());
        }
    }

    // 1. Ask candidate nodes to prepare the model; withdraw from nodes no longer candidates.
    let (candidates, others) = nodes(dd, ctx).await?;
    let request = crds::ModelRequest {
        id: id.clone(),
        family: spec.model.family.clone(),
        location: spec.model.location.clone(),
    };
    let mut asked = Vec::new();
    for (dn, _) in &candidates {
        if !dn.spec.models.iter().any(|m| m == &request) {
            add_request(ctx, &id, &dn.name_any(), &request).await?;
            asked.push(dn.name_any());
        }
    }
    if !asked.is_empty() {
        let note = format!(
            "asked {} to profile and warm {}",
            asked.join(", "),
            spec.model.location.describe()
        );
        publish(
            ctx,
            dd,
            EventType::Normal,
            "PrepareRequested",
            "Prepare",
            note,
        )
        .await;
    }
    for dn in others
        .iter()
        .filter(|dn| dn.spec.models.iter().any(|m| m.id == id))
    {
        withdraw(ctx, &id, dn).await?;
        let note = format!(
            "withdrew the prepare request from {} (no longer a candidate)",
            dn.name_any()
        );
        publish(
            ctx,
            dd,
            EventType::Normal,
            "PrepareWithdrawn",
            "Prepare",
            note,
        )
        .await;
    }
    if candidates.is_empty() {
        let msg = format!(
            "no node with a DiffusionNode matches the node selector and offers {resource}; check accelerator.nodeSelector and that the layerwise agent runs on the accelerator nodes"
        );
        let reason = "NoCandidateNodes";
        degrade(
            ctx,
            dd,
            (&old, &mut status),
            cond::MODEL_PROFILED,
            reason,
            &msg,
            now,
        )
        .await?;
        return Ok(Action::requeue(Duration::from_secs(30)));
    }

    // 2. Wait for profiles.
    let mut profiled = Vec::new();
    let mut failed = Vec::new();
    for (dn, offer) in &candidates {
        let Some(m) = dn.status.as_ref().and_then(|s| s.model(&id)) else {
            continue;
        };
        match node_profile(&spec.model.family, m) {
            Err(why) => failed.push(format!("{}: {why}", dn.name_any())),
            Ok(Some(p)) => profiled.push((dn, *offer, m, p)),
            Ok(None) => {}
        }
    }
    if profiled.is_empty() {
        let (reason, msg) = if !failed.is_empty() && failed.len() == candidates.len() {
            (
                "ProfileFailed",
                format!(
                    "every candidate node failed to profile the model: {}",
                    failed.join("; ")
                ),
            )
        } else {
            (
                "WaitingForProfile",
                format!(
                    "waiting for {} candidate node(s) to profile {}",
                    candidates.len(),
                    spec.model.location.describe()
                ),
            )
        };
        if reason == "ProfileFailed"
            && previous(&old, cond::MODEL_PROFILED) != Some((reason, msg.as_str()))
        {
            publish(ctx, dd, EventType::Warning, reason, "Profile", msg.clone()).await;
        }
        set(
            &mut status.conditions,
            cond::MODEL_PROFILED,
            false,
            reason,
            &msg,
            gen,
            now,
        );
        set(
            &mut status.conditions,
            cond::DEGRADED,
            reason == "ProfileFailed",
            reason,
            &msg,
            gen,
            now,
        );
        write_status(ctx, dd, &status).await?;
        return Ok(Action::requeue(
            ctx.settings.resync.min(Duration::from_secs(5)),
        ));
    }
    let names: Vec<String> = profiled.iter().map(|(dn, ..)| dn.name_any()).collect();
    let profile = profiled[0].3.clone();
    let msg = format!(
        "{} blocks, {:.2} GiB; profiled on {}",
        profile.blocks,
        profile.total_bytes as f64 / (1u64 << 30) as f64,
        names.join(", ")
    );
    if !cond::is_true(&old.conditions, cond::MODEL_PROFILED) {
        publish(
            ctx,
            dd,
            EventType::Normal,
            "ModelProfiled",
            "Profile",
            msg.clone(),
        )
        .await;
    }
    set(
        &mut status.conditions,
        cond::MODEL_PROFILED,
        true,
        "Profiled",
        msg,
        gen,
        now,
    );

    // 3. Plan.
    // Each node with its own profile, and the memory pods may use there: what its agent
    // reports (physical or cgroup), never more than the Node's allocatable memory.
    let shapes: Vec<Candidate> = profiled
        .iter()
        .filter_map(|(dn, offer, m, profile)| {
            let st = dn.status.as_ref()?;
            let acc = st
                .accelerators
                .iter()
                .find(|a| a.resource_name == resource)?;
            let host = st.usable_host_bytes();
            Some(Candidate {
                node: NodeShape {
                    name: dn.name_any(),
                    devices: acc.count.min(offer.devices),
                    device_bytes: acc.memory_bytes,
                    host_bytes: offer.memory.map_or(host, |a| a.min(host)),
                    fast_peer_link: acc.fast_peer_link,
                    warm: m.state == ModelState::Warm,
                },
                profile,
            })
        })
        .collect();
    let limits = ctx.settings.limits.for_spec(spec);
    let overrides = Overrides::of(spec);
    let w = &spec.workload;
    let plan = match planner::plan_candidates(&shapes, w, &overrides, &limits) {
        Ok(plan) => plan,
        Err(refusal) => {
            let reason = refusal.shortage.reason();
            let msg = format!(
                "cannot serve {}x{}x{} (batch {}) requests: {refusal}{}",
                w.max_width,
                w.max_height,
                w.max_frames,
                w.max_batch,
                if status.plan.is_some() {
                    "; the previous plan keeps running"
                } else {
                    ""
                }
            );
            degrade(
                ctx,
                dd,
                (&old, &mut status),
                cond::PLANNED,
                reason,
                &msg,
                now,
            )
            .await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    };
    let summary = format!(
        "{}: {:.2} GiB device per rank, {:.2} GiB host per pod, on {}",
        resources::plan_summary(&plan),
        plan.device_bytes_per_rank as f64 / (1u64 << 30) as f64,
        plan.host_bytes_per_pod as f64 / (1u64 << 30) as f64,
        plan.nodes.join(", ")
    );
    if old.plan.as_ref() != Some(&plan) {
        let note = format!(
            "{summary}. {}",
            plan.reasons.get(1).cloned().unwrap_or_default()
        );
        publish(ctx, dd, EventType::Normal, "Planned", "Plan", note).await;
    }
    set(
        &mut status.conditions,
        cond::PLANNED,
        true,
        "Planned",
        &summary,
        gen,
        now,
    );
    status.plan = Some(plan.clone());

    // 4. Replicas.
    let deploys: Api<Deployment> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let existing = deploys
        .get_opt(&dd.name_any())
        .await
        .map_err(kube(format!("reading Deployment of {id}")))?;
    let running = existing.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let replicas = match &spec.autoscaling {
        None => spec.replicas.unwrap_or(1),
        Some(a) if a.mode == AutoscalingMode::External => spec
            .replicas
            .unwrap_or(a.min_replicas)
            .clamp(a.min_replicas, a.max_replicas),
        Some(a) => {
            let bounds = Bounds {
                min: a.min_replicas,
                max: a.max_replicas,
                target: a.target_queue_per_replica,
                delay: Duration::from_secs(u64::from(a.scale_down_delay_seconds)),
            };
            let load = scrape(dd, ctx).await?;
            status.queue_depth = load;
            let current = running.unwrap_or_else(|| spec.replicas.unwrap_or(a.min_replicas));
            let step = autoscaler::step(
                current,
                load,
                &bounds,
                old.scale_down_pending_since.as_ref().map(|t| t.0),
                now,
            );
            // Status keeps whole seconds: round up so the stored wait never shortens the delay.
            status.scale_down_pending_since = step.pending_since.map(|t| Time(ceil_second(t)));
            if running.is_some() && step.replicas != current {
                let note = format!(
                    "scaled from {current} to {} replicas: {load} requests queued or running, target {} per replica",
                    step.replicas, a.target_queue_per_replica
                );
                publish(ctx, dd, EventType::Normal, "Scaled", "Scale", note).await;
            }
            step.replicas
        }
    };
    if running.is_some() && running != Some(replicas) {
        status.last_scale_time = Some(Time(now));
        if spec
            .autoscaling
            .as_ref()
            .is_none_or(|a| a.mode == AutoscalingMode::External)
        {
            let note = format!(
                "scaled from {} to {replicas} replicas (spec)",
                running.unwrap_or_default()
            );
            publish(ctx, dd, EventType::Normal, "Scaled", "Scale", note).await;
        }
    }

    // 5. The engine Deployment and Service.
    let warm: Vec<String> = shapes
        .iter()
        .filter(|s| s.node.warm && plan.nodes.contains(&s.node.name))
        .map(|s| s.node.name.clone())
        .collect();
    if ensure_job_key(ctx, dd).await? {
        let note = format!(
            "created Secret {} with the key the engine pods check job ids with",
            resources::job_key_secret_name(dd)
        );
        publish(ctx, dd, EventType::Normal, "JobKeyCreated", "Deploy", note).await;
    }
    let desired = resources::deployment(dd, &plan, replicas, &ctx.settings.engine_image, &warm);
    let pp = PatchParams::apply(MANAGER).force();
    let applied = deploys
        .patch(&dd.name_any(), &pp, &Patch::Apply(&desired))
        .await
        .map_err(kube(format!("applying Deployment of {id}")))?;
    let services: Api<Service> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    services
        .patch(&dd.name_any(), &pp, &Patch::Apply(&resources::service(dd)))
        .await
        .map_err(kube(format!("applying Service of {id}")))?;
    let old_plan = existing.as_ref().and_then(|d| {
        d.spec
            .as_ref()?
            .template
            .metadata
            .as_ref()?
            .annotations
            .as_ref()?
            .get(PLAN_ANNOTATION)
            .cloned()
    });
    match old_plan {
        None => {
            let note = format!(
                "created Deployment and Service {} with {replicas} replica(s): {}",
                dd.name_any(),
                resources::plan_summary(&plan)
            );
            publish(ctx, dd, EventType::Normal, "Created", "Deploy", note).await;
        }
        Some(p) if p != resources::plan_summary(&plan) => {
            let note = format!(
                "plan changed from {p} to {}: rolling the engine pods",
                resources::plan_summary(&plan)
            );
            publish(ctx, dd, EventType::Normal, "Rolling", "Deploy", note).await;
        }
        Some(_) => {}
    }

    // 6. Status from what runs.
    let ds = applied.status.unwrap_or_default();
    let ready = ds.ready_replicas.unwrap_or(0);
    let updated = ds.updated_replicas.unwrap_or(0);
    status.replicas = replicas;
    status.ready_replicas = ready;
    // Available means a request sent now is served: a deployment scaled to zero is not.
    let available = ready >= 1;
    let pods_msg = format!("{ready} of {replicas} engine pods ready");
    set(
        &mut status.conditions,
        cond::AVAILABLE,
        available,
        if available {
            "EnginesReady"
        } else if replicas == 0 {
            "ScaledToZero"
        } else {
            "NoEngineReady"
        },
        &pods_msg,
        gen,
        now,
    );
    let rolling = updated < replicas
        || ready < replicas
        || ds.observed_generation < applied.metadata.generation;
    set(
        &mut status.conditions,
        cond::PROGRESSING,
        rolling,
        if rolling {
            "RollingOut"
        } else {
            "RolloutComplete"
        },
        &pods_msg,
        gen,
        now,
    );
    let warm_msg = format!(
        "model warm in the page cache of {} of {} planned nodes",
        warm.len(),
        plan.nodes.len()
    );
    let all_warm = warm.len() == plan.nodes.len();
    set(
        &mut status.conditions,
        cond::CACHE_WARM,
        all_warm,
        if all_warm { "Warm" } else { "Warming" },
        warm_msg,
        gen,
        now,
    );
    set(
        &mut status.conditions,
        cond::DEGRADED,
        false,
        "AsPlanned",
        "running as planned",
        gen,
        now,
    );
    if available && !cond::is_true(&old.conditions, cond::AVAILABLE) {
        publish(ctx, dd, EventType::Normal, "Available", "Deploy", pods_msg).await;
    }
    write_status(ctx, dd, &status).await?;
    Ok(Action::requeue(ctx.settings.resync))
}

/// Creates the deployment's job-key Secret unless it is there; true when it made it. An
/// existing Secret is never rewritten, so the key stays what the running pods have. Create
/// only: the operator never reads a Secret (its RBAC grants no `get` on them).
async fn ensure_job_key(ctx: &Context, dd: &DiffusionDeployment) -> Result<bool> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| Error::Random {
        what: "a job-id key",
        msg: e.to_string(),
    })?;
    let key: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let secret = resources::job_key_secret(dd, key);
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(kube(format!(
            "creating Secret {} of {}",
            resources::job_key_secret_name(dd),
            model_id(dd)
        ))(e)),
    }
}

/// `t` rounded up to a whole second (what a `Time` in status keeps).
fn ceil_second(t: Timestamp) -> Timestamp {
    if t.subsec_nanosecond() == 0 {
        t
    } else {
        Timestamp::from_second(t.as_second() + 1).unwrap_or(t)
    }
}

/// Sum of queued and running requests over the deployment's running engine pods. A pod that
/// does not answer counts as idle (it is not serving either).
async fn scrape(dd: &DiffusionDeployment, ctx: &Context) -> Result<u64> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let list = pods
        .list(&ListParams::default().labels(&resources::selector_string(dd)))
        .await
        .map_err(kube(format!("listing engine pods of {}", model_id(dd))))?;
    let running: Vec<&Pod> = list
        .items
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .collect();
    let loads = futures::future::join_all(running.iter().map(|p| ctx.load.load(p))).await;
    let mut total = 0;
    for (pod, load) in running.iter().zip(loads) {
        match load {
            Ok(l) => total += l.total(),
            Err(err) => debug!(pod = %pod.name_any(), error = %err, "no load from engine pod"),
        }
    }
    Ok(total)
}

async fn cleanup(dd: &DiffusionDeployment, ctx: &Context) -> Result<Action> {
    let id = model_id(dd);
    let all = Api::<DiffusionNode>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube("listing DiffusionNodes"))?;
    let mut withdrawn = Vec::new();
    for dn in all
        .items
        .iter()
        .filter(|dn| dn.spec.models.iter().any(|m| m.id == id))
    {
        withdraw(ctx, &id, dn).await?;
        withdrawn.push(dn.name_any());
    }
    if !withdrawn.is_empty() {
        let note = format!(
            "withdrew the prepare requests from {}",
            withdrawn.join(", ")
        );
        publish(
            ctx,
            dd,
            EventType::Normal,
            "PrepareWithdrawn",
            "Cleanup",
            note,
        )
        .await;
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_of_another_family_is_refused_naming_both() {
        let mut p = layerwise_e2e::fixtures::dit_profile(4, 1 << 20, 0, 0);
        let status = |state, profile: Option<Profile>, error: Option<&str>| NodeModelStatus {
            id: "ns/m".into(),
            state,
            profile,
            error: error.map(Into::into),
            ..Default::default()
        };
        let warm = status(ModelState::Warm, Some(p.clone()), None);
        assert_eq!(node_profile("dit", &warm), Ok(Some(&p)));
        let why = node_profile("wan", &warm).unwrap_err();
        assert!(
            why.contains("names family `wan`") && why.contains("a `dit` pipeline"),
            "{why}"
        );
        p.family = "wan".into();
        let warm = status(ModelState::Warming, Some(p.clone()), None);
        assert_eq!(node_profile("wan", &warm), Ok(Some(&p)));
        let failed = status(ModelState::Failed, Some(p), Some("bad header"));
        assert_eq!(node_profile("wan", &failed), Err("bad header".into()));
        let pending = status(ModelState::Profiling, None, None);
        assert_eq!(node_profile("wan", &pending), Ok(None));
    }
}
