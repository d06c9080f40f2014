//! DiffusionNodes owned by their Nodes. The agent makes a node's DiffusionNode; the operator
//! makes the Node its owner (an owner reference by uid), so when an autoscaler removes the
//! Node, Kubernetes' garbage collector removes its DiffusionNode, and DiffusionNodes do not
//! pile up as nodes come and go. The Node's removal itself reconciles the deployments that
//! counted it ([`crate::stores`]), which plan again without it.

use std::time::Duration;

use crds::DiffusionNode;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{debug, warn};

use crate::context::MANAGER;
use crate::stores::Stores;

/// How often the DiffusionNodes are checked for their owner. A Node removed before its
/// DiffusionNode is owned leaves it behind (until a node of that name comes again), so the
/// window is kept short; the check reads the stores, and only a DiffusionNode without its
/// owner costs a request.
const PERIOD: Duration = Duration::from_secs(2);

/// The owner references `dn` should carry with `node` as its owner, when they differ from
/// what it carries: its others kept, a reference to an earlier Node of the same name
/// replaced. Neither a controller nor blocking the Node's deletion: the Node goes when its
/// owner says.
pub fn owner_references(node: &Node, dn: &DiffusionNode) -> Option<Vec<OwnerReference>> {
    let uid = node.uid()?;
    let existing = dn.owner_references();
    if existing.iter().any(|o| o.kind == "Node" && o.uid == uid) {
        return None;
    }
    let mut refs: Vec<OwnerReference> = existing
        .iter()
        .filter(|o| o.kind != "Node")
        .cloned()
        .collect();
    refs.push(OwnerReference {
        api_version: Node::api_version(&()).into_owned(),
        kind: Node::kind(&()).into_owned(),
        name: node.name_any(),
        uid,
        controller: None,
        block_owner_deletion: None,
    });
    Some(refs)
}

/// Gives every DiffusionNode whose Node is known that Node as its owner, once per change.
async fn adopt(client: &Client, stores: &Stores) {
    let api: Api<DiffusionNode> = Api::all(client.clone());
    for dn in stores.diffusion_nodes.state() {
        let Some(node) = stores.node(&dn.name_any()) else {
            continue;
        };
        let Some(refs) = owner_references(&node, &dn) else {
            continue;
        };
        let patch = serde_json::json!({ "metadata": { "ownerReferences": refs } });
        match api
            .patch(
                &dn.name_any(),
                &PatchParams {
                    field_manager: Some(MANAGER.into()),
                    ..PatchParams::default()
                },
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => debug!(node = %dn.name_any(), "the Node owns its DiffusionNode"),
            Err(e) => {
                warn!(node = %dn.name_any(), error = %e, "cannot make the Node own its DiffusionNode")
            }
        }
    }
}

/// Keeps every DiffusionNode owned by its Node, while this replica leads.
pub async fn run(client: Client, stores: Stores) {
    let mut tick = tokio::time::interval(PERIOD);
    loop {
        tick.tick().await;
        if stores.ready().await.is_ok() {
            adopt(&client, &stores).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(uid: &str) -> Node {
        serde_json::from_value(json!({ "metadata": { "name": "gpu-1", "uid": uid } })).unwrap()
    }

    fn dn(owners: serde_json::Value) -> DiffusionNode {
        serde_json::from_value(json!({
            "apiVersion": "layerwise.dev/v1alpha1",
            "kind": "DiffusionNode",
            "metadata": { "name": "gpu-1", "ownerReferences": owners },
            "spec": {},
        }))
        .unwrap()
    }

    #[test]
    fn a_diffusion_node_is_owned_by_its_node_once_and_by_the_current_one() {
        let refs = owner_references(&node("u1"), &dn(json!([]))).expect("no owner yet");
        assert_eq!(
            serde_json::to_value(&refs).unwrap(),
            json!([{ "apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u1" }])
        );
        let owned = dn(serde_json::to_value(&refs).unwrap());
        assert_eq!(owner_references(&node("u1"), &owned), None);
        // A Node made again under the same name: the new one owns it, others stay.
        let mixed = dn(json!([
            { "apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u1" },
            { "apiVersion": "x/v1", "kind": "Other", "name": "o", "uid": "o1" },
        ]));
        let refs = owner_references(&node("u2"), &mixed).unwrap();
        let got: Vec<(&str, &str)> = refs
            .iter()
            .map(|o| (o.kind.as_str(), o.uid.as_str()))
            .collect();
        assert_eq!(got, [("Other", "o1"), ("Node", "u2")]);
        // A Node the store holds without a uid gives nothing to point at.
        let no_uid: Node =
            serde_json::from_value(json!({ "metadata": { "name": "gpu-1" } })).unwrap();
        assert_eq!(owner_references(&no_uid, &dn(json!([]))), None);
    }
}
