//! Which changes matter, and to which deployments: the facts of a Node, a DiffusionNode or
//! an engine pod a reconcile reads, compared with what was seen before; and trimming stored
//! objects to those facts.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use crds::{DiffusionDeployment, DiffusionNode};
use futures::{stream, Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Pod, PodStatus};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::ResourceExt;
use serde::Serialize;
use tracing::warn;

use crate::autoscaler::{DELETION_COST, DELETION_COST_AT};
use crate::error::Result;
use crate::placement::selector_matches;

/// allocatable resources.
pub(super) fn trim_node(n: &mut Node) {
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

/// Keeps what the scrape, the unschedulable check, the surge check and the deletion costs
/// read of an engine pod: its name, namespace, labels and deletion, the deletion-cost
/// annotations ([`crate::autoscaler::DELETION_COST`]), its node and its containers' requests, its phase
/// and IP, and the scheduler's condition.
pub(super) fn trim_pod(p: &mut Pod) {
    p.managed_fields_mut().clear();
    p.annotations_mut()
        .retain(|k, _| [DELETION_COST, DELETION_COST_AT].contains(&k.as_str()));
    p.metadata.owner_references = None;
    p.spec = p.spec.take().and_then(|s| {
        let node_name = s.node_name?;
        Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some(node_name),
            containers: s
                .containers
                .into_iter()
                .map(|c| k8s_openapi::api::core::v1::Container {
                    name: c.name,
                    resources: c.resources.map(|r| {
                        k8s_openapi::api::core::v1::ResourceRequirements {
                            requests: r.requests,
                            ..Default::default()
                        }
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    });
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
pub(super) fn unscheduled_facts(p: &Pod) -> u64 {
    unschedulable(p).map_or(UNSEEN_POD.0, |why| hash_of(&why))
}
pub(super) const UNSEEN_POD: (u64, u64) = (0, 0);

/// The deployment an engine pod belongs to (its `app.kubernetes.io/instance` label, in its
/// namespace).
pub(super) fn pod_refs(pod: &Pod) -> Vec<ObjectRef<DiffusionDeployment>> {
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
pub(super) fn node_facts(n: &Node) -> u64 {
    hash_of(&(
        n.labels(),
        n.spec.as_ref().map(|s| (&s.unschedulable, &s.taints)),
        n.status.as_ref().map(|s| &s.allocatable),
    ))
}

/// A DiffusionNode's inventory: what makes its node a fit or not.
pub(super) fn inventory_facts(dn: &DiffusionNode) -> u64 {
    hash_of(&dn.status.as_ref().map(|s| {
        (
            &s.accelerators,
            s.host_memory_bytes,
            s.cgroup_memory_limit_bytes,
        )
    }))
}

/// A DiffusionNode's model requests and reports.
pub(super) fn model_facts(dn: &DiffusionNode) -> u64 {
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
pub(super) enum Baseline {
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
pub(super) fn changes<K, S>(
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
