//! The network rule: the cluster's processes listen on and talk to loopback only, and
//! every node and pod address it hands out is in 127.0.0.0/8.

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::ListParams;
use kube::Api;
use layerwise_e2e::{cluster, net};

#[tokio::test]
async fn cluster_processes_use_loopback_only() -> Result<()> {
    cluster::client().await?; // make sure the cluster is up
    let pids = cluster::cluster_dir().join("pids");
    if !pids.is_dir() {
        eprintln!(
            "skipped: {} does not exist (a cluster not started by tests/cluster/up)",
            pids.display()
        );
        return Ok(());
    }
    let mut listening = 0;
    for entry in std::fs::read_dir(&pids)? {
        let path = entry?.path();
        let pid: u32 = std::fs::read_to_string(&path)?
            .trim()
            .parse()
            .with_context(|| format!("pid in {}", path.display()))?;
        let name = path.file_stem().unwrap_or_default().to_string_lossy();
        for socket in net::sockets_of(pid).with_context(|| format!("sockets of {name}"))? {
            ensure!(
                socket.is_loopback_only(),
                "{name} (pid {pid}) has a socket outside loopback: {socket:?}"
            );
            listening += usize::from(socket.state == 0x0A);
        }
    }
    // etcd (client and peer), apiserver, controller manager, scheduler, kwok.
    ensure!(
        listening >= 6,
        "only {listening} listening sockets found: wrong pids?"
    );
    Ok(())
}

#[tokio::test]
async fn node_pod_and_service_addresses_are_loopback() -> Result<()> {
    let client = cluster::client().await?;
    let all = ListParams::default();
    for node in Api::<Node>::all(client.clone()).list(&all).await? {
        let name = node.metadata.name.unwrap_or_default();
        let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
        ensure!(
            addresses.iter().any(|a| a.type_ == "InternalIP"),
            "node {name} has no InternalIP"
        );
        for a in addresses.iter().filter(|a| a.type_.ends_with("IP")) {
            ensure!(
                net::is_loopback(a.address.parse()?),
                "node {name} {} {} is outside 127.0.0.0/8",
                a.type_,
                a.address
            );
        }
        for cidr in node.spec.and_then(|s| s.pod_cidrs).unwrap_or_default() {
            let ip = cidr.split('/').next().unwrap_or_default();
            ensure!(net::is_loopback(ip.parse()?), "node {name} podCIDR {cidr}");
        }
    }
    for pod in Api::<Pod>::all(client.clone()).list(&all).await? {
        let name = pod.metadata.name.unwrap_or_default();
        for ip in pod.status.and_then(|s| s.pod_ips).unwrap_or_default() {
            ensure!(
                net::is_loopback(ip.ip.parse()?),
                "pod {name} has IP {}",
                ip.ip
            );
        }
    }
    for svc in Api::<Service>::all(client).list(&all).await? {
        let name = svc.metadata.name.unwrap_or_default();
        for ip in svc.spec.and_then(|s| s.cluster_ips).unwrap_or_default() {
            if ip != "None" {
                ensure!(
                    net::is_loopback(ip.parse()?),
                    "service {name} has ClusterIP {ip}"
                );
            }
        }
    }
    Ok(())
}
