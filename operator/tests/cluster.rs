//! The operator against the real control plane (tests/cluster): the chart's CRDs and RBAC
//! installed, DiffusionNode profiles written by the test as the agent would, the controller
//! run in-process as the chart's service account, and kwok playing the GPU nodes' kubelets.
//!
//! Every test works in its own namespace, runs a controller that watches only it, and removes
//! what it made; all traffic goes to the loopback apiserver.

mod world;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use crds::{DiffusionDeployment, DiffusionNode};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::DynamicObject;
use kube::Api;
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::dra::{self, FakeNode};
use layerwise_e2e::shapes::Shape;
use layerwise_e2e::tools::{
    apply_crds, impersonating, inference_pool_crd, install_crds, ok, repo, tool,
};
use serde_json::json;
use world::{
    condition, deployment_manifest, event_reasons, profile, running_pods, status_of, Fixed, World,
    GIB, WAIT,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_runs_replans_and_cleans_up() -> Result<()> {
    // ~102 GiB: resident on the 140 GiB H200, only sharded on the 80 GiB A100s.
    let world = World::new(
        "operator",
        Arc::new(Fixed(AtomicU64::new(0))),
        profile(100, GIB),
    )
    .await?;
    let result = lifecycle(&world).await;
    let torn = world.teardown().await;
    result.and(torn)
}

async fn lifecycle(w: &World) -> Result<()> {
    let t0 = Instant::now();
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let dd = deployment_manifest("big", json!({ "replicas": 1 }));
    api.create(&PostParams::default(), &serde_json::from_value(dd)?)
        .await?;

    // A model outside the roots the operator serves from: refused with a condition and an
    // event, nothing asked of the nodes, no Deployment.
    let outside = deployment_manifest(
        "outside",
        json!({ "model": { "location": { "hostPath": "/etc/ssh" } } }),
    );
    api.create(&PostParams::default(), &serde_json::from_value(outside)?)
        .await?;
    let refused = wait_until("the model outside the roots refused", WAIT, || async {
        let s = status_of(&api, "outside").await?;
        Ok(match condition(&s, "Planned") {
            Some((st, reason, msg)) if st == "False" && reason == "ModelOutsideRoots" => Ok(msg),
            other => Err(format!("Planned {other:?}")),
        })
    })
    .await?;
    assert!(
        refused.contains("/etc/ssh") && refused.contains("/models"),
        "{refused}"
    );
    // A person must act: Stalled (kstatus' Failed), not Ready; the steps the reconcile never
    // reached are Unknown, not False.
    let s = status_of(&api, "outside").await?;
    for (c, want) in [
        ("Stalled", ("True", "ModelOutsideRoots")),
        ("Ready", ("False", "ModelOutsideRoots")),
        ("Reconciling", ("False", "Stalled")),
        ("ModelProfiled", ("Unknown", "NotReached")),
        ("Available", ("Unknown", "NotReached")),
    ] {
        let got = condition(&s, c);
        assert_eq!(
            got.as_ref().map(|g| (g.0.as_str(), g.1.as_str())),
            Some(want),
            "{c}: {:?}",
            s.conditions
        );
    }
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    assert!(deploys.get_opt("outside").await?.is_none());
    assert!(event_reasons(client, ns)
        .await?
        .iter()
        .any(|r| r == "ModelOutsideRoots"));
    let dns: Api<crds::DiffusionNode> = Api::all(client.clone());
    for dn in dns.list(&Default::default()).await? {
        assert!(
            !dn.spec.models.iter().any(|m| m.id.ends_with("/outside")),
            "{} was asked to prepare a model outside the roots",
            dn.metadata.name.unwrap_or_default()
        );
    }
    api.delete("outside", &Default::default()).await?;

    let status = wait_until("plan recorded and Available", WAIT, || async {
        let s = status_of(&api, "big").await?;
        let avail = condition(&s, "Available");
        Ok(match (&s.plan, &avail) {
            (Some(_), Some((st, ..))) if st == "True" => Ok(s),
            _ => Err(format!(
                "plan {:?}, Available {avail:?}, Planned {:?}",
                s.plan.as_ref().map(|p| p.strategy),
                condition(&s, "Planned")
            )),
        })
    })
    .await?;
    eprintln!("plan + Available after {:?}", t0.elapsed());
    // The summary condition follows, as `kubectl wait` and kstatus-based tools read it.
    ok(
        tool(
            "kubectl",
            &[
                "wait",
                "--for=condition=Ready",
                "--timeout=60s",
                "-n",
                ns,
                "diffusiondeployment/big",
            ],
            None,
        )?,
        "kubectl wait --for=condition=Ready",
    )?;
    let s = status_of(&api, "big").await?;
    for c in ["Reconciling", "Stalled"] {
        assert_eq!(
            condition(&s, c).map(|c| c.0),
            Some("False".into()),
            "{c}: {:?}",
            s.conditions
        );
    }
    let plan = status.plan.clone().unwrap();
    assert_eq!(plan.strategy, crds::Strategy::Resident, "{plan:?}");
    assert_eq!(plan.nodes, vec!["h200-0".to_string()]);
    assert!(
        plan.rejected.iter().any(|r| r.starts_with("sharded")),
        "{:?}",
        plan.rejected
    );
    for c in ["ModelProfiled", "Planned", "CacheWarm", "Available"] {
        assert_eq!(
            condition(&status, c).map(|c| c.0),
            Some("True".into()),
            "{c}: {:?}",
            status.conditions
        );
    }

    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let d = deploys.get("big").await?;
    let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap().join(" ");
    assert!(args.contains("--strategy resident --dp 1"), "{args}");
    assert_eq!(
        c.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"].0,
        "1"
    );
    assert_eq!(
        c.security_context
            .as_ref()
            .unwrap()
            .read_only_root_filesystem,
        Some(true)
    );
    assert_eq!(c.volume_mounts.as_ref().unwrap()[0].read_only, Some(true));
    assert_eq!(d.metadata.owner_references.as_ref().unwrap()[0].name, "big");
    let key = job_key(w, c).await?;

    let pods = wait_until("an engine pod Running", WAIT, || async {
        let pods = running_pods(client, ns, "big").await?;
        Ok(if pods.len() == 1 {
            Ok(pods)
        } else {
            Err(format!("{pods:?}"))
        })
    })
    .await?;
    assert_eq!(pods[0].1, "h200-0", "scheduled onto the node the plan fits");

    let table = ok(
        tool("kubectl", &["get", "diffusiondeployments", "-n", ns], None)?,
        "kubectl get",
    )?;
    eprintln!("{table}");
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "STRATEGY", "DP", "SP", "REPLICAS", "READY", "QUEUE", "AGE"]
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(&row[..6], ["big", "resident", "1", "1", "1", "1"]);

    // Bigger images: activations no longer fit beside the whole model; the fewest H200
    // devices whose shards and activations fit is three, but pods of three would leave two
    // of the node's eight idle: four, and the pods roll.
    let t1 = Instant::now();
    api.patch(
        "big",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "workload": { "maxWidth": 2048, "maxHeight": 2048 } } })),
    )
    .await?;
    let replanned = wait_until("re-plan after a spec change", WAIT, || async {
        let s = status_of(&api, "big").await?;
        Ok(match &s.plan {
            Some(p) if p.strategy != crds::Strategy::Resident => Ok(p.clone()),
            p => Err(format!("{:?}", p.as_ref().map(|p| (p.strategy, p.dp)))),
        })
    })
    .await?;
    assert_eq!(
        (replanned.strategy, replanned.dp),
        (crds::Strategy::Sharded, 4),
        "{replanned:?}"
    );
    wait_until("rolled pod Running with 4 accelerators", WAIT, || async {
        let d = deploys.get("big").await?;
        let args = d.spec.unwrap().template.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap()
            .join(" ");
        let pods = running_pods(client, ns, "big").await?;
        Ok(
            if args.contains("--strategy sharded --dp 4") && pods.len() == 1 {
                Ok(())
            } else {
                Err(format!("{args}; {pods:?}"))
            },
        )
    })
    .await?;
    eprintln!("re-planned and rolled after {:?}", t1.elapsed());
    // Dozens of reconciles later (resync 1 s, a new plan, a roll): the same key.
    let d = deploys.get("big").await?;
    let again = job_key(w, &d.spec.unwrap().template.spec.unwrap().containers[0]).await?;
    assert!(
        again == key,
        "the job key Secret was rewritten: resourceVersion {} then {}",
        key.0,
        again.0
    );

    // An infeasible spec is reported; what runs stays.
    api.patch(
        "big",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "workload": { "maxWidth": 8192, "maxHeight": 8192 } } })),
    )
    .await?;
    let refused = wait_until("infeasible spec reported", WAIT, || async {
        let s = status_of(&api, "big").await?;
        Ok(match condition(&s, "Planned") {
            Some((st, reason, msg)) if st == "False" => Ok((reason, msg)),
            other => Err(format!("{other:?}")),
        })
    })
    .await?;
    assert_eq!(refused.0, "InsufficientDeviceMemory", "{refused:?}");
    assert!(refused.1.contains("short by"), "{}", refused.1);
    let d = deploys.get("big").await?;
    assert!(d.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap()
        .join(" ")
        .contains("--strategy sharded --dp 4"));
    assert_eq!(
        running_pods(client, ns, "big").await?.len(),
        1,
        "nothing running is torn down"
    );

    let reasons = event_reasons(client, ns).await?;
    for r in [
        "PrepareRequested",
        "ModelProfiled",
        "Planned",
        "Created",
        "Available",
        "Rolling",
        "InsufficientDeviceMemory",
        "JobKeyCreated",
    ] {
        assert!(
            reasons.iter().any(|x| x == r),
            "no {r} event in {reasons:?}"
        );
    }

    // Deleting the resource removes everything it created.
    let t2 = Instant::now();
    api.delete("big", &DeleteParams::default()).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    let id = format!("{ns}/big");
    wait_until("everything the deployment made is gone", WAIT, || async {
        let left = (
            api.get_opt("big").await?.is_some(),
            deploys.get_opt("big").await?.is_some(),
            services.get_opt("big").await?.is_some(),
            secrets.get_opt("big-job-key").await?.is_some(),
            running_pods(client, ns, "big").await?.len(),
            dns.list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|d| d.spec.models.iter().any(|m| m.id == id))
                .count(),
        );
        Ok(if left == (false, false, false, false, 0, 0) {
            Ok(())
        } else {
            Err(format!(
                "(resource, deployment, service, job key secret, pods, prepare requests) = {left:?}"
            ))
        })
    })
    .await?;
    eprintln!("cleaned up after {:?}", t2.elapsed());
    Ok(())
}

