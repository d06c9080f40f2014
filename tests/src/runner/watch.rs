//! The watch over the namespace's pods: hands each pod of ours on a fake node to a
//! supervisor, and tells the supervisor when its pod is being deleted.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::names::{ANNOTATION, ANNOTATION_VALUE};
use super::state::{Config, State};
use super::status::delete_now;
use super::supervise::supervise;

/// Watches the namespace's pods and hands each of ours to a supervisor.
pub(super) async fn watch_pods(
    client: Client,
    config: Arc<Config>,
    state: Arc<Mutex<State>>,
    mut stop: watch::Receiver<bool>,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    let mut events = std::pin::pin!(watcher(pods, watcher::Config::default()));
    // Pod UID to its supervisor's "delete" signal and task.
    let mut supervised: HashMap<String, (watch::Sender<bool>, JoinHandle<()>)> = HashMap::new();
    loop {
        let event = tokio::select! {
            _ = stop.changed() => break,
            e = events.next() => e,
        };
        let pods: Vec<Pod> = match event {
            Some(Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p))) => vec![p],
            Some(Ok(watcher::Event::Delete(p))) => {
                // Gone without us (a forced delete): the supervisor stops its container.
                if let Some((tx, _)) = p.uid().and_then(|u| supervised.get(&u)) {
                    let _ = tx.send(true);
                }
                continue;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "node runner: watching pods");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            None => break,
        };
        for pod in pods {
            if pod.annotations().get(ANNOTATION).map(String::as_str) != Some(ANNOTATION_VALUE) {
                continue;
            }
            let Some(uid) = pod.uid() else { continue };
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            let Some(node) = node.filter(|n| config.node_roots.contains_key(n)) else {
                continue;
            };
            if let Some((tx, _)) = supervised.get(&uid) {
                if pod.metadata.deletion_timestamp.is_some() {
                    let _ = tx.send(true);
                }
                continue;
            }
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok());
            if pod.metadata.deletion_timestamp.is_some() {
                // Deleted before it ever ran: nothing to stop.
                let _ = delete_now(&client, &pod).await;
                continue;
            }
            let Some(ip) = ip else { continue };
            let (tx, rx) = watch::channel(false);
            let task = tokio::spawn(supervise(
                client.clone(),
                config.clone(),
                state.clone(),
                pod,
                node,
                ip,
                rx,
            ));
            supervised.insert(uid, (tx, task));
        }
        supervised.retain(|_, (_, task)| !task.is_finished());
    }
    // Shut down: every container goes.
    for (tx, _) in supervised.values() {
        let _ = tx.send(true);
    }
    for (_, (_, task)) in supervised {
        let _ = tokio::time::timeout(Duration::from_secs(20), task).await;
    }
}
