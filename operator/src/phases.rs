//! One reconcile of a DiffusionDeployment, as phases in order: admit the spec, ask nodes
//! to prepare the model, collect their profiles, plan, size the replicas, apply the engine
//! Deployment and Service, report what runs, and keep the InferencePool the spec asks for.
//! A phase that cannot go on returns `ControlFlow::Break` with a typed [`Stop`], and
//! [`apply`] records every stop the same way ([`Report::stop`]); API errors are `Err` and
//! go to the controller's error policy.

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use crds::{AutoscalingMode, DiffusionDeployment, ModelState, NodeModelStatus, Plan, Profile};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use tracing::{debug, warn};

use crate::autoscaler::{self, Bounds, Observed};
use crate::conditions as cond;
use crate::context::{Context, MANAGER};
use crate::dra;
use crate::error::{kube, Error, Result};
use crate::inference_pool;
use crate::placement::{self, Candidate};
use crate::planner::{self, NodeShape, Overrides};
use crate::report::{Report, Stop};
use crate::requests::model_id;
use crate::requests::Change;
use crate::resources::{self, PLAN_ANNOTATION};
use crate::stores;
use crate::volume::{self, Located};

/// What a phase returns: go on with a `T`, or stop for a reason.
type Phase<T> = ControlFlow<Stop, T>;

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
    let profiled = proceed!(profiles(dd, &asked, r));
    let (plan, warm, template) = proceed!(plan(dd, ctx, &profiled, devices.as_ref(), r));
    if r.old.plan.as_ref() != Some(&plan) || !r.was_true(cond::PLANNED) {
        r.record(ctx, dd).await?;
    }
    if let Some(template) = &template {
        claim_devices(dd, ctx, template, r).await?;
    }
    let (replicas, existing) = replicas(dd, ctx, r).await?;
    let applied = deploy(dd, ctx, &plan, replicas, existing, &warm, r).await?;
    let unplaced = unscheduled(dd, ctx, replicas, &applied);
    observe(&plan, replicas, &warm, &applied, &unplaced, r);
    inference_pool::reconcile(dd, ctx, r).await?;
    Ok(ControlFlow::Continue(()))
}

/// Where the model is on the nodes (see [`crate::volume`]): a hostPath as it is, a claim
/// as the folder and nodes of the volume it is bound to. The folder must lie inside the
/// configured roots: nothing is asked of the nodes and no pod mounts it otherwise.
async fn locate(dd: &DiffusionDeployment, ctx: &Context) -> Result<Phase<Located>> {
    let location = &dd.spec.model.location;
    let located = match (&location.host_path, &location.persistent_volume_claim) {
        (Some(path), _) => Located {
            host_path: path.clone(),
            nodes: None,
            describe: path.clone(),
        },
        (None, Some(claim)) => {
            let ns = dd.namespace().unwrap_or_default();
            let pvc = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
                .get_opt(&claim.claim_name)
                .await
                .map_err(kube(format!(
                    "reading PersistentVolumeClaim {} of {}",
                    claim.claim_name,
                    model_id(dd)
                )))?;
            let bound = pvc
                .as_ref()
                .and_then(|c| c.spec.as_ref()?.volume_name.clone())
                .filter(|v| !v.is_empty());
            let pv = match &bound {
                Some(v) => Api::<PersistentVolume>::all(ctx.client.clone())
                    .get_opt(v)
                    .await
                    .map_err(kube(format!("reading PersistentVolume {v}")))?,
                None => None,
            };
            match volume::locate_claim(
                &claim.claim_name,
                claim.sub_path.as_deref(),
                pvc.as_ref(),
                pv.as_ref(),
            ) {
                Ok(located) => located,
                Err(why) => {
                    return Ok(ControlFlow::Break(Stop::ClaimUnusable {
                        reason: why.reason,
                        message: why.message,
                    }))
                }
            }
        }
        (None, None) => {
            return Ok(ControlFlow::Break(Stop::ClaimUnusable {
                reason: "NoModelLocation",
                message: "the model names neither hostPath nor persistentVolumeClaim".into(),
            }))
        }
    };
    let roots = &ctx.settings.model_roots;
    if !crds::common::within_roots(&located.host_path, roots) {
        return Ok(ControlFlow::Break(Stop::ModelOutsideRoots {
            path: located.host_path,
            roots: roots.clone(),
        }));
    }
    Ok(ControlFlow::Continue(located))
}

