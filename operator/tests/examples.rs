//! Model locations against the real control plane: a claim bound to a node's local volume is
//! prepared and planned on that node only; any other claim is refused with the reason; and
//! every shipped example (`crds/examples`), applied as it is, reaches `Available` with a
//! model of its family at the place it names.

mod world;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::{ensure, Context as _, Result};
use crds::{DiffusionDeployment, DiffusionNode, ModelRequest};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client, ResourceExt};
use layerwise_e2e::cluster::wait_until;
use layerwise_e2e::tools::{ok, repo, tool};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use serde_json::json;
use world::{
    condition, deployment_manifest, profile, running_pods, status_of, Fixed, Setup, World, WAIT,
};

/// A PersistentVolume named `name` whose spec is `spec` (its source, affinity), pre-bound to
/// claim `claim` of `ns`.
fn volume(name: &str, ns: &str, claim: &str, spec: serde_json::Value) -> PersistentVolume {
    let mut pv = json!({
        "metadata": { "name": name },
        "spec": {
            "capacity": { "storage": "100Gi" },
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "claimRef": { "namespace": ns, "name": claim },
        }
    });
    world::merge(&mut pv["spec"], spec);
    serde_json::from_value(pv).expect("a PersistentVolume")
}

fn claim(name: &str, volume: Option<&str>) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": { "requests": { "storage": "100Gi" } },
        }
    }))
    .expect("a PersistentVolumeClaim")
}

fn on_node(node: &str) -> serde_json::Value {
    json!({ "nodeAffinity": { "required": { "nodeSelectorTerms": [{ "matchExpressions": [
        { "key": "kubernetes.io/hostname", "operator": "In", "values": [node] }
    ] }] } } })
}

/// Creates the volumes (cluster-wide, so removed by [`delete_volumes`] whatever happens).
async fn create_volumes(client: &Client, pvs: &[PersistentVolume]) -> Result<()> {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    for pv in pvs {
        api.create(&PostParams::default(), pv)
            .await
            .with_context(|| format!("creating PersistentVolume {}", pv.name_any()))?;
    }
    Ok(())
}

async fn delete_volumes(client: &Client, names: &[String]) -> Result<()> {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    for name in names {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e).with_context(|| format!("deleting PersistentVolume {name}")),
        }
    }
    Ok(())
}

async fn bound(client: &Client, ns: &str, name: &str) -> Result<()> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    wait_until(&format!("claim {name} Bound"), WAIT, || async {
        let phase = api
            .get(name)
            .await?
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default();
        Ok(if phase == "Bound" { Ok(()) } else { Err(phase) })
    })
    .await
}

/// Waits for `Planned` False with `reason`; returns the message.
async fn refused(api: &Api<DiffusionDeployment>, name: &str, reason: &str) -> Result<String> {
    wait_until(&format!("{name} refused with {reason}"), WAIT, || async {
        let s = status_of(api, name).await?;
        Ok(match condition(&s, "Planned") {
            Some((st, r, msg)) if st == "False" && r == reason => Ok(msg),
            other => Err(format!("Planned {other:?}")),
        })
    })
    .await
}

