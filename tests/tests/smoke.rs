//! Smoke test of the whole stack below layerwise: a Deployment that asks for one GPU is
//! scheduled onto a fake GPU node, its pods run, and deleting it removes them.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client};
use layerwise_e2e::{cluster, net};

const WAIT: Duration = Duration::from_secs(90);
const REPLICAS: usize = 2;

#[tokio::test]
async fn gpu_deployment_runs_on_fake_gpu_nodes_and_goes_away() -> Result<()> {
    let client = cluster::client().await?;
    let ns = cluster::create_namespace(&client, "smoke").await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());

    let result = run(client, &ns).await;
    // Clean up whatever happened above; the namespace takes anything left with it.
    let cleanup = namespaces.delete(&ns, &DeleteParams::default()).await;
    result?;
    cleanup.context("deleting the test namespace")?;
    Ok(())
}

async fn run(client: Client, ns: &str) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let nodes: Api<Node> = Api::all(client.clone());

    let deployment: Deployment = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": "gpu-smoke" },
        "spec": {
            "replicas": REPLICAS,
            "selector": { "matchLabels": { "app": "gpu-smoke" } },
            "template": {
                "metadata": { "labels": { "app": "gpu-smoke" } },
                "spec": {
                    "containers": [{
                        "name": "main",
                        // kwok runs no containers, so the image is never pulled.
                        "image": "layerwise-e2e/placeholder:0",
                        "resources": { "limits": { "nvidia.com/gpu": 1 } }
                    }]
                }
            }
        }
    }))?;
    let applied = deployments
        .patch(
            "gpu-smoke",
            &PatchParams::apply("layerwise-e2e").force(),
            &Patch::Apply(&deployment),
        )
        .await?;

    let selector = ListParams::default().labels("app=gpu-smoke");
    let running = cluster::wait_until("gpu-smoke pods Running", WAIT, || async {
        let list = pods.list(&selector).await?;
        let running: Vec<Pod> = list
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .cloned()
            .collect();
        Ok(if running.len() == REPLICAS {
            Ok(running)
        } else {
            Err(format!(
                "{} of {} pods Running",
                running.len(),
                list.items.len()
            ))
        })
    })
    .await?;

    for pod in &running {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let node_name = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .with_context(|| format!("pod {name} is Running but not bound"))?;
        let node = nodes.get(&node_name).await?;
        let gpus = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("nvidia.com/gpu"))
            .map(|q| q.0.clone());
        ensure!(
            gpus.as_deref().is_some_and(|g| g != "0"),
            "pod {name} landed on {node_name}, which has no nvidia.com/gpu (allocatable {gpus:?})"
        );
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .with_context(|| format!("pod {name} has no IP"))?;
        ensure!(
            net::is_loopback(ip.parse()?),
            "pod {name} got IP {ip}, outside 127.0.0.0/8"
        );
    }

    let uid = applied
        .metadata
        .uid
        .clone()
        .context("deployment without uid")?;
    deployments
        .delete("gpu-smoke", &DeleteParams::foreground())
        .await?;
    tokio::time::timeout(
        WAIT,
        await_condition(
            deployments.clone(),
            "gpu-smoke",
            conditions::is_deleted(&uid),
        ),
    )
    .await
    .context("timed out waiting for the deployment to be deleted")??;
    cluster::wait_until("gpu-smoke pods gone", WAIT, || async {
        let left = pods.list(&selector).await?.items.len();
        Ok(if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} pods left"))
        })
    })
    .await
}
