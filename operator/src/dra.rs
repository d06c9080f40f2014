//! Devices by Dynamic Resource Allocation (`spec.accelerator.dra`, `resource.k8s.io/v1`).
//!
//! Where a deployment asks for its devices through DRA, the nodes offer no extended resource:
//! their DRA driver publishes each device in a ResourceSlice, with its attributes (product,
//! PCIe root) and capacities (memory). The operator reads the DeviceClass the spec names (or
//! the one the spec's ResourceClaimTemplate requests), keeps the devices its selectors
//! select, and gives the planner each node's count, memory, product and the largest group
//! of devices that share one value of the link attribute ([`Inventory`]). Figures a slice
//! does not publish are the node agent's.
//!
//! A pod's ranks all-gather every block, so they must sit on devices that share a fast link:
//! the planner sizes a pod's ranks against the largest such group of a node, and the
//! ResourceClaimTemplate generated for a plan ([`template`]) asks the scheduler for the
//! plan's dp × sp devices of the class, each with at least the plan's device memory, all
//! sharing one value of the link attribute. That template is named after its own contents,
//! so a new plan gets a new template and the pods roll onto it; the operator deletes its
//! earlier templates once no engine pod claims through them.
//!
//! The operator reads the part of CEL that device classes select devices with
//! ([`Selector`]): conjunctions of equalities between `device.driver` or a device attribute
//! and a literal. A class beyond that is refused with a condition that quotes it, rather
//! than planned against devices it may not select.

use std::collections::{BTreeMap, BTreeSet};

use crds::{DeviceAllocation, DiffusionDeployment};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, Device, DeviceAttribute, DeviceClaim, DeviceClass, DeviceConstraint,
    DeviceRequest, DeviceSelector, ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate,
    ResourceClaimTemplateSpec, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};

use crate::context::{Context, MANAGER};
use crate::error::{kube, Result};
use crate::requests::model_id;

/// The name of the pod's claim and of the template's one device request.
pub use crate::resources::DEVICE_CLAIM as CLAIM;

/// The CEL expression a device's attribute or driver is compared in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Driver,
    /// An attribute: its domain (the driver's where the expression names it) and name.
    Attribute {
        domain: String,
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Literal {
    Str(String),
    Int(i64),
    Bool(bool),
}

/// A DeviceClass's selectors, in the part of CEL the operator reads: every term must hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    terms: Vec<(Field, Literal)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    Str(String),
    Int(i64),
    And,
    Eq,
    Dot,
    Open,
    Close,
    OpenBracket,
    CloseBracket,
}

fn tokens(expr: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '&' | '=' => {
                if chars.next_if(|(_, n)| *n == c).is_none() {
                    return Err(format!("a lone `{c}` at {i}"));
                }
                out.push(if c == '&' { Token::And } else { Token::Eq });
            }
            '.' => out.push(Token::Dot),
            '(' => out.push(Token::Open),
            ')' => out.push(Token::Close),
            '[' => out.push(Token::OpenBracket),
            ']' => out.push(Token::CloseBracket),
            '\'' | '"' => {
                let mut s = String::new();
                loop {
                    match chars.next() {
                        Some((_, q)) if q == c => break,
                        Some((_, '\\')) => return Err("escapes in strings".into()),
                        Some((_, x)) => s.push(x),
                        None => return Err(format!("a string opened at {i} is not closed")),
                    }
                }
                out.push(Token::Str(s));
            }
            c if c.is_ascii_digit() || c == '-' => {
                let mut s = c.to_string();
                while let Some((_, d)) = chars.next_if(|(_, d)| d.is_ascii_digit()) {
                    s.push(d);
                }
                let n = s.parse().map_err(|_| format!("`{s}` at {i}"))?;
                out.push(Token::Int(n));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut s = c.to_string();
                while let Some((_, d)) =
                    chars.next_if(|(_, d)| d.is_ascii_alphanumeric() || *d == '_')
                {
                    s.push(d);
                }
                out.push(Token::Ident(s));
            }
            c => return Err(format!("`{c}` at {i}")),
        }
    }
    Ok(out)
}

