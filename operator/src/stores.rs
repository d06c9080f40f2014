//! The leader's view of the fleet: reflector stores of Nodes and DiffusionNodes that every
//! reconcile reads instead of listing them, and the reconciles their changes cause; and
//! stores of the engine Deployments and Services the operator made, which a reconcile reads
//! instead of getting them (their changes reconcile their owner, as `Controller::owns`
//! does), with what it last applied of each ([`Applied`]) so an unchanged object is not
//! applied again; and a store of the engine pods, which the builtin autoscaler's scrape and
//! the unschedulable check read instead of listing them.
//!
//! Each kind is watched once. Its watch stream fills the store and, past the first full
//! list, turns a change that matters into reconciles of the deployments it concerns:
//! - a Node whose labels, allocatable resources or schedulability change (or that goes):
//!   the deployments whose node selector matches it, and those that asked it to prepare;
//! - a DiffusionNode whose model requests or reports change: the deployments they name;
//!   when its inventory (accelerators, memory) changes, or it is new: also the deployments
//!   whose selector matches its Node;
//! - an engine pod the scheduler turns away, or that it places after all (or that goes while
//!   turned away): its deployment. Nothing else about a pod reconciles: its readiness
//!   reaches the deployment through its engine Deployment's status.
//!
//! The agents' periodic rewrites (`updatedAt`) and kubelet heartbeats change nothing that
//! matters and cause nothing. Stored objects are trimmed to what placement reads.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use crds::{DiffusionDeployment, DiffusionNode};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{stream, FutureExt, Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Pod, PodStatus, Service};
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
    /// The engine pods (label [`MANAGED_BY`], which their template carries), trimmed to
    /// what the scrape and the unschedulable check read ([`trim_pod`]).
    pub pods: Store<Pod>,
    /// True once all five hold their first full list. (A reflector store's own readiness
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

    /// The engine pods in `ns` whose labels include `selector`'s, from the store.
    pub fn pods_of(&self, ns: &str, selector: &BTreeMap<String, String>) -> Vec<Arc<Pod>> {
        self.pods
            .state()
            .into_iter()
            .filter(|p| {
                p.metadata.namespace.as_deref() == Some(ns)
                    && selector_matches(selector, p.labels())
            })
            .collect()
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

/// What [`watch`] starts: the stores, the reconciles that Node and DiffusionNode changes
/// cause, the owned objects' watch streams (for `Controller::owns_stream`, which maps each
/// change to its owner), and a future that resolves once every store is synced.
pub struct Watches {
    pub stores: Stores,
    pub triggers: BoxStream<'static, ObjectRef<DiffusionDeployment>>,
    pub engines: Touched<Deployment>,
    pub services: Touched<Service>,
    pub synced: BoxFuture<'static, ()>,
}

/// A watch stream of the objects of a kind that were applied or deleted.
pub type Touched<K> = BoxStream<'static, Result<K, watcher::Error>>;

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
    let (pods, pod_writer) = reflector::store::<Pod>();
    let (synced_tx, synced) = tokio::sync::watch::channel(false);
    let stores = Stores {
        nodes,
        diffusion_nodes: dns,
        engines,
        services,
        pods,
        synced,
    };
    let synced = announce_synced(stores.clone(), synced_tx);
    let (engine_events, service_events) =
        engine_watches(client, namespace, engine_writer, service_writer);
    let pod_triggers = pod_triggers(client, namespace, pod_writer);
    let node_triggers = node_triggers(client, node_writer, deployments.clone(), stores.clone());
    let dn_triggers = diffusion_node_triggers(client, dn_writer, deployments, stores.clone());
    Watches {
        stores,
        triggers: stream::select(stream::select(node_triggers, dn_triggers), pod_triggers).boxed(),
        engines: engine_events,
        services: service_events,
        synced: synced.boxed(),
    }
}

/// Tells `synced` once every store of `stores` holds its first full list, then waits
/// forever: dropping the sender would end every wait with an error.
async fn announce_synced(stores: Stores, synced: tokio::sync::watch::Sender<bool>) {
    let ready = stores.nodes.wait_until_ready().await.is_ok()
        && stores.diffusion_nodes.wait_until_ready().await.is_ok()
        && stores.engines.wait_until_ready().await.is_ok()
        && stores.services.wait_until_ready().await.is_ok()
        && stores.pods.wait_until_ready().await.is_ok();
    if ready {
        let _ = synced.send(true);
    }
    futures::future::pending::<()>().await
}