/// The devices Dynamic Resource Allocation offers, where the spec asks for its devices so
/// ([`dra`]); `None` where it counts an extended resource.
async fn devices(dd: &DiffusionDeployment, ctx: &Context) -> Result<Phase<Option<dra::Inventory>>> {
    let Some(spec) = &dd.spec.accelerator.dra else {
        return Ok(ControlFlow::Continue(None));
    };
    Ok(match dra::observe(dd, spec, ctx).await? {
        Ok(inv) => ControlFlow::Continue(Some(inv)),
        Err(why) => ControlFlow::Break(Stop::DevicesUnusable {
            reason: why.reason,
            message: why.message,
        }),
    })
}

/// Applies the generated ResourceClaimTemplate the plan's pods claim their devices
/// through, and deletes the earlier ones no engine pod claims through any more.
async fn claim_devices(
    dd: &DiffusionDeployment,
    ctx: &Context,
    wanted: &ResourceClaimTemplate,
    r: &mut Report,
) -> Result<()> {
    let pods: Vec<Pod> = engine_pods(dd, ctx).iter().map(|p| (**p).clone()).collect();
    for gone in dra::apply_template(dd, ctx, wanted, &pods).await? {
        let note = format!("deleted ResourceClaimTemplate {gone}: no engine pod claims through it");
        r.event(EventType::Normal, "ClaimTemplateDeleted", "Deploy", note);
    }
    Ok(())
}

/// Asks the prepare set to profile and warm the model; withdraws the request from every
/// other node. Returns the prepare set.
async fn prepare(
    dd: &DiffusionDeployment,
    ctx: &Context,
    located: &Located,
    devices: Option<&dra::Inventory>,
    r: &mut Report,
) -> Result<Phase<Vec<Candidate>>> {
    let id = model_id(dd);
    let spec = &dd.spec;
    let resource = spec.accelerator.resource();
    let mut nodes = ctx.stores.nodes.state();
    if let Some(on) = &located.nodes {
        nodes.retain(|n| volume::node_matches(on, n));
    }
    let all = placement::candidates(
        spec,
        &nodes,
        |n| {
            ctx.stores
                .diffusion_node(n)
                .map(|dn| ctx.requests.current(dn))
        },
        devices.map(dra::Inventory::counts).as_ref(),
    );
    let plan = r.old.plan.as_ref();
    let bound = placement::prepare_bound(spec, plan, &all, ctx.settings.prepare_nodes);
    let chosen: Vec<Candidate> = placement::prepare_set(&all, &id, resource, plan, bound)
        .into_iter()
        .map(|i| all[i].clone())
        .collect();
    // The agents read host folders: a claim reaches them as its volume's folder.
    let request = crds::ModelRequest {
        id: id.clone(),
        family: spec.model.family.clone(),
        location: crds::ModelLocation {
            host_path: Some(located.host_path.clone()),
            persistent_volume_claim: None,
        },
    };
    // The asks and withdraws go out together, each through its node's writer: a new
    // deployment's first reconcile asks its whole prepare set, and each node's agent starts
    // on its request as soon as it lands.
    // Each candidate's DiffusionNode already shows this process's own writes.
    let asked: Vec<String> = chosen
        .iter()
        .filter(|c| !c.dn.spec.models.contains(&request))
        .map(Candidate::name)
        .collect();
    let keep: BTreeSet<String> = chosen.iter().map(Candidate::name).collect();
    let withdrawn: Vec<String> = ctx
        .stores
        .diffusion_nodes
        .state()
        .iter()
        .filter(|dn| !keep.contains(&dn.name_any()) && ctx.requests.asked(dn, &id).is_some())
        .map(|dn| dn.name_any())
        .collect();
    let changes = asked
        .iter()
        .map(|node| (node, Change::Ask(request.clone())))
        .chain(
            withdrawn
                .iter()
                .map(|node| (node, Change::Withdraw(id.clone()))),
        );
    futures::future::try_join_all(changes.map(|(node, change)| ctx.requests.change(node, change)))
        .await?;
    if !asked.is_empty() {
        let note = format!(
            "asked {} to profile and warm {}",
            asked.join(", "),
            located.describe
        );
        r.event(EventType::Normal, "PrepareRequested", "Prepare", note);
    }
    for node in &withdrawn {
        let note = format!("withdrew the prepare request from {node} (no longer a candidate)");
        r.event(EventType::Normal, "PrepareWithdrawn", "Prepare", note);
    }
    if chosen.is_empty() {
        return Ok(ControlFlow::Break(Stop::NoCandidateNodes {
            resource: match devices {
                Some(inv) => format!("devices of DeviceClass {} in its ResourceSlices", inv.class),
                None => resource.to_string(),
            },
            volume: located.nodes.is_some().then(|| located.describe.clone()),
        }));
    }
    Ok(ControlFlow::Continue(chosen))
}

