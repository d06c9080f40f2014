//! The leader's view of the fleet: reflector stores of Nodes and DiffusionNodes that every
//! reconcile reads instead of listing them, and the reconciles their changes cause; and
//! stores of the engine Deployments and Services the operator made, which a reconcile reads
//! instead of getting them (their changes reconcile their owner, as `Controller::owns`
//! does), with what it last applied of each ([`Applied`]) so an unchanged object is not
//! applied again.
//!
//! Each kind is watched once. Its watch stream fills the store and, past the first full
//! list, turns a change that matters into reconciles of the deployments it concerns:
//! - a Node whose labels, allocatable resources or schedulability change (or that goes):
//!   the deployments whose node selector matches it, and those that asked it to prepare;
//! - a DiffusionNode whose model requests or reports change: the deployments they name;
//!   when its inventory (accelerators, memory) changes, or it is new: also the deployments
//!   whose selector matches its Node.
//!
//! The agents' periodic rewrites (`updatedAt`) and kubelet heartbeats change nothing that
//! matters and cause nothing. Stored objects are trimmed to what placement reads.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::time::Duration;

use crds::{DiffusionDeployment, DiffusionNode};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{stream, FutureExt, Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Service};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use tracing::warn;

use crate::error::{Error, Result};
use crate::placement::selector_matches;

/// How long a reconcile waits for the stores' first list before it gives up (and is retried).
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// The label the operator puts on what it creates (key and value); its owned Deployments
/// and Services are watched by it.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "layerwise-operator");

/// The stores every reconcile reads.
#[derive(Clone)]
pub struct Stores {
    pub nodes: Store<Node>,
    pub diffusion_nodes: Store<DiffusionNode>,
    /// The engine Deployments the operator made (label [`MANAGED_BY`]).
    pub engines: Store<Deployment>,
    /// The engine Services the operator made.
    pub services: Store<Service>,
    /// True once all four hold their first full list. (A reflector store's own readiness
    /// wakes only one of the tasks waiting on it; every reconcile waits here instead.)
    synced: tokio::sync::watch::Receiver<bool>,
}

impl Stores {
    /// Waits until every store holds its first full list: a reconcile that read an empty
    /// store of engine Deployments would take a running one for missing.
    pub async fn ready(&self) -> Result<()> {
        let mut synced = self.synced.clone();
        let waited = tokio::time::timeout(SYNC_TIMEOUT, synced.wait_for(|s| *s))
            .await
            .map(|r| r.map(|_| ()));
        match waited {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Error::StoresNotSynced("their watches ended")),
            Err(_) => Err(Error::StoresNotSynced("no full list within a minute")),
        }
    }

    /// A node's DiffusionNode, from the store.
    pub fn diffusion_node(&self, name: &str) -> Option<std::sync::Arc<DiffusionNode>> {
        self.diffusion_nodes.get(&ObjectRef::new(name))
    }

    /// A Node, from the store.
    pub fn node(&self, name: &str) -> Option<std::sync::Arc<Node>> {
        self.nodes.get(&ObjectRef::new(name))
    }

    /// An engine Deployment the operator made, from the store.
    pub fn engine(&self, ns: &str, name: &str) -> Option<std::sync::Arc<Deployment>> {
        self.engines.get(&ObjectRef::new(name).within(ns))
    }

    /// An engine Service the operator made, from the store.
    pub fn service(&self, ns: &str, name: &str) -> Option<std::sync::Arc<Service>> {
        self.services.get(&ObjectRef::new(name).within(ns))
    }
}

/// What the operator last applied of each object it owns: a hash of the object it sent
/// and the version the apiserver answered with (a Deployment's `generation`, which any
/// change to its spec moves; a Service's `resourceVersion`, which any change moves). While
/// the stored object is still at that version and the desired object hashes the same, an
/// apply would change nothing, so it is not sent: a steady reconcile writes nothing.
/// Anything else that changes the object moves its version, and the next reconcile applies
/// again. Kept in memory: a new leader applies everything once.
#[derive(Default)]
pub struct Applied(std::sync::Mutex<HashMap<AppliedKey, (u64, String)>>);

