//! The watches: each kind watched once, its stream filling its store and turning the
//! changes that matter into reconciles of the deployments they concern.

use crds::{DiffusionDeployment, DiffusionNode};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{stream, FutureExt, Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};

use crate::error::Result;

use super::triggers::{
    changes, dn_refs, inventory_facts, model_facts, node_facts, node_refs, pod_refs, trim_node,
    trim_pod, unscheduled_facts, Baseline, UNSEEN_POD,
};
use super::view::{Stores, MANAGED_BY};

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
