//! Which nodes a deployment asks to prepare its model.
//!
//! Candidates are the DiffusionNodes of Nodes that match the deployment's node selector and
//! offer its accelerator. Of those, a bounded *prepare set* is asked to profile and warm the
//! model: asking every candidate would cost one API write per node per deployment, an agent
//! read and a page-cache copy of every model on every node, and DiffusionNode requests are
//! capped at 128 entries. The set keeps the nodes already asked, then adds nodes of the
//! shapes the plan in force runs on, then one node of each other shape in turn (largest
//! devices first), so the planner sees every kind of node the selector allows. It holds at
//! least enough nodes for the deployment's most replicas. Within a shape, each deployment
//! takes nodes in its own order (rendezvous hashing of its id and the node's name), so the
//! deployments of a fleet spread over its nodes instead of all asking, and crowding their
//! pods onto, the same few; and a node joining or leaving moves few choices.
//!
//! Pure functions over the stores' objects; the controller makes the API calls.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crds::{DiffusionDeploymentSpec, DiffusionNode, Plan};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use layerwise_core::bytesize::parse_bytes;

/// What a Node offers pods, from its allocatable resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// Accelerators of the requested resource.
    pub devices: u32,
    /// Memory, when the Node reports it.
    pub memory: Option<u64>,
}

/// What `node` offers of `resource`, when it offers any.
pub fn offer(node: &Node, resource: &str) -> Option<Offer> {
    let allocatable = node.status.as_ref()?.allocatable.as_ref()?;
    let devices = allocatable
        .get(resource)?
        .0
        .parse::<u32>()
        .ok()
        .filter(|c| *c > 0)?;
    Some(Offer {
        devices,
        memory: allocatable_memory(node),
    })
}

fn allocatable_memory(node: &Node) -> Option<u64> {
    let allocatable = node.status.as_ref()?.allocatable.as_ref()?;
    parse_bytes(&allocatable.get("memory")?.0).ok()
}

/// What `node` offers of the devices its ResourceSlices publish (`dra`: devices by node),
/// when any.
pub fn dra_offer(node: &Node, dra: &BTreeMap<String, u32>) -> Option<Offer> {
    let devices = *dra.get(&node.name_any())?;
    (devices > 0).then(|| Offer {
        devices,
        memory: allocatable_memory(node),
    })
}

/// Whether `labels` carry every label of `selector` (equality, as `nodeSelector` does).
pub fn selector_matches(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A candidate node: its DiffusionNode and what its Node offers.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub dn: Arc<DiffusionNode>,
    pub offer: Offer,
}

impl Candidate {
    pub fn name(&self) -> String {
        self.dn.name_any()
    }

    /// Whether the deployment with `id` has asked this node to prepare its model.
    pub fn asked(&self, id: &str) -> bool {
        self.dn.spec.models.iter().any(|m| m.id == id)
    }
}

/// The candidates for `spec` among `nodes`, by name; `dn` finds a node's DiffusionNode.
/// Their devices are the extended resource's, or, where the spec asks for devices by
/// Dynamic Resource Allocation, those its ResourceSlices publish (`dra`: devices by node).
pub fn candidates(
    spec: &DiffusionDeploymentSpec,
    nodes: &[Arc<Node>],
    dn: impl Fn(&str) -> Option<Arc<DiffusionNode>>,
    dra: Option<&BTreeMap<String, u32>>,
) -> Vec<Candidate> {
    let resource = spec.accelerator.resource();
    let mut out: Vec<Candidate> = nodes
        .iter()
        .filter(|n| selector_matches(&spec.accelerator.node_selector, n.labels()))
        .filter_map(|n| {
            let offer = match dra {
                Some(inv) => dra_offer(n, inv)?,
                None => offer(n, resource)?,
            };
            Some(Candidate {
                dn: dn(&n.name_any())?,
                offer,
            })
        })
        .collect();
    out.sort_by_key(Candidate::name);
    out
}

/// A node's shape for `resource`: device memory (as its agent reports it; 0 before it
/// has), devices offered, host memory.
type Shape = (u64, u32, u64);