/// The deployment's job-key Secret, checked: owned by the DiffusionDeployment (so it is
/// collected with it), immutable, one 256-bit key, what the engine container `c` takes as
/// `LAYERWISE_JOB_KEY` beside its pod IP; and out of the operator's own reach (it may
/// create Secrets, never read them). Returns its resourceVersion and key.
async fn job_key(
    w: &World,
    c: &k8s_openapi::api::core::v1::Container,
) -> Result<(String, Vec<u8>)> {
    let secrets: Api<Secret> = Api::namespaced(w.client.clone(), &w.ns);
    let secret = secrets.get("big-job-key").await?;
    let owner = &secret.metadata.owner_references.clone().unwrap_or_default()[0];
    ensure!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller)
            == ("DiffusionDeployment", "big", Some(true)),
        "{owner:?}"
    );
    ensure!(secret.immutable == Some(true), "{:?}", secret.immutable);
    let key = secret.data.clone().unwrap_or_default()["job-key"].0.clone();
    ensure!(
        key.len() == 64 && key.iter().all(u8::is_ascii_hexdigit),
        "a key of {} bytes",
        key.len()
    );
    let env = c.env.clone().unwrap_or_default();
    let from = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.clone())
    };
    let r = from("LAYERWISE_JOB_KEY").and_then(|f| f.secret_key_ref);
    ensure!(
        r.as_ref().map(|r| (r.name.as_str(), r.key.as_str())) == Some(("big-job-key", "job-key")),
        "LAYERWISE_JOB_KEY from {r:?}"
    );
    let ip = from("LAYERWISE_POD_IP").and_then(|f| f.field_ref);
    ensure!(
        ip.as_ref().map(|f| f.field_path.as_str()) == Some("status.podIP"),
        "LAYERWISE_POD_IP from {ip:?}"
    );
    let sa = format!(
        "system:serviceaccount:{}:{}-layerwise-operator",
        w.ns, w.release
    );
    let as_operator: Api<Secret> = Api::namespaced(impersonating(&sa).await?, &w.ns);
    match as_operator.get("big-job-key").await {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => bail!("the operator's account read a Secret: {other:?}"),
    }
    Ok((secret.metadata.resource_version.unwrap_or_default(), key))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaler_grows_at_once_and_shrinks_after_the_delay() -> Result<()> {
    let load = Arc::new(Fixed(AtomicU64::new(0)));
    // ~25 GiB: resident anywhere.
    let world = World::new("autoscale", load.clone(), profile(57, 400 << 20)).await?;
    let result = autoscale(&world, &load).await;
    let torn = world.teardown().await;
    result.and(torn)
}