/// A recursive-descent reader of `term && term && ...`, each term `(…)` or `a == b`.
struct Reader {
    tokens: Vec<Token>,
    at: usize,
}

impl Reader {
    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn eat(&mut self, t: &Token) -> bool {
        let hit = self.tokens.get(self.at) == Some(t);
        if hit {
            self.at += 1;
        }
        hit
    }

    fn conjunction(&mut self, out: &mut Vec<(Field, Literal)>) -> Result<(), String> {
        loop {
            if self.eat(&Token::Open) {
                self.conjunction(out)?;
                if !self.eat(&Token::Close) {
                    return Err("an unclosed `(`".into());
                }
            } else {
                out.push(self.equality()?);
            }
            if !self.eat(&Token::And) {
                return Ok(());
            }
        }
    }

    fn equality(&mut self) -> Result<(Field, Literal), String> {
        let a = self.operand()?;
        if !self.eat(&Token::Eq) {
            return Err("only `==` comparisons".into());
        }
        match (a, self.operand()?) {
            (Ok(f), Err(l)) | (Err(l), Ok(f)) => Ok((f, l)),
            _ => Err("a comparison of a device's field with a literal".into()),
        }
    }

    /// A device field (Ok) or a literal (Err).
    fn operand(&mut self) -> Result<Result<Field, Literal>, String> {
        match self.next() {
            Some(Token::Str(s)) => Ok(Err(Literal::Str(s))),
            Some(Token::Int(n)) => Ok(Err(Literal::Int(n))),
            Some(Token::Ident(b)) if b == "true" || b == "false" => {
                Ok(Err(Literal::Bool(b == "true")))
            }
            Some(Token::Ident(d)) if d == "device" => {
                if !self.eat(&Token::Dot) {
                    return Err("`device` without a field".into());
                }
                match self.next() {
                    Some(Token::Ident(f)) if f == "driver" => Ok(Ok(Field::Driver)),
                    Some(Token::Ident(f)) if f == "attributes" => {
                        let domain = self.index()?;
                        let name = if self.eat(&Token::Dot) {
                            match self.next() {
                                Some(Token::Ident(n)) => n,
                                _ => return Err("an attribute without a name".into()),
                            }
                        } else {
                            self.index()?
                        };
                        Ok(Ok(Field::Attribute { domain, name }))
                    }
                    other => Err(format!("the device field {other:?}")),
                }
            }
            other => Err(format!("the operand {other:?}")),
        }
    }

    fn index(&mut self) -> Result<String, String> {
        match (self.next(), self.next(), self.next()) {
            (Some(Token::OpenBracket), Some(Token::Str(s)), Some(Token::CloseBracket)) => Ok(s),
            _ => Err("an index that is not a quoted string".into()),
        }
    }
}

impl Selector {
    /// The selector of `class`, or what in it the operator cannot read.
    pub fn of(class: &DeviceClass) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for s in class.spec.selectors.iter().flatten() {
            let Some(cel) = &s.cel else {
                return Err("a selector without a CEL expression".into());
            };
            let mut reader = Reader {
                tokens: tokens(&cel.expression)
                    .map_err(|why| format!("`{}`: cannot read {why}", cel.expression))?,
                at: 0,
            };
            reader.conjunction(&mut terms).and_then(|()| {
                if reader.at == reader.tokens.len() {
                    Ok(())
                } else {
                    Err("more after the last term (only `&&` joins terms)".into())
                }
            })
            .map_err(|why| {
                format!(
                    "`{}`: the operator reads conjunctions (`&&`) of `==` between device.driver or device.attributes['domain'].name and a literal, and met {why}",
                    cel.expression
                )
            })?;
        }
        Ok(Selector { terms })
    }

    /// The driver every selected device has, where a term pins one.
    pub fn driver(&self) -> Option<&str> {
        self.terms.iter().find_map(|(f, l)| match (f, l) {
            (Field::Driver, Literal::Str(d)) => Some(d.as_str()),
            _ => None,
        })
    }

    /// Whether `device` of `driver` has every term.
    pub fn selects(&self, driver: &str, device: &Device) -> bool {
        self.terms.iter().all(|(field, want)| match field {
            Field::Driver => *want == Literal::Str(driver.to_string()),
            Field::Attribute { domain, name } => attribute(driver, device, domain, name)
                .is_some_and(|a| literal_of(a).as_ref() == Some(want)),
        })
    }
}