fn shape(c: &Candidate, resource: &str) -> Shape {
    let st = c.dn.status.as_ref();
    let device = st
        .and_then(|s| s.accelerators.iter().find(|a| a.resource_name == resource))
        .map_or(0, |a| a.memory_bytes);
    let host = st.map_or(0, |s| s.usable_host_bytes());
    let host = c.offer.memory.map_or(host, |m| m.min(host));
    (device, c.offer.devices, host)
}

/// The rank of `node` in the order deployment `id` takes nodes in: FNV-1a of both, then
/// MurmurHash3's 64-bit finalizer so that names differing in their last characters still
/// land far apart; stable across processes and Rust versions (every replica agrees).
fn rendezvous(id: &str, node: &str) -> u64 {
    let mut h = id
        .bytes()
        .chain([0])
        .chain(node.bytes())
        .fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
        });
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51afd7ed558ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ceb9fe1a85ec53);
    h ^ (h >> 33)
}

/// How many nodes the prepare set holds: at least `base`, and at least enough for the
/// deployment's most replicas (under the plan in force, as many pods per node as its
/// smallest planned node fits; one per node before there is a plan).
pub fn prepare_bound(
    spec: &DiffusionDeploymentSpec,
    plan: Option<&Plan>,
    candidates: &[Candidate],
    base: usize,
) -> usize {
    let most = spec
        .autoscaling
        .as_ref()
        .map_or(spec.replicas.unwrap_or(1), |a| a.max_replicas)
        .max(1) as usize;
    let per_node = plan
        .and_then(|p| {
            candidates
                .iter()
                .filter(|c| p.nodes.contains(&c.name()))
                .map(|c| (c.offer.devices / p.devices()) as usize)
                .min()
        })
        .unwrap_or(1)
        .max(1);
    base.max(most.div_ceil(per_node))
}