async fn autoscale(w: &World, load: &Fixed) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    // Kept to the A100 nodes, away from the H200 the other test plans for.
    let auto = json!({
        "autoscaling": { "minReplicas": 1, "maxReplicas": 3, "targetQueuePerReplica": 2, "scaleDownDelaySeconds": 4 },
        "accelerator": { "nodeSelector": { "node.kubernetes.io/instance-type": "a100" } },
    });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("small", auto))?,
    )
    .await?;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let replicas = |want: i32| {
        let deploys = deploys.clone();
        move || {
            let deploys = deploys.clone();
            async move {
                let r = deploys
                    .get_opt("small")
                    .await?
                    .and_then(|d| d.spec?.replicas);
                Ok(if r == Some(want) {
                    Ok(())
                } else {
                    Err(format!("replicas {r:?}"))
                })
            }
        }
    };
    wait_until("Deployment at 1 replica", WAIT, replicas(1)).await?;
    wait_until("one pod Running", WAIT, || async {
        let n = running_pods(client, ns, "small").await?.len();
        Ok(if n == 1 {
            Ok(())
        } else {
            Err(format!("{n} running"))
        })
    })
    .await?;

    // 5 queued on the one pod: ceil(5 / 2) = 3.
    let t = Instant::now();
    load.0.store(5, Ordering::SeqCst);
    wait_until("scale up to 3", Duration::from_secs(30), replicas(3)).await?;
    eprintln!("scaled up after {:?}", t.elapsed());
    // The reconcile that scaled writes the status after the Deployment: not at the same
    // instant.
    wait_until(
        "the queue depth in status",
        Duration::from_secs(10),
        || async {
            let depth = status_of(&api, "small").await?.queue_depth;
            Ok(if depth >= 5 {
                Ok(())
            } else {
                Err(format!("queue depth {depth}"))
            })
        },
    )
    .await?;

    let t = Instant::now();
    load.0.store(0, Ordering::SeqCst);
    wait_until("scale down to 1", Duration::from_secs(60), replicas(1)).await?;
    let took = t.elapsed();
    eprintln!("scaled down after {took:?}");
    assert!(
        took >= Duration::from_secs(4),
        "scaled down after {took:?}, before the 4 s delay"
    );
    let reasons = event_reasons(client, ns).await?;
    assert!(
        reasons.iter().filter(|r| *r == "Scaled").count() >= 1,
        "{reasons:?}"
    );
    api.delete("small", &DeleteParams::default()).await?;
    wait_until("deployment gone", WAIT, || async {
        Ok(if api.get_opt("small").await?.is_none() {
            Ok(())
        } else {
            Err("still there".into())
        })
    })
    .await?;
    Ok(())
}

