//! The operator's prepare requests on DiffusionNodes (`spec.models`), written by one writer
//! per node.
//!
//! A fleet's deployments are reconciled together (after a restart, or when many are
//! created), so many of them ask the same node at once, while the node's agent rewrites the
//! object's status as it answers. Every write of a DiffusionNode costs the apiserver the
//! whole object (validation, managed fields, the watch's fan-out), and writes to one object
//! that race retry against each other inside the apiserver. So a reconcile does not write a
//! node's requests itself: it hands its change to the node's writer and waits for the write
//! that carries it. Changes that come while a write is in flight go out together in the
//! next one: one JSON patch that touches only the entries they name. An entry it replaces
//! or removes is first tested at the index this process knows it at; a new one is appended.
//! So it commutes with the agent's status writes and with other writers' changes to other
//! entries (another operator serving other namespaces), and it never removes an entry it
//! did not mean to. When what this process knows is stale (a failed test, or an entry it
//! appends that is there already), the writer reads the node and computes the patch again,
//! once; a second failure is the reconciles' error, and they are retried.
//!
//! The DiffusionNode store follows its watch and can be behind a write: a reconcile in that
//! window would find its request missing (or a withdrawn one still there) and ask again, a
//! write and an event for nothing. So the list this process last wrote to a node, with the
//! generation the apiserver answered, stands for the store's while the stored DiffusionNode
//! (same uid) is older; once the store has caught up, what it holds is the truth, and a
//! request someone removed since is asked again. Kept in memory: a new leader starts from
//! the store.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crds::{DiffusionDeployment, DiffusionNode, ModelRequest};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;
use tracing::debug;

use crate::error::{kube, Error, Result};

/// The id a deployment's prepare requests and node reports carry: `<namespace>/<name>`.
pub fn model_id(dd: &DiffusionDeployment) -> String {
    format!("{}/{}", dd.namespace().unwrap_or_default(), dd.name_any())
}

/// One deployment's change to a node's requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add the request, or replace the one with its id.
    Ask(ModelRequest),
    /// Remove the request with this id.
    Withdraw(String),
}

impl Change {
    fn id(&self) -> &str {
        match self {
            Change::Ask(request) => &request.id,
            Change::Withdraw(id) => id,
        }
    }
}

/// The JSON patch operations that make `changes` (in order: the last change of an id wins)
/// on the list `models`; none when the list already shows them. Replacements first, at the
/// indices of `models`; then removals, the highest index first, so each index still holds
/// when its operation runs; then the new entries, appended.
fn operations(models: &[ModelRequest], changes: &[Change]) -> Vec<serde_json::Value> {
    let mut last: Vec<&Change> = Vec::new();
    for change in changes.iter().rev() {
        if !last.iter().any(|c| c.id() == change.id()) {
            last.push(change);
        }
    }
    last.reverse();
    let at = |id: &str| models.iter().position(|m| m.id == id);
    let test = |i: usize, id: &str| json!({ "op": "test", "path": format!("/spec/models/{i}/id"), "value": id });
    let mut ops = Vec::new();
    let mut removals = Vec::new();
    let mut appends = Vec::new();
    for change in last {
        match (change, at(change.id())) {
            (Change::Ask(request), Some(i)) if &models[i] != request => {
                ops.push(test(i, &request.id));
                ops.push(json!({ "op": "replace", "path": format!("/spec/models/{i}"), "value": request }));
            }
            (Change::Ask(_), Some(_)) | (Change::Withdraw(_), None) => {}
            (Change::Ask(request), None) => {
                appends.push(json!({ "op": "add", "path": "/spec/models/-", "value": request }))
            }
            (Change::Withdraw(id), Some(i)) => removals.push((i, id)),
        }
    }
    removals.sort_by_key(|r| std::cmp::Reverse(r.0));
    for (i, id) in removals {
        ops.push(test(i, id));
        ops.push(json!({ "op": "remove", "path": format!("/spec/models/{i}") }));
    }
    ops.extend(appends);
    ops
}

