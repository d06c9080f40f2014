//! Where a model is on the nodes, for the agents that profile and warm it.
//!
//! A `hostPath` location is the same folder on every node. A `persistentVolumeClaim`
//! location is served when the claim is bound to a PersistentVolume whose files are a folder
//! on a node's disk — a `local` volume, or a `hostPath` one — because the agents read and
//! warm host folders, and page-cache warming means nothing for storage reached over a
//! network. The claim is then resolved to that folder (plus `subPath`) and to the volume's
//! node affinity: only nodes the volume can be mounted on are asked to prepare the model, so
//! the plan keeps to them (the scheduler holds the engine pods to the same nodes through the
//! claim). Any other claim is refused with the reason; the pure decisions are here, the
//! reads in [`crate::phases`].

use std::path::{Component, Path};

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, PersistentVolume, PersistentVolumeClaim,
};
use kube::ResourceExt;

/// A model location as the nodes see it.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    /// The folder on the node that holds the pipeline.
    pub host_path: String,
    /// The nodes it is on: `None` for every node (a `hostPath` location).
    pub nodes: Option<NodeSelector>,
    /// How events and conditions name it.
    pub describe: String,
}

/// Why a claim cannot be served: a condition reason and a message that says what to do.
#[derive(Clone, Debug, PartialEq)]
pub struct Unusable {
    pub reason: &'static str,
    pub message: String,
}

impl Unusable {
    fn new(reason: &'static str, message: String) -> Self {
        Unusable { reason, message }
    }
}

/// Why a source the API accepts is not served by this operator yet, where it is not: a
/// claim in `Staged` mode needs the agents to copy a claim's folder into their node model
/// caches, which they do not (they stage `s3` sources, [`crate::staging`]), so the
/// deployment says so instead of planning around files no node has.
pub fn unserved(location: &crds::ModelLocation) -> Option<Unusable> {
    let claim = location.persistent_volume_claim.as_ref()?;
    (claim.mode == crds::ClaimMode::Staged).then(|| {
        Unusable::new(
            "StagingUnavailable",
            format!(
                "PersistentVolumeClaim {} has mode Staged (copied into the nodes' model caches), and this operator does not stage models yet: use mode InPlace on a local or hostPath volume",
                claim.claim_name
            ),
        )
    })
}

/// The folder and nodes of claim `claim` (`subPath` `sub_path`), from the claim as read
/// (`None`: it does not exist) and the volume it is bound to (`None`: no such volume).
pub fn locate_claim(
    claim: &str,
    sub_path: Option<&str>,
    pvc: Option<&PersistentVolumeClaim>,
    pv: Option<&PersistentVolume>,
) -> Result<Located, Unusable> {
    let Some(pvc) = pvc else {
        return Err(Unusable::new(
            "ClaimNotFound",
            format!(
                "PersistentVolumeClaim {claim} does not exist in the DiffusionDeployment's namespace"
            ),
        ));
    };
    let phase = pvc
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending");
    let volume = pvc.spec.as_ref().and_then(|s| s.volume_name.as_deref());
    let volume = match (phase, volume) {
        ("Bound", Some(v)) if !v.is_empty() => v,
        _ => {
            return Err(Unusable::new(
                "ClaimNotBound",
                format!(
                    "PersistentVolumeClaim {claim} is {phase}, not bound to a PersistentVolume; the agents can prepare a model only on a bound local or hostPath volume (a claim whose StorageClass binds WaitForFirstConsumer stays Pending: pre-bind it with spec.volumeName)"
                ),
            ))
        }
    };
    let Some(pv) = pv else {
        return Err(Unusable::new(
            "VolumeNotFound",
            format!("PersistentVolumeClaim {claim} is bound to PersistentVolume {volume}, which does not exist"),
        ));
    };
    let spec = pv.spec.clone().unwrap_or_default();
    let (kind, root) = if let Some(local) = &spec.local {
        ("local", local.path.clone())
    } else if let Some(host) = &spec.host_path {
        ("hostPath", host.path.clone())
    } else {
        return Err(Unusable::new(
            "VolumeNotLocal",
            format!(
                "PersistentVolumeClaim {claim} is bound to PersistentVolume {volume} of type {}, whose files are not a folder on a node: the agents can profile and warm a model only on a local or hostPath volume (or name the folder with hostPath)",
                volume_type(pv)
            ),
        ));
    };
    let sub = sub_path.unwrap_or("").trim_matches('/');
    let bad = |p: &Path| p.components().any(|c| c == Component::ParentDir);
    if bad(Path::new(sub)) || !Path::new(&root).is_absolute() || bad(Path::new(&root)) {
        return Err(Unusable::new(
            "VolumeNotLocal",
            format!("PersistentVolumeClaim {claim}: PersistentVolume {volume}'s path `{root}` with subPath `{sub}` is not an absolute folder without `..`"),
        ));
    }
    let host_path = if sub.is_empty() {
        root.clone()
    } else {
        format!("{}/{sub}", root.trim_end_matches('/'))
    };
    let nodes = spec.node_affinity.and_then(|a| a.required);
    if kind == "local" && nodes.is_none() {
        return Err(Unusable::new(
            "VolumeNotLocal",
            format!("PersistentVolumeClaim {claim} is bound to local PersistentVolume {volume}, which has no required node affinity, so no node is known to hold it"),
        ));
    }
    Ok(Located {
        describe: format!(
            "pvc:{claim}/{sub} ({kind} PersistentVolume {volume} at {host_path}{})",
            if nodes.is_some() {
                ", on the nodes its affinity names"
            } else {
                ""
            }
        ),
        host_path,
        nodes,
    })
}

