//! The stores every reconcile reads ([`Stores`]): the fleet's Nodes and DiffusionNodes, the
//! engine Deployments, Services and pods the operator made, and waiting for their first list.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crds::DiffusionNode;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;

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
    pub(super) synced: tokio::sync::watch::Receiver<bool>,
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