/// A node of the prepare set that reported a usable profile.
struct Profiled<'a> {
    candidate: &'a Candidate,
    model: &'a NodeModelStatus,
    profile: &'a Profile,
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

/// The nodes of the prepare set that reported a profile; waits while none has.
fn profiles<'a>(
    dd: &DiffusionDeployment,
    asked: &'a [Candidate],
    r: &mut Report,
) -> Phase<Vec<Profiled<'a>>> {
    let id = model_id(dd);
    let mut profiled = Vec::new();
    let mut failed = Vec::new();
    for c in asked {
        let Some(m) = c.dn.status.as_ref().and_then(|s| s.model(&id)) else {
            continue;
        };
        match node_profile(&dd.spec.model.family, m) {
            Err(why) => failed.push(format!("{}: {why}", c.name())),
            Ok(Some(profile)) => profiled.push(Profiled {
                candidate: c,
                model: m,
                profile,
            }),
            Ok(None) => {}
        }
    }
    if profiled.is_empty() {
        return ControlFlow::Break(if !failed.is_empty() && failed.len() == asked.len() {
            Stop::ProfileFailed { failures: failed }
        } else {
            Stop::WaitingForProfile {
                nodes: asked.len(),
                location: dd.spec.model.location.describe(),
            }
        });
    }
    let names: Vec<String> = profiled.iter().map(|p| p.candidate.name()).collect();
    let profile = profiled[0].profile;
    let msg = format!(
        "{} blocks, {:.2} GiB; profiled on {}",
        profile.blocks,
        profile.total_bytes as f64 / (1u64 << 30) as f64,
        names.join(", ")
    );
    if !r.was_true(cond::MODEL_PROFILED) {
        r.event(EventType::Normal, "ModelProfiled", "Profile", msg.clone());
    }
    r.set(cond::MODEL_PROFILED, true, "Profiled", msg);
    ControlFlow::Continue(profiled)
}

/// What a node's accelerators are, for the planner: (devices one pod's ranks may use,
/// memory of each, product, whether they share a fast link). The agent's figures, or,
/// where the spec asks for devices by DRA, the node's ResourceSlices' (the largest group
/// of devices that share a fast link; the agent's figure for what the slices leave out).
fn accelerators(
    agent: Option<&crds::AcceleratorInventory>,
    devices: Option<&dra::Inventory>,
    node: &str,
    offered: u32,
) -> Option<(u32, u64, String, bool)> {
    match devices {
        None => {
            let a = agent?;
            Some((
                a.count.min(offered),
                a.memory_bytes,
                a.product.clone(),
                a.fast_peer_link,
            ))
        }
        Some(inv) => {
            let d = inv.nodes.get(node)?;
            let (ranks, linked) = d.for_ranks();
            let memory = d.memory_bytes.or(agent.map(|a| a.memory_bytes))?;
            let product = d
                .product
                .clone()
                .or(agent.map(|a| a.product.clone()))
                .unwrap_or_default();
            Some((ranks.min(offered), memory, product, linked))
        }
    }
}