async fn available(api: &Api<DiffusionDeployment>, name: &str) -> Result<crds::Plan> {
    wait_until(&format!("{name} Available"), WAIT, || async {
        let s = status_of(api, name).await?;
        Ok(match (&s.plan, condition(&s, "Available")) {
            (Some(plan), Some((st, ..))) if st == "True" => Ok(plan.clone()),
            (_, avail) => Err(format!(
                "Available {avail:?}; Planned {:?}; ModelProfiled {:?}",
                condition(&s, "Planned"),
                condition(&s, "ModelProfiled")
            )),
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_served_from_its_volumes_node_and_other_claims_are_refused() -> Result<()> {
    let w = World::new(
        "claims",
        Arc::new(Fixed(AtomicU64::new(0))),
        profile(57, 400 << 20),
    )
    .await?;
    let mut on_a100_1 = on_node("a100-1");
    world::merge(
        &mut on_a100_1,
        json!({ "hostPath": { "path": "/models/store" } }),
    );
    let pvs = [
        volume(&format!("{}-store", w.ns), &w.ns, "store", on_a100_1),
        volume(
            &format!("{}-nfs", w.ns),
            &w.ns,
            "nfs-store",
            json!({ "nfs": { "server": "127.0.0.1", "path": "/export" } }),
        ),
    ];
    let names: Vec<String> = pvs.iter().map(|p| p.name_any()).collect();
    let result = async {
        create_volumes(&w.client, &pvs).await?;
        claims(&w, &names).await
    }
    .await;
    let client = w.client.clone();
    let torn = w.teardown().await;
    let gone = delete_volumes(&client, &names).await;
    result.and(torn).and(gone)
}

async fn claims(w: &World, pvs: &[String]) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    for c in [
        claim("store", Some(&pvs[0])),
        claim("nfs-store", Some(&pvs[1])),
        claim("pending", None),
    ] {
        pvcs.create(&PostParams::default(), &c).await?;
    }
    bound(client, ns, "store").await?;
    bound(client, ns, "nfs-store").await?;

    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let on_claim = |name: &str, claim: &str| {
        deployment_manifest(
            name,
            json!({ "replicas": 1, "model": { "location": { "hostPath": null, "persistentVolumeClaim": { "claimName": claim, "subPath": "dit" } } } }),
        )
    };
    for (name, c) in [
        ("local", "store"),
        ("network", "nfs-store"),
        ("unbound", "pending"),
        ("missing", "nowhere"),
    ] {
        api.create(
            &PostParams::default(),
            &serde_json::from_value(on_claim(name, c))?,
        )
        .await?;
    }

    // The bound hostPath volume with node affinity: prepared on its node only, as a host
    // folder the agent reads; planned there; its pod runs there.
    let plan = available(&api, "local").await?;
    ensure!(plan.nodes == ["a100-1"], "planned on {:?}", plan.nodes);
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    let id = format!("{ns}/local");
    let mut asked = Vec::new();
    for dn in dns.list(&Default::default()).await? {
        if let Some(m) = dn.spec.models.iter().find(|m| m.id == id) {
            ensure!(
                m.location.host_path.as_deref() == Some("/models/store/dit"),
                "{:?}",
                m.location
            );
            asked.push(dn.name_any());
        }
    }
    ensure!(asked == ["a100-1"], "asked to prepare: {asked:?}");
    let pods = wait_until("the engine pod Running", WAIT, || async {
        let pods = running_pods(client, ns, "local").await?;
        Ok(if pods.len() == 1 {
            Ok(pods)
        } else {
            Err(format!("{pods:?}"))
        })
    })
    .await?;
    ensure!(pods[0].1 == "a100-1", "{pods:?}");
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let d = deploys.get("local").await?;
    let volumes = serde_json::to_value(&d.spec.unwrap().template.spec.unwrap().volumes)?;
    ensure!(
        volumes.to_string().contains(r#""claimName":"store""#),
        "the engine pods mount the claim: {volumes}"
    );

    // Network storage, an unbound claim, no claim: refused with the reason, nothing asked
    // of the nodes, no Deployment.
    let msg = refused(&api, "network", "VolumeNotLocal").await?;
    ensure!(
        msg.contains("of type nfs") && msg.contains("nfs-store"),
        "{msg}"
    );
    let msg = refused(&api, "unbound", "ClaimNotBound").await?;
    ensure!(msg.contains("pending") && msg.contains("Pending"), "{msg}");
    let msg = refused(&api, "missing", "ClaimNotFound").await?;
    ensure!(msg.contains("nowhere"), "{msg}");
    for name in ["network", "unbound", "missing"] {
        ensure!(
            deploys.get_opt(name).await?.is_none(),
            "{name} has a Deployment"
        );
        let id = format!("{ns}/{name}");
        for dn in dns.list(&Default::default()).await? {
            ensure!(
                !dn.spec.models.iter().any(|m| m.id == id),
                "{} was asked to prepare {name}",
                dn.name_any()
            );
        }
    }
    Ok(())
}

/// The model each example's location names, synthesized at its real shapes (headers over
/// sparse files): the preset and transformer depth.
fn model_for(location: &str) -> Option<(&'static str, Option<usize>)> {
    Some(match location {
        "/models/dit-xl-2-512" => ("xl", None),
        // DiT-XL/2's blocks, deeper: 12 GB in f32.
        "/models/big-dit" => ("xl", Some(128)),
        // The local volume's folder (model-store.yaml) with subPath huge-dit.
        "/models/store/huge-dit" => ("xl", Some(512)),
        "/models/wan2.1-t2v-1.3b" => ("wan2.1-1.3b", None),
        "/models/qwen-image" => ("qwen-image", None),
        _ => return None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_example_reaches_available() -> Result<()> {
    let root = tempfile::tempdir()?;
    let models = root.path().to_path_buf();
    // The fake agent profiles what it is asked for from the synthesized folder, as the real
    // agent does (the checkpoint's own headers; its family must be the one asked for).
    let answer: world::Answer = Arc::new(move |req: &ModelRequest| {
        let host = req.location.host_path.as_deref().unwrap_or_default();
        let dir = models.join(host.trim_start_matches('/'));
        let p = layerwise_engine::families::profile(&dir).map_err(|e| e.to_string())?;
        if p.family != req.family {
            return Err(format!(
                "the request names family {}, but {host} is a {} pipeline",
                req.family, p.family
            ));
        }
        Ok(p)
    });
    let w = World::answering("examples", answer).await?;
    let op = w
        .operator(Arc::new(Fixed(AtomicU64::new(0))), Setup::default())
        .await?;
    let pv = format!("{}-model-store", w.ns);
    let result = examples(&w, root.path(), &pv).await;
    let client = w.client.clone();
    let torn = w.teardown_with(vec![op]).await;
    let gone = delete_volumes(&client, &[pv]).await;
    result.and(torn).and(gone)
}

async fn examples(w: &World, root: &Path, pv: &str) -> Result<()> {
    let dir = repo().join("crds/examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"));
    files.sort();
    let mut deployments = BTreeMap::new();
    let mut synthesized = BTreeMap::new();
    // The files of the claim (model-store.yaml) and of the deployment served from it go
    // first, and that deployment is Available before the others are applied: its pod needs
    // all eight GPUs of the volume's node, and the scheduler spreads the others' one-GPU
    // pods over every node, that one included, when they come first (see "Unschedulable"
    // below).
    // Each: the file, its documents, the DiffusionDeployments among them.
    let mut first: Vec<(PathBuf, Vec<String>, Vec<String>)> = Vec::new();
    let mut rest: Vec<(PathBuf, Vec<String>, Vec<String>)> = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)?;
        let mut docs = Vec::new();
        let mut names = Vec::new();
        let mut on_claim = false;
        // A deployment whose nodeSelector names one class of node (offload.yaml's single
        // L4) goes first too: the others' pods may land anywhere, that node included, and
        // with surge rollouts a replaced pod's successor briefly doubles a deployment's.
        let mut pinned = false;
        for mut v in serde_saphyr::from_multiple::<serde_json::Value>(&text)? {
            match v["kind"].as_str() {
                Some("DiffusionDeployment") => {
                    let name = v["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    let loc = &v["spec"]["model"]["location"];
                    let path = match (loc["hostPath"].as_str(), &loc["persistentVolumeClaim"]) {
                        (Some(p), _) => p.to_string(),
                        (None, c) => {
                            ensure!(
                                c["claimName"] == "model-store",
                                "{}: a claim other than model-store.yaml's",
                                file.display()
                            );
                            on_claim = true;
                            format!("/models/store/{}", c["subPath"].as_str().unwrap_or(""))
                        }
                    };
                    pinned |= v["spec"]["accelerator"]["nodeSelector"].is_object();
                    let family = v["spec"]["model"]["family"].as_str().unwrap_or_default();
                    let (preset, layers) = model_for(&path).with_context(|| {
                        format!(
                            "{}: no model of family {family} known for {path}: add it to model_for",
                            file.display()
                        )
                    })?;
                    if !synthesized.contains_key(&path) {
                        let mut opts = SynthOptions::preset(preset)?;
                        opts.sparse = true;
                        if let Some(n) = layers {
                            opts.set_layers(n);
                        }
                        synth(&root.join(path.trim_start_matches('/')), &opts)?;
                        synthesized.insert(path.clone(), preset);
                    }
                    deployments.insert(name.clone(), path);
                    names.push(name);
                }
                // model-store.yaml: the volume on a node of this cluster, bound to this
                // namespace's claim, under a name of this test.
                Some("PersistentVolume") => {
                    on_claim = true;
                    v["metadata"]["name"] = json!(pv);
                    v["spec"]["claimRef"]["namespace"] = json!(w.ns);
                    v["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]
                        ["matchExpressions"][0]["values"] = json!(["a100-0"]);
                }
                Some("PersistentVolumeClaim") => {
                    on_claim = true;
                    v["spec"]["volumeName"] = json!(pv);
                }
                other => anyhow::bail!("{}: an example of kind {other:?}", file.display()),
            }
            docs.push(serde_json::to_string(&v)?);
        }
        let group = if on_claim || pinned {
            &mut first
        } else {
            &mut rest
        };
        group.push((file.clone(), docs, names));
    }
    ensure!(
        deployments.len() >= 5,
        "expected an example per strategy and one on a claim, found {deployments:?}"
    );
    let on_claim: Vec<&String> = deployments
        .iter()
        .filter(|(_, p)| p.starts_with("/models/store/"))
        .map(|(name, _)| name)
        .collect();
    ensure!(
        !on_claim.is_empty(),
        "no example serves a model from a claim"
    );
    let api: Api<DiffusionDeployment> = Api::namespaced(w.client.clone(), &w.ns);
    let mut plans = BTreeMap::new();
    for group in [first, rest] {
        for (file, docs, _) in &group {
            for doc in docs {
                ok(
                    tool("kubectl", &["apply", "-n", &w.ns, "-f", "-"], Some(doc))?,
                    &format!("kubectl apply {}", file.display()),
                )?;
            }
        }
        for name in group.iter().flat_map(|(_, _, names)| names) {
            let path = &deployments[name];
            let plan = available(&api, name).await?;
            eprintln!(
                "{name} ({path}, {}): {:?} dp {} on {:?}",
                synthesized[path], plan.strategy, plan.dp, plan.nodes
            );
            if path.starts_with("/models/store/") {
                ensure!(plan.nodes == ["a100-0"], "{name}: {:?}", plan.nodes);
            }
            plans.insert(name.clone(), plan);
        }
    }
    unschedulable(w, &api, on_claim[0], &plans[on_claim[0]]).await
}

/// A second replica of the whole-node deployment on the claim cannot be placed (its one
/// node's devices are all taken): the deployment stays Available with its first pod, and
/// `Progressing` says `Unschedulable` with the scheduler's reason, with a Warning event.
async fn unschedulable(
    w: &World,
    api: &Api<DiffusionDeployment>,
    name: &str,
    plan: &crds::Plan,
) -> Result<()> {
    ensure!(
        plan.nodes.len() == 1,
        "{name}: planned on {:?}, expected its volume's one node",
        plan.nodes
    );
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({ "spec": { "replicas": 2 } })),
    )
    .await?;
    let msg = wait_until(&format!("{name} Unschedulable"), WAIT, || async {
        let s = status_of(api, name).await?;
        Ok(
            match (condition(&s, "Progressing"), condition(&s, "Available")) {
                (Some((p, r, msg)), Some((a, ..)))
                    if p == "True" && r == "Unschedulable" && a == "True" =>
                {
                    Ok(msg)
                }
                other => Err(format!("Progressing, Available: {other:?}")),
            },
        )
    })
    .await?;
    ensure!(
        msg.starts_with("1 of 2 engine pods ready; 1 cannot be scheduled: ")
            && msg.contains("Insufficient nvidia.com/gpu"),
        "{msg}"
    );
    let reasons = world::event_reasons(&w.client, &w.ns).await?;
    ensure!(
        reasons.iter().any(|r| r == "Unschedulable"),
        "no Unschedulable event: {reasons:?}"
    );
    Ok(())
}