/// Applies `manifest` with kubectl, returning its exit status and output.
fn kubectl_apply(ns: &str, manifest: &str, dry_run: bool) -> Result<(bool, String)> {
    let mut args = vec!["apply", "--server-side", "-n", ns, "-f", "-"];
    if dry_run {
        args.push("--dry-run=server");
    }
    let out = tool("kubectl", &args, Some(manifest))?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

#[tokio::test]
async fn invalid_specs_are_rejected_with_the_cel_message_and_examples_are_valid() -> Result<()> {
    let client = cluster::client().await?;
    install_crds(&client, WAIT).await?;
    let ns = cluster::create_namespace(&client, "cel").await?;
    let nss: Api<Namespace> = Api::all(client.clone());
    let result = cel(&ns);
    nss.delete(&ns, &DeleteParams::default()).await?;
    result
}

fn cel(ns: &str) -> Result<()> {
    let cases = [
        (
            json!({ "autoscaling": { "minReplicas": 3, "maxReplicas": 2 } }),
            "minReplicas must not exceed maxReplicas",
        ),
        (
            json!({ "model": { "location": { "hostPath": "models/x" } } }),
            "hostPath must be an absolute path",
        ),
        (
            json!({ "model": { "location": { "persistentVolumeClaim": { "claimName": "c" } } } }),
            "set exactly one source: hostPath, persistentVolumeClaim or s3",
        ),
        (json!({ "dp": 0 }), "dp must be at least 1"),
        (
            json!({ "autoscaling": { "minReplicas": 0, "maxReplicas": 2 } }),
            "builtin autoscaling needs minReplicas of at least 1",
        ),
        (
            json!({ "autoscaling": { "mode": "builtin", "minReplicas": 0, "maxReplicas": 2 } }),
            "builtin autoscaling needs minReplicas of at least 1",
        ),
        (
            json!({ "strategy": "sharded", "dp": 1, "sp": 1 }),
            "strategy sharded needs dp × sp of at least 2",
        ),
        (
            json!({ "strategy": "offload-sharded", "dp": 1, "sp": 1 }),
            "strategy offload-sharded needs dp × sp of at least 2",
        ),
        (json!({ "sp": 0 }), "sp must be between 1 and 16"),
        (json!({ "sp": 17 }), "sp must be between 1 and 16"),
        (
            json!({ "workload": { "maxLatencySeconds": 0 } }),
            "maxLatencySeconds must be positive",
        ),
        (
            json!({ "strategy": "fastest" }),
            "Unsupported value: \"fastest\"",
        ),
        (
            json!({ "inferencePool": { "enabled": true, "endpointPickerRef": { "name": "epp" } } }),
            "endpointPickerRef.port is required when kind is Service",
        ),
        (
            json!({ "inferencePool": { "endpointPickerRef": { "name": "epp", "port": { "number": 0 } } } }),
            "endpointPickerRef.port.number must be between 1 and 65535",
        ),
        (
            json!({ "inferencePool": { "endpointPickerRef": { "name": "epp", "port": { "number": 9002 }, "failureMode": "Sometimes" } } }),
            "Unsupported value: \"Sometimes\"",
        ),
        (
            json!({ "accelerator": { "resourceName": "nvidia.com/gpu", "dra": { "deviceClassName": "gpu.nvidia.com" } } }),
            "resourceName (an extended resource) and dra (devices by Dynamic Resource Allocation) are two ways",
        ),
        (
            json!({ "accelerator": { "dra": {} } }),
            "dra names exactly one of deviceClassName",
        ),
        (
            json!({ "accelerator": { "dra": { "deviceClassName": "a", "resourceClaimTemplateName": "b" } } }),
            "dra names exactly one of deviceClassName",
        ),
        (
            json!({ "accelerator": { "dra": { "deviceClassName": "gpu.nvidia.com", "linkAttribute": "not a name" } } }),
            "spec.accelerator.dra.linkAttribute",
        ),
    ];
    for (extra, message) in cases {
        let manifest = serde_json::to_string(&deployment_manifest("bad", extra.clone()))?;
        let (success, out) = kubectl_apply(ns, &manifest, false)?;
        ensure!(!success, "{extra} was accepted: {out}");
        ensure!(
            out.contains(message),
            "{extra}: expected {message:?} in {out}"
        );
    }
    // The model location is immutable.
    let good = serde_json::to_string(&deployment_manifest("imm", json!({})))?;
    let (success, out) = kubectl_apply(ns, &good, false)?;
    ensure!(success, "valid spec refused: {out}");
    let moved = serde_json::to_string(&deployment_manifest(
        "imm",
        json!({ "model": { "location": { "hostPath": "/models/other" } } }),
    ))?;
    let (success, out) = kubectl_apply(ns, &moved, false)?;
    ensure!(
        !success && out.contains("model location is immutable"),
        "{out}"
    );

    // Every example is valid against the CRDs.
    let mut n = 0;
    for entry in std::fs::read_dir(repo().join("crds/examples"))? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let (success, out) = kubectl_apply(ns, &std::fs::read_to_string(&path)?, true)?;
        ensure!(success, "{} is not valid: {out}", path.display());
        n += 1;
    }
    if n < 4 {
        bail!("expected an example per strategy, found {n}");
    }

    // The DRA section's manifests in docs/operations.md: the DiffusionDeployment and the
    // template it shows the operator generating are valid against the API.
    let doc = std::fs::read_to_string(repo().join("docs/operations.md"))?;
    let section = doc
        .split("\n## Devices by Dynamic Resource Allocation\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .context("docs/operations.md has no DRA section")?;
    let blocks: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .collect();
    ensure!(blocks.len() == 2, "{} yaml blocks", blocks.len());
    for block in blocks {
        // In the test's namespace.
        let manifest: String = block
            .lines()
            .filter(|l| !l.starts_with("  namespace:"))
            .map(|l| format!("{l}\n"))
            .collect();
        let (success, out) = kubectl_apply(ns, &manifest, true)?;
        ensure!(
            success,
            "the docs' manifest is not valid: {out}\n{manifest}"
        );
    }
    Ok(())
}

const POOL_CRD: &str = "inferencepools.inference.networking.k8s.io";

/// Removes the InferencePool CRD (and so the API) and waits until discovery no longer
/// serves it.
async fn remove_pool_crd(client: &kube::Client) -> Result<()> {
    let crd = inference_pool_crd()?;
    let path = crd.to_str().unwrap();
    let args = ["delete", "--ignore-not-found", "--wait", "-f", path];
    ok(
        tool("kubectl", &args, None)?,
        "kubectl delete InferencePool CRD",
    )?;
    wait_until("the InferencePool API gone", WAIT, || async {
        Ok(
            match client
                .list_api_group_resources("inference.networking.k8s.io/v1")
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Ok(l) if l.resources.is_empty() => Ok(()),
                other => Err(format!("{:?}", other.map(|l| l.resources.len()))),
            },
        )
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_bound_no_plan_meets_is_said_and_the_fastest_plan_runs() -> Result<()> {
    let world = World::new(
        "latency",
        Arc::new(Fixed(AtomicU64::new(0))),
        profile(20, GIB),
    )
    .await?;
    let result = latency_bound(&world).await;
    let torn = world.teardown().await;
    result.and(torn)
}

/// A bound no plan meets (a millisecond a request): the planner still plans the fastest
/// option, the plan records the bound missed and its prediction, the `Planned` condition
/// is True with reason `LatencyBoundNotMet` naming the bound, and a Warning event says so.
async fn latency_bound(w: &World) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let bounded = json!({ "replicas": 0, "workload": { "maxLatencySeconds": 0.001 } });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("bounded", bounded))?,
    )
    .await?;
    let (msg, plan) = wait_until("the missed bound reported", WAIT, || async {
        let s = status_of(&api, "bounded").await?;
        Ok(match (condition(&s, "Planned"), s.plan) {
            (Some((st, reason, msg)), Some(plan))
                if st == "True" && reason == "LatencyBoundNotMet" =>
            {
                Ok((msg, plan))
            }
            (other, _) => Err(format!("Planned {other:?}")),
        })
    })
    .await?;
    assert!(
        msg.contains("maxLatencySeconds 0.001") && msg.contains("the fastest predicts"),
        "{msg}"
    );
    assert_eq!(plan.latency_bound_met, Some(false), "{plan:?}");
    assert!(
        plan.predicted_latency_seconds.is_some_and(|s| s > 0.001),
        "{plan:?}"
    );
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    assert!(deploys.get_opt("bounded").await?.is_some(), "the plan runs");
    let reasons = wait_until("the warning event", WAIT, || async {
        let r = event_reasons(client, ns).await?;
        Ok(if r.iter().any(|x| x == "LatencyBoundNotMet") {
            Ok(r)
        } else {
            Err(format!("{r:?}"))
        })
    })
    .await?;
    assert!(reasons.iter().any(|r| r == "LatencyBoundNotMet"));
    Ok(())
}