/// The name of a volume's source type, for messages (`nfs`, `csi (driver)`, ...).
fn volume_type(pv: &PersistentVolume) -> String {
    let value = serde_json::to_value(pv.spec.clone().unwrap_or_default()).unwrap_or_default();
    const NOT_SOURCES: [&str; 9] = [
        "accessModes",
        "capacity",
        "claimRef",
        "mountOptions",
        "nodeAffinity",
        "persistentVolumeReclaimPolicy",
        "storageClassName",
        "volumeMode",
        "volumeAttributesClassName",
    ];
    let source = value.as_object().and_then(|o| {
        o.keys()
            .find(|k| !NOT_SOURCES.contains(&k.as_str()))
            .cloned()
    });
    match (source, pv.spec.as_ref().and_then(|s| s.csi.as_ref())) {
        (_, Some(csi)) => format!("csi ({})", csi.driver),
        (Some(s), None) => s,
        (None, None) => "unknown".into(),
    }
}

/// Whether `node` satisfies `selector` as the scheduler reads a volume's node affinity:
/// the terms are ORed, a term's requirements ANDed, and an empty term matches nothing.
pub fn node_matches(selector: &NodeSelector, node: &Node) -> bool {
    let labels = node.labels();
    let name = node.name_any();
    selector.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        (!exprs.is_empty() || !fields.is_empty())
            && exprs
                .iter()
                .all(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)))
            && fields.iter().all(|r| {
                r.key == "metadata.name"
                    && matches!(r.operator.as_str(), "In" | "NotIn")
                    && requirement_holds(r, Some(name.as_str()))
            })
    })
}

fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |v: &str| v.parse::<i64>().ok();
    match (r.operator.as_str(), value) {
        ("In", Some(v)) => values.iter().any(|x| x == v),
        ("NotIn", v) => v.is_none_or(|v| !values.iter().any(|x| x == v)),
        ("Exists", v) => v.is_some(),
        ("DoesNotExist", v) => v.is_none(),
        ("Gt", Some(v)) => {
            matches!((number(v), values.first().and_then(|x| number(x))), (Some(a), Some(b)) if a > b)
        }
        ("Lt", Some(v)) => {
            matches!((number(v), values.first().and_then(|x| number(x))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({ "metadata": { "name": name, "labels": labels } })).unwrap()
    }

    fn claim(phase: &str, volume: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": { "name": "store" },
            "spec": { "volumeName": volume },
            "status": { "phase": phase },
        }))
        .unwrap()
    }

    fn volume(spec: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(json!({ "metadata": { "name": "pv-1" }, "spec": spec })).unwrap()
    }

    fn on_host(name: &str) -> serde_json::Value {
        json!({ "required": { "nodeSelectorTerms": [{ "matchExpressions": [
            { "key": "kubernetes.io/hostname", "operator": "In", "values": [name] }
        ] }] } })
    }

    #[test]
    fn a_bound_local_or_host_path_volume_gives_its_folder_and_nodes() {
        let bound = claim("Bound", Some("pv-1"));
        let local =
            volume(json!({ "local": { "path": "/models/store/" }, "nodeAffinity": on_host("a") }));
        let got = locate_claim("store", Some("dit/"), Some(&bound), Some(&local)).unwrap();
        assert_eq!(got.host_path, "/models/store/dit");
        let sel = got.nodes.expect("the local volume's affinity");
        assert!(node_matches(
            &sel,
            &node("a", json!({ "kubernetes.io/hostname": "a" }))
        ));
        assert!(!node_matches(
            &sel,
            &node("b", json!({ "kubernetes.io/hostname": "b" }))
        ));
        assert!(
            got.describe.contains("local PersistentVolume pv-1"),
            "{}",
            got.describe
        );

        let host = volume(json!({ "hostPath": { "path": "/models/store" } }));
        let got = locate_claim("store", None, Some(&bound), Some(&host)).unwrap();
        assert_eq!((got.host_path.as_str(), got.nodes), ("/models/store", None));
    }

    #[test]
    fn other_claims_are_refused_with_the_reason() {
        let reason = |pvc: Option<&PersistentVolumeClaim>, pv: Option<&PersistentVolume>| {
            let e = locate_claim("store", Some("x"), pvc, pv).unwrap_err();
            assert!(e.message.contains("store"), "{}", e.message);
            (e.reason, e.message)
        };
        assert_eq!(reason(None, None).0, "ClaimNotFound");
        let (r, m) = reason(Some(&claim("Pending", None)), None);
        assert!(
            r == "ClaimNotBound" && m.contains("Pending") && m.contains("WaitForFirstConsumer"),
            "{m}"
        );
        let bound = claim("Bound", Some("pv-1"));
        assert_eq!(reason(Some(&bound), None).0, "VolumeNotFound");
        let nfs = volume(
            json!({ "nfs": { "server": "127.0.0.1", "path": "/export" }, "storageClassName": "" }),
        );
        let (r, m) = reason(Some(&bound), Some(&nfs));
        assert!(r == "VolumeNotLocal" && m.contains("of type nfs"), "{m}");
        let csi = volume(json!({ "csi": { "driver": "ebs.csi.aws.com", "volumeHandle": "v" } }));
        let (_, m) = reason(Some(&bound), Some(&csi));
        assert!(m.contains("csi (ebs.csi.aws.com)"), "{m}");
        let no_affinity = volume(json!({ "local": { "path": "/models/store" } }));
        assert!(reason(Some(&bound), Some(&no_affinity))
            .1
            .contains("no required node affinity"));
        let escape = volume(json!({ "hostPath": { "path": "/models/../etc" } }));
        assert_eq!(reason(Some(&bound), Some(&escape)).0, "VolumeNotLocal");
    }

    #[test]
    fn staged_claims_are_refused_by_name_and_s3_is_served() {
        let loc =
            |v: serde_json::Value| -> crds::ModelLocation { serde_json::from_value(v).unwrap() };
        let staged =
            loc(json!({ "persistentVolumeClaim": { "claimName": "nfs", "mode": "Staged" } }));
        let why = unserved(&staged).expect("a staged claim");
        assert_eq!(why.reason, "StagingUnavailable");
        assert!(
            why.message.contains("nfs") && why.message.contains("Staged"),
            "{}",
            why.message
        );
        for served in [
            json!({ "hostPath": "/models/m" }),
            json!({ "persistentVolumeClaim": { "claimName": "local" } }),
            json!({ "persistentVolumeClaim": { "claimName": "local", "mode": "InPlace" } }),
            json!({ "s3": { "endpoint": "http://127.0.0.1:8333", "bucket": "models" } }),
        ] {
            assert_eq!(unserved(&loc(served.clone())), None, "{served}");
        }
    }

    #[test]
    fn node_selectors_follow_the_schedulers_rules() {
        let sel = |terms: serde_json::Value| -> NodeSelector {
            serde_json::from_value(json!({ "nodeSelectorTerms": terms })).unwrap()
        };
        let n = node("gpu-1", json!({ "zone": "a", "gen": "9" }));
        let expr = |op: &str, values: serde_json::Value| {
            sel(
                json!([{ "matchExpressions": [{ "key": if op == "DoesNotExist" { "x" } else { "gen" }, "operator": op, "values": values }] }]),
            )
        };
        assert!(node_matches(&expr("In", json!(["8", "9"])), &n));
        assert!(!node_matches(&expr("NotIn", json!(["9"])), &n));
        assert!(node_matches(&expr("Exists", json!(null)), &n));
        assert!(node_matches(&expr("DoesNotExist", json!(null)), &n));
        assert!(node_matches(&expr("Gt", json!(["8"])), &n));
        assert!(!node_matches(&expr("Lt", json!(["9"])), &n));
        // Terms are ORed, requirements ANDed; an empty term matches nothing.
        assert!(!node_matches(&sel(json!([{}])), &n));
        let and = sel(json!([{ "matchExpressions": [
            { "key": "zone", "operator": "In", "values": ["a"] },
            { "key": "gen", "operator": "In", "values": ["8"] }
        ] }]));
        assert!(!node_matches(&and, &n));
        let or = sel(json!([
            { "matchExpressions": [{ "key": "zone", "operator": "In", "values": ["b"] }] },
            { "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["gpu-1"] }] }
        ]));
        assert!(node_matches(&or, &n));
    }
}