/// The owning deployment's uid and the kind applied.
type AppliedKey = (String, &'static str);

impl Applied {
    /// Whether `desired` (of `kind`, owned by the deployment `uid`) is what was applied last
    /// and the stored object is still at the version that apply made.
    pub fn unchanged(
        &self,
        uid: &str,
        kind: &'static str,
        desired: &impl Serialize,
        stored: Option<&str>,
    ) -> bool {
        let map = self.0.lock().expect("not poisoned");
        map.get(&(uid.to_string(), kind))
            .is_some_and(|(hash, version)| {
                *hash == hash_of(desired) && Some(version.as_str()) == stored
            })
    }

    /// The version the last apply of `kind` for `uid` made, if this process made one.
    pub fn version(&self, uid: &str, kind: &'static str) -> Option<String> {
        let map = self.0.lock().expect("not poisoned");
        map.get(&(uid.to_string(), kind)).map(|(_, v)| v.clone())
    }

    /// Records that `desired` was applied and the apiserver answered with `version`.
    pub fn record(&self, uid: &str, kind: &'static str, desired: &impl Serialize, version: String) {
        let mut map = self.0.lock().expect("not poisoned");
        map.insert((uid.to_string(), kind), (hash_of(desired), version));
    }

    /// Forgets a deployment that is gone.
    pub fn forget(&self, uid: &str) {
        self.0
            .lock()
            .expect("not poisoned")
            .retain(|(u, _), _| u != uid);
    }
}

/// The prepare-request writes this process made to DiffusionNodes, each with the generation
/// the apiserver answered. The DiffusionNode store follows its watch and can be behind a
/// write: a reconcile in that window would find its request missing (or a withdrawn one
/// still there) and write again, a patch and an event for nothing, and a withdraw's JSON
/// patch would fail its test. While the stored DiffusionNode (same uid) is older than the
/// write's generation, the write stands for it. Once the store has caught up, what it holds
/// is the truth: a request someone removed since is asked again. Kept in memory: a new
/// leader starts from the store.
#[derive(Default)]
pub struct Requests(std::sync::Mutex<HashMap<(String, String), Written>>);

/// A prepare-request write: the request added (the hash of what it asked, see
/// [`Write::asked`]), or withdrawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Asked(u64),
    Withdrawn,
}

impl Write {
    pub fn asked(request: &crds::ModelRequest) -> Self {
        Self::Asked(hash_of(request))
    }
}

struct Written {
    uid: Option<String>,
    generation: i64,
    write: Write,
}

impl Requests {
    /// Whether this process made `write` for the deployment `id` on `dn` and the store's
    /// `dn` does not show it yet.
    pub fn in_flight(&self, dn: &DiffusionNode, id: &str, write: Write) -> bool {
        let map = self.0.lock().expect("not poisoned");
        map.get(&(dn.name_any(), id.to_string())).is_some_and(|w| {
            w.write == write
                && w.uid == dn.metadata.uid
                && dn.metadata.generation.unwrap_or(0) < w.generation
        })
    }

    /// Records `write` for `id`, answered with the DiffusionNode `answered`.
    pub fn record(&self, id: &str, answered: &DiffusionNode, write: Write) {
        let mut map = self.0.lock().expect("not poisoned");
        map.insert(
            (answered.name_any(), id.to_string()),
            Written {
                uid: answered.metadata.uid.clone(),
                generation: answered.metadata.generation.unwrap_or(0),
                write,
            },
        );
    }

    /// Forgets a deployment that is gone.
    pub fn forget(&self, id: &str) {
        self.0
            .lock()
            .expect("not poisoned")
            .retain(|(_, i), _| i != id);
    }
}

