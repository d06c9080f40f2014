//! The deploy phase: the engine Deployment, Service, PodDisruptionBudget and job-key Secret,
//! each applied only when what the operator would write changed.

use crds::{DiffusionDeployment, Plan};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use crate::context::{Context, MANAGER};
use crate::error::{kube, Error, Result};
use crate::report::Report;
use crate::requests::model_id;
use crate::resources::{self, PLAN_ANNOTATION};

/// Applies the engine Deployment and Service (and makes the job-key Secret once); returns
/// the Deployment as applied.
pub(super) async fn deploy(
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
    let image = resources::image::engine_image(
        dd,
        r.old.engine_image.as_deref(),
        existing.as_ref(),
        &ctx.settings.engine_image,
    );
    if let Some(was) = r.old.engine_image.as_deref().filter(|was| *was != image) {
        let note = format!("engine image changed from {was} to {image}: rolling the engine pods");
        r.event(EventType::Normal, "EngineImageChanged", "Deploy", note);
    }
    r.status.engine_image = Some(image.clone());
    let mut desired = resources::deployment(
        dd,
        &placed,
        replicas,
        &image,
        &ctx.settings.engine_pods,
        &warm,
    );
    crate::surge::steer(
        dd,
        ctx,
        &placed,
        replicas,
        &mut desired,
        existing.as_ref(),
        r,
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
