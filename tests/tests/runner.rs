//! The node runner as a kubelet: a pod it can run starts in a container from its image, as
//! its spec says, and its exit is recorded; a pod it cannot run as its spec says fails
//! visibly, with the kubelet's reason in the container's waiting state, a Warning event and
//! an entry in the runner's failures. (`e2e.rs` runs the chart's pods through it.)

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use layerwise_e2e::cluster::{self, wait_until};
use layerwise_e2e::images;
use layerwise_e2e::runner::{self, NodeRunner};
use layerwise_e2e::tools;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A one-container pod on `node`, handed to the runner, with the chart's security context
/// changed by `security` (merged into the container's) and the volumes given.
fn pod(name: &str, node: &str, image: &str, security: serde_json::Value) -> Result<Pod> {
    let mut container_security = json!({
        "allowPrivilegeEscalation": false, "privileged": false,
        "readOnlyRootFilesystem": true, "capabilities": { "drop": ["ALL"] },
    });
    for (k, v) in security.as_object().into_iter().flatten() {
        container_security[k] = v.clone();
    }
    Ok(serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "annotations": { runner::ANNOTATION: runner::ANNOTATION_VALUE },
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {
                "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                "seccompProfile": { "type": "RuntimeDefault" },
            },
            "containers": [{
                "name": "main",
                "image": image,
                "command": ["layerwise"],
                "args": ["--version"],
                "securityContext": container_security,
            }],
        },
    }))?)
}

#[tokio::test]
async fn runs_what_it_can_and_fails_the_rest_visibly() -> Result<()> {
    images::ensure(&["engine"])?;
    let engine = images::tag("engine")?;
    let client = cluster::client().await?;
    let ns = cluster::create_namespace(&client, "runner").await?;
    let work = tempfile::Builder::new()
        .prefix("layerwise-runner-")
        .tempdir()?;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .list(&ListParams::default().labels("type=kwok"))
        .await?
        .items
        .first()
        .map(|n| n.name_any())
        .context("the test cluster has no fake nodes")?;
    let root = work.path().join("nodes").join(&node);
    std::fs::create_dir_all(&root)?;
    let runner = NodeRunner::start(
        client.clone(),
        runner::Config {
            namespace: ns.clone(),
            node_roots: BTreeMap::from([(node.clone(), root)]),
            work: work.path().join("pods"),
        },
    )?;

    let result = async {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let mut configmap = pod("configmap", &node, &engine, json!({}))?;
        let spec = configmap.spec.as_mut().expect("spec");
        spec.volumes = Some(vec![serde_json::from_value(
            json!({ "name": "config", "configMap": { "name": "settings" } }),
        )?]);
        spec.containers[0].volume_mounts = Some(vec![serde_json::from_value(
            json!({ "name": "config", "mountPath": "/etc/settings" }),
        )?]);
        // (pod, its spec, the reason, a word of the message)
        let refused = [
            (
                pod("not-built", &node, "layerwise-not-built:0.0.0", json!({}))?,
                "ErrImageNeverPull",
                "never pulls",
            ),
            (
                pod("as-root", &node, &engine, json!({ "runAsUser": 0 }))?,
                "CreateContainerConfigError",
                "runAsNonRoot",
            ),
            (
                pod(
                    "privileged",
                    &node,
                    &engine,
                    json!({ "privileged": true, "allowPrivilegeEscalation": null }),
                )?,
                "CreateContainerConfigError",
                "privileged",
            ),
            (configmap, "CreateContainerConfigError", "volume config"),
        ];
        let ok = pod("version", &node, &engine, json!({}))?;
        pods.create(&PostParams::default(), &ok).await?;
        for (p, _, _) in &refused {
            pods.create(&PostParams::default(), p).await?;
        }

        // The pod it can run: from the image, as 65532, to a clean exit.
        let exit = wait_until("the version pod's exit", WAIT, || async {
            Ok(
                match runner.exits().into_iter().find(|e| e.pod == "version") {
                    Some(e) => Ok(e),
                    None => Err(format!("failures: {:?}", runner.failures())),
                },
            )
        })
        .await?;
        ensure!(
            exit.code == Some(0) && exit.log_tail.contains("layerwise "),
            "the version pod ended {:?} with {:?}",
            exit.code,
            exit.log_tail
        );
        wait_until("the version pod terminated with code 0", WAIT, || async {
            let p = pods.get("version").await?;
            let state = p
                .status
                .and_then(|s| s.container_statuses)
                .and_then(|c| c.into_iter().next())
                .and_then(|c| c.state);
            let code = state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .map(|t| t.exit_code);
            Ok(if code == Some(0) {
                Ok(())
            } else {
                Err(format!("{state:?}"))
            })
        })
        .await?;

        // The ones it cannot: each says why, where `kubectl get pods` and events show it.
        let events: Api<Event> = Api::namespaced(client.clone(), &ns);
        for (p, reason, word) in &refused {
            let name = p.name_any();
            wait_until(&format!("{name} refused with {reason}"), WAIT, || async {
                let p = pods.get(&name).await?;
                let waiting = p
                    .status
                    .and_then(|s| s.container_statuses)
                    .and_then(|c| c.into_iter().next())
                    .and_then(|c| c.state)
                    .and_then(|s| s.waiting);
                let events = events
                    .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
                    .await?
                    .items;
                let event = events.iter().any(|e| {
                    e.type_.as_deref() == Some("Warning")
                        && e.message.as_deref().is_some_and(|m| m.contains(reason))
                });
                Ok(match &waiting {
                    Some(w)
                        if w.reason.as_deref() == Some(*reason)
                            && w.message.as_deref().is_some_and(|m| m.contains(word))
                            && event =>
                    {
                        Ok(())
                    }
                    _ => Err(format!("waiting {waiting:?}, warning event {event}")),
                })
            })
            .await?;
            let failures = runner.failures();
            ensure!(
                failures
                    .iter()
                    .any(|f| f.starts_with(&format!("pod {name}: {reason}: "))),
                "the runner's failures do not name {name}: {failures:#?}"
            );
        }
        ensure!(
            runner.running().is_empty(),
            "containers still run: {:?}",
            runner.running()
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    runner.shutdown().await;
    let teardown = tools::finish_teardown(&client, &ns, Vec::new()).await;
    result?;
    teardown
}