fn literal_of(a: &DeviceAttribute) -> Option<Literal> {
    a.string
        .clone()
        .or_else(|| a.version.clone())
        .map(Literal::Str)
        .or(a.int.map(Literal::Int))
        .or(a.bool.map(Literal::Bool))
}

/// A device's attribute `domain`/`name`: keyed by the qualified name, or by the bare name
/// where the domain is the driver's own.
fn attribute<'a>(
    driver: &str,
    device: &'a Device,
    domain: &str,
    name: &str,
) -> Option<&'a DeviceAttribute> {
    let attrs = device.attributes.as_ref()?;
    attrs
        .get(&format!("{domain}/{name}"))
        .or_else(|| (domain == driver).then(|| attrs.get(name)).flatten())
}

/// `qualified` (`domain/name`, or a bare name in the driver's domain) of `device`.
fn qualified_attribute<'a>(
    driver: &str,
    device: &'a Device,
    qualified: &str,
) -> Option<&'a DeviceAttribute> {
    match qualified.split_once('/') {
        Some((domain, name)) => attribute(driver, device, domain, name),
        None => attribute(driver, device, driver, qualified),
    }
}

/// A device's memory: its capacity `memory` (in the driver's domain).
fn memory_of(driver: &str, device: &Device) -> Option<u64> {
    let caps = device.capacity.as_ref()?;
    let cap = caps
        .get("memory")
        .or_else(|| caps.get(&format!("{driver}/memory")))?;
    crds::quantity_bytes(&cap.value.0)
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

/// FNV-1a of `bytes`: stable across processes, so every replica names a template alike.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}

/// The ResourceClaimTemplate for `devices` devices of `inv`'s class with at least
/// `memory_bytes` each (where the devices publish memory), sharing one value of the link
/// attribute where `linked`; named `<deployment>-<hash of its spec>`, owned by `dd`.
pub fn template(
    dd: &DiffusionDeployment,
    inv: &Inventory,
    devices: u32,
    memory_bytes: u64,
    linked: bool,
) -> ResourceClaimTemplate {
    let selectors = inv.memory_published.then(|| {
        vec![DeviceSelector {
            cel: Some(CELDeviceSelector {
                expression: format!(
                    "device.capacity[device.driver].memory.compareTo(quantity('{memory_bytes}')) >= 0"
                ),
            }),
        }]
    });
    let constraints = (linked && devices >= 2).then(|| {
        vec![DeviceConstraint {
            requests: Some(vec![CLAIM.into()]),
            match_attribute: Some(inv.link_attribute.clone()),
            ..Default::default()
        }]
    });
    let spec = ResourceClaimTemplateSpec {
        metadata: None,
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: CLAIM.into(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: inv.class.clone(),
                        allocation_mode: Some("ExactCount".into()),
                        count: Some(i64::from(devices)),
                        selectors,
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                constraints,
                ..Default::default()
            }),
        },
    };
    let hash = fnv(&serde_json::to_vec(&spec).expect("a template spec serializes"));
    let base = dd.name_any();
    let base = &base[..base.len().min(200)];
    let meta = crate::resources::owned_meta(dd);
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(format!("{base}-{:08x}", hash as u32)),
            ..meta
        },
        spec,
    }
}

/// The template the pods of `plan` claim their devices through: its dp × sp devices, each
/// with the plan's device memory, sharing a fast link where the plan's nodes have one.
pub fn for_plan(
    dd: &DiffusionDeployment,
    inv: &Inventory,
    plan: &crds::Plan,
) -> ResourceClaimTemplate {
    template(
        dd,
        inv,
        plan.devices(),
        plan.device_bytes_per_rank,
        plan.fast_peer_link,
    )
}