/// What the spec fixes; where the pods claim through the spec's own ResourceClaimTemplate,
/// its device count fixes dp × sp (dp = count / sp), or why it cannot.
fn overrides(
    spec: &crds::DiffusionDeploymentSpec,
    devices: Option<&dra::Inventory>,
) -> Result<Overrides, String> {
    let mut o = Overrides::of(spec);
    let Some((template, count)) = devices.and_then(|inv| inv.named.as_ref()) else {
        return Ok(o);
    };
    let sp = o.sp.unwrap_or(1).max(1);
    let dp = count / sp;
    if dp == 0 || dp * sp != *count || o.dp.is_some_and(|d| d != dp) {
        return Err(format!(
            "ResourceClaimTemplate {template} claims {count} device(s) a pod, which dp {} × sp {sp} does not use exactly; set spec.dp and spec.sp so that dp × sp = {count}, or name a DeviceClass and let the operator size the claim",
            o.dp.map_or("(unset)".to_string(), |d| d.to_string())
        ));
    }
    o.dp = Some(dp);
    o.sp = Some(sp);
    Ok(o)
}

/// Plans from each profiled node's own facts; returns the plan, the planned nodes where
/// the model is warm, and the ResourceClaimTemplate the operator generates for the plan's
/// pods where they claim their devices by DRA from a DeviceClass.
fn plan(
    dd: &DiffusionDeployment,
    ctx: &Context,
    profiled: &[Profiled],
    devices: Option<&dra::Inventory>,
    r: &mut Report,
) -> Phase<(Plan, Vec<String>, Option<ResourceClaimTemplate>)> {
    let spec = &dd.spec;
    let resource = spec.accelerator.resource();
    // Each node with its own profile, and the memory pods may use there: what its agent
    // reports (physical or cgroup), never more than the Node's allocatable memory.
    let shapes: Vec<planner::Candidate> = profiled
        .iter()
        .filter_map(|p| {
            let (dn, offer) = (&p.candidate.dn, p.candidate.offer);
            let st = dn.status.as_ref()?;
            let agent = st.accelerators.iter().find(|a| a.resource_name == resource);
            let name = dn.name_any();
            let (count, device_bytes, product, fast_peer_link) =
                accelerators(agent, devices, &name, offer.devices)?;
            let host = st.usable_host_bytes();
            let (rates, rates_from) =
                NodeShape::rates_for(&product, spec.accelerator.rates.as_ref());
            Some(planner::Candidate {
                node: NodeShape {
                    name,
                    devices: count,
                    device_bytes,
                    host_bytes: offer.memory.map_or(host, |a| a.min(host)),
                    fast_peer_link,
                    warm: p.model.state == ModelState::Warm,
                    rates,
                    rates_from,
                },
                profile: p.profile,
            })
        })
        .collect();
    let limits = ctx.settings.limits.for_spec(spec);
    let w = &spec.workload;
    let fixed = match overrides(spec, devices) {
        Ok(o) => o,
        Err(message) => {
            return ControlFlow::Break(Stop::DevicesUnusable {
                reason: "ResourceClaimTemplateMismatch",
                message,
            })
        }
    };
    let mut template = None;
    let plan = match planner::plan_candidates(&shapes, w, &fixed, &limits) {
        Ok(mut plan) => {
            if let Some(inv) = devices {
                plan.resource_claim_template = Some(match &inv.named {
                    Some((name, _)) => name.clone(),
                    None => template.insert(dra::for_plan(dd, inv, &plan)).name_any(),
                });
            }
            plan
        }
        Err(refusal) => {
            let message = format!(
                "cannot serve {}x{}x{} (batch {}) requests: {refusal}{}",
                w.max_width,
                w.max_height,
                w.max_frames,
                w.max_batch,
                if r.status.plan.is_some() {
                    "; the previous plan keeps running"
                } else {
                    ""
                }
            );
            return ControlFlow::Break(Stop::Unplannable {
                reason: refusal.shortage.reason(),
                message,
            });
        }
    };
    let mut summary = format!(
        "{}: {:.2} GiB device per rank, {:.2} GiB host per pod, on {}",
        resources::plan_summary(&plan),
        plan.device_bytes_per_rank as f64 / (1u64 << 30) as f64,
        plan.host_bytes_per_pod as f64 / (1u64 << 30) as f64,
        plan.nodes.join(", ")
    );
    if r.old.plan.as_ref() != Some(&plan) {
        let note = format!(
            "{summary}. {}",
            plan.reasons.get(1).cloned().unwrap_or_default()
        );
        r.event(EventType::Normal, "Planned", "Plan", note);
        ctx.telemetry.metrics.planned(plan.strategy.as_str());
    }
    // A latency bound no sp meets: the fastest plan runs, and the condition says so.
    let reason = match plan.latency_bound_met {
        Some(false) => {
            let why = format!(
                "no plan meets workload.maxLatencySeconds {}: the fastest predicts {:.1} s a request",
                w.max_latency_seconds.unwrap_or_default(),
                plan.predicted_latency_seconds.unwrap_or_default()
            );
            if r.old.plan.as_ref() != Some(&plan) {
                r.event(
                    EventType::Warning,
                    "LatencyBoundNotMet",
                    "Plan",
                    why.clone(),
                );
            }
            summary = format!("{summary}; {why}");
            "LatencyBoundNotMet"
        }
        _ => "Planned",
    };
    r.set(cond::PLANNED, true, reason, &summary);
    r.status.plan = Some(plan.clone());
    let warm = shapes
        .iter()
        .filter(|s| s.node.warm && plan.nodes.contains(&s.node.name))
        .map(|s| s.node.name.clone())
        .collect();
    ControlFlow::Continue((plan, warm, template))
}

