//! The fake fleet: every node the shapes file asks for is there, Ready, with its
//! accelerator count, host resources and GPU Feature Discovery labels.

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::Api;
use layerwise_e2e::{cluster, shapes};

#[tokio::test]
async fn nodes_are_listed_with_their_capacities() -> Result<()> {
    let client = cluster::client().await?;
    let nodes: Api<Node> = Api::all(client);
    let listed = nodes
        .list(&ListParams::default().labels("type=kwok"))
        .await?;
    let shapes = shapes::load()?;
    let expected: u32 = shapes.iter().map(|s| s.count).sum();
    ensure!(
        listed.items.len() == expected as usize,
        "{} fake nodes listed, shapes file asks for {expected}",
        listed.items.len()
    );

    for shape in &shapes {
        for name in shape.node_names() {
            let node = listed
                .items
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name.as_str()))
                .with_context(|| format!("node {name} missing"))?;
            let status = node.status.as_ref().context("node without status")?;
            let capacity = status.capacity.as_ref().context("node without capacity")?;
            let get = |key: &str| capacity.get(key).map(|q| q.0.as_str());
            ensure!(
                get(&shape.resource) == Some(shape.devices.to_string().as_str()),
                "{name}: {} capacity {:?}, want {}",
                shape.resource,
                get(&shape.resource),
                shape.devices
            );
            ensure!(
                get("cpu") == Some(shape.cpu.as_str()),
                "{name}: cpu {:?}",
                get("cpu")
            );
            ensure!(
                get("memory") == Some(shape.memory.as_str()),
                "{name}: memory {:?}",
                get("memory")
            );
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            ensure!(ready, "{name} is not Ready");
            if shape.resource.starts_with("nvidia.com/") {
                let labels = node
                    .metadata
                    .labels
                    .as_ref()
                    .context("node without labels")?;
                let label = |key: &str| labels.get(key).map(String::as_str);
                ensure!(
                    label("nvidia.com/gpu.memory")
                        == Some(shape.device_memory_mib.to_string().as_str()),
                    "{name}: nvidia.com/gpu.memory {:?}",
                    label("nvidia.com/gpu.memory")
                );
                ensure!(
                    label("nvidia.com/gpu.product") == Some(shape.product.as_str()),
                    "{name}: nvidia.com/gpu.product {:?}",
                    label("nvidia.com/gpu.product")
                );
            }
        }
    }
    Ok(())
}
