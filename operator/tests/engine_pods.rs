//! Engine pods as a platform team sets them up, against the real control plane: the chart
//! installed with pull secrets, a RuntimeClass and tolerations for every engine pod, the
//! operator given exactly what the chart's operator Deployment passes it, and a
//! DiffusionDeployment asking for its own pull secret, tolerations, topology spread and
//! PodDisruptionBudget. The Deployment and the PDB the operator makes (as the chart's
//! service account) carry them, the apiserver admits the pods, and the disruption controller
//! counts them.

mod world;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::{ensure, Context as _, Result};
use crds::DiffusionDeployment;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PodSpec, Toleration};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use layerwise_e2e::cluster::wait_until;
use layerwise_operator::resources::EnginePods;
use serde_json::json;
use world::{deployment_manifest, event_reasons, profile, running_pods, Fixed, Setup, World, WAIT};

/// The taint every accelerator node of the platform carries.
const PLATFORM_TAINT: &str = "example.com/accelerator";
/// The taint only this model's nodes carry.
const MODEL_TAINT: &str = "example.com/team-ml";

fn toleration(key: &str) -> Toleration {
    Toleration {
        key: Some(key.into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_pods_carry_the_platforms_and_the_models_settings() -> Result<()> {
    // A RuntimeClass of this test's own: the apiserver refuses pods naming one that is not
    // there, so the pods being created shows the name reached them intact.
    let client = layerwise_e2e::cluster::client().await?;
    let runtime_class = format!(
        "lw-test-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos()
    );
    let rcs: Api<RuntimeClass> = Api::all(client.clone());
    rcs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": { "name": runtime_class },
            "handler": "runc",
        }))?,
    )
    .await?;
    let tolerations = format!(
        "enginePods.tolerations=[{}]",
        serde_json::to_string(&toleration(PLATFORM_TAINT))?
    );
    let runtime = format!("enginePods.runtimeClassName={runtime_class}");
    // ~25 GiB: resident on any of the fleet's GPUs.
    let small = profile(57, 400 << 20);
    let world = World::installed(
        "engine-pods",
        Arc::new(move |_: &crds::ModelRequest| Ok(small.clone())),
        &[
            "--set",
            "imagePullSecrets[0].name=regcred",
            "--set",
            &runtime,
            "--set-json",
            &tolerations,
        ],
    )
    .await;
    let result = match world {
        Ok(w) => {
            // The controller stays up until teardown has deleted the deployments (it removes
            // their finalizers).
            let (op, result) = match operator(&w, &runtime_class).await {
                Ok(op) => (vec![op], run(&w, &runtime_class).await),
                Err(e) => (Vec::new(), Err(e)),
            };
            let torn = w.teardown_with(op).await;
            result.and(torn)
        }
        Err(e) => Err(e),
    };
    let removed = rcs.delete(&runtime_class, &DeleteParams::default()).await;
    result.and(removed.map(|_| ()).map_err(Into::into))
}

/// What the chart's operator Deployment passes the operator about engine pods, read as the
/// operator reads its flags.
async fn chart_engine_pods(w: &World) -> Result<EnginePods> {
    let deploys: Api<Deployment> = Api::namespaced(w.client.clone(), &w.ns);
    let op = deploys
        .get(&format!("{}-layerwise-operator", w.release))
        .await?;
    let env: BTreeMap<String, String> = op
        .spec
        .and_then(|s| s.template.spec)
        .context("the operator's pod template")?
        .containers[0]
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let secrets: Vec<String> = env
        .get("LAYERWISE_ENGINE_IMAGE_PULL_SECRETS")
        .map(|s| s.split(',').map(String::from).collect())
        .unwrap_or_default();
    EnginePods::from_flags(
        &secrets,
        env.get("LAYERWISE_ENGINE_RUNTIME_CLASS")
            .map(String::as_str),
        env.get("LAYERWISE_ENGINE_TOLERATIONS").map(String::as_str),
    )
    .map_err(anyhow::Error::msg)
}

/// A controller given what the chart passes the operator, checked to be what was set.
async fn operator(w: &World, runtime_class: &str) -> Result<world::Operator> {
    let engine_pods = chart_engine_pods(w).await?;
    assert_eq!(
        engine_pods,
        EnginePods {
            image_pull_secrets: vec!["regcred".into()],
            runtime_class_name: Some(runtime_class.into()),
            tolerations: vec![toleration(PLATFORM_TAINT)],
            ..EnginePods::default()
        }
    );
    let setup = Setup {
        engine_pods,
        ..Setup::default()
    };
    w.operator(Arc::new(Fixed(AtomicU64::new(0))), setup).await
}