/// The list of requests on a node as some version of it holds them.
#[derive(Clone, Debug)]
struct Version {
    uid: Option<String>,
    generation: i64,
    models: Vec<ModelRequest>,
}

impl Version {
    fn of(dn: &DiffusionNode) -> Self {
        Self {
            uid: dn.metadata.uid.clone(),
            generation: dn.metadata.generation.unwrap_or(0),
            models: dn.spec.models.clone(),
        }
    }

    /// Whether this written version is newer than `dn`, the same object.
    fn newer_than(&self, dn: &DiffusionNode) -> bool {
        self.uid == dn.metadata.uid && dn.metadata.generation.unwrap_or(0) < self.generation
    }
}

type Answer = std::result::Result<(), Arc<Error>>;
/// A change waiting for its node's writer, with the reconcile waiting for its answer.
type Pending = (Change, oneshot::Sender<Answer>);

struct Inner {
    api: Api<DiffusionNode>,
    store: Store<DiffusionNode>,
    manager: String,
    /// Per node whose writer runs, the changes waiting for it (a node has an entry exactly
    /// while its writer runs).
    queues: Mutex<HashMap<String, Vec<Pending>>>,
    /// Per node, what this process last wrote (or read while retrying) and the store may not
    /// show yet.
    written: Mutex<HashMap<String, Version>>,
}

/// The prepare-request writers, one per node while it has changes to write.
#[derive(Clone)]
pub struct Requests(Arc<Inner>);

impl Requests {
    /// Writes with `client` under the field manager `manager`; `store` is the leader's
    /// DiffusionNode store.
    pub fn new(client: Client, store: Store<DiffusionNode>, manager: &str) -> Self {
        Self(Arc::new(Inner {
            api: Api::all(client),
            store,
            manager: manager.to_string(),
            queues: Mutex::default(),
            written: Mutex::default(),
        }))
    }

    /// `dn` (a stored DiffusionNode) with the requests this process knows it has: its own
    /// last write while the store is behind it, else the store's. Placement reads the
    /// requests through this: a prepare set computed from a store that shows only some of
    /// a deployment's asks would fill the rest with other nodes, withdraw the asks it
    /// missed and ask them again on the next reconcile.
    pub fn current(&self, dn: Arc<DiffusionNode>) -> Arc<DiffusionNode> {
        let name = dn.name_any();
        let mut written = self.0.written.lock().expect("not poisoned");
        match written.get(&name) {
            Some(w) if w.newer_than(&dn) => {
                let mut newer = (*dn).clone();
                newer.spec.models.clone_from(&w.models);
                Arc::new(newer)
            }
            Some(_) => {
                // The store has caught up (or the object is new): it is the truth again.
                written.remove(&name);
                dn
            }
            None => dn,
        }
    }

    /// The request of the deployment `id` on `dn`, as [`Requests::current`] knows it.
    pub fn asked(&self, dn: &Arc<DiffusionNode>, id: &str) -> Option<ModelRequest> {
        let dn = self.current(dn.clone());
        dn.spec.models.iter().find(|m| m.id == id).cloned()
    }