/// What the operator made: the objects carrying [`MANAGED_BY`].
fn owned_config() -> watcher::Config {
    watcher::Config::default().labels(&format!("{}={}", MANAGED_BY.0, MANAGED_BY.1))
}

/// The API of a namespaced kind in `namespace`, or in every namespace.
fn owned_api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// The watches of the engine Deployments and Services the operator made, filling their
/// stores. Touched, not only applied: a deleted engine Deployment or Service reconciles its
/// owner, which makes it again.
fn engine_watches(
    client: &Client,
    namespace: Option<&str>,
    engines: reflector::store::Writer<Deployment>,
    services: reflector::store::Writer<Service>,
) -> (Touched<Deployment>, Touched<Service>) {
    let engine_events = watcher(owned_api(client, namespace), owned_config())
        .default_backoff()
        .modify(|d: &mut Deployment| d.managed_fields_mut().clear())
        .reflect(engines)
        .touched_objects()
        .boxed();
    let service_events = watcher(owned_api(client, namespace), owned_config())
        .default_backoff()
        .modify(|s: &mut Service| s.managed_fields_mut().clear())
        .reflect(services)
        .touched_objects()
        .boxed();
    (engine_events, service_events)
}

/// The watch of the engine pods, filling their store, and the reconciles of the
/// deployments whose pods the scheduler turns away or places after all.
fn pod_triggers(
    client: &Client,
    namespace: Option<&str>,
    pods: reflector::store::Writer<Pod>,
) -> impl Stream<Item = ObjectRef<DiffusionDeployment>> + Send + 'static {
    let pod_events = watcher(owned_api::<Pod>(client, namespace), owned_config())
        .default_backoff()
        .modify(trim_pod)
        .reflect(pods);
    changes(
        pod_events,
        "Pod",
        Baseline::Facts(UNSEEN_POD),
        unscheduled_facts,
        |_| 0,
        |pod, _| pod_refs(pod),
    )
}

/// The watch of the Nodes, filling their store, and the reconciles of the deployments a
/// Node's change concerns ([`node_refs`]).
fn node_triggers(
    client: &Client,
    nodes: reflector::store::Writer<Node>,
    deployments: Store<DiffusionDeployment>,
    stores: Stores,
) -> impl Stream<Item = ObjectRef<DiffusionDeployment>> + Send + 'static {
    let node_events = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(trim_node)
        .reflect(nodes);
    changes(
        node_events,
        "Node",
        Baseline::New,
        node_facts,
        |_| 0,
        move |node, _| {
            node_refs(
                &deployments.state(),
                stores.diffusion_node(&node.name_any()).as_deref(),
                node,
            )
        },
    )
}

/// The watch of the DiffusionNodes, filling their store, and the reconciles of the
/// deployments a DiffusionNode's change concerns ([`dn_refs`]).
fn diffusion_node_triggers(
    client: &Client,
    diffusion_nodes: reflector::store::Writer<DiffusionNode>,
    deployments: Store<DiffusionDeployment>,
    stores: Stores,
) -> impl Stream<Item = ObjectRef<DiffusionDeployment>> + Send + 'static {
    let dn_events = watcher(
        Api::<DiffusionNode>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|dn: &mut DiffusionNode| {
        dn.managed_fields_mut().clear();
        dn.annotations_mut().clear();
    })
    .reflect(diffusion_nodes);
    changes(
        dn_events,
        "DiffusionNode",
        Baseline::New,
        inventory_facts,
        model_facts,
        move |dn, wide| {
            let node = if wide {
                stores.node(&dn.name_any())
            } else {
                None
            };
            dn_refs(&deployments.state(), node.as_deref(), dn)
        },
    )
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

/// Keeps what the scrape and the unschedulable check read of an engine pod: its name,
/// namespace, labels and deletion, its phase and IP, and the scheduler's condition.
fn trim_pod(p: &mut Pod) {
    p.managed_fields_mut().clear();
    p.annotations_mut().clear();
    p.metadata.owner_references = None;
    p.spec = None;
    p.status = p.status.take().map(|s| PodStatus {
        phase: s.phase,
        pod_ip: s.pod_ip,
        conditions: s.conditions.map(|c| {
            c.into_iter()
                .filter(|c| c.type_ == "PodScheduled")
                .collect()
        }),
        ..Default::default()
    });
}