async fn run(w: &World, runtime_class: &str) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);

    // What the apiserver refuses before the operator sees it.
    for (bad, says) in [
        (
            json!({ "engine": { "disruptionBudget": { "minAvailable": 1, "maxUnavailable": 1 } } }),
            "exactly one of minAvailable and maxUnavailable",
        ),
        (
            json!({ "engine": { "disruptionBudget": { "minAvailable": "half" } } }),
            "minAvailable must be a number of at least 0 or a percentage",
        ),
        (
            json!({ "engine": { "topologySpreadConstraints": [
                { "maxSkew": 0, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule" } ] } }),
            "maxSkew must be at least 1",
        ),
        (
            json!({ "engine": { "topologySpreadConstraints": [
                { "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "Sometimes" } ] } }),
            "whenUnsatisfiable must be DoNotSchedule or ScheduleAnyway",
        ),
    ] {
        let dd: DiffusionDeployment =
            serde_json::from_value(deployment_manifest("refused", bad.clone()))?;
        let err = api
            .create(&PostParams::default(), &dd)
            .await
            .err()
            .with_context(|| format!("{bad} was accepted"))?;
        ensure!(err.to_string().contains(says), "{bad}: {err}");
    }

    let dd = deployment_manifest(
        "spread",
        json!({
            "replicas": 2,
            "accelerator": { "tolerations": [toleration(MODEL_TAINT), toleration(PLATFORM_TAINT)] },
            "engine": {
                "imagePullSecrets": [{ "name": "model-registry" }],
                "topologySpreadConstraints": [{
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                }],
                "disruptionBudget": { "minAvailable": 1 },
            },
        }),
    );
    api.create(&PostParams::default(), &serde_json::from_value(dd)?)
        .await?;

    // Both pods are admitted (their RuntimeClass exists) and run.
    wait_until("two engine pods running", WAIT, || async {
        let pods = running_pods(client, ns, "spread").await?;
        Ok(if pods.len() == 2 {
            Ok(())
        } else {
            Err(format!("{pods:?}"))
        })
    })
    .await?;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let d = deploys.get("spread").await?;
    let selector = d.spec.as_ref().unwrap().selector.match_labels.clone();
    let pod: PodSpec = d.spec.unwrap().template.spec.unwrap();
    let secrets: Vec<&str> = pod
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(secrets, ["regcred", "model-registry"]);
    assert_eq!(pod.runtime_class_name.as_deref(), Some(runtime_class));
    assert_eq!(
        pod.tolerations.as_deref(),
        Some(&[toleration(PLATFORM_TAINT), toleration(MODEL_TAINT)][..])
    );
    let spread = pod.topology_spread_constraints.unwrap_or_default();
    assert_eq!(spread.len(), 1, "{spread:?}");
    assert_eq!(
        (
            spread[0].topology_key.as_str(),
            spread[0].when_unsatisfiable.as_str()
        ),
        ("kubernetes.io/hostname", "ScheduleAnyway")
    );
    assert_eq!(
        spread[0].label_selector.as_ref().unwrap().match_labels,
        selector
    );

    // The budget is the operator's, selects the engine pods, and the disruption controller
    // counts them: two healthy, one may go.
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    let pdb = wait_until(
        "the PodDisruptionBudget counting both pods",
        WAIT,
        || async {
            let Some(pdb) = pdbs.get_opt("spread").await? else {
                return Ok(Err("no PodDisruptionBudget".into()));
            };
            let st = pdb.status.clone().unwrap_or_default();
            Ok(
                if st.current_healthy == Some(2) && st.disruptions_allowed == Some(1) {
                    Ok(pdb)
                } else {
                    Err(format!("status {st:?}"))
                },
            )
        },
    )
    .await?;
    let owner = &pdb.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("DiffusionDeployment", "spread")
    );
    let spec = pdb.spec.unwrap();
    assert_eq!(spec.min_available, Some(IntOrString::Int(1)));
    assert_eq!(spec.selector.unwrap().match_labels, selector);

    // A new budget replaces the old one's terms.
    let patch = json!({ "spec": { "engine": { "disruptionBudget": { "minAvailable": null, "maxUnavailable": "50%" } } } });
    api.patch("spread", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_until("the budget follows the spec", WAIT, || async {
        let spec = pdbs.get("spread").await?.spec.unwrap_or_default();
        Ok(
            match (spec.min_available.as_ref(), spec.max_unavailable.as_ref()) {
                (None, Some(IntOrString::String(p))) if p == "50%" => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
    })
    .await?;

    // Dropping it from the spec deletes it.
    let patch = json!({ "spec": { "engine": { "disruptionBudget": null } } });
    api.patch("spread", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_until("the budget deleted", WAIT, || async {
        Ok(match pdbs.get_opt("spread").await? {
            None => Ok(()),
            Some(p) => Err(format!("still there: {:?}", p.spec)),
        })
    })
    .await?;
    ensure!(
        event_reasons(client, ns)
            .await?
            .iter()
            .any(|r| r == "DisruptionBudgetDeleted"),
        "no DisruptionBudgetDeleted event"
    );
    Ok(())
}
