//! A fake DRA driver for the test cluster: a kwok node that offers no extended resource,
//! with its GPUs published in a ResourceSlice the way the NVIDIA DRA driver publishes them
//! (driver `gpu.nvidia.com`; attributes `type`, `productName`, `index` and the standard
//! `resource.kubernetes.io/pcieRoot`; capacity `memory`), and the driver's DeviceClass.
//! The scheduler's DRA plugin allocates claims against that slice; kwok plays the kubelet,
//! so no device is ever prepared.
//!
//! Every address the node carries is loopback, as `tests/cluster/up` gives the fleet's.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::cluster::wait_until;

/// The driver the fake publishes as, and the name of its DeviceClass.
pub const DRIVER: &str = "gpu.nvidia.com";
/// The standard attribute of a device's PCIe root.
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

/// One fake node and its GPUs.
#[derive(Debug, Clone)]
pub struct FakeNode {
    pub name: String,
    /// Its loopback addresses: InternalIP 127.0.1.`octet`, pods in 127.1.`octet`.0/24.
    pub octet: u8,
    /// GPUs under each PCIe root, root by root.
    pub roots: Vec<u32>,
    pub memory_gib: u64,
    pub product: String,
}

impl FakeNode {
    /// The PCIe root of device `gpu-<i>`.
    pub fn root_of(&self, device: &str) -> Option<String> {
        let i: u32 = device.strip_prefix("gpu-")?.parse().ok()?;
        let mut first = 0;
        for (r, n) in self.roots.iter().enumerate() {
            if i < first + n {
                return Some(format!("pci0000:{:02x}", r * 0x40));
            }
            first += n;
        }
        None
    }

    fn slice_name(&self) -> String {
        format!("{}-{DRIVER}", self.name)
    }
}

/// Publishes `node`: the Node (Ready once kwok takes it), the DeviceClass and its slice,
/// which also holds one MIG device that the class does not select.
pub async fn publish(client: &Client, node: &FakeNode) -> Result<()> {
    let o = node.octet;
    let n: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            "labels": {
                "type": "kwok-dra", "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            },
        },
        "spec": { "podCIDR": format!("127.1.{o}.0/24"), "podCIDRs": [format!("127.1.{o}.0/24")] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": format!("127.0.1.{o}") },
                          { "type": "Hostname", "address": node.name }],
            "capacity": { "cpu": "64", "memory": "2000Gi", "pods": "110" },
            "allocatable": { "cpu": "64", "memory": "2000Gi", "pods": "110" },
        },
    }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .with_context(|| format!("creating fake DRA node {}", node.name))?;
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": DRIVER },
        "spec": { "selectors": [{ "cel": { "expression":
            format!("device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'") } }] },
    }))?;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    if classes.get_opt(DRIVER).await?.is_none() {
        classes.create(&PostParams::default(), &class).await?;
    }
    let total: u32 = node.roots.iter().sum();
    let mut devices: Vec<serde_json::Value> = (0..total)
        .map(|i| {
            let name = format!("gpu-{i}");
            json!({
                "name": name,
                "attributes": {
                    "type": { "string": "gpu" },
                    "index": { "int": i },
                    "productName": { "string": node.product },
                    PCIE_ROOT: { "string": node.root_of(&name) },
                },
                "capacity": { "memory": { "value": format!("{}Gi", node.memory_gib) } },
            })
        })
        .collect();
    devices.push(json!({
        "name": "mig-0",
        "attributes": { "type": { "string": "mig" }, "productName": { "string": node.product } },
        "capacity": { "memory": { "value": "10Gi" } },
    }));
    let slice: ResourceSlice = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": node.slice_name() },
        "spec": {
            "driver": DRIVER, "nodeName": node.name,
            "pool": { "name": node.name, "generation": 1, "resourceSliceCount": 1 },
            "devices": devices,
        },
    }))?;
    Api::<ResourceSlice>::all(client.clone())
        .create(&PostParams::default(), &slice)
        .await
        .with_context(|| format!("publishing the ResourceSlice of {}", node.name))?;
    let nodes: Api<Node> = Api::all(client.clone());
    wait_until(
        "the fake DRA node Ready",
        Duration::from_secs(60),
        || async {
            let ready = nodes.get(&node.name).await?.status.and_then(|s| {
                s.conditions?
                    .into_iter()
                    .find(|c| c.type_ == "Ready")
                    .map(|c| c.status == "True")
            });
            Ok(if ready == Some(true) {
                Ok(())
            } else {
                Err(format!("Ready {ready:?}"))
            })
        },
    )
    .await
}

/// Removes what [`publish`] made (the slice, the Node and the DeviceClass) and the node's
/// DiffusionNode, which a fake agent may have made for it.
pub async fn withdraw(client: &Client, node: &FakeNode) -> Result<()> {
    let gone = |r: kube::Result<_>| match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    };
    let dp = DeleteParams::default();
    gone(
        Api::<ResourceSlice>::all(client.clone())
            .delete(&node.slice_name(), &dp)
            .await
            .map(|_| ()),
    )?;
    gone(
        Api::<Node>::all(client.clone())
            .delete(&node.name, &dp)
            .await
            .map(|_| ()),
    )?;
    gone(
        Api::<crds::DiffusionNode>::all(client.clone())
            .delete(&node.name, &dp)
            .await
            .map(|_| ()),
    )?;
    gone(
        Api::<DeviceClass>::all(client.clone())
            .delete(DRIVER, &dp)
            .await
            .map(|_| ()),
    )?;
    Ok(())
}
