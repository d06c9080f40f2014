//! What DRA offers, read: the DeviceClass the spec names (or its ResourceClaimTemplate
//! requests), the devices of the nodes' ResourceSlices it selects, and per node their count,
//! memory, product and largest group sharing one value of the link attribute
//! ([`Inventory`]); or why the class cannot be used ([`Unusable`]).

use std::collections::{BTreeMap, BTreeSet};

use crds::{DeviceAllocation, DiffusionDeployment};
use k8s_openapi::api::resource::v1::{Device, DeviceClass, ResourceClaimTemplate, ResourceSlice};
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use layerwise_core::bytesize::parse_bytes;

use crate::context::Context;
use crate::error::{kube, Result};
use crate::requests::model_id;

use super::selector::{attribute, literal_of, qualified_attribute, Selector};

/// A device's memory: its capacity `memory` (in the driver's domain).
fn memory_of(driver: &str, device: &Device) -> Option<u64> {
    let caps = device.capacity.as_ref()?;
    let cap = caps
        .get("memory")
        .or_else(|| caps.get(&format!("{driver}/memory")))?;
    parse_bytes(&cap.value.0).ok()
}

/// What one node's ResourceSlices offer of a class.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeDevices {
    /// Devices of the class.
    pub count: u32,
    /// The least memory of them, where every one publishes it.
    pub memory_bytes: Option<u64>,
    /// Their product (`productName`), where they publish one.
    pub product: Option<String>,
    /// The most of them that share one value of the link attribute (0 where none has it).
    pub linked: u32,
}

impl NodeDevices {
    /// The devices one pod's ranks may all-gather over: the largest group that shares a
    /// fast link, or every device (without a fast link) where none shares one.
    pub fn for_ranks(&self) -> (u32, bool) {
        if self.linked >= 2 {
            (self.linked, true)
        } else {
            (self.count, false)
        }
    }
}

/// What the spec's DRA devices come to: the class, the template the pods use where the
/// spec names one (and the devices it asks for), and each node's devices of the class.
#[derive(Debug, Clone, PartialEq)]
pub struct Inventory {
    pub class: String,
    pub link_attribute: String,
    /// The spec's own template and the devices it claims; `None`: the operator generates.
    pub named: Option<(String, u32)>,
    pub nodes: BTreeMap<String, NodeDevices>,
    /// Whether every counted device publishes its memory (the generated template then
    /// asks for the plan's memory per device).
    pub memory_published: bool,
}

impl Inventory {
    /// Devices of the class by node.
    pub fn counts(&self) -> BTreeMap<String, u32> {
        self.nodes
            .iter()
            .map(|(n, d)| (n.clone(), d.count))
            .collect()
    }
}

/// Each node's devices that `selector` selects, from `slices`: of each pool only the
/// slices of its newest generation, node-local slices only, devices without a taint that
/// keeps pods off.
pub fn inventory(
    slices: &[ResourceSlice],
    selector: &Selector,
    link_attribute: &str,
) -> (BTreeMap<String, NodeDevices>, bool) {
    let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for s in slices {
        let g = newest
            .entry((s.spec.driver.as_str(), s.spec.pool.name.as_str()))
            .or_insert(s.spec.pool.generation);
        *g = (*g).max(s.spec.pool.generation);
    }
    let mut links: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
    let mut nodes: BTreeMap<String, NodeDevices> = BTreeMap::new();
    let mut unpublished: BTreeSet<String> = BTreeSet::new();
    for s in slices {
        let driver = s.spec.driver.as_str();
        if newest[&(driver, s.spec.pool.name.as_str())] != s.spec.pool.generation {
            continue;
        }
        let Some(node) = &s.spec.node_name else {
            continue;
        };
        for d in s.spec.devices.iter().flatten() {
            let tainted = d.taints.iter().flatten().any(|t| t.effect != "None");
            if tainted || !selector.selects(driver, d) {
                continue;
            }
            let n = nodes.entry(node.clone()).or_default();
            n.count += 1;
            match memory_of(driver, d) {
                Some(m) => n.memory_bytes = Some(n.memory_bytes.map_or(m, |x| x.min(m))),
                None => {
                    unpublished.insert(node.clone());
                }
            }
            if n.product.is_none() {
                n.product =
                    attribute(driver, d, driver, "productName").and_then(|a| a.string.clone());
            }
            if let Some(v) = qualified_attribute(driver, d, link_attribute).and_then(literal_of) {
                *links
                    .entry(node.clone())
                    .or_default()
                    .entry(format!("{v:?}"))
                    .or_default() += 1;
            }
        }
    }
    for (node, n) in &mut nodes {
        n.linked = links
            .get(node)
            .and_then(|l| l.values().max().copied())
            .unwrap_or(0);
        // A device without its memory: the node's least is unknown.
        if unpublished.contains(node) {
            n.memory_bytes = None;
        }
    }
    (nodes, unpublished.is_empty())
}