/// The replicas wanted: the spec's, or the builtin autoscaler's from the engine pods' load.
/// Returns them with the Deployment as it is now.
async fn replicas(
    dd: &DiffusionDeployment,
    ctx: &Context,
    r: &mut Report,
) -> Result<(i32, Option<Deployment>)> {
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
            let observed = scrape(dd, ctx, r).await;
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
    Ok((replicas, existing))
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
async fn scrape(dd: &DiffusionDeployment, ctx: &Context, r: &mut Report) -> Observed {
    let id = model_id(dd);
    let pods = engine_pods(dd, ctx);
    let running: Vec<&Pod> = pods
        .iter()
        .map(|p| p.as_ref())
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .collect();
    let loads = futures::future::join_all(running.iter().map(|p| ctx.load.load(p))).await;
    let mut load = 0;
    let mut failed = Vec::new();
    for (pod, result) in running.iter().zip(loads) {
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
    Observed {
        load,
        complete: failed.is_empty(),
    }
}

/// Applies the engine Deployment and Service (and makes the job-key Secret once); returns
/// the Deployment as applied.
async fn deploy(
    dd: &DiffusionDeployment,
    ctx: &Context,
    plan: &Plan,
    replicas: i32,
    existing: Option<Deployment>,
    warm: &[String],
    r: &mut Report,
) -> Result<Deployment> {
    if ensure_job_key(ctx, dd).await? {
        let note = format!(
            "created Secret {} with the key the engine pods check job ids with",
            resources::job_key_secret_name(dd)
        );
        r.event(EventType::Normal, "JobKeyCreated", "Deploy", note);
    }
    let (placed, warm) = kept_placement(plan, existing.as_ref(), warm);
    let desired = resources::deployment(
        dd,
        &placed,
        replicas,
        &ctx.settings.engine_image,
        &ctx.settings.engine_pods,
        &warm,
    );
    let old_plan = existing.as_ref().and_then(template_plan);
    let applied = apply_engine(dd, ctx, &desired, existing, r).await?;
    let summary = resources::plan_summary(plan);
    match old_plan {
        None => {
            let note = format!(
                "created Deployment and Service {} with {replicas} replica(s): {summary}",
                dd.name_any(),
            );
            r.event(EventType::Normal, "Created", "Deploy", note);
        }
        Some(p) if p != summary => {
            let note = format!("plan changed from {p} to {summary}: rolling the engine pods");
            r.event(EventType::Normal, "Rolling", "Deploy", note);
        }
        Some(_) => {}
    }
    Ok(applied)
}

/// The plan and warm nodes the pod template is made with.
///
/// Any change to the pod template replaces every engine pod, and each new pod loads the
/// model again. Which nodes are warm changes as agents warm, and a plan's nodes grow as
/// agents report: neither is a reason to replace pods that run. So while the plan itself
/// stays, the template keeps the nodes and preference it was made with (read from the
/// `existing` Deployment), unless a node was dropped from the plan or pods wait for a node
/// (then the plan's nodes may place them).
fn kept_placement(
    plan: &Plan,
    existing: Option<&Deployment>,
    warm: &[String],
) -> (Plan, Vec<String>) {
    match existing.and_then(resources::scheduling_of) {
        Some((summary, nodes, preferred))
            if summary == resources::plan_summary(plan)
                && nodes.iter().all(|n| plan.nodes.contains(n))
                && (nodes.len() == plan.nodes.len() || all_available(existing)) =>
        {
            let mut placed = plan.clone();
            placed.nodes = nodes;
            (placed, preferred)
        }
        _ => (plan.clone(), warm.to_vec()),
    }
}

/// The plan summary a Deployment's pod template was made with.
fn template_plan(d: &Deployment) -> Option<String> {
    d.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(PLAN_ANNOTATION)
        .cloned()
}

/// Applies the `desired` engine Deployment (over the `existing` one), the Service and the
/// PodDisruptionBudget; returns the Deployment as applied. Each is applied only when it
/// differs from what this process last applied, or the object moved since (see
/// [`crate::stores::Applied`]).
async fn apply_engine(
    dd: &DiffusionDeployment,
    ctx: &Context,
    desired: &Deployment,
    existing: Option<Deployment>,
    r: &mut Report,
) -> Result<Deployment> {
    let id = model_id(dd);
    let ns = dd.namespace().unwrap_or_default();
    let uid = dd.uid().unwrap_or_default();
    let name = dd.name_any();
    let generation = |d: &Deployment| d.metadata.generation.map(|g| g.to_string());
    let service = resources::service(dd);
    let stored = ctx.stores.service(&ns, &name).map(|s| (*s).clone());
    let resource_version = |s: &Service| s.metadata.resource_version.clone();
    // The three are independent: applied together, so the slowest (a new Service waits its
    // turn for a ClusterIP) is the only wait. All three run to the end, so a budget deleted
    // beside a failed apply is still told (the next reconcile would not delete it again).
    let (applied, service_applied, budget) = futures::future::join3(
        async {
            apply_if_changed(ctx, &ns, &name, &uid, desired, existing, generation)
                .await
                .map_err(kube(format!("applying Deployment of {id}")))
        },
        async {
            apply_if_changed(ctx, &ns, &name, &uid, &service, stored, resource_version)
                .await
                .map_err(kube(format!("applying Service of {id}")))
        },
        disruption_budget(dd, ctx),
    )
    .await;
    if let Ok(Some(note)) = &budget {
        r.event(
            EventType::Normal,
            "DisruptionBudgetDeleted",
            "Deploy",
            note.clone(),
        );
    }
    let applied = applied?;
    service_applied?;
    budget?;
    Ok(applied)
}

/// Server-side applies `desired` (owned by the deployment `uid`) unless it is what this
/// process last applied and the `stored` object is still at the version that apply made;
/// returns the object as applied, or as stored when nothing was sent. `version` reads the
/// version an edit moves: a Deployment's `generation` (any spec edit), another kind's
/// `resourceVersion` (any edit). See [`crate::stores::Applied`].
async fn apply_if_changed<K>(
    ctx: &Context,
    ns: &str,
    name: &str,
    uid: &str,
    desired: &K,
    stored: Option<K>,
    version: impl Fn(&K) -> Option<String>,
) -> std::result::Result<K, kube::Error>
where
    K: k8s_openapi::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    if let Some(stored) = stored {
        let at = version(&stored);
        if at.is_some() && ctx.applied.unchanged(uid, K::KIND, desired, at.as_deref()) {
            return Ok(stored);
        }
    }
    let applied = Api::<K>::namespaced(ctx.client.clone(), ns)
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(desired),
        )
        .await?;
    let at = version(&applied).unwrap_or_default();
    ctx.applied.record(uid, K::KIND, desired, at);
    Ok(applied)
}

