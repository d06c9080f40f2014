//! The planning phase: the profiles the prepared nodes report, each candidate's
//! accelerators (the agent's figures, or the devices DRA publishes), what the spec fixes, and
//! the planner's plan or refusal.

use std::ops::ControlFlow;

use crds::{DiffusionDeployment, ModelState, NodeModelStatus, Plan, Profile};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::runtime::events::EventType;
use kube::ResourceExt;

use crate::conditions as cond;
use crate::context::Context;
use crate::dra;
use crate::error::Result;
use crate::placement::Candidate;
use crate::planner::{self, NodeReport, NodeShape, Overrides};
use crate::report::{Report, Stop};
use crate::requests::model_id;
use crate::resources::{self};

use super::phase::Phase;

/// A node of the prepare set that reported a usable profile.
pub(super) struct Profiled<'a> {
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
pub(super) fn profiles<'a>(
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
pub(super) fn plan(
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
            let report = NodeReport {
                name,
                devices: count,
                device_bytes,
                product,
                fast_peer_link,
                host_bytes: offer.memory.map_or(host, |a| a.min(host)),
                warm: p.model.state == ModelState::Warm,
            };
            Some(planner::Candidate {
                node: NodeShape::for_spec(report, spec),
                profile: p.profile,
            })
        })
        .collect();
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
    let plan = match planner::plan_deployment(spec, &shapes, &fixed, &ctx.settings.limits) {
        Ok(planner::Recorded { mut plan, .. }) => {
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
                "{}{}",
                refusal.for_workload(w),
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

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