/// The template the spec names, read: its one request's class and device count, or why the
/// operator cannot use it.
pub fn named_request(t: &ResourceClaimTemplate) -> Result<(String, u32), String> {
    let requests = t
        .spec
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let [request] = requests else {
        return Err(format!(
            "it has {} device requests; the operator uses templates of one",
            requests.len()
        ));
    };
    let Some(exact) = &request.exactly else {
        return Err(format!(
            "its request {} is not `exactly` (firstAvailable alternatives give pods different device counts)",
            request.name
        ));
    };
    if exact.allocation_mode.as_deref().unwrap_or("ExactCount") != "ExactCount" {
        return Err(format!(
            "its request {} has allocationMode {}; the ranks of a pod need an exact count",
            request.name,
            exact.allocation_mode.as_deref().unwrap_or_default()
        ));
    }
    let count = exact.count.unwrap_or(1);
    let count = u32::try_from(count)
        .ok()
        .filter(|c| *c >= 1)
        .ok_or_else(|| format!("its request {} asks for {count} devices", request.name))?;
    Ok((exact.device_class_name.clone(), count))
}

/// Why the spec's DRA devices cannot be planned: the condition reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unusable {
    pub reason: &'static str,
    pub message: String,
}

fn unusable(reason: &'static str, message: String) -> Unusable {
    Unusable { reason, message }
}

/// Reads what `dra` needs from the cluster: the template it names (if any), the class,
/// and the ResourceSlices.
pub async fn observe(
    dd: &DiffusionDeployment,
    dra: &DeviceAllocation,
    ctx: &Context,
) -> Result<Result<Inventory, Unusable>> {
    let id = model_id(dd);
    let ns = dd.namespace().unwrap_or_default();
    let not_served = |what: &str| {
        unusable(
            "DynamicResourceAllocationUnavailable",
            format!("spec.accelerator.dra needs the cluster to serve {what} (resource.k8s.io/v1, Kubernetes 1.34 and later)"),
        )
    };
    let named = match &dra.resource_claim_template_name {
        None => None,
        Some(name) => {
            let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), &ns);
            let t = match api.get_opt(name).await {
                Ok(t) => t,
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    return Ok(Err(not_served("resourceclaimtemplates")))
                }
                Err(e) => {
                    return Err(kube(format!(
                        "reading ResourceClaimTemplate {name} of {id}"
                    ))(e))
                }
            };
            let Some(t) = t else {
                return Ok(Err(unusable(
                    "ResourceClaimTemplateNotFound",
                    format!("spec.accelerator.dra names ResourceClaimTemplate {name}, which namespace {ns} does not have"),
                )));
            };
            match named_request(&t) {
                Ok((class, count)) => Some((name.clone(), class, count)),
                Err(why) => {
                    return Ok(Err(unusable(
                        "ResourceClaimTemplateUnsupported",
                        format!("ResourceClaimTemplate {name}: {why}"),
                    )))
                }
            }
        }
    };
    let class_name =
        match (&named, &dra.device_class_name) {
            (Some((_, class, _)), _) => class.clone(),
            (None, Some(class)) => class.clone(),
            (None, None) => return Ok(Err(unusable(
                "DeviceClassNotNamed",
                "spec.accelerator.dra names neither deviceClassName nor resourceClaimTemplateName"
                    .into(),
            ))),
        };
    let classes: Api<DeviceClass> = Api::all(ctx.client.clone());
    let class = match classes.get_opt(&class_name).await {
        Ok(Some(c)) => c,
        Ok(None) => {
            return Ok(Err(unusable(
                "DeviceClassNotFound",
                format!("DeviceClass {class_name} does not exist; install the DRA driver that provides it, or name another"),
            )))
        }
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Err(not_served("deviceclasses"))),
        Err(e) => return Err(kube(format!("reading DeviceClass {class_name} for {id}"))(e)),
    };
    let selector = match Selector::of(&class) {
        Ok(s) => s,
        Err(why) => {
            return Ok(Err(unusable(
                "DeviceClassUnreadable",
                format!("DeviceClass {class_name}'s selector {why}"),
            )))
        }
    };
    // Only the slices of the class's driver, where it pins one (the API selects on it).
    let lp = match selector.driver() {
        Some(d) => ListParams::default().fields(&format!("spec.driver={d}")),
        None => ListParams::default(),
    };
    let slices: Api<ResourceSlice> = Api::all(ctx.client.clone());
    let slices = match slices.list(&lp).await {
        Ok(l) => l.items,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Err(not_served("resourceslices"))),
        Err(e) => return Err(kube(format!("listing ResourceSlices for {id}"))(e)),
    };
    let link_attribute = dra.link_attribute().to_string();
    let (nodes, memory_published) = inventory(&slices, &selector, &link_attribute);
    Ok(Ok(Inventory {
        class: class_name,
        link_attribute,
        named: named.map(|(name, _, count)| (name, count)),
        nodes,
        memory_published,
    }))
}