/// Applies the generated `wanted` template and deletes the deployment's earlier ones that
/// no engine pod claims through any more.
pub async fn apply_template(
    dd: &DiffusionDeployment,
    ctx: &Context,
    wanted: &ResourceClaimTemplate,
    pods: &[Pod],
) -> Result<Vec<String>> {
    let id = model_id(dd);
    let ns = dd.namespace().unwrap_or_default();
    let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), &ns);
    let name = wanted.name_any();
    let mut obj =
        serde_json::to_value(wanted).map_err(|source| crate::error::Error::Serialize {
            what: "ResourceClaimTemplate",
            source,
        })?;
    obj["apiVersion"] = "resource.k8s.io/v1".into();
    obj["kind"] = "ResourceClaimTemplate".into();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .map_err(kube(format!(
        "applying ResourceClaimTemplate {name} of {id}"
    )))?;
    let claimed: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| {
            p.spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
        })
        .filter_map(|c| c.resource_claim_template_name.as_deref())
        .collect();
    let selector = crate::resources::selector_string(dd);
    let ours = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(kube(format!("listing ResourceClaimTemplates of {id}")))?;
    let mut deleted = Vec::new();
    for t in ours.items {
        let n = t.name_any();
        let owned = t
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == dd.metadata.uid.as_ref());
        if n == name || !owned || claimed.contains(n.as_str()) {
            continue;
        }
        match api.delete(&n, &DeleteParams::default()).await {
            Ok(_) => deleted.push(n),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(kube(format!("deleting ResourceClaimTemplate {n} of {id}"))(
                    e,
                ))
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        DeviceCapacity, DeviceClassSpec, ResourcePool, ResourceSliceSpec,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

    fn class(exprs: &[&str]) -> DeviceClass {
        DeviceClass {
            metadata: ObjectMeta {
                name: Some("gpu.example.com".into()),
                ..Default::default()
            },
            spec: DeviceClassSpec {
                selectors: Some(
                    exprs
                        .iter()
                        .map(|e| DeviceSelector {
                            cel: Some(CELDeviceSelector {
                                expression: e.to_string(),
                            }),
                        })
                        .collect(),
                ),
                ..Default::default()
            },
        }
    }

    fn device(name: &str, kind: &str, gib: Option<u64>, root: Option<&str>) -> Device {
        let mut attrs = BTreeMap::from([
            (
                "type".to_string(),
                DeviceAttribute {
                    string: Some(kind.into()),
                    ..Default::default()
                },
            ),
            (
                "productName".to_string(),
                DeviceAttribute {
                    string: Some("NVIDIA H100 80GB HBM3".into()),
                    ..Default::default()
                },
            ),
        ]);
        if let Some(r) = root {
            attrs.insert(
                DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
                DeviceAttribute {
                    string: Some(r.into()),
                    ..Default::default()
                },
            );
        }
        Device {
            name: name.into(),
            attributes: Some(attrs),
            capacity: gib.map(|g| {
                BTreeMap::from([(
                    "memory".to_string(),
                    DeviceCapacity {
                        value: Quantity(format!("{g}Gi")),
                        ..Default::default()
                    },
                )])
            }),
            ..Default::default()
        }
    }

    fn slice(node: &str, driver: &str, generation: i64, devices: Vec<Device>) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta::default(),
            spec: ResourceSliceSpec {
                driver: driver.into(),
                node_name: Some(node.into()),
                pool: ResourcePool {
                    name: node.into(),
                    generation,
                    resource_slice_count: 1,
                },
                devices: Some(devices),
                ..Default::default()
            },
        }
    }

    const NVIDIA: &str =
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'";

    #[test]
    fn the_classes_selectors_are_read_and_applied() {
        let s = Selector::of(&class(&[NVIDIA])).unwrap();
        assert_eq!(s.driver(), Some("gpu.nvidia.com"));
        assert!(s.selects("gpu.nvidia.com", &device("gpu-0", "gpu", Some(80), None)));
        assert!(!s.selects("gpu.nvidia.com", &device("mig-0", "mig", Some(10), None)));
        assert!(!s.selects("gpu.other.com", &device("gpu-0", "gpu", Some(80), None)));
        // Brackets, double quotes, parentheses, literals on the left, and several selectors.
        let s = Selector::of(&class(&[
            "(\"gpu.nvidia.com\" == device.driver)",
            "device.attributes[\"gpu.nvidia.com\"][\"type\"] == 'gpu' && true == true",
        ]));
        assert!(s.is_err(), "two literals compared: {s:?}");
        let s = Selector::of(&class(&[
            "(\"gpu.nvidia.com\" == device.driver)",
            "device.attributes[\"gpu.nvidia.com\"][\"type\"] == 'gpu'",
        ]))
        .unwrap();
        assert!(s.selects("gpu.nvidia.com", &device("gpu-0", "gpu", None, None)));
        // No selector: every device, of any driver.
        let any = Selector::of(&class(&[])).unwrap();
        assert!(any.selects("x", &device("a", "b", None, None)));
        assert_eq!(any.driver(), None);
    }

    #[test]
    fn selectors_beyond_equalities_are_refused_quoting_them() {
        for e in [
            "device.driver == 'a' || device.driver == 'b'",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            "device.attributes['gpu.nvidia.com'].type != 'mig'",
            "device.driver == 'a' &",
            "device.driver == 'unclosed",
        ] {
            let why = Selector::of(&class(&[e])).unwrap_err();
            assert!(why.contains(e), "{why}");
        }
    }

    #[test]
    fn the_inventory_counts_link_groups_memory_and_the_newest_pools() {
        let s = Selector::of(&class(&[NVIDIA])).unwrap();
        let link = DeviceAllocation::DEFAULT_LINK_ATTRIBUTE;
        let eight: Vec<Device> = (0..8)
            .map(|i| {
                device(
                    &format!("gpu-{i}"),
                    "gpu",
                    Some(80),
                    Some(if i < 4 { "pci0000:00" } else { "pci0000:80" }),
                )
            })
            .chain([device("mig-0", "mig", Some(10), Some("pci0000:00"))])
            .collect();
        let mut tainted = device("gpu-9", "gpu", Some(80), Some("pci0000:00"));
        tainted.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
            effect: "NoSchedule".into(),
            key: "broken".into(),
            ..Default::default()
        }]);
        let slices = vec![
            slice("a", "gpu.nvidia.com", 2, eight),
            // An older generation of the same pool: ignored.
            slice(
                "a",
                "gpu.nvidia.com",
                1,
                vec![device("gpu-7", "gpu", Some(40), Some("x"))],
            ),
            slice(
                "b",
                "gpu.nvidia.com",
                1,
                vec![device("gpu-0", "gpu", Some(48), None), tainted],
            ),
            slice(
                "c",
                "gpu.other.com",
                1,
                vec![device("gpu-0", "gpu", Some(48), None)],
            ),
        ];
        let (nodes, published) = inventory(&slices, &s, link);
        assert!(published);
        let a = &nodes["a"];
        assert_eq!((a.count, a.memory_bytes, a.linked), (8, Some(80 << 30), 4));
        assert_eq!(a.product.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(a.for_ranks(), (4, true));
        let b = &nodes["b"];
        assert_eq!(
            (b.count, b.linked),
            (1, 0),
            "the tainted device is left out"
        );
        assert_eq!(b.for_ranks(), (1, false));
        assert!(!nodes.contains_key("c"));
        // A device without memory: the figure is unknown (the agent's then).
        let slices = vec![slice(
            "a",
            "gpu.nvidia.com",
            1,
            vec![
                device("gpu-0", "gpu", Some(80), None),
                device("gpu-1", "gpu", None, None),
            ],
        )];
        let (nodes, published) = inventory(&slices, &s, link);
        assert!(!published);
        assert_eq!(nodes["a"].memory_bytes, None);
    }

    fn template_of(spec: serde_json::Value) -> ResourceClaimTemplate {
        serde_json::from_value(json!({
            "metadata": { "name": "mine" },
            "spec": { "spec": { "devices": spec } },
        }))
        .unwrap()
    }

    #[test]
    fn a_named_template_gives_its_class_and_count_or_why_not() {
        let one = template_of(
            json!({ "requests": [{ "name": "g", "exactly": { "deviceClassName": "gpu.nvidia.com", "count": 4 } }] }),
        );
        assert_eq!(named_request(&one).unwrap(), ("gpu.nvidia.com".into(), 4));
        let all = template_of(
            json!({ "requests": [{ "name": "g", "exactly": { "deviceClassName": "c", "allocationMode": "All" } }] }),
        );
        assert!(named_request(&all)
            .unwrap_err()
            .contains("allocationMode All"));
        let two = template_of(json!({ "requests": [
            { "name": "g", "exactly": { "deviceClassName": "c" } },
            { "name": "h", "exactly": { "deviceClassName": "c" } }] }));
        assert!(named_request(&two)
            .unwrap_err()
            .contains("2 device requests"));
        let alt = template_of(
            json!({ "requests": [{ "name": "g", "firstAvailable": [{ "name": "a", "deviceClassName": "c" }] }] }),
        );
        assert!(named_request(&alt).unwrap_err().contains("not `exactly`"));
    }

    #[test]
    fn the_generated_template_asks_for_the_plans_devices_memory_and_link() {
        let dd: DiffusionDeployment = serde_json::from_value(json!({
            "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": { "name": "wan", "namespace": "ns", "uid": "u-1" },
            "spec": { "model": { "family": "wan", "location": { "hostPath": "/m" } } },
        }))
        .unwrap();
        let inv = Inventory {
            class: "gpu.nvidia.com".into(),
            link_attribute: DeviceAllocation::DEFAULT_LINK_ATTRIBUTE.into(),
            named: None,
            nodes: BTreeMap::new(),
            memory_published: true,
        };
        let t = template(&dd, &inv, 4, 70 << 30, true);
        let v = serde_json::to_value(&t.spec.spec).unwrap();
        let req = &v["devices"]["requests"][0];
        assert_eq!(req["name"], CLAIM);
        assert_eq!(req["exactly"]["deviceClassName"], "gpu.nvidia.com");
        assert_eq!(req["exactly"]["count"], 4);
        assert_eq!(
            req["exactly"]["selectors"][0]["cel"]["expression"],
            format!(
                "device.capacity[device.driver].memory.compareTo(quantity('{}')) >= 0",
                70u64 << 30
            )
        );
        assert_eq!(
            v["devices"]["constraints"][0],
            json!({ "requests": [CLAIM], "matchAttribute": "resource.kubernetes.io/pcieRoot" })
        );
        let owner = &t.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.name.as_str(), owner.uid.as_str()), ("wan", "u-1"));
        // The name follows the contents: the same plan, the same name; another, another.
        assert_eq!(
            template(&dd, &inv, 4, 70 << 30, true).metadata.name,
            t.metadata.name
        );
        let other = template(&dd, &inv, 2, 70 << 30, true);
        assert_ne!(other.metadata.name, t.metadata.name);
        assert!(t.name_any().starts_with("wan-"));
        // One device, or no fast link: no constraint; no memory published: no selector.
        let lone = template(&dd, &inv, 1, 70 << 30, true);
        assert!(lone
            .spec
            .spec
            .devices
            .as_ref()
            .unwrap()
            .constraints
            .is_none());
        let bare = Inventory {
            memory_published: false,
            ..inv
        };
        let t = template(&dd, &bare, 4, 70 << 30, false);
        let d = t.spec.spec.devices.unwrap();
        assert!(d.constraints.is_none());
        assert!(d.requests.unwrap()[0]
            .exactly
            .as_ref()
            .unwrap()
            .selectors
            .is_none());
    }
}