/// Applies the PodDisruptionBudget the spec asks for, or deletes the one a former spec
/// asked for (once per spec without one: see [`Context::no_budget`]); returns the event's
/// note when it deleted one.
async fn disruption_budget(dd: &DiffusionDeployment, ctx: &Context) -> Result<Option<String>> {
    let id = model_id(dd);
    let uid = dd.uid().unwrap_or_default();
    let pdbs: Api<PodDisruptionBudget> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    match resources::disruption_budget(dd) {
        Some(pdb) => {
            ctx.no_budget.lock().expect("not poisoned").remove(&uid);
            pdbs.patch(
                &dd.name_any(),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&pdb),
            )
            .await
            .map_err(kube(format!("applying PodDisruptionBudget of {id}")))?;
            Ok(None)
        }
        None => {
            if ctx.no_budget.lock().expect("not poisoned").contains(&uid) {
                return Ok(None);
            }
            let deleted = match pdbs.delete(&dd.name_any(), &DeleteParams::default()).await {
                Ok(_) => Some(format!(
                    "deleted PodDisruptionBudget {}: the spec asks for none",
                    dd.name_any()
                )),
                Err(kube::Error::Api(e)) if e.code == 404 => None,
                Err(e) => {
                    return Err(kube(format!("deleting PodDisruptionBudget of {id}"))(e));
                }
            };
            ctx.no_budget.lock().expect("not poisoned").insert(uid);
            Ok(deleted)
        }
    }
}