/// What [`watch`] starts: the stores, the reconciles that Node and DiffusionNode changes
/// cause, the owned objects' watch streams (for `Controller::owns_stream`, which maps each
/// change to its owner), and a future that resolves once every store is synced.
pub struct Watches {
    pub stores: Stores,
    pub triggers: BoxStream<'static, ObjectRef<DiffusionDeployment>>,
    pub engines: BoxStream<'static, Result<Deployment, watcher::Error>>,
    pub services: BoxStream<'static, Result<Service, watcher::Error>>,
    pub synced: BoxFuture<'static, ()>,
}

/// Builds the stores and their watches; `deployments` is the controller's own store of
/// DiffusionDeployments (for mapping changes to them), `namespace` the one the operator
/// serves (`None`: all).
pub fn watch(
    client: &Client,
    deployments: Store<DiffusionDeployment>,
    namespace: Option<&str>,
) -> Watches {
    let (nodes, node_writer) = reflector::store::<Node>();
    let (dns, dn_writer) = reflector::store::<DiffusionNode>();
    let (engines, engine_writer) = reflector::store::<Deployment>();
    let (services, service_writer) = reflector::store::<Service>();
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let stores = Stores {
        nodes,
        diffusion_nodes: dns,
        engines,
        services,
        synced,
    };
    let st = stores.clone();
    let synced = async move {
        let ready = st.nodes.wait_until_ready().await.is_ok()
            && st.diffusion_nodes.wait_until_ready().await.is_ok()
            && st.engines.wait_until_ready().await.is_ok()
            && st.services.wait_until_ready().await.is_ok();
        if ready {
            let _ = synced_tx.send(true);
        }
        // Keeps the sender: dropping it would end every wait with an error.
        futures::future::pending::<()>().await
    };

    let owned = watcher::Config::default().labels(&format!("{}={}", MANAGED_BY.0, MANAGED_BY.1));
    let (engine_api, service_api) = match namespace {
        Some(ns) => (
            Api::<Deployment>::namespaced(client.clone(), ns),
            Api::<Service>::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    // Touched, not only applied: a deleted engine Deployment or Service reconciles its
    // owner, which makes it again.
    let engine_events = watcher(engine_api, owned.clone())
        .default_backoff()
        .modify(|d: &mut Deployment| d.managed_fields_mut().clear())
        .reflect(engine_writer)
        .touched_objects()
        .boxed();
    let service_events = watcher(service_api, owned)
        .default_backoff()
        .modify(|s: &mut Service| s.managed_fields_mut().clear())
        .reflect(service_writer)
        .touched_objects()
        .boxed();

    let node_events = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(trim_node)
        .reflect(node_writer);
    let (dds, st) = (deployments.clone(), stores.clone());
    let node_triggers = changes(
        node_events,
        "Node",
        node_facts,
        |_| 0,
        move |node, _| {
            node_refs(
                &dds.state(),
                st.diffusion_node(&node.name_any()).as_deref(),
                node,
            )
        },
    );

    let dn_events = watcher(
        Api::<DiffusionNode>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|dn: &mut DiffusionNode| {
        dn.managed_fields_mut().clear();
        dn.annotations_mut().clear();
    })
    .reflect(dn_writer);
    let st = stores.clone();
    let dn_triggers = changes(
        dn_events,
        "DiffusionNode",
        inventory_facts,
        model_facts,
        move |dn, wide| {
            let node = if wide { st.node(&dn.name_any()) } else { None };
            dn_refs(&deployments.state(), node.as_deref(), dn)
        },
    );

    Watches {
        stores,
        triggers: stream::select(node_triggers, dn_triggers).boxed(),
        engines: engine_events,
        services: service_events,
        synced: synced.boxed(),
    }
}

/// Keeps what placement reads of a Node: name, labels, schedulability and taints,
/// allocatable resources.
fn trim_node(n: &mut Node) {
    n.managed_fields_mut().clear();
    n.annotations_mut().clear();
    n.spec = n.spec.take().map(|s| NodeSpec {
        unschedulable: s.unschedulable,
        taints: s.taints,
        ..Default::default()
    });
    n.status = n.status.take().map(|s| NodeStatus {
        allocatable: s.allocatable,
        ..Default::default()
    });
}

pub(crate) fn hash_of(v: &impl Serialize) -> u64 {
    let mut h = DefaultHasher::new();
    serde_json::to_string(v).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// What a Node change must be about to matter.
fn node_facts(n: &Node) -> u64 {
    hash_of(&(
        n.labels(),
        n.spec.as_ref().map(|s| (&s.unschedulable, &s.taints)),
        n.status.as_ref().map(|s| &s.allocatable),
    ))
}

/// A DiffusionNode's inventory: what makes its node a fit or not.
fn inventory_facts(dn: &DiffusionNode) -> u64 {
    hash_of(&dn.status.as_ref().map(|s| {
        (
            &s.accelerators,
            s.host_memory_bytes,
            s.cgroup_memory_limit_bytes,
        )
    }))
}

/// A DiffusionNode's model requests and reports.
fn model_facts(dn: &DiffusionNode) -> u64 {
    hash_of(&(&dn.spec.models, dn.status.as_ref().map(|s| &s.models)))
}

/// The deployments a change to `node` concerns.
pub fn node_refs(
    dds: &[std::sync::Arc<DiffusionDeployment>],
    dn: Option<&DiffusionNode>,
    node: &Node,
) -> Vec<ObjectRef<DiffusionDeployment>> {
    let asked: BTreeSet<&str> = dn
        .map(|d| d.spec.models.iter().map(|m| m.id.as_str()).collect())
        .unwrap_or_default();
    dds.iter()
        .filter(|dd| {
            selector_matches(&dd.spec.accelerator.node_selector, node.labels())
                || asked.contains(crate::controller::model_id(dd).as_str())
        })
        .map(|dd| ObjectRef::from_obj(dd.as_ref()))
        .collect()
}

/// The deployments a change to `dn` concerns: those it names, and with its `node` (given
/// when its inventory changed) those whose selector matches that node.
pub fn dn_refs(
    dds: &[std::sync::Arc<DiffusionDeployment>],
    node: Option<&Node>,
    dn: &DiffusionNode,
) -> Vec<ObjectRef<DiffusionDeployment>> {
    let mut ids: BTreeSet<String> = dn.spec.models.iter().map(|m| m.id.clone()).collect();
    if let Some(st) = &dn.status {
        ids.extend(st.models.iter().map(|m| m.id.clone()));
    }
    if let Some(node) = node {
        ids.extend(
            dds.iter()
                .filter(|dd| selector_matches(&dd.spec.accelerator.node_selector, node.labels()))
                .map(|dd| crate::controller::model_id(dd)),
        );
    }
    ids.iter()
        .filter_map(|id| id.split_once('/'))
        .map(|(ns, name)| ObjectRef::new(name).within(ns))
        .collect()
}

/// Turns a reflected watch stream into the reconciles its changes cause. `wide` and
/// `narrow` hash what matters of an object; `map(obj, wide_changed)` names the deployments.
/// The first full list only fills the store (the controller reconciles every deployment at
/// start anyway); a relist after a lost watch triggers for what changed meanwhile, once the
/// store holds the new list.
fn changes<K, S>(
    events: S,
    kind: &'static str,
    wide: fn(&K) -> u64,
    narrow: fn(&K) -> u64,
    map: impl Fn(&K, bool) -> Vec<ObjectRef<DiffusionDeployment>> + Send + 'static,
) -> impl Stream<Item = ObjectRef<DiffusionDeployment>> + Send + 'static
where
    K: kube::Resource + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut seen: HashMap<String, (u64, u64)> = HashMap::new();
    let mut listed_once = false;
    let mut relisted: Vec<ObjectRef<DiffusionDeployment>> = Vec::new();
    events
        .map(move |event| {
            let diff = |obj: &K, seen: &mut HashMap<String, (u64, u64)>| {
                let now = (wide(obj), narrow(obj));
                match seen.insert(obj.name_any(), now) {
                    Some(before) if before == now => None,
                    Some(before) => Some(map(obj, before.0 != now.0)),
                    None => Some(map(obj, true)),
                }
            };
            let refs = match event {
                Ok(watcher::Event::Apply(obj)) => diff(&obj, &mut seen).unwrap_or_default(),
                Ok(watcher::Event::Delete(obj)) => {
                    seen.remove(&obj.name_any());
                    map(&obj, true)
                }
                Ok(watcher::Event::Init) => Vec::new(),
                Ok(watcher::Event::InitApply(obj)) => {
                    let refs = diff(&obj, &mut seen);
                    if listed_once {
                        relisted.extend(refs.unwrap_or_default());
                    }
                    Vec::new()
                }
                Ok(watcher::Event::InitDone) => {
                    listed_once = true;
                    std::mem::take(&mut relisted)
                }
                Err(err) => {
                    warn!(kind, error = %err, "watch failed; retrying with backoff");
                    Vec::new()
                }
            };
            stream::iter(refs)
        })
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n
    }

    fn dd(ns: &str, name: &str, selector: serde_json::Value) -> Arc<DiffusionDeployment> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
                "metadata": { "name": name, "namespace": ns },
                "spec": {
                    "model": { "family": "dit", "location": { "hostPath": "/models/m" } },
                    "workload": { "maxWidth": 512, "maxHeight": 512 },
                    "accelerator": { "nodeSelector": selector },
                },
            }))
            .unwrap(),
        )
    }

    fn dn(name: &str, asked_by: &[&str]) -> DiffusionNode {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
            "metadata": { "name": name },
            "spec": { "models": asked_by.iter().map(|id| serde_json::json!({
                "id": id, "family": "dit", "location": { "hostPath": "/models/m" },
            })).collect::<Vec<_>>() },
        }))
        .unwrap()
    }

    #[test]
    fn a_write_stands_for_the_store_until_the_store_reaches_its_generation() {
        let at = |generation: i64, uid: &str, asked_by: &[&str]| {
            let mut d = dn("n1", asked_by);
            d.metadata.generation = Some(generation);
            d.metadata.uid = Some(uid.into());
            d
        };
        let asked = at(5, "u1", &["ns/a"]);
        let request = asked.spec.models[0].clone();
        let mut other = request.clone();
        other.location.host_path = Some("/models/other".into());
        let requests = Requests::default();
        let stale = at(4, "u1", &[]);
        assert!(!requests.in_flight(&stale, "ns/a", Write::asked(&request)));

        requests.record("ns/a", &asked, Write::asked(&request));
        // The store still holds generation 4: the ask stands, for this request only.
        assert!(requests.in_flight(&stale, "ns/a", Write::asked(&request)));
        assert!(!requests.in_flight(&stale, "ns/a", Write::asked(&other)));
        assert!(!requests.in_flight(&stale, "ns/b", Write::asked(&request)));
        assert!(!requests.in_flight(&stale, "ns/a", Write::Withdrawn));
        // Caught up (and someone removed it since), or a new object of the same name: the
        // store is the truth again.
        assert!(!requests.in_flight(&at(5, "u1", &[]), "ns/a", Write::asked(&request)));
        assert!(!requests.in_flight(&at(6, "u1", &[]), "ns/a", Write::asked(&request)));
        assert!(!requests.in_flight(&at(1, "u2", &[]), "ns/a", Write::asked(&request)));

        // A withdraw replaces the ask.
        requests.record("ns/a", &at(6, "u1", &[]), Write::Withdrawn);
        assert!(requests.in_flight(&asked, "ns/a", Write::Withdrawn));
        assert!(!requests.in_flight(&asked, "ns/a", Write::asked(&request)));
        requests.forget("ns/a");
        assert!(!requests.in_flight(&asked, "ns/a", Write::Withdrawn));
    }

    fn names(refs: Vec<ObjectRef<DiffusionDeployment>>) -> Vec<String> {
        refs.iter()
            .map(|r| format!("{}/{}", r.namespace.clone().unwrap_or_default(), r.name))
            .collect()
    }

    #[test]
    fn a_node_concerns_the_deployments_it_matches_or_was_asked_by() {
        let dds = vec![
            dd("a", "any", serde_json::json!({})),
            dd("a", "h200", serde_json::json!({ "type": "h200" })),
            dd("b", "a100", serde_json::json!({ "type": "a100" })),
            dd("b", "l40", serde_json::json!({ "type": "l40" })),
        ];
        let n = node("n1", &[("type", "a100")]);
        let asked = dn("n1", &["b/l40"]);
        assert_eq!(
            names(node_refs(&dds, Some(&asked), &n)),
            ["a/any", "b/a100", "b/l40"]
        );
    }

    #[test]
    fn a_diffusion_node_concerns_the_ids_it_names_and_with_new_inventory_its_nodes_matches() {
        let dds = vec![
            dd("a", "any", serde_json::json!({})),
            dd("b", "a100", serde_json::json!({ "type": "a100" })),
            dd("b", "l40", serde_json::json!({ "type": "l40" })),
        ];
        let d = dn("n1", &["c/gone"]);
        assert_eq!(names(dn_refs(&dds, None, &d)), ["c/gone"]);
        let n = node("n1", &[("type", "a100")]);
        assert_eq!(
            names(dn_refs(&dds, Some(&n), &d)),
            ["a/any", "b/a100", "c/gone"]
        );
    }

    #[tokio::test]
    async fn only_changes_that_matter_trigger_and_the_first_list_does_not() {
        use watcher::Event::*;
        let labelled = |v: &str| node("n1", &[("type", v)]);
        let mut heartbeat = labelled("a100");
        heartbeat.metadata.resource_version = Some("99".into());
        let events = vec![
            Ok(Init),
            Ok(InitApply(labelled("a100"))),
            Ok(InitApply(node("n2", &[]))),
            Ok(InitDone),
            // Same facts (a heartbeat, a new resourceVersion): nothing.
            Ok(Apply(heartbeat)),
            // A label changes: its deployments.
            Ok(Apply(labelled("h200"))),
            Ok(Delete(node("n2", &[]))),
            // A relist that finds n1 changed again: triggered at InitDone.
            Ok(Init),
            Ok(InitApply(labelled("l40"))),
            Ok(InitDone),
        ];
        let mapped = changes(
            stream::iter(events),
            "Node",
            node_facts,
            |_| 0,
            |n: &Node, wide| vec![ObjectRef::new(&format!("{}-{wide}", n.name_any())).within("ns")],
        );
        let got = names(mapped.collect().await);
        assert_eq!(got, ["ns/n1-true", "ns/n2-true", "ns/n1-true"]);
    }

    #[test]
    fn trimming_keeps_what_placement_reads() {
        let mut n: Node = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "n", "labels": { "a": "b" }, "annotations": { "x": "y" },
                          "managedFields": [{ "manager": "kubelet" }] },
            "spec": { "podCIDR": "127.1.1.0/24", "unschedulable": true },
            "status": { "allocatable": { "nvidia.com/gpu": "8" }, "capacity": { "cpu": "1" },
                        "images": [{ "names": ["x"] }], "conditions": [{ "type": "Ready", "status": "True" }] },
        }))
        .unwrap();
        let facts = node_facts(&n);
        trim_node(&mut n);
        assert_eq!(node_facts(&n), facts, "trimming changes no fact");
        assert!(n.annotations().is_empty() && n.managed_fields().is_empty());
        let st = n.status.as_ref().unwrap();
        assert!(st.images.is_none() && st.conditions.is_none() && st.capacity.is_none());
        assert_eq!(st.allocatable.as_ref().unwrap()["nvidia.com/gpu"].0, "8");
        assert_eq!(n.spec.as_ref().unwrap().unschedulable, Some(true));
        assert!(n.spec.as_ref().unwrap().pod_cidr.is_none());
    }
}