/// The scheduler's reason when it turned the pod away (`None` otherwise).
pub fn unschedulable(p: &Pod) -> Option<&str> {
    let c = p
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")?;
    (c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .then(|| c.message.as_deref().unwrap_or("no reason given"))
}

/// An engine pod's facts: whether the scheduler turned it away, and why. A pod seen for the
/// first time counts as one that was placed ([`UNSEEN_POD`]): a new pod reconciles nothing
/// until the scheduler turns it away.
fn unscheduled_facts(p: &Pod) -> u64 {
    unschedulable(p).map_or(UNSEEN_POD.0, |why| hash_of(&why))
}
const UNSEEN_POD: (u64, u64) = (0, 0);

/// The deployment an engine pod belongs to (its `app.kubernetes.io/instance` label, in its
/// namespace).
fn pod_refs(pod: &Pod) -> Vec<ObjectRef<DiffusionDeployment>> {
    match (pod.namespace(), pod.labels().get(INSTANCE)) {
        (Some(ns), Some(name)) => vec![ObjectRef::new(name).within(&ns)],
        _ => Vec::new(),
    }
}

/// The label that names an engine pod's deployment (see [`crate::resources`]).
pub const INSTANCE: &str = "app.kubernetes.io/instance";

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
                || asked.contains(crate::requests::model_id(dd).as_str())
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
                .map(|dd| crate::requests::model_id(dd)),
        );
    }
    ids.iter()
        .filter_map(|id| id.split_once('/'))
        .map(|(ns, name)| ObjectRef::new(name).within(ns))
        .collect()
}

/// What an object not seen before counts as.
#[derive(Clone, Copy)]
enum Baseline {
    /// A change in itself: a new (or deleted) object reconciles what it concerns.
    New,
    /// An object with these facts (`(wide, narrow)`): a new object reconciles only when its
    /// facts differ from them, a deleted one only when its last facts did.
    Facts((u64, u64)),
}

