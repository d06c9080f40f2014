//! What the planner is given: the candidate nodes' shapes (with the profile each one's agent
//! reported), what the spec fixes, and the allowances beside the model's own bytes. Plain
//! data, so the search and its tests build them without a cluster.

use crds::{DiffusionDeploymentSpec, Profile, StrategyChoice};
use layerwise_core::compute_dtype::Backend;
use layerwise_core::decode::{DecodeSite, DeviceKind};
use layerwise_core::timing::{Rates, RatesFrom};

/// One candidate node as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeShape {
    pub name: String,
    /// Accelerators of the requested resource on the node.
    pub devices: u32,
    /// Memory of each device.
    pub device_bytes: u64,
    /// Host memory pods may use (physical memory or cgroup limit, the smaller).
    pub host_bytes: u64,
    /// Whether the devices all-gather over a fast peer link.
    pub fast_peer_link: bool,
    /// Whether the model is already warm in this node's page cache.
    pub warm: bool,
    /// What its accelerators sustain, for the step-time model ([`layerwise_core::timing`]).
    pub rates: Rates,
    /// Where `rates` come from: the product table's row for the reported product or the
    /// fallback's, the spec's figures over them (its `Display` is the plan's words).
    pub rates_from: RatesFrom,
}

impl NodeShape {
    /// The rates of accelerators of `product`: the planner's defaults for it
    /// ([`layerwise_core::timing::PRODUCT_RATES`], an A100's where the table has no row),
    /// with each figure `spec` sets in their place; and where they come from.
    pub fn rates_for(product: &str, spec: Option<&crds::AcceleratorRates>) -> (Rates, RatesFrom) {
        let (defaults, from) = RatesFrom::product(product);
        match spec {
            Some(r) if *r != crds::AcceleratorRates::default() => {
                (r.over(defaults), from.overridden())
            }
            _ => (defaults, from),
        }
    }
}

/// What a node reports of itself to the planner: its agent's figures (or the devices
/// Dynamic Resource Allocation publishes), bounded by what the Node offers. The reconcile
/// reads it from the cluster and `layerwise-operator plan` from its flags; both turn it into
/// a [`NodeShape`] by [`NodeShape::for_spec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReport {
    pub name: String,
    /// Accelerators one pod's ranks may use.
    pub devices: u32,
    /// Memory of each.
    pub device_bytes: u64,
    /// The accelerator product, as the node agent reports it (NVML's name).
    pub product: String,
    /// Whether the devices share a fast peer link.
    pub fast_peer_link: bool,
    /// Host memory pods may use.
    pub host_bytes: u64,
    /// Whether the model is already warm in the node's page cache.
    pub warm: bool,
}

impl NodeShape {
    /// The planner's view of `node` for a deployment of `spec`: its figures, and the rates
    /// of its product with what `spec.accelerator.rates` sets in their place.
    pub fn for_spec(node: NodeReport, spec: &DiffusionDeploymentSpec) -> NodeShape {
        let (rates, rates_from) =
            NodeShape::rates_for(&node.product, spec.accelerator.rates.as_ref());
        NodeShape {
            name: node.name,
            devices: node.devices,
            device_bytes: node.device_bytes,
            host_bytes: node.host_bytes,
            fast_peer_link: node.fast_peer_link,
            warm: node.warm,
            rates,
            rates_from,
        }
    }
}

/// What the spec fixes; `StrategyChoice::Auto` and `None` leave the choice to the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overrides {
    pub strategy: StrategyChoice,
    pub dp: Option<u32>,
    /// Ranks per request (sequence parallelism); `None`: the planner chooses.
    pub sp: Option<u32>,
    pub slots: Option<u32>,
}

impl Overrides {
    /// What `spec` fixes.
    pub fn of(spec: &DiffusionDeploymentSpec) -> Overrides {
        Overrides {
            strategy: spec.strategy,
            dp: spec.dp,
            sp: spec.sp,
            slots: spec.slots,
        }
    }
}

/// Allowances the planner adds beside the model's own bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Device bytes per rank the runtime needs (context, kernels, allocator slack).
    pub device_overhead: u64,
    /// Host bytes per pod beside the model (process, buffers, server).
    pub host_overhead: u64,
    /// K the planner starts from (2: one block computing, one in flight).
    pub min_slots: u32,
    /// The most slots the planner grows K to when memory allows.
    pub max_slots: u32,
    /// The most ranks per pod the planner chooses on its own (dp × sp, unless the spec
    /// fixes sp beyond it).
    pub max_dp: u32,
    /// Where the engine pods decode ([`DecodeSite::for_resource`] of the accelerator): on
    /// the device, the planner reserves the decoder's weights and largest decode there.
    pub decode: DecodeSite,
    /// What the engine pods compute on ([`DeviceKind::backend`] of the accelerator's):
    /// it decides the element their activations are charged in
    /// ([`super::need::compute_element`]).
    pub backend: Backend,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            device_overhead: 1 << 30,
            host_overhead: 2 << 30,
            min_slots: layerwise_core::strategy::MIN_STREAMING_SLOTS,
            max_slots: 4,
            max_dp: 8,
            decode: DecodeSite::for_resource(crds::Accelerator::DEFAULT_RESOURCE),
            backend: DeviceKind::of_resource(crds::Accelerator::DEFAULT_RESOURCE).backend(),
        }
    }
}

impl Limits {
    /// These allowances, with what `spec` sets in their place (its device overhead, in
    /// whole MiB as the engine's `--device-overhead-mib` takes it, rounded up; where its
    /// accelerator makes the pods decode).
    pub fn for_spec(self, spec: &DiffusionDeploymentSpec) -> Limits {
        const MIB: u64 = 1 << 20;
        Limits {
            decode: DecodeSite::for_resource(spec.accelerator.resource()),
            backend: DeviceKind::of_resource(spec.accelerator.resource()).backend(),
            device_overhead: spec
                .engine
                .device_overhead_bytes
                .unwrap_or(self.device_overhead)
                .div_ceil(MIB)
                .saturating_mul(MIB),
            ..self
        }
    }
}

/// A candidate node and the profile of the model its agent reported.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub node: NodeShape,
    pub profile: &'a Profile,
}