    /// Makes `change` on `node` and returns once a write that carries it has been answered
    /// (or there was nothing to write).
    pub async fn change(&self, node: &str, change: Change) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let start = match self
            .0
            .queues
            .lock()
            .expect("not poisoned")
            .entry(node.to_string())
        {
            Entry::Occupied(mut pending) => {
                pending.get_mut().push((change, tx));
                false
            }
            Entry::Vacant(queue) => {
                queue.insert(vec![(change, tx)]);
                true
            }
        };
        if start {
            tokio::spawn(self.clone().write_queue(node.to_string()));
        }
        match rx.await {
            Ok(answer) => answer.map_err(Error::Shared),
            Err(_) => Err(Error::WriterStopped(node.to_string())),
        }
    }

    /// Writes `node`'s pending changes, a batch per write, until none are left.
    async fn write_queue(self, node: String) {
        loop {
            let batch = {
                let mut queues = self.0.queues.lock().expect("not poisoned");
                let Some(pending) = queues.get_mut(&node) else {
                    return;
                };
                if pending.is_empty() {
                    queues.remove(&node);
                    return;
                }
                std::mem::take(pending)
            };
            let (changes, waiters): (Vec<Change>, Vec<_>) = batch.into_iter().unzip();
            let answer = self.write(&node, &changes).await.map_err(Arc::new);
            for waiter in waiters {
                // A reconcile that stopped waiting has nothing to be told.
                let _ = waiter.send(answer.clone());
            }
        }
    }

    /// One write of `changes` to `node`'s list: computed from the newest version this
    /// process knows, and once more from a fresh read if someone else changed the list.
    async fn write(&self, node: &str, changes: &[Change]) -> Result<()> {
        let known = self.0.store.get(&ObjectRef::new(node));
        let mut base = match known {
            Some(dn) => Version::of(&self.current(dn)),
            None => self.read(node).await?,
        };
        let mut retried = false;
        loop {
            let mut ops = operations(&base.models, changes);
            if ops.is_empty() {
                return Ok(());
            }
            // Never a recreated object of the same name with what this process knew of the
            // old one.
            ops.insert(
                0,
                json!({ "op": "test", "path": "/metadata/uid", "value": base.uid }),
            );
            let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))
                .map_err(|source| Error::Serialize {
                    what: "prepare-request patch",
                    source,
                })?;
            let params = PatchParams {
                field_manager: Some(self.0.manager.clone()),
                ..PatchParams::default()
            };
            let sent = self
                .0
                .api
                .patch(node, &params, &Patch::Json::<()>(patch))
                .await;
            debug!(
                node,
                changes = changes.len(),
                retried,
                ok = sent.is_ok(),
                "wrote prepare requests"
            );
            match sent {
                Ok(dn) => {
                    self.record(node, Version::of(&dn));
                    return Ok(());
                }
                // A failed test or an entry appended twice (422), or a lost race the
                // apiserver did not retry (409): the list moved under this process.
                Err(kube::Error::Api(e)) if !retried && (e.code == 409 || e.code == 422) => {
                    retried = true;
                    base = self.read(node).await?;
                }
                Err(e) => {
                    return Err(kube(format!(
                        "writing the prepare requests of DiffusionNode {node}"
                    ))(e))
                }
            }
        }
    }

    /// Reads `node` from the apiserver and remembers its list as the newest known.
    async fn read(&self, node: &str) -> Result<Version> {
        let dn = self
            .0
            .api
            .get(node)
            .await
            .map_err(kube(format!("reading DiffusionNode {node}")))?;
        let version = Version::of(&dn);
        self.record(node, version.clone());
        Ok(version)
    }

    fn record(&self, node: &str, version: Version) {
        self.0
            .written
            .lock()
            .expect("not poisoned")
            .insert(node.to_string(), version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: &str, path: &str) -> ModelRequest {
        ModelRequest {
            id: id.into(),
            family: "dit".into(),
            location: crds::ModelLocation {
                host_path: Some(path.into()),
                ..Default::default()
            },
        }
    }

    fn dn(generation: i64, uid: &str, models: Vec<ModelRequest>) -> Arc<DiffusionNode> {
        let mut d = DiffusionNode::new("n1", crds::DiffusionNodeSpec { models });
        d.metadata.generation = Some(generation);
        d.metadata.uid = Some(uid.into());
        Arc::new(d)
    }

    fn requests() -> Requests {
        let (store, _writer) = kube::runtime::reflector::store::<DiffusionNode>();
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Requests::new(Client::try_from(config).unwrap(), store, "test")
    }

    /// `ops` applied to a DiffusionNode holding `models`, as the apiserver applies them.
    fn patched(models: &[ModelRequest], ops: Vec<serde_json::Value>) -> Vec<ModelRequest> {
        let mut doc = json!({ "metadata": { "uid": "u1" }, "spec": { "models": models } });
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        serde_json::from_value(doc["spec"]["models"].clone()).unwrap()
    }

    #[test]
    fn a_batch_touches_only_the_entries_it_names_and_the_last_change_of_an_id_wins() {
        let base = vec![
            request("ns/a", "/m/a"),
            request("ns/b", "/m/b"),
            request("other/x", "/m/x"),
            request("ns/c", "/m/c"),
        ];
        let changes = [
            Change::Ask(request("ns/d", "/m/d")),
            Change::Withdraw("ns/d".into()),
            Change::Ask(request("ns/a", "/m/a2")),
            Change::Withdraw("ns/c".into()),
            Change::Withdraw("ns/b".into()),
            Change::Ask(request("ns/e", "/m/e")),
            Change::Withdraw("ns/missing".into()),
            Change::Ask(request("ns/d", "/m/d2")),
        ];
        let ops = operations(&base, &changes);
        // Each replacement and removal is tested at its index first.
        let tests = ops.iter().filter(|o| o["op"] == "test").count();
        assert_eq!(tests, 3, "{ops:#?}");
        assert_eq!(
            patched(&base, ops),
            vec![
                request("ns/a", "/m/a2"),
                request("other/x", "/m/x"),
                request("ns/e", "/m/e"),
                request("ns/d", "/m/d2"),
            ]
        );
        // Nothing to write when the list already shows every change.
        assert!(operations(
            &base,
            &[
                Change::Ask(request("ns/a", "/m/a")),
                Change::Withdraw("ns/z".into())
            ]
        )
        .is_empty());
    }

    #[test]
    fn a_stale_index_fails_the_patch_instead_of_removing_another_entry() {
        let known = vec![request("ns/a", "/m/a"), request("ns/b", "/m/b")];
        let ops = operations(&known, &[Change::Withdraw("ns/b".into())]);
        // Someone removed ns/a since: index 1 is out of range, and index 0 is ns/b.
        let mut doc = json!({ "spec": { "models": [request("ns/b", "/m/b")] } });
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
        assert!(json_patch::patch(&mut doc, &patch).is_err());
        // Someone added an entry before it: the test at index 1 names another id.
        let mut doc = json!({ "spec": { "models": [request("ns/a", "/m/a"), request("x/y", "/m/y"), request("ns/b", "/m/b")] } });
        let ops = operations(&known, &[Change::Withdraw("ns/b".into())]);
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
        assert!(json_patch::patch(&mut doc, &patch).is_err());
    }

    #[tokio::test]
    async fn a_write_stands_for_the_store_until_the_store_reaches_its_generation() {
        let requests = requests();
        let a = request("ns/a", "/m/a");
        let stale = dn(4, "u1", vec![]);
        assert_eq!(requests.asked(&stale, "ns/a"), None);

        requests.record("n1", Version::of(&dn(5, "u1", vec![a.clone()])));
        // The store still holds generation 4: the write stands for it.
        assert_eq!(requests.asked(&stale, "ns/a"), Some(a.clone()));
        assert_eq!(requests.asked(&stale, "ns/b"), None);
        // A new object of the same name: the store is the truth, and the write is forgotten.
        assert_eq!(requests.asked(&dn(1, "u2", vec![]), "ns/a"), None);
        assert_eq!(requests.asked(&stale, "ns/a"), None);

        // Caught up, and someone removed it since: the store is the truth again.
        requests.record("n1", Version::of(&dn(5, "u1", vec![a.clone()])));
        assert_eq!(requests.asked(&dn(6, "u1", vec![]), "ns/a"), None);
        // A withdraw written at generation 7 stands for a store that still shows the ask.
        requests.record("n1", Version::of(&dn(7, "u1", vec![])));
        assert_eq!(requests.asked(&dn(6, "u1", vec![a.clone()]), "ns/a"), None);
        assert_eq!(
            requests.asked(&dn(7, "u1", vec![a.clone()]), "ns/a"),
            Some(a)
        );
    }
}