/// The prepare set: indices into `candidates` (sorted by name), at most `bound` of them.
/// Nodes already asked stay (those the plan runs on first, should the bound shrink); then
/// nodes of a shape the plan runs on; then the other shapes in turn, largest first.
pub fn prepare_set(
    candidates: &[Candidate],
    id: &str,
    resource: &str,
    plan: Option<&Plan>,
    bound: usize,
) -> Vec<usize> {
    let planned = |i: &usize| plan.is_some_and(|p| p.nodes.contains(&candidates[*i].name()));
    let mut chosen: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].asked(id))
        .collect();
    chosen.sort_by_key(|i| !planned(i));
    chosen.truncate(bound);
    if chosen.len() == bound {
        return chosen;
    }
    let planned_shapes: BTreeSet<Shape> = (0..candidates.len())
        .filter(planned)
        .map(|i| shape(&candidates[i], resource))
        .collect();
    let mut groups: BTreeMap<(bool, Reverse<Shape>), Vec<usize>> = BTreeMap::new();
    for i in (0..candidates.len()).filter(|i| !candidates[*i].asked(id)) {
        let s = shape(&candidates[i], resource);
        groups
            .entry((!planned_shapes.contains(&s), Reverse(s)))
            .or_default()
            .push(i);
    }
    for g in groups.values_mut() {
        g.sort_by_key(|&i| rendezvous(id, &candidates[i].name()));
    }
    // Round-robin, the plan's shapes before the others.
    for tier in [false, true] {
        let tier: Vec<&Vec<usize>> = groups
            .iter()
            .filter(|((other, _), _)| *other == tier)
            .map(|(_, g)| g)
            .collect();
        let longest = tier.iter().map(|g| g.len()).max().unwrap_or(0);
        for round in 0..longest {
            for g in &tier {
                if chosen.len() == bound {
                    return chosen;
                }
                if let Some(&i) = g.get(round) {
                    chosen.push(i);
                }
            }
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crds::{AcceleratorInventory, DiffusionNodeSpec, DiffusionNodeStatus, ModelRequest};
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const GPU: &str = "nvidia.com/gpu";

    fn node(name: &str, labels: &[(&str, &str)], gpus: &str) -> Arc<Node> {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n.status = Some(NodeStatus {
            allocatable: Some(BTreeMap::from([
                (GPU.to_string(), Quantity(gpus.into())),
                ("memory".to_string(), Quantity("1000Gi".into())),
            ])),
            ..Default::default()
        });
        Arc::new(n)
    }

    fn dn(name: &str, device_gib: u64, count: u32, asked_by: &[&str]) -> Arc<DiffusionNode> {
        let mut d = DiffusionNode::new(
            name,
            DiffusionNodeSpec {
                models: asked_by
                    .iter()
                    .map(|id| ModelRequest {
                        id: id.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            },
        );
        d.status = Some(DiffusionNodeStatus {
            accelerators: vec![AcceleratorInventory {
                resource_name: GPU.into(),
                count,
                memory_bytes: device_gib << 30,
                ..Default::default()
            }],
            host_memory_bytes: 1 << 40,
            ..Default::default()
        });
        Arc::new(d)
    }

    fn cand(name: &str, device_gib: u64, count: u32, asked_by: &[&str]) -> Candidate {
        Candidate {
            dn: dn(name, device_gib, count, asked_by),
            offer: Offer {
                devices: count,
                memory: Some(1000 << 30),
            },
        }
    }

    fn spec(selector: &[(&str, &str)], replicas: i32) -> DiffusionDeploymentSpec {
        let mut s: DiffusionDeploymentSpec = serde_json::from_value(serde_json::json!({
            "model": { "family": "dit", "location": { "hostPath": "/models/m" } },
            "workload": { "maxWidth": 512, "maxHeight": 512 },
            "replicas": replicas,
        }))
        .unwrap();
        s.accelerator.node_selector = selector
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        s
    }

    fn plan_on(nodes: &[&str], dp: u32) -> Plan {
        let zero = serde_json::json!({
            "blockWeights": 0, "slots": 0, "residentWeights": 0, "activations": 0, "overhead": 0
        });
        serde_json::from_value(serde_json::json!({
            "strategy": "resident", "dp": dp, "slots": 0, "fastPeerLink": true,
            "deviceBytesPerRank": 0, "hostBytesPerPod": 0, "deviceBreakdown": zero,
            "nodes": nodes, "reasons": [], "rejected": [],
        }))
        .unwrap()
    }

    #[test]
    fn candidates_match_the_selector_offer_the_resource_and_have_a_diffusion_node() {
        let nodes = vec![
            node("b", &[("t", "x")], "8"),
            node("a", &[("t", "x")], "4"),
            node("c", &[("t", "y")], "8"),
            node("d", &[("t", "x")], "0"),
            node("e", &[("t", "x")], "8"),
        ];
        let dns = |name: &str| (name != "e").then(|| dn(name, 80, 8, &[]));
        let got: Vec<String> = candidates(&spec(&[("t", "x")], 1), &nodes, dns, None)
            .iter()
            .map(Candidate::name)
            .collect();
        assert_eq!(
            got,
            ["a", "b"],
            "c: selector, d: no GPUs, e: no DiffusionNode"
        );
        let all = candidates(&spec(&[], 1), &nodes, dns, None);
        assert_eq!(all.len(), 3);
        assert_eq!(
            all[0].offer,
            Offer {
                devices: 4,
                memory: Some(1000 << 30)
            }
        );
    }

    #[test]
    fn under_dra_the_candidates_are_the_nodes_whose_slices_publish_devices() {
        let nodes = vec![
            node("a", &[("t", "x")], "0"),
            node("b", &[("t", "x")], "8"),
            node("c", &[("t", "y")], "0"),
        ];
        let dns = |name: &str| Some(dn(name, 80, 8, &[]));
        // a: 8 devices in its slices (no extended resource); b: none published; c: the
        // selector leaves it out.
        let slices = BTreeMap::from([("a".to_string(), 8), ("c".to_string(), 4)]);
        let got = candidates(&spec(&[("t", "x")], 1), &nodes, dns, Some(&slices));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name(), "a");
        assert_eq!(
            got[0].offer,
            Offer {
                devices: 8,
                memory: Some(1000 << 30)
            }
        );
        let none = BTreeMap::from([("a".to_string(), 0)]);
        assert!(candidates(&spec(&[], 1), &nodes, dns, Some(&none)).is_empty());
    }

    #[test]
    fn a_thousand_candidates_get_a_bounded_set_with_every_shape() {
        let shapes = [(80, 8), (141, 8), (48, 4), (24, 1), (141, 4)];
        let cands: Vec<Candidate> = (0..1000)
            .map(|i| {
                let (gib, count) = shapes[i % shapes.len()];
                cand(&format!("n{i:04}"), gib, count, &[])
            })
            .collect();
        let set = prepare_set(&cands, "ns/a", GPU, None, 8);
        assert_eq!(set.len(), 8);
        let seen: BTreeSet<Shape> = set.iter().map(|&i| shape(&cands[i], GPU)).collect();
        assert_eq!(seen.len(), shapes.len(), "every shape is asked");
        // Largest devices first: the two 141 GiB shapes lead.
        assert_eq!(shape(&cands[set[0]], GPU).0, 141 << 30);
        assert_eq!(shape(&cands[set[1]], GPU).0, 141 << 30);
    }

    #[test]
    fn asked_nodes_stay_and_the_plans_shape_fills_first() {
        let mut cands = vec![
            cand("a100-0", 80, 8, &["ns/a"]),
            cand("a100-1", 80, 8, &[]),
            cand("a100-2", 80, 8, &[]),
            cand("h200-0", 141, 8, &["ns/a"]),
            cand("h200-1", 141, 8, &[]),
            cand("l40-0", 48, 4, &[]),
        ];
        // No plan yet: asked nodes, then the largest shapes in turn (for the A100s,
        // whichever of the two this deployment ranks first).
        let set = prepare_set(&cands, "ns/a", GPU, None, 4);
        assert_eq!(set[..3], [0, 3, 4]);
        assert!(set[3] == 1 || set[3] == 2, "{set:?}");
        // The plan runs on a100-0: more A100s before anything else.
        let plan = plan_on(&["a100-0"], 1);
        let set = prepare_set(&cands, "ns/a", GPU, Some(&plan), 4);
        assert_eq!(set[..2], [0, 3]);
        assert_eq!(
            set[2..].iter().copied().collect::<BTreeSet<_>>(),
            [1, 2].into()
        );
        // A shrinking bound keeps the planned node.
        assert_eq!(prepare_set(&cands, "ns/a", GPU, Some(&plan), 1), [0]);
        cands.truncate(2);
        assert_eq!(prepare_set(&cands, "ns/a", GPU, None, 8), [0, 1]);
    }

    #[test]
    fn deployments_spread_over_nodes_of_one_shape() {
        let cands: Vec<Candidate> = (0..200)
            .map(|i| cand(&format!("h100-{i}"), 80, 8, &[]))
            .collect();
        let mut times = vec![0; cands.len()];
        for d in 0..100 {
            let set = prepare_set(&cands, &format!("ns/m-{d}"), GPU, None, 8);
            assert_eq!(set.len(), 8);
            for i in set {
                times[i] += 1;
            }
        }
        // 800 choices over 200 nodes: 4 each on average, none asked by a crowd.
        let most = times.iter().max().unwrap();
        let unused = times.iter().filter(|t| **t == 0).count();
        assert!(*most <= 12 && unused < 20, "most {most}, unused {unused}");
        // The same deployment chooses the same nodes every time.
        assert_eq!(
            prepare_set(&cands, "ns/m-7", GPU, None, 8),
            prepare_set(&cands, "ns/m-7", GPU, None, 8)
        );
    }

    #[test]
    fn the_bound_covers_the_most_replicas() {
        let cands = vec![cand("a", 80, 8, &[]), cand("b", 80, 4, &[])];
        assert_eq!(prepare_bound(&spec(&[], 1), None, &cands, 8), 8);
        assert_eq!(prepare_bound(&spec(&[], 20), None, &cands, 8), 20);
        // dp 2 on nodes of 8 and 4 GPUs: the smaller fits 2 pods, so 10 nodes for 20.
        let plan = plan_on(&["a", "b"], 2);
        assert_eq!(prepare_bound(&spec(&[], 20), Some(&plan), &cands, 8), 10);
        let mut auto = spec(&[], 1);
        auto.autoscaling =
            serde_json::from_value(serde_json::json!({ "minReplicas": 1, "maxReplicas": 12 }))
                .unwrap();
        assert_eq!(prepare_bound(&auto, None, &cands, 8), 12);
    }
}