/// `spec.inferencePool` against the real control plane: without the InferencePool API the
/// deployment runs and says why it has no pool; once the inference extension's CRD (the
/// pinned release's own YAML) is installed the operator applies the pool, owned by the
/// deployment, selecting the engine Service's pods on the engine port with the spec's
/// endpoint picker; switching it off deletes the pool, and deleting the deployment collects
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_pool_follows_the_spec_and_the_clusters_api() -> Result<()> {
    let client = cluster::client().await?;
    remove_pool_crd(&client).await?;
    let world = World::new("pool", Arc::new(Fixed(AtomicU64::new(0))), profile(20, GIB)).await?;
    let result = inference_pool(&world).await;
    let torn = world.teardown().await;
    let removed = remove_pool_crd(&client).await;
    result.and(torn).and(removed)
}

async fn inference_pool(w: &World) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let routed = json!({ "replicas": 0, "inferencePool": { "enabled": true, "endpointPickerRef": {
        "name": "routed-epp", "port": { "number": 9002 } } } });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("routed", routed))?,
    )
    .await?;

    // No InferencePool API: refused with the condition naming it; the engines still run.
    let why = wait_until("the pool refused for want of the API", WAIT, || async {
        let s = status_of(&api, "routed").await?;
        Ok(match condition(&s, "InferencePool") {
            Some((st, reason, msg)) if st == "False" && reason == "InferencePoolUnavailable" => {
                Ok(msg)
            }
            other => Err(format!("InferencePool {other:?}")),
        })
    })
    .await?;
    assert!(
        why.contains("inferencepools.inference.networking.k8s.io/v1"),
        "{why}"
    );
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    assert!(deploys.get_opt("routed").await?.is_some());
    assert!(event_reasons(client, ns)
        .await?
        .iter()
        .any(|r| r == "InferencePoolUnavailable"));

    // The inference extension's CRD installed: the pool appears at the next look.
    apply_crds(client, &inference_pool_crd()?, &[POOL_CRD], WAIT).await?;
    let pools: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &layerwise_operator::inference_pool::api_resource(),
    );
    let pool = wait_until("the InferencePool applied", WAIT, || async {
        Ok(match pools.get_opt("routed").await? {
            Some(p) => Ok(p),
            None => Err("no InferencePool routed".to_string()),
        })
    })
    .await?;
    let spec = &pool.data["spec"];
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let selector = services
        .get("routed")
        .await?
        .spec
        .unwrap()
        .selector
        .unwrap();
    assert_eq!(
        spec["selector"]["matchLabels"],
        serde_json::to_value(&selector)?,
        "{spec}"
    );
    assert_eq!(spec["targetPorts"], json!([{ "number": 8080 }]), "{spec}");
    assert_eq!(spec["endpointPickerRef"]["name"], "routed-epp", "{spec}");
    assert_eq!(spec["endpointPickerRef"]["port"]["number"], 9002, "{spec}");
    assert_eq!(
        spec["endpointPickerRef"]["failureMode"], "FailClose",
        "{spec}"
    );
    let owner = &pool.metadata.owner_references.as_ref().unwrap()[0];
    let dd = api.get("routed").await?;
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), Some(&owner.uid)),
        ("DiffusionDeployment", "routed", dd.metadata.uid.as_ref())
    );
    wait_until("the InferencePool condition True", WAIT, || async {
        let s = status_of(&api, "routed").await?;
        Ok(match condition(&s, "InferencePool") {
            Some((st, reason, _)) if st == "True" && reason == "Applied" => Ok(()),
            other => Err(format!("InferencePool {other:?}")),
        })
    })
    .await?;

    // Switched off: the pool is deleted and the condition goes.
    let switch = |on: bool| Patch::Merge(json!({ "spec": { "inferencePool": { "enabled": on } } }));
    api.patch("routed", &PatchParams::default(), &switch(false))
        .await?;
    wait_until("the InferencePool deleted", WAIT, || async {
        let gone = pools.get_opt("routed").await?.is_none();
        let s = status_of(&api, "routed").await?;
        let cond = condition(&s, "InferencePool");
        Ok(if gone && cond.is_none() {
            Ok(())
        } else {
            Err(format!("pool gone {gone}, condition {cond:?}"))
        })
    })
    .await?;
    assert!(event_reasons(client, ns)
        .await?
        .iter()
        .any(|r| r == "InferencePoolDeleted"));

    // On again, then the deployment deleted: the pool is collected with it.
    api.patch("routed", &PatchParams::default(), &switch(true))
        .await?;
    wait_until("the InferencePool applied again", WAIT, || async {
        Ok(match pools.get_opt("routed").await? {
            Some(_) => Ok(()),
            None => Err("no InferencePool routed".to_string()),
        })
    })
    .await?;
    api.delete("routed", &DeleteParams::default()).await?;
    wait_until("the InferencePool collected", WAIT, || async {
        Ok(if pools.get_opt("routed").await?.is_none() {
            Ok(())
        } else {
            Err("InferencePool routed still there".to_string())
        })
    })
    .await?;
    Ok(())
}