/// Turns a reflected watch stream into the reconciles its changes cause. `wide` and
/// `narrow` hash what matters of an object; `map(obj, wide_changed)` names the deployments.
/// The first full list only fills the store (the controller reconciles every deployment at
/// start anyway); a relist after a lost watch triggers for what changed meanwhile, once the
/// store holds the new list.
fn changes<K, S>(
    events: S,
    kind: &'static str,
    baseline: Baseline,
    wide: fn(&K) -> u64,
    narrow: fn(&K) -> u64,
    map: impl Fn(&K, bool) -> Vec<ObjectRef<DiffusionDeployment>> + Send + 'static,
) -> impl Stream<Item = ObjectRef<DiffusionDeployment>> + Send + 'static
where
    K: kube::Resource + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut seen: HashMap<(Option<String>, String), (u64, u64)> = HashMap::new();
    let mut listed_once = false;
    let mut relisted: Vec<ObjectRef<DiffusionDeployment>> = Vec::new();
    let key = |obj: &K| (obj.namespace(), obj.name_any());
    let unseen = match baseline {
        Baseline::New => None,
        Baseline::Facts(facts) => Some(facts),
    };
    events
        .map(move |event| {
            let diff = |obj: &K, seen: &mut HashMap<_, (u64, u64)>| {
                let now = (wide(obj), narrow(obj));
                match seen.insert(key(obj), now).or(unseen) {
                    Some(before) if before == now => None,
                    Some(before) => Some(map(obj, before.0 != now.0)),
                    None => Some(map(obj, true)),
                }
            };
            let refs = match event {
                Ok(watcher::Event::Apply(obj)) => diff(&obj, &mut seen).unwrap_or_default(),
                Ok(watcher::Event::Delete(obj)) => {
                    let last = seen.remove(&key(&obj));
                    match unseen {
                        Some(facts) if last.is_none_or(|l| l == facts) => Vec::new(),
                        _ => map(&obj, true),
                    }
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
            Baseline::New,
            node_facts,
            |_| 0,
            |n: &Node, wide| vec![ObjectRef::new(&format!("{}-{wide}", n.name_any())).within("ns")],
        );
        let got = names(mapped.collect().await);
        assert_eq!(got, ["ns/n1-true", "ns/n2-true", "ns/n1-true"]);
    }

    fn pod(name: &str, instance: &str, scheduled: Option<(&str, &str)>) -> Pod {
        let conditions = scheduled.map(|(status, message)| {
            let reason = if status == "False" {
                "Unschedulable"
            } else {
                ""
            };
            serde_json::json!([{ "type": "PodScheduled", "status": status, "reason": reason,
                                 "message": message }])
        });
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "namespace": "ns", "labels": { INSTANCE: instance } },
            "status": { "phase": "Pending", "conditions": conditions },
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn an_engine_pod_reconciles_its_deployment_only_when_the_scheduler_turns_it_away_or_places_it_after_all(
    ) {
        use watcher::Event::*;
        let full = Some((
            "False",
            "0/5 nodes are available: 1 Insufficient nvidia.com/gpu",
        ));
        let events = vec![
            Ok(Init),
            Ok(InitApply(pod("a-1", "a", None))),
            Ok(InitDone),
            // New pods, placed or not yet looked at: nothing (their Deployment's status
            // tells their deployment).
            Ok(Apply(pod("b-1", "b", None))),
            Ok(Apply(pod("b-1", "b", Some(("True", ""))))),
            Ok(Apply(pod("c-1", "c", None))),
            // Turned away: its deployment; again with the same reason: nothing.
            Ok(Apply(pod("c-1", "c", full))),
            Ok(Apply(pod("c-1", "c", full))),
            // Another reason: again.
            Ok(Apply(pod("c-1", "c", Some(("False", "0/5 nodes: taint"))))),
            // Placed after all: its deployment.
            Ok(Apply(pod("c-1", "c", Some(("True", ""))))),
            // A placed pod goes: nothing; one that goes while turned away: its deployment.
            Ok(Delete(pod("b-1", "b", Some(("True", ""))))),
            Ok(Apply(pod("d-1", "d", full))),
            Ok(Delete(pod("d-1", "d", full))),
            // Turned away when first seen: its deployment.
            Ok(Apply(pod("e-1", "e", full))),
        ];
        let mapped = changes(
            stream::iter(events),
            "Pod",
            Baseline::Facts(UNSEEN_POD),
            unscheduled_facts,
            |_| 0,
            |p: &Pod, _| pod_refs(p),
        );
        let got = names(mapped.collect().await);
        assert_eq!(got, ["ns/c", "ns/c", "ns/c", "ns/d", "ns/d", "ns/e"]);
    }

    #[test]
    fn a_trimmed_pod_keeps_what_the_scrape_and_the_unschedulable_check_read() {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "e-1", "namespace": "ns", "labels": { INSTANCE: "e" },
                          "annotations": { "x": "y" }, "managedFields": [{ "manager": "k" }],
                          "deletionTimestamp": "2026-01-01T00:00:00Z" },
            "spec": { "containers": [{ "name": "engine", "image": "layerwise-engine:0.1.0" }] },
            "status": { "phase": "Running", "podIP": "127.1.0.5", "conditions": [
                { "type": "Ready", "status": "True" },
                { "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                  "message": "0/5 nodes are available" }],
                "containerStatuses": [{ "name": "engine", "image": "i", "imageID": "",
                    "ready": true, "restartCount": 0 }] },
        }))
        .unwrap();
        trim_pod(&mut p);
        assert!(p.spec.is_none() && p.annotations().is_empty() && p.managed_fields().is_empty());
        assert!(p.metadata.deletion_timestamp.is_some());
        assert_eq!(pod_refs(&p), [ObjectRef::new("e").within("ns")]);
        let st = p.status.as_ref().unwrap();
        assert_eq!(st.phase.as_deref(), Some("Running"));
        assert_eq!(st.pod_ip.as_deref(), Some("127.1.0.5"));
        assert!(st.container_statuses.is_none());
        assert_eq!(st.conditions.as_ref().unwrap().len(), 1);
        assert_eq!(unschedulable(&p), Some("0/5 nodes are available"));
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
