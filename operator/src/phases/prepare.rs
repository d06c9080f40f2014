//! The phases before planning: where the model is on the nodes, the devices Dynamic
//! Resource Allocation offers (and claiming the plan's), and asking the candidate nodes to
//! prepare the model.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use crds::DiffusionDeployment;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use crate::context::Context;
use crate::dra;
use crate::error::{kube, Result};
use crate::placement::{self, Candidate};
use crate::report::{Report, Stop};
use crate::requests::model_id;
use crate::requests::Change;
use crate::volume::{self, Located};

use super::observe::engine_pods;
use super::phase::Phase;

/// Where the model is on the nodes (see [`crate::volume`]): a hostPath as it is, a claim
/// as the folder and nodes of the volume it is bound to. The folder must lie inside the
/// configured roots: nothing is asked of the nodes and no pod mounts it otherwise.
pub(super) async fn locate(dd: &DiffusionDeployment, ctx: &Context) -> Result<Phase<Located>> {
    let location = &dd.spec.model.location;
    if let Some(why) = volume::unserved(location) {
        return Ok(ControlFlow::Break(Stop::ClaimUnusable {
            reason: why.reason,
            message: why.message,
        }));
    }
    if let Some(s3) = &location.s3 {
        // The agents stage it into their caches: no folder to check until a copy exists.
        return Ok(ControlFlow::Continue(Located {
            host_path: String::new(),
            nodes: None,
            describe: s3.describe(),
        }));
    }
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
                message: "the model names no source: set hostPath, persistentVolumeClaim or s3"
                    .into(),
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
pub(super) async fn devices(
    dd: &DiffusionDeployment,
    ctx: &Context,
) -> Result<Phase<Option<dra::Inventory>>> {
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
pub(super) async fn claim_devices(
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
pub(super) async fn prepare(
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
    // The agents read host folders: a claim reaches them as its volume's folder (a hub
    // cache repository's with the revision to read of it); an s3 source as it is, for them
    // to stage (the credentials stay in their Secret, named only).
    let location = match &spec.model.location.s3 {
        Some(_) => spec.model.location.clone(),
        None => crds::ModelLocation {
            host_path: Some(located.host_path.clone()),
            revision: spec.model.location.revision.clone(),
            ..Default::default()
        },
    };
    let request = crds::ModelRequest {
        id: id.clone(),
        family: spec.model.family.clone(),
        location,
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