/// `spec.accelerator.dra` against the real control plane, with a fake DRA driver's node:
/// eight 80 GiB GPUs under two PCIe roots, published in a ResourceSlice (its agent reports
/// 1 GiB devices, all linked, so a plan from the agent's figures would differ). The planner
/// takes the slice's memory and sizes a pod's ranks to one root's four GPUs; the operator
/// generates the ResourceClaimTemplate of the plan, the pods claim through it, and the real
/// scheduler allocates each pod four GPUs of one root, two pods taking both roots. A class
/// that does not exist is refused with a condition naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_by_dra_are_planned_from_resource_slices_and_claimed_on_one_link() -> Result<()> {
    let client = cluster::client().await?;
    let node = FakeNode {
        name: "dra-h100-0".into(),
        octet: 200,
        roots: vec![4, 4],
        memory_gib: 80,
        product: "NVIDIA H100 80GB HBM3".into(),
    };
    dra::withdraw(&client, &node).await?;
    dra::publish(&client, &node).await?;
    let world = World::new("dra", Arc::new(Fixed(AtomicU64::new(0))), profile(100, GIB)).await;
    let world = match world {
        Ok(w) => w,
        Err(e) => {
            let _ = dra::withdraw(&client, &node).await;
            return Err(e);
        }
    };
    world.extra_shapes.lock().unwrap().push(Shape {
        prefix: "dra-h100".into(),
        count: 1,
        resource: "nvidia.com/gpu".into(),
        devices: 8,
        device_memory_mib: 1024,
        product: "NVIDIA-H100-80GB-HBM3".into(),
        cpu: "64".into(),
        memory: "2000Gi".into(),
    });
    let result = devices_by_dra(&world, &node).await;
    let torn = world.teardown().await;
    let withdrawn = dra::withdraw(&client, &node).await;
    result.and(torn).and(withdrawn)
}

