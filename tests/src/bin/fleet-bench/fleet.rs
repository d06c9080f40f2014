//! The fake fleet: N GPU nodes of mixed shapes, with their Node objects (kwok keeps them
//! Ready) and DiffusionNodes, and the model each deployment serves.

use anyhow::{Context, Result};
use crds::{DiffusionNode, Profile};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use layerwise_e2e::fixtures::dit_profile;
use serde_json::json;

use super::common::{AGENT, GIB, PARALLEL};

/// A kind of node: `share` of the fleet in percent.
pub(super) struct Shape {
    pub(super) prefix: &'static str,
    pub(super) share: usize,
    pub(super) gpus: u32,
    pub(super) device_gib: u64,
    pub(super) product: &'static str,
    pub(super) host_gib: u64,
}

pub(super) const SHAPES: [Shape; 6] = [
    Shape {
        prefix: "h100",
        share: 30,
        gpus: 8,
        device_gib: 80,
        product: "NVIDIA-H100-80GB-HBM3",
        host_gib: 2048,
    },
    Shape {
        prefix: "a100",
        share: 25,
        gpus: 8,
        device_gib: 80,
        product: "NVIDIA-A100-SXM4-80GB",
        host_gib: 1024,
    },
    Shape {
        prefix: "l40s",
        share: 20,
        gpus: 4,
        device_gib: 48,
        product: "NVIDIA-L40S",
        host_gib: 512,
    },
    Shape {
        prefix: "h200",
        share: 10,
        gpus: 8,
        device_gib: 141,
        product: "NVIDIA-H200",
        host_gib: 2048,
    },
    Shape {
        prefix: "a10g",
        share: 10,
        gpus: 1,
        device_gib: 24,
        product: "NVIDIA-A10G",
        host_gib: 256,
    },
    Shape {
        prefix: "gb200",
        share: 5,
        gpus: 4,
        device_gib: 186,
        product: "NVIDIA-GB200",
        host_gib: 1024,
    },
];

/// The model of deployment `k`: four sizes, from resident anywhere to sharded on eight.
pub(super) fn model(k: usize) -> Profile {
    match k % 4 {
        0 => dit_profile(28, 400 << 20, GIB, 320 << 20),
        1 => dit_profile(48, GIB, 2 * GIB, 320 << 20),
        2 => dit_profile(80, 2 * GIB, 2 * GIB, 320 << 20),
        _ => dit_profile(160, 3 * GIB, 4 * GIB, 320 << 20),
    }
}

/// One fake node: its name, shape and index.
#[derive(Clone)]
pub(super) struct FakeNode {
    pub(super) name: String,
    pub(super) shape: usize,
    pub(super) index: usize,
}

pub(super) fn fleet(n: usize) -> Vec<FakeNode> {
    let mut out = Vec::with_capacity(n);
    for (s, shape) in SHAPES.iter().enumerate() {
        let count = if s == SHAPES.len() - 1 {
            n - out.len()
        } else {
            n * shape.share / 100
        };
        for i in 0..count {
            let index = out.len();
            out.push(FakeNode {
                name: format!("fleet-{}-{i}", shape.prefix),
                shape: s,
                index,
            });
        }
    }
    out
}

pub(super) fn node_object(n: &FakeNode) -> serde_json::Value {
    let s = &SHAPES[n.shape];
    let cidr = format!("127.{}.{}.0/24", 16 + n.index / 256, n.index % 256);
    let ip = format!("127.3.{}.{}", n.index / 250, n.index % 250 + 1);
    let allocatable = json!({
        "cpu": "96", "memory": format!("{}Gi", s.host_gib), "pods": "110",
        "nvidia.com/gpu": s.gpus.to_string(),
    });
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": n.name,
            "annotations": { "kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0" },
            // With the deprecated beta OS and architecture labels a kubelet sets at
            // registration: without them kube-controller-manager adds them node by node for
            // minutes, and each addition is a label change that concerns deployments.
            "labels": {
                "kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "layerwise.dev/fleet-bench": "true",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": s.prefix,
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": s.gpus.to_string(),
                "nvidia.com/gpu.product": s.product,
                "nvidia.com/gpu.memory": (s.device_gib * 1024).to_string(),
            },
        },
        "spec": { "podCIDR": cidr, "podCIDRs": [cidr] },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": n.name }],
            "capacity": allocatable, "allocatable": allocatable,
        },
    })
}

/// The DiffusionNode status the agent of `n` reports, with `models` prepared.
pub(super) fn agent_status(n: &FakeNode, models: &[serde_json::Value]) -> serde_json::Value {
    let s = &SHAPES[n.shape];
    json!({
        "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
        "metadata": { "name": n.name },
        "status": {
            "accelerators": [{
                "resourceName": "nvidia.com/gpu", "product": s.product, "count": s.gpus,
                "memoryBytes": s.device_gib * GIB, "fastPeerLink": s.gpus > 1,
            }],
            "hostMemoryBytes": s.host_gib * GIB,
            "models": models,
            "modelCount": models.len(),
        },
    })
}

pub(super) async fn create_fleet(client: &Client, fleet: &[FakeNode]) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let dns: Api<DiffusionNode> = Api::all(client.clone());
    futures::stream::iter(fleet.iter().map(|n| {
        let (nodes, dns) = (nodes.clone(), dns.clone());
        async move {
            let pp = PatchParams::apply(AGENT).force();
            nodes
                .patch(&n.name, &pp, &Patch::Apply(node_object(n)))
                .await
                .with_context(|| format!("creating Node {}", n.name))?;
            let dn = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
                             "metadata": { "name": n.name }, "spec": { "models": [] } });
            dns.patch(&n.name, &pp, &Patch::Apply(dn)).await?;
            dns.patch_status(&n.name, &pp, &Patch::Apply(agent_status(n, &[])))
                .await
                .with_context(|| format!("reporting DiffusionNode {}", n.name))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(PARALLEL)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}
