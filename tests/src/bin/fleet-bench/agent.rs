//! The fake node agents: every prepare request answered with a warm profile at once, one
//! report at a time per node, and when each stage of that happened.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crds::DiffusionNode;
use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::common::AGENT;
use super::fleet::{agent_status, model, FakeNode};

/// When each model (by its request id, `namespace/name`) first reached a fake agent, and
/// when the first report with its profile was written: with the plan's time, where a
/// deployment's wait went (the operator's ask, the agents' report, or the operator's plan).
#[derive(Default)]
pub(super) struct Stages {
    /// When the deployments were created; nothing is timed before.
    pub(super) t0: Option<Instant>,
    pub(super) asked: BTreeMap<String, Duration>,
    pub(super) reported: BTreeMap<String, Duration>,
    /// When the agents' own watch first showed a profile of the model: how far behind the
    /// write the apiserver's watch delivers it.
    pub(super) seen: BTreeMap<String, Duration>,
}

pub(super) type SharedStages = std::sync::Arc<std::sync::Mutex<Stages>>;

impl Stages {
    /// Notes now as the first time of `ids` in the map `of` picks, once timing started.
    pub(super) fn mark<'a>(
        &mut self,
        of: fn(&mut Stages) -> &mut BTreeMap<String, Duration>,
        ids: impl IntoIterator<Item = &'a String>,
    ) {
        let Some(t0) = self.t0 else { return };
        let map = of(self);
        for id in ids {
            map.entry(id.clone()).or_insert_with(|| t0.elapsed());
        }
    }
}

/// Plays every node's agent: a DiffusionNode whose requests differ from what it reports is
/// answered with every requested model warm and profiled. Each node has one writer, as a
/// real agent's node loop is: its reports go out one at a time, the latest requests when
/// the last write is answered (concurrent writes of one node could land out of order and
/// take back a profile already reported), and all nodes answer concurrently.
pub(super) async fn agent(client: Client, fleet: Vec<FakeNode>, stages: SharedStages) {
    let by_name: BTreeMap<String, FakeNode> =
        fleet.into_iter().map(|n| (n.name.clone(), n)).collect();
    let dns: Api<DiffusionNode> = Api::all(client);
    let mut writers: BTreeMap<String, tokio::sync::watch::Sender<Vec<String>>> = BTreeMap::new();
    let events = watcher(dns.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let Ok(dn) = event else { continue };
        let Some(n) = by_name.get(&dn.name_any()) else {
            continue;
        };
        let requested: Vec<String> = dn.spec.models.iter().map(|m| m.id.clone()).collect();
        {
            let mut st = stages.lock().unwrap();
            st.mark(|s| &mut s.asked, &requested);
            st.mark(
                |s| &mut s.seen,
                dn.status.iter().flat_map(|s| &s.models).map(|m| &m.id),
            );
        }
        let reported: Vec<&str> = dn
            .status
            .as_ref()
            .map(|s| s.models.iter().map(|m| m.id.as_str()).collect())
            .unwrap_or_default();
        if requested == reported {
            continue;
        }
        let writer = writers.entry(n.name.clone()).or_insert_with(|| {
            // The fleet was created reporting no model.
            let (tx, rx) = tokio::sync::watch::channel(Vec::new());
            tokio::spawn(report(dns.clone(), n.clone(), rx, stages.clone()));
            tx
        });
        writer.send_if_modified(|latest| {
            let changed = *latest != requested;
            if changed {
                latest.clone_from(&requested);
            }
            changed
        });
    }
}

/// One node's writer: reports the latest requested models, one write at a time (a failed
/// write is tried again unless newer requests came meanwhile). Ends with the agent.
pub(super) async fn report(
    dns: Api<DiffusionNode>,
    n: FakeNode,
    mut requested: tokio::sync::watch::Receiver<Vec<String>>,
    stages: SharedStages,
) {
    let pp = PatchParams::apply(AGENT).force();
    while requested.changed().await.is_ok() {
        loop {
            let ids = requested.borrow_and_update().clone();
            let models: Vec<serde_json::Value> = ids
                .iter()
                .map(|id| {
                    let k = id
                        .rsplit_once("m-")
                        .and_then(|(_, k)| k.parse::<usize>().ok())
                        .unwrap_or(0);
                    let p = model(k);
                    json!({ "id": id, "state": "Warm", "profile": p,
                            "residentBytes": p.total_bytes, "totalBytes": p.total_bytes })
                })
                .collect();
            let status = agent_status(&n, &models);
            match dns.patch_status(&n.name, &pp, &Patch::Apply(status)).await {
                Ok(_) => {
                    stages.lock().unwrap().mark(|s| &mut s.reported, &ids);
                    break;
                }
                Err(e) => {
                    eprintln!("agent: reporting {}: {e}", n.name);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if requested.has_changed().unwrap_or(true) {
                        break;
                    }
                }
            }
        }
    }
}