async fn devices_by_dra(w: &World, node: &FakeNode) -> Result<()> {
    let (client, ns) = (&w.client, w.ns.as_str());
    let api: Api<DiffusionDeployment> = Api::namespaced(client.clone(), ns);
    let accelerator = |class: &str| {
        json!({ "dra": { "deviceClassName": class },
                "nodeSelector": { "kubernetes.io/hostname": node.name } })
    };
    let spec = json!({ "replicas": 2, "strategy": "offload-sharded",
                       "accelerator": accelerator(dra::DRIVER) });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("claimed", spec))?,
    )
    .await?;
    let missing = json!({ "replicas": 1, "accelerator": accelerator("no-such.example.com") });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("unclassed", missing))?,
    )
    .await?;

    // Planned from the slice: four ranks (one root), 80 GiB devices, a fast link.
    let plan = wait_until("the DRA plan", WAIT, || async {
        let s = status_of(&api, "claimed").await?;
        Ok(match (condition(&s, "Planned"), s.plan) {
            (Some((st, _, _)), Some(plan)) if st == "True" => Ok(plan),
            (other, _) => Err(format!("Planned {other:?}")),
        })
    })
    .await?;
    assert_eq!((plan.dp, plan.sp), (4, 1), "{plan:?}");
    assert!(plan.fast_peer_link, "{plan:?}");
    assert_eq!(plan.nodes, std::slice::from_ref(&node.name));
    assert!(
        plan.device_bytes_per_rank > GIB,
        "the slice's memory, not the agent's"
    );
    let template = plan.resource_claim_template.clone().expect("a template");

    // The generated template: the plan's devices, memory and link; owned by the deployment.
    // (The plan is recorded before the reconcile goes on to apply the template and the
    // Deployment.)
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), ns);
    let t = wait_until("the generated template", WAIT, || async {
        Ok(match templates.get_opt(&template).await? {
            Some(t) => Ok(t),
            None => Err(format!("no ResourceClaimTemplate {template}")),
        })
    })
    .await?;
    let v = serde_json::to_value(&t.spec.spec)?;
    let req = &v["devices"]["requests"][0];
    assert_eq!(req["exactly"]["deviceClassName"], dra::DRIVER, "{v}");
    assert_eq!(req["exactly"]["count"], 4, "{v}");
    assert!(
        req["exactly"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap()
            .contains(&plan.device_bytes_per_rank.to_string()),
        "{v}"
    );
    assert_eq!(
        v["devices"]["constraints"][0]["matchAttribute"],
        dra::PCIE_ROOT,
        "{v}"
    );
    let dd = api.get("claimed").await?;
    assert_eq!(
        t.metadata.owner_references.as_ref().unwrap()[0].uid,
        dd.metadata.uid.clone().unwrap()
    );

    // The pods claim through it and ask for no extended resource.
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pod_spec = wait_until("the engine Deployment", WAIT, || async {
        Ok(match deploys.get_opt("claimed").await? {
            Some(d) => Ok(d.spec.unwrap().template.spec.unwrap()),
            None => Err("no Deployment claimed".to_string()),
        })
    })
    .await?;
    let claims = pod_spec.resource_claims.clone().unwrap();
    assert_eq!(
        claims[0].resource_claim_template_name.as_deref(),
        Some(template.as_str())
    );
    let res = pod_spec.containers[0].resources.clone().unwrap();
    assert_eq!(res.claims.unwrap()[0].name, claims[0].name);
    assert!(!res.limits.unwrap().contains_key("nvidia.com/gpu"));

    // The scheduler allocates each pod four GPUs of one root; the two pods take both roots.
    let roots = wait_until("both pods running on allocated claims", WAIT, || async {
        let running = running_pods(client, ns, "claimed").await?;
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
        let mut roots = Vec::new();
        for c in claims.list(&ListParams::default()).await?.items {
            let devices: Vec<String> = c
                .status
                .and_then(|s| s.allocation)
                .and_then(|a| a.devices)
                .map(|d| d.results.unwrap_or_default())
                .unwrap_or_default()
                .into_iter()
                .map(|r| r.device)
                .collect();
            let of: BTreeSet<Option<String>> = devices.iter().map(|d| node.root_of(d)).collect();
            roots.push((devices.len(), of));
        }
        Ok(if running.len() == 2 && roots.len() == 2 {
            Ok((running, roots))
        } else {
            Err(format!("running {running:?}, claims {roots:?}"))
        })
    })
    .await?;
    let (running, roots) = roots;
    assert!(running.iter().all(|(_, n)| *n == node.name), "{running:?}");
    for (count, of) in &roots {
        assert_eq!(*count, 4, "{roots:?}");
        assert_eq!(of.len(), 1, "one root a pod: {roots:?}");
    }
    assert_ne!(
        roots[0].1, roots[1].1,
        "the two pods on the two roots: {roots:?}"
    );

    // A new plan (sharded: the fewest ranks that fit, 2) gets a new template; the pods roll
    // onto it, and the old one is deleted once no pod claims through it.
    api.patch(
        "claimed",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "strategy": "sharded" } })),
    )
    .await?;
    let replanned = wait_until("the old template deleted", WAIT, || async {
        let plan = status_of(&api, "claimed").await?.plan;
        let old = templates.get_opt(&template).await?;
        Ok(match plan {
            Some(p) if p.dp == 2 && old.is_none() => Ok(p),
            p => Err(format!(
                "dp {:?}, old template there: {}",
                p.map(|p| p.dp),
                old.is_some()
            )),
        })
    })
    .await?;
    let new = replanned.resource_claim_template.unwrap();
    assert_ne!(new, template);
    let t = templates.get(&new).await?;
    assert_eq!(
        serde_json::to_value(&t.spec.spec)?["devices"]["requests"][0]["exactly"]["count"],
        2
    );
    // The event goes out when the reconcile that deleted the template reports.
    wait_until("the ClaimTemplateDeleted event", WAIT, || async {
        let r = event_reasons(client, ns).await?;
        Ok(if r.iter().any(|x| x == "ClaimTemplateDeleted") {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        })
    })
    .await?;

    // A class the cluster does not have: refused, naming it.
    let why = wait_until("the missing class refused", WAIT, || async {
        let s = status_of(&api, "unclassed").await?;
        Ok(match condition(&s, "Planned") {
            Some((st, reason, msg)) if st == "False" && reason == "DeviceClassNotFound" => Ok(msg),
            other => Err(format!("Planned {other:?}")),
        })
    })
    .await?;
    assert!(why.contains("no-such.example.com"), "{why}");
    assert!(deploys.get_opt("unclassed").await?.is_none());

    // The team's own template: used as it is, its two devices fixing dp × sp.
    let mine: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": { "name": "two-gpus" },
        "spec": { "spec": { "devices": { "requests": [{ "name": "gpus", "exactly": {
            "deviceClassName": dra::DRIVER, "count": 2 } }] } } },
    }))?;
    templates.create(&PostParams::default(), &mine).await?;
    let named = json!({ "replicas": 0, "strategy": "offload-sharded", "accelerator": {
        "dra": { "resourceClaimTemplateName": "two-gpus" },
        "nodeSelector": { "kubernetes.io/hostname": node.name } } });
    api.create(
        &PostParams::default(),
        &serde_json::from_value(deployment_manifest("named", named))?,
    )
    .await?;
    let plan = wait_until("the named template's plan", WAIT, || async {
        Ok(match status_of(&api, "named").await?.plan {
            Some(plan) => Ok(plan),
            None => Err("no plan".to_string()),
        })
    })
    .await?;
    assert_eq!((plan.dp, plan.sp), (2, 1), "{plan:?}");
    assert_eq!(plan.resource_claim_template.as_deref(), Some("two-gpus"));
    let pod_spec = wait_until("the named template's Deployment", WAIT, || async {
        Ok(match deploys.get_opt("named").await? {
            Some(d) => Ok(d.spec.unwrap().template.spec.unwrap()),
            None => Err("no Deployment".to_string()),
        })
    })
    .await?;
    let claims = pod_spec.resource_claims.unwrap();
    assert_eq!(
        claims[0].resource_claim_template_name.as_deref(),
        Some("two-gpus")
    );
    Ok(())
}