/// Whether every replica the Deployment wants is available (none waits to be placed).
fn all_available(d: Option<&Deployment>) -> bool {
    d.and_then(|d| d.status.as_ref())
        .is_some_and(|s| s.unavailable_replicas.unwrap_or(0) == 0)
}

/// The deployment's engine pods, from the operator's store of them (no request).
fn engine_pods(dd: &DiffusionDeployment, ctx: &Context) -> Vec<Arc<Pod>> {
    ctx.stores.pods_of(
        &dd.namespace().unwrap_or_default(),
        &resources::selector_labels(dd),
    )
}

/// The engine pods the scheduler could not place, each with the scheduler's reason (`<pod>:
/// <message>`, sorted). Looked at only while fewer pods are ready than wanted. A pod the
/// scheduler turns away (or places after all) reconciles its deployment (see
/// [`crate::stores`]), so the message follows the scheduler's.
fn unscheduled(
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
fn observe(
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

/// Creates the deployment's job-key Secret unless it is there; true when it made it. An
/// existing Secret is never rewritten, so the key stays what the running pods have. Create
/// only: the operator never reads a Secret (its RBAC grants no `get` on them). Once made or
/// found, this process does not ask again for the same deployment.
async fn ensure_job_key(ctx: &Context, dd: &DiffusionDeployment) -> Result<bool> {
    let uid = dd.uid().unwrap_or_default();
    if ctx.job_keys.lock().expect("not poisoned").contains(&uid) {
        return Ok(false);
    }
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| Error::Random {
        what: "a job-id key",
        msg: e.to_string(),
    })?;
    let key: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &dd.namespace().unwrap_or_default());
    let secret = resources::job_key_secret(dd, key);
    let made = match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => true,
        Err(kube::Error::Api(e)) if e.code == 409 => false,
        Err(e) => {
            return Err(kube(format!(
                "creating Secret {} of {}",
                resources::job_key_secret_name(dd),
                model_id(dd)
            ))(e))
        }
    };
    ctx.job_keys.lock().expect("not poisoned").insert(uid);
    Ok(made)
}

/// `t` rounded up to a whole second (what a `Time` in status keeps).
fn ceil_second(t: Timestamp) -> Timestamp {
    if t.subsec_nanosecond() == 0 {
        t
    } else {
        Timestamp::from_second(t.as_second() + 1).unwrap_or(t)
    }
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

    fn inventory(node: dra::NodeDevices, named: Option<u32>) -> dra::Inventory {
        dra::Inventory {
            class: "gpu.nvidia.com".into(),
            link_attribute: crds::DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
            named: named.map(|n| ("mine".to_string(), n)),
            nodes: [("n".to_string(), node)].into(),
            memory_published: true,
        }
    }

    #[test]
    fn the_slices_figures_win_and_the_agents_fill_in_what_they_leave_out() {
        let agent = crds::AcceleratorInventory {
            resource_name: "nvidia.com/gpu".into(),
            product: "NVIDIA-H100-80GB-HBM3".into(),
            count: 8,
            memory_bytes: 1 << 30,
            fast_peer_link: true,
        };
        // No DRA: the agent's figures, bounded by what the Node offers.
        assert_eq!(
            accelerators(Some(&agent), None, "n", 4),
            Some((4, 1 << 30, agent.product.clone(), true))
        );
        assert_eq!(accelerators(None, None, "n", 4), None);
        // DRA: the slices' memory and product, a pod's ranks on one link group.
        let full = dra::NodeDevices {
            count: 8,
            memory_bytes: Some(80 << 30),
            product: Some("NVIDIA H100 80GB HBM3".into()),
            linked: 4,
        };
        let inv = inventory(full.clone(), None);
        assert_eq!(
            accelerators(Some(&agent), Some(&inv), "n", 8),
            Some((4, 80 << 30, "NVIDIA H100 80GB HBM3".into(), true))
        );
        // A node the slices do not list is no candidate under DRA.
        assert_eq!(accelerators(Some(&agent), Some(&inv), "other", 8), None);
        // Slices without memory, product or link: the agent's memory and product, every
        // device, no fast link; and without the agent, no memory to plan with.
        let bare = inventory(
            dra::NodeDevices {
                count: 8,
                ..Default::default()
            },
            None,
        );
        assert_eq!(
            accelerators(Some(&agent), Some(&bare), "n", 8),
            Some((8, 1 << 30, agent.product.clone(), false))
        );
        assert_eq!(accelerators(None, Some(&bare), "n", 8), None);
    }

    #[test]
    fn a_named_templates_device_count_fixes_dp_times_sp() {
        let spec = |extra: serde_json::Value| -> crds::DiffusionDeploymentSpec {
            let mut v = serde_json::json!({
                "model": { "family": "wan", "location": { "hostPath": "/m" } },
            });
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            serde_json::from_value(v).unwrap()
        };
        let four = inventory(dra::NodeDevices::default(), Some(4));
        let o = overrides(&spec(serde_json::json!({})), Some(&four)).unwrap();
        assert_eq!((o.dp, o.sp), (Some(4), Some(1)));
        let o = overrides(&spec(serde_json::json!({ "sp": 2 })), Some(&four)).unwrap();
        assert_eq!((o.dp, o.sp), (Some(2), Some(2)));
        for bad in [
            serde_json::json!({ "sp": 3 }),
            serde_json::json!({ "dp": 2 }),
            serde_json::json!({ "sp": 8 }),
        ] {
            let why = overrides(&spec(bad.clone()), Some(&four)).unwrap_err();
            assert!(
                why.contains("ResourceClaimTemplate mine claims 4 device(s)"),
                "{bad}: {why}"
            );
        }
        // A generated template, or none: the spec's own overrides.
        let gen = inventory(dra::NodeDevices::default(), None);
        let o = overrides(&spec(serde_json::json!({ "dp": 3 })), Some(&gen)).unwrap();
        assert_eq!((o.dp, o.sp), (Some(3), None));
        assert_eq!(
            overrides(&spec(serde_json::json!({})), None).unwrap().dp,
            None
        );
    }
}
