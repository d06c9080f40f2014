//! The planner: a pure function from a checkpoint profile, the candidate nodes' shapes and the
//! workload bounds (plus any fixed strategy, dp, sp or slots) to a plan or a refusal.
//!
//! A pod runs `dp` groups of `sp` ranks ([`layerwise_core::topology`]): each group serves
//! one request, its `sp` ranks splitting the request's latent sequence, and the weights
//! shard over all `dp × sp` ranks. The planner tries sp from 1 up (1, 2, 4, 8, as far as
//! the node's accelerators and [`MAX_SP`] allow, and only where the profile declares the
//! all-to-all's buffers: the families that split their sequence) and keeps the first
//! whose activations per rank fit beside the weights and whose predicted latency meets
//! `workload.maxLatencySeconds`; within that sp the options are ranked as they always
//! were. Where no sp meets the bound, it plans the fastest and says so.
//!
//! Memory is counted per rank on the device (block weights kept there, K slots of one padded
//! block, prologue/epilogue, activations of the largest allowed request, runtime overhead,
//! and the VAE decoder with its largest decode where the pods decode on the device) and per
//! pod on the host (one copy of the model, mapped, plus pinned staging
//! buffers for the offload strategies, plus runtime). Slot sizes and activation cost come
//! from the engine's [`Profile`], so there is one formula. A plan is only ever recorded for
//! nodes it fits; a refusal names the resource that falls short and by how many bytes.

use std::collections::BTreeMap;
use std::fmt;

use crds::{
    ComponentPlacement, ComponentPlan, DiffusionDeploymentSpec, MemoryBreakdown, Plan, Profile,
    Strategy, StrategyChoice, Workload,
};
use layerwise_core::bounds::RequestBounds;
use layerwise_core::decode::{DecodeSite, DecoderBytes};
use layerwise_core::memory::{self, Placement};
use layerwise_core::timing::{self, Choice, GroupCompute, Prediction, Rates, Work};
use layerwise_core::topology::MAX_SP;

const GIB: f64 = (1u64 << 30) as f64;

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
    /// What its accelerators sustain, for the step-time model ([`timing`]).
    pub rates: Rates,
    /// Where `rates` come from, in words (the product's defaults, the spec).
    pub rates_from: String,
}

impl NodeShape {
    /// The rates of accelerators of `product`: the planner's defaults for it
    /// ([`timing::PRODUCT_RATES`]), with each figure `spec` sets in its place; and where
    /// they come from, in words.
    pub fn rates_for(product: &str, spec: Option<&crds::AcceleratorRates>) -> (Rates, String) {
        let (defaults, known) = Rates::for_product(product);
        let from = match known {
            Some(name) => format!("the {name} defaults"),
            None => format!("the defaults for an unknown product ({product:?})"),
        };
        match spec {
            Some(r) if *r != crds::AcceleratorRates::default() => (
                r.over(defaults),
                format!("spec.accelerator.rates over {from}"),
            ),
            _ => (defaults, from),
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

/// The resource a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortage {
    /// No node offers the accelerator (or matches the selector).
    NoNodes,
    /// Fewer accelerators on every node than the plan's dp × sp.
    Accelerators,
    /// Device memory per rank.
    DeviceMemory,
    /// Host memory per pod.
    HostMemory,
    /// The fixed settings contradict each other.
    Spec,
}

impl Shortage {
    /// The Kubernetes condition reason for a refusal of this kind.
    pub fn reason(self) -> &'static str {
        match self {
            Shortage::NoNodes => "NoCandidateNodes",
            Shortage::Accelerators => "InsufficientAccelerators",
            Shortage::DeviceMemory => "InsufficientDeviceMemory",
            Shortage::HostMemory => "InsufficientHostMemory",
            Shortage::Spec => "InvalidSpec",
        }
    }
}

/// Why no plan fits: the resource, the node it was closest on, and the numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub shortage: Shortage,
    pub node: Option<String>,
    /// What the closest option needs and what the node has (bytes or accelerators).
    pub needed: u64,
    pub available: u64,
    /// The option the numbers are for, in words.
    pub option: String,
}

impl Refusal {
    /// How much is missing (bytes, or accelerators for `Accelerators`).
    pub fn shortfall(&self) -> u64 {
        self.needed.saturating_sub(self.available)
    }

    /// A refusal of settings that contradict each other or what the engine accepts.
    fn invalid(why: String) -> Refusal {
        Refusal {
            shortage: Shortage::Spec,
            node: None,
            needed: 0,
            available: 0,
            option: why,
        }
    }

    /// A refusal of a figure that overflows on `node`: more than any device holds.
    fn beyond_any_device(node: &NodeShape, what: String) -> Refusal {
        Refusal {
            shortage: Shortage::DeviceMemory,
            node: Some(node.name.clone()),
            needed: u64::MAX,
            available: node.device_bytes,
            option: format!("{what} (beyond any device)"),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = self
            .node
            .as_deref()
            .map(|n| format!(" on node {n}"))
            .unwrap_or_default();
        match self.shortage {
            Shortage::NoNodes => write!(f, "no candidate node: {}", self.option),
            Shortage::Spec => write!(f, "invalid settings: {}", self.option),
            Shortage::Accelerators => write!(
                f,
                "accelerators short by {}{on}: {} needs {} per pod, the node has {}",
                self.shortfall(),
                self.option,
                self.needed,
                self.available
            ),
            Shortage::DeviceMemory | Shortage::HostMemory => write!(
                f,
                "{} short by {} bytes ({:.2} GiB){on}: {} needs {} bytes, the node has {} bytes",
                if self.shortage == Shortage::DeviceMemory {
                    "device memory per rank"
                } else {
                    "host memory (the model's page-cache copy and one pod)"
                },
                self.shortfall(),
                self.shortfall() as f64 / GIB,
                self.option,
                self.needed,
                self.available
            ),
        }
    }
}

/// The memory one (strategy, dp, K) option needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub device: MemoryBreakdown,
    pub host_per_pod: u64,
    /// Host bytes one node holds once for every pod of the model: its page-cache copy.
    pub host_shared: u64,
}

/// Peak activation bytes for the largest allowed request, or `None` when the engine's formula
/// would overflow (a request no device could hold).
pub fn activation_bytes(profile: &Profile, w: &Workload) -> Option<u64> {
    activation_bytes_per_rank(profile, w, 1)
}

/// [`activation_bytes`] on each rank of a group of `sp` that splits the request's sequence:
/// the engine's own formula ([`RequestBounds::activation_bytes_per_rank`]), which its start
/// check calls with its `--sp`.
pub fn activation_bytes_per_rank(profile: &Profile, w: &Workload, sp: u32) -> Option<u64> {
    crate::resources::request_bounds(w)
        .activation_bytes_per_rank(&profile.activation, u64::from(sp))
}

/// Whether `profile`'s family splits a request's sequence over ranks: it declares the
/// buffers of the all-to-all ([`crds::ActivationCost::exchange_bytes_per_token`]), as the
/// `wan` and `cosmos3` families do. A profile of an agent that predates them declares none.
pub fn splits_sequence(profile: &Profile) -> bool {
    profile.activation.exchange_bytes_per_token > 0
}

/// The sp the planner tries, in order, where the spec leaves it: 1, then 2, 4 and 8 as far
/// as `devices` and [`MAX_SP`] allow (none beyond 1 where `splits` is false).
pub fn sp_candidates(devices: u32, splits: bool) -> Vec<u32> {
    [1u32, 2, 4, 8]
        .into_iter()
        .filter(|&sp| sp == 1 || (splits && sp <= devices && sp as usize <= MAX_SP))
        .collect()
}

/// What the engine pods' decoder keeps on each device where they decode (`site`): its
/// weights and the decode of the largest output `w` allows, by the engine's own
/// [`DecodeSite::decoder_bytes`]; nothing where they decode on the host. `None` when
/// that decode would overflow (an output no device could decode).
pub fn decoder_bytes(profile: &Profile, w: &Workload, site: DecodeSite) -> Option<DecoderBytes> {
    site.decoder_bytes(
        profile.decoder_bytes,
        &profile.activation,
        &crate::resources::request_bounds(w),
    )
}

/// Device bytes per rank and host bytes per pod for one option: the engine's memory model
/// ([`layerwise_core::memory`]) over the profile's groups, with `resident` marking the
/// groups kept whole on the device, and `decoder` beside the rank.
pub fn need(
    profile: &Profile,
    activations: u64,
    decoder: DecoderBytes,
    placement: &Placement,
    limits: &Limits,
) -> Need {
    let d = memory::device_bytes(
        &profile.groups,
        placement,
        profile.outside_block_bytes,
        activations,
        limits.device_overhead,
    )
    .with_decoder(decoder);
    let device = MemoryBreakdown {
        block_weights: d.block_weights,
        slots: d.slots,
        resident_weights: d.resident_weights,
        activations: d.activations,
        overhead: d.overhead,
        decoder: d.decoder,
    };
    Need {
        device,
        host_per_pod: memory::pod_host_bytes(&profile.groups, placement, limits.host_overhead),
        host_shared: profile.total_bytes,
    }
}

fn device_total(b: &MemoryBreakdown) -> u64 {
    [
        b.block_weights,
        b.slots,
        b.resident_weights,
        b.activations,
        b.overhead,
        b.decoder,
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add)
}

/// One (strategy, dp, sp, K, components kept resident, blocks kept) the planner may choose.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Option_ {
    strategy: Strategy,
    /// Groups: requests served at once.
    dp: u32,
    /// Ranks of a group, splitting its request's sequence.
    sp: u32,
    k: u32,
    /// Components whose blocks stay whole on the device although the strategy streams.
    resident: Vec<String>,
    /// Blocks kept on the device of each group of the streamed components named here
    /// (none of the others).
    kept: BTreeMap<String, u64>,
}

impl Option_ {
    fn new(strategy: Strategy, dp: u32, sp: u32, k: u32) -> Option_ {
        Option_ {
            strategy,
            dp,
            sp,
            k,
            resident: Vec::new(),
            kept: BTreeMap::new(),
        }
    }

    /// Accelerators of a pod: dp × sp.
    fn ranks(&self) -> u32 {
        self.dp.max(1).saturating_mul(self.sp.max(1))
    }

    /// Where this option puts `profile`'s weights, for the memory model: sharded over
    /// every rank of the pod.
    fn placement(&self, profile: &Profile) -> Placement {
        Placement {
            strategy: self.strategy,
            dp: u64::from(self.ranks()),
            slots: u64::from(self.k),
            resident: self.resident_groups(profile),
            resident_blocks: 0,
            resident_blocks_by_group: Vec::new(),
        }
        .with_component_blocks(&profile.groups, &self.kept)
    }

    /// Per group of `profile`, whether it stays whole on the device.
    fn resident_groups(&self, profile: &Profile) -> Vec<bool> {
        profile
            .groups
            .iter()
            .map(|g| self.resident.contains(&g.component))
            .collect()
    }

    /// The blocks kept, as the plan records them: one count when every streamed component
    /// keeps the same, else per component (the rest keeping none).
    fn kept_blocks(&self) -> (u64, BTreeMap<String, u64>) {
        let counts: Vec<u64> = self.kept.values().copied().collect();
        match counts.first() {
            Some(&n) if counts.iter().all(|&c| c == n) => (n, BTreeMap::new()),
            _ => (
                0,
                self.kept
                    .iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(c, n)| (c.clone(), *n))
                    .collect(),
            ),
        }
    }
}

impl fmt::Display for Option_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dp = if self.sp > 1 {
            format!("dp={} × sp={}", self.dp, self.sp)
        } else {
            format!("dp={}", self.dp)
        };
        if self.strategy.streams() {
            write!(
                f,
                "{} with {dp} and {} slots",
                self.strategy.as_str(),
                self.k
            )?;
            if !self.resident.is_empty() {
                write!(f, ", {} resident", self.resident.join(" and "))?;
            }
            let kept: Vec<String> = self
                .kept
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(|(c, n)| format!("{n} of {c}'s blocks"))
                .collect();
            if !kept.is_empty() {
                write!(f, ", {} kept", kept.join(" and "))?;
            }
            Ok(())
        } else {
            write!(f, "{} with {dp}", self.strategy.as_str())
        }
    }
}

/// The components a streaming plan may keep whole on the device, in the order the planner
/// tries them: pipeline order, which puts the text encoder first (it runs once per request
/// on a short sequence, so its copies hide behind the least compute), then the experts.
/// The last one always streams: a plan that streams nothing is `resident`.
fn residency_candidates(profile: &Profile) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for g in &profile.groups {
        if !names.contains(&g.component) {
            names.push(g.component.clone());
        }
    }
    names.pop();
    names
}

/// Strategies in the order the planner prefers them: nothing moves, then only peers talk,
/// then the host feeds all-gathering ranks, then every rank copies whole blocks.
const PREFERENCE: [Strategy; 4] = [
    Strategy::Resident,
    Strategy::Sharded,
    Strategy::OffloadSharded,
    Strategy::Offload,
];

fn rank(s: Strategy) -> usize {
    PREFERENCE
        .iter()
        .position(|p| *p == s)
        .unwrap_or(PREFERENCE.len())
}

/// The (strategy, dp) pairs to try on `node` with groups of `sp` ranks, best first; each is
/// then tried with K from the cap down.
fn options_for(node: &NodeShape, o: &Overrides, sp: u32, limits: &Limits) -> Vec<(Strategy, u32)> {
    let sp = sp.max(1);
    let max_dp = (node.devices.min(limits.max_dp) / sp).max(1);
    // The fewest groups whose ranks can all-gather: 2, or 1 where a group has several.
    let min_gather = if sp >= 2 { 1 } else { 2 };
    let strategies: Vec<Strategy> = match o.strategy {
        StrategyChoice::Auto => PREFERENCE.to_vec(),
        StrategyChoice::Fixed(s) => vec![s],
    };
    let mut out = Vec::new();
    for s in strategies {
        let auto = o.strategy == StrategyChoice::Auto;
        match (s, o.dp) {
            (_, Some(dp)) => {
                let gathers = matches!(s, Strategy::Sharded | Strategy::OffloadSharded);
                // In auto mode offload-sharded needs a fast peer link; without it (or with
                // one rank) every rank copies whole blocks instead.
                if gathers && dp.saturating_mul(sp) < 2 {
                    continue;
                }
                if auto && s == Strategy::OffloadSharded && !node.fast_peer_link {
                    continue;
                }
                if auto && s == Strategy::Offload && dp * sp >= 2 && node.fast_peer_link {
                    // offload-sharded moves 1/dp per rank for the same memory: always better.
                    continue;
                }
                out.push((s, dp));
            }
            (Strategy::Resident | Strategy::Offload, None) => out.push((s, 1)),
            // The fewest ranks whose shards fit, among those that divide the node's
            // accelerators first: pods of that dp use every accelerator of the node, where
            // fewer ranks that do not divide it would leave some idle.
            (Strategy::Sharded, None) => {
                let (tiles, rest): (Vec<u32>, Vec<u32>) =
                    (min_gather..=max_dp).partition(|dp| node.devices.is_multiple_of(*dp * sp));
                out.extend(tiles.into_iter().chain(rest).map(|dp| (s, dp)));
            }
            // Memory per rank does not shrink with dp here, but copy traffic per rank does:
            // use every accelerator of the node (up to the cap).
            (Strategy::OffloadSharded, None) => {
                if max_dp * sp >= 2 && (node.fast_peer_link || !auto) {
                    out.push((s, max_dp));
                }
            }
        }
    }
    out
}

/// A candidate node with the profile its agent reported and the activation bytes that
/// profile gives the workload.
struct Site<'a> {
    node: &'a NodeShape,
    profile: &'a Profile,
    /// The workload's bounds, which activations per rank are counted at.
    bounds: RequestBounds,
    decoder: DecoderBytes,
    /// The request the step-time model times: the workload at its bounds, on this
    /// profile's tokens (unsplit: [`Site::work`] splits it).
    work: Work,
    /// What each of the profile's groups computes.
    compute: Vec<GroupCompute>,
}

impl Site<'_> {
    /// Activation bytes on each rank of a group of `sp`: the engine's formula.
    fn act(&self, sp: u32) -> Option<u64> {
        self.bounds
            .activation_bytes_per_rank(&self.profile.activation, u64::from(sp))
    }

    /// The request at the bounds, its sequence split over `sp` ranks.
    fn work(&self, sp: u32) -> Work {
        self.work.with_sp(u64::from(sp))
    }

    /// The predicted latency of a request at the bounds under `opt`.
    fn latency(&self, opt: &Option_) -> f64 {
        timing::predict(
            &self.profile.groups,
            &self.compute,
            &self.work(opt.sp),
            &opt.placement(self.profile),
            &self.node.rates,
        )
        .request
    }
}

/// A failed check, kept to build the refusal.
#[derive(Debug, Clone)]
struct Miss {
    shortage: Shortage,
    node: String,
    needed: u64,
    available: u64,
    option: Option_,
}

/// Checks `opt` against `node`: Ok with its need, or the first resource that falls short.
fn check(site: &Site, opt: &Option_, limits: &Limits) -> Result<Need, Miss> {
    check_placement(site, opt, &opt.placement(site.profile), limits)
}

/// [`check`] of `opt` with its weights placed as `placement` says.
fn check_placement(
    site: &Site,
    opt: &Option_,
    placement: &Placement,
    limits: &Limits,
) -> Result<Need, Miss> {
    let (profile, node) = (site.profile, site.node);
    let miss = |shortage, needed, available| Miss {
        shortage,
        node: node.name.clone(),
        needed,
        available,
        option: opt.clone(),
    };
    if opt.ranks() > node.devices {
        return Err(miss(
            Shortage::Accelerators,
            u64::from(opt.ranks()),
            u64::from(node.devices),
        ));
    }
    let Some(act) = site.act(opt.sp) else {
        return Err(miss(Shortage::DeviceMemory, u64::MAX, node.device_bytes));
    };
    let n = need(profile, act, site.decoder, placement, limits);
    let dev = device_total(&n.device);
    if dev > node.device_bytes {
        return Err(miss(Shortage::DeviceMemory, dev, node.device_bytes));
    }
    let host = memory::node_host_bytes(n.host_shared, n.host_per_pod, 1);
    if host > node.host_bytes {
        return Err(miss(Shortage::HostMemory, host, node.host_bytes));
    }
    Ok(n)
}

/// A candidate node and the profile of the model its agent reported.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub node: NodeShape,
    pub profile: &'a Profile,
}

/// Plans one replica of `profile` on the best of `nodes` (every node reporting the same
/// profile) for requests up to `workload`.
pub fn plan(
    profile: &Profile,
    nodes: &[NodeShape],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    let candidates: Vec<Candidate> = nodes
        .iter()
        .map(|n| Candidate {
            node: n.clone(),
            profile,
        })
        .collect();
    plan_candidates(&candidates, workload, overrides, limits)
}

/// Plans one replica on the best of `candidates`, each sized with its own profile, for
/// requests up to `workload`. A plan's figures hold on every node it names. Where the pods
/// would decode on the device and no option fits with the decoder there, the pods decode
/// on the host instead (the plan's `decoder` term is then 0, and the operator tells the
/// engine so), and the reasons say why.
pub fn plan_candidates(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    check_overrides(overrides)?;
    let sps = sp_choices(candidates, overrides)?;
    let bound = workload.max_latency_seconds;
    // Each sp in turn, the fewest first: the first that fits and meets the bound wins;
    // where none meets it, the fastest that fits.
    let mut tried: Vec<(u32, Result<f64, Refusal>)> = Vec::new();
    let (mut met, mut fastest): (Option<Plan>, Option<Plan>) = (None, None);
    for &sp in &sps {
        let plan = match plan_sp(candidates, workload, overrides, sp, limits) {
            Ok(plan) => plan,
            Err(r) => {
                tried.push((sp, Err(r)));
                continue;
            }
        };
        let latency = plan.predicted_latency_seconds.unwrap_or(f64::INFINITY);
        tried.push((sp, Ok(latency)));
        if bound.is_none_or(|b| latency <= b) {
            met = Some(plan);
            break;
        }
        if fastest
            .as_ref()
            .is_none_or(|f| latency < f.predicted_latency_seconds.unwrap_or(f64::INFINITY))
        {
            fastest = Some(plan);
        }
    }
    let bound_met = met.is_some();
    let Some(mut plan) = met.or(fastest) else {
        // The refusal that got furthest (host memory is checked after device memory),
        // closest to fitting.
        let stage = |s: Shortage| match s {
            Shortage::HostMemory => 0,
            Shortage::DeviceMemory => 1,
            _ => 2,
        };
        return Err(tried
            .into_iter()
            .filter_map(|(_, r)| r.err())
            .min_by_key(|r| (stage(r.shortage), r.shortfall()))
            .expect("at least one sp is tried"));
    };
    plan.latency_bound_met = bound.map(|_| bound_met);
    let profile = candidates
        .iter()
        .find(|c| plan.nodes.contains(&c.node.name))
        .map(|c| c.profile)
        .expect("a plan names the nodes it fits");
    // Why this sp: where the family splits its sequence, or where the spec or a latency
    // bound asked for something only sequence parallelism could give.
    if splits_sequence(profile) || overrides.sp.is_some() || bound.is_some() {
        let why = sp_reason(&SpOutcome {
            profile,
            workload,
            fixed: overrides.sp.is_some(),
            tried: &tried,
            sp: plan.sp,
            latency: plan.predicted_latency_seconds.unwrap_or_default(),
            bound_met,
        });
        plan.reasons.insert(1.min(plan.reasons.len()), why);
    }
    Ok(plan)
}

/// [`plan_candidates`] with groups of `sp` ranks. Where the pods would decode on the device
/// and no option fits with the decoder there, the pods decode on the host instead (the
/// plan's `decoder` term is then 0, and the operator tells the engine so), and the reasons
/// say why.
fn plan_sp(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    match plan_decoding(candidates, workload, overrides, sp, limits) {
        Err(r) if limits.decode == DecodeSite::Device && r.shortage == Shortage::DeviceMemory => {
            let host = Limits {
                decode: DecodeSite::Host,
                ..*limits
            };
            let mut p = plan_decoding(candidates, workload, overrides, sp, &host)?;
            p.reasons.push(format!(
                "the pods decode on the host's CPU: no option fits with the VAE decoder beside the ranks on the device ({r})"
            ));
            Ok(p)
        }
        r => r,
    }
}

/// [`plan_sp`] with the pods decoding where `limits` says.
fn plan_decoding(
    candidates: &[Candidate],
    workload: &Workload,
    overrides: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    if candidates.is_empty() {
        return Err(Refusal {
            shortage: Shortage::NoNodes,
            node: None,
            needed: 1,
            available: 0,
            option: "no node matches the node selector, offers the accelerator and has reported a profile".into(),
        });
    }
    let sites = sites(candidates, workload, sp, limits)?;
    let search = Search::new(overrides, limits);
    let mut misses: Vec<Miss> = Vec::new();
    let Some(best) = search.best(&sites, sp, &mut misses) else {
        return Err(refusal(misses));
    };
    let latency = sites[best.site].latency(&best.option);
    let chosen = Chosen::new(&sites, best.option, best.site, limits);
    let reasons = search.reasons(
        &chosen,
        best.notes,
        best.timed.as_ref(),
        &sites[best.site].node.rates_from,
        candidates.len(),
    );
    let (resident_blocks, resident_blocks_by_component) = chosen.option.kept_blocks();
    let rejected = rejected(chosen.option.strategy, &misses);
    let n = chosen.need;
    Ok(Plan {
        components: components(&chosen.option, chosen.profile),
        strategy: chosen.option.strategy,
        dp: chosen.option.dp,
        sp: chosen.option.sp,
        predicted_latency_seconds: Some((latency * 1e3).round() / 1e3),
        latency_bound_met: None,
        resource_claim_template: None,
        slots: chosen.option.k,
        fast_peer_link: chosen.fits.iter().all(|(site, _)| site.node.fast_peer_link),
        device_bytes_per_rank: device_total(&n.device),
        host_bytes_per_pod: n.host_per_pod,
        host_bytes_per_node: n.host_shared,
        resident_blocks,
        resident_blocks_by_component,
        device_breakdown: n.device,
        nodes: chosen
            .fits
            .iter()
            .map(|(site, _)| site.node.name.clone())
            .collect(),
        reasons,
        rejected,
    })
}

/// Refuses fixed settings that contradict each other, or that the engine would refuse at
/// start.
fn check_overrides(overrides: &Overrides) -> Result<(), Refusal> {
    if let (
        Some(dp),
        Some(sp),
        StrategyChoice::Fixed(Strategy::Sharded | Strategy::OffloadSharded),
    ) = (overrides.dp, overrides.sp, overrides.strategy)
    {
        if dp.saturating_mul(sp) < 2 {
            return Err(Refusal::invalid(format!(
                "strategy {} needs dp × sp >= 2 ranks per pod, got dp {dp} × sp {sp}",
                overrides.strategy.as_str()
            )));
        }
    }
    if overrides.dp == Some(0) {
        return Err(Refusal::invalid("dp must be at least 1".into()));
    }
    if let Some(sp) = overrides.sp.filter(|&sp| sp == 0 || sp as usize > MAX_SP) {
        return Err(Refusal::invalid(format!(
            "sp {sp}: must be between 1 and {MAX_SP}"
        )));
    }
    let min_slots = layerwise_core::strategy::MIN_STREAMING_SLOTS;
    if let Some(k) = overrides.slots.filter(|k| *k < min_slots) {
        // The engine would refuse to start with fewer: one block computes while the next
        // arrives.
        return Err(Refusal::invalid(format!(
            "slots {k}: streaming strategies need at least {min_slots}"
        )));
    }
    Ok(())
}

/// The sp to try, in order: the spec's, or [`sp_candidates`] up to the most accelerators a
/// candidate has. Refuses an sp above 1 (fixed, or needed for a gathering strategy fixed
/// with dp 1) for a family that does not split its sequence, as the engine refuses it at
/// start.
fn sp_choices(candidates: &[Candidate], overrides: &Overrides) -> Result<Vec<u32>, Refusal> {
    let unsplit = candidates.iter().find(|c| !splits_sequence(c.profile));
    let family = |c: &Candidate| {
        format!(
            "the {} family does not split a request's sequence over ranks (sequence parallelism is for wan and cosmos3; the profile node {} reports declares no all-to-all)",
            c.profile.family, c.node.name
        )
    };
    let gathers = matches!(
        overrides.strategy,
        StrategyChoice::Fixed(Strategy::Sharded | Strategy::OffloadSharded)
    );
    match (overrides.sp, unsplit) {
        (Some(sp), Some(c)) if sp > 1 => Err(Refusal {
            node: Some(c.node.name.clone()),
            ..Refusal::invalid(format!("sp {sp}: {}", family(c)))
        }),
        (None, Some(c)) if gathers && overrides.dp == Some(1) => Err(Refusal {
            node: Some(c.node.name.clone()),
            ..Refusal::invalid(format!(
                "strategy {} with dp 1 needs sp >= 2, and {}",
                overrides.strategy.as_str(),
                family(c)
            ))
        }),
        (Some(sp), _) => Ok(vec![sp]),
        (None, _) => {
            let devices = candidates.iter().map(|c| c.node.devices).max().unwrap_or(1);
            Ok(sp_candidates(devices, unsplit.is_none()))
        }
    }
}

/// Each candidate with what `workload` costs on its profile, or the refusal of the first
/// whose model cannot run the workload: the engine refuses to start with bounds its model
/// cannot run, and so does the plan.
fn sites<'a>(
    candidates: &'a [Candidate],
    workload: &Workload,
    sp: u32,
    limits: &Limits,
) -> Result<Vec<Site<'a>>, Refusal> {
    let bounds = crate::resources::request_bounds(workload);
    let mut sites = Vec::with_capacity(candidates.len());
    for c in candidates {
        if let Some(b) = bounds.beyond(&c.profile.limits) {
            return Err(Refusal {
                node: Some(c.node.name.clone()),
                ..Refusal::invalid(format!("workload.{} {b}", b.dimension.workload_field()))
            });
        }
        if activation_bytes_per_rank(c.profile, workload, sp).is_none() {
            return Err(Refusal::beyond_any_device(
                &c.node,
                format!(
                    "activations of a {}x{}x{} request with batch {}{}",
                    workload.max_width,
                    workload.max_height,
                    workload.max_frames,
                    workload.max_batch,
                    if sp > 1 {
                        format!(" over sp {sp}")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        let Some(decoder) = decoder_bytes(c.profile, workload, limits.decode) else {
            return Err(Refusal::beyond_any_device(
                &c.node,
                format!(
                    "decoding a {}x{} output on the device",
                    workload.max_width, workload.max_height
                ),
            ));
        };
        if c.profile.groups.is_empty() && c.profile.blocks > 0 {
            return Err(Refusal::invalid(format!(
                "the profile of node {} has no per-group block bytes (its agent predates this operator): upgrade the agents",
                c.node.name
            )));
        }
        sites.push(Site {
            node: &c.node,
            profile: c.profile,
            bounds,
            decoder,
            work: Work::at_bounds(&c.profile.activation, &bounds),
            compute: c.profile.group_compute(),
        });
    }
    Ok(sites)
}

/// How the planner ranks the options that fit on different nodes, the least first: the
/// preferred strategy, then the fewest ranks, then the least predicted request time.
fn preference(o: &Option_) -> (usize, u32) {
    (rank(o.strategy), o.dp)
}

/// The best option over every node, with the node it was found on, the notes on the
/// components it keeps or streams, and its predicted time where it streams.
struct Best {
    option: Option_,
    notes: Vec<String>,
    timed: Option<Timed>,
    /// Its index among the sites.
    site: usize,
}

/// What the step-time model said of the chosen option: its prediction, and the request
/// time with one block fewer and one more of each component whose blocks it keeps.
#[derive(Debug, Clone)]
struct Timed {
    choice: Choice,
    /// Per component: (blocks, request seconds with one fewer, with one more where that
    /// fits).
    around: Vec<(String, u64, Option<f64>, Option<f64>)>,
}

/// What one planning pass holds fixed while it searches the options: the spec's settings,
/// the allowances, and the range K grows in.
struct Search<'a> {
    overrides: &'a Overrides,
    limits: &'a Limits,
    /// K to start from; the planner grows it with the memory left once components are
    /// placed.
    k_first: u32,
    /// The most slots K grows to.
    k_cap: u32,
}

impl<'a> Search<'a> {
    fn new(overrides: &'a Overrides, limits: &'a Limits) -> Search<'a> {
        let k_first = overrides.slots.unwrap_or(limits.min_slots.max(1));
        Search {
            overrides,
            limits,
            k_first,
            k_cap: limits.max_slots.max(k_first),
        }
    }

    /// The best of each node's first option with groups of `sp` ranks that fits, by
    /// [`preference`] and then the predicted request time; every miss on the way goes to
    /// `misses`.
    fn best(&self, sites: &[Site], sp: u32, misses: &mut Vec<Miss>) -> Option<Best> {
        let mut best: Option<Best> = None;
        for (si, site) in sites.iter().enumerate() {
            let Some((option, notes, timed)) = self.first_fit(site, sp, misses) else {
                continue;
            };
            let time = |t: &Option<Timed>| t.as_ref().map_or(0.0, |t| t.choice.prediction.request);
            let better = best.as_ref().is_none_or(|b| {
                (preference(&option), time(&timed)) < (preference(&b.option), time(&b.timed))
            });
            if better {
                best = Some(Best {
                    option,
                    notes,
                    timed,
                    site: si,
                });
            }
        }
        best
    }

    /// The first of [`options_for`] `site` that fits it, with the components, K and
    /// blocks kept chosen by predicted time where it streams ([`Self::by_time`]), and
    /// what was decided about each component; every miss goes to `misses`.
    fn first_fit(
        &self,
        site: &Site,
        sp: u32,
        misses: &mut Vec<Miss>,
    ) -> Option<(Option_, Vec<String>, Option<Timed>)> {
        for (strategy, dp) in options_for(site.node, self.overrides, sp, self.limits) {
            let k = if strategy.streams() { self.k_first } else { 0 };
            let opt = Option_::new(strategy, dp, sp, k);
            if let Err(m) = check(site, &opt, self.limits) {
                misses.push(m);
                continue;
            }
            if !strategy.streams() {
                return Some((opt, Vec::new(), None));
            }
            let (opt, notes, timed) = self.by_time(site, opt);
            return Some((opt, notes, Some(timed)));
        }
        None
    }

    /// For `opt`'s strategy and dp: the components kept whole, K (unless the spec fixes
    /// it) and the blocks kept of each streamed component with the least predicted
    /// request time ([`timing::choose`]) among those that fit, ties within
    /// [`timing::TIE_TOLERANCE`] going to the fewest device bytes. The notes say why each
    /// candidate component is kept or streams.
    fn by_time(&self, site: &Site, opt: Option_) -> (Option_, Vec<String>, Timed) {
        let profile = site.profile;
        let candidates = residency_candidates(profile);
        let ks: Vec<u32> = match self.overrides.slots {
            Some(k) => vec![k],
            None => (self.k_first..=self.k_cap).collect(),
        };
        // Every subset of the candidates (pipeline order, a handful at most) with every K.
        let subsets: Vec<Vec<String>> = (0u32..1 << candidates.len().min(4))
            .map(|mask| {
                candidates
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| c.clone())
                    .collect()
            })
            .collect();
        let mut found: Vec<(Option_, Choice)> = Vec::new();
        let mut misses: BTreeMap<String, Miss> = BTreeMap::new();
        for resident in &subsets {
            for &k in &ks {
                let base = Option_ {
                    resident: resident.clone(),
                    k,
                    ..opt.clone()
                };
                let fits = |p: &Placement| {
                    check_placement(site, &base, p, self.limits)
                        .ok()
                        .map(|n| device_total(&n.device))
                };
                let placement = base.placement(profile);
                match timing::choose(
                    &profile.groups,
                    &site.compute,
                    &site.work(base.sp),
                    &placement,
                    &site.node.rates,
                    &fits,
                ) {
                    Some(choice) => {
                        let chosen = Option_ {
                            kept: choice.kept.clone(),
                            ..base
                        };
                        found.push((chosen, choice));
                    }
                    None => {
                        if let (Err(m), [c]) = (check(site, &base, self.limits), &resident[..]) {
                            misses.entry(c.clone()).or_insert(m);
                        }
                    }
                }
            }
        }
        let picked = timing::pick(found.iter().map(|(_, c)| c.clone()))
            .expect("the option fits with nothing kept");
        let (chosen, choice) = found
            .iter()
            .find(|(_, c)| *c == picked)
            .cloned()
            .expect("picked among them");
        let notes = candidates
            .iter()
            .map(|c| component_note(c, &chosen, &choice, &found, misses.get(c)))
            .collect();
        let around = self.around(site, &chosen);
        (chosen, notes, Timed { choice, around })
    }

    /// Per component whose blocks `chosen` keeps: the predicted request time with one
    /// block fewer, and with one more where that fits.
    fn around(
        &self,
        site: &Site,
        chosen: &Option_,
    ) -> Vec<(String, u64, Option<f64>, Option<f64>)> {
        let time = |o: &Option_| site.latency(o);
        chosen
            .kept
            .iter()
            .map(|(c, &n)| {
                let with = |m: u64| {
                    let mut o = chosen.clone();
                    o.kept.insert(c.clone(), m);
                    o
                };
                let fewer = (n > 0).then(|| time(&with(n - 1)));
                let more = with(n + 1);
                let more = (more.placement(site.profile).streams(&site.profile.groups)
                    && check(site, &more, self.limits).is_ok())
                .then(|| time(&more));
                (c.clone(), n, fewer, more)
            })
            .collect()
    }

    /// Why the plan is what it is: its memory, the copies of the model it holds, its
    /// strategy, its predicted time (`timed`, at rates from `rates_from`), what it keeps
    /// on the device (with the search's `notes` on each component), its slots, the nodes
    /// it fits of `candidates`, and whether the spec fixed it.
    fn reasons(
        &self,
        chosen: &Chosen,
        notes: Vec<String>,
        timed: Option<&Timed>,
        rates_from: &str,
        candidates: usize,
    ) -> Vec<String> {
        let o = &chosen.option;
        let mut reasons = vec![memory_reason(o, &chosen.need, self.limits.decode)];
        reasons.extend(chosen.copies_reason());
        reasons.push(self.strategy_reason(chosen));
        if let Some(t) = timed {
            reasons.push(timing_reason(
                &t.choice.prediction,
                chosen.site,
                o.sp,
                rates_from,
            ));
        }
        reasons.extend(notes);
        if let Some(t) = timed {
            reasons.extend(kept_blocks_reason(t, chosen.profile));
        }
        reasons.extend(self.slots_reason(o));
        let fit_names: Vec<&str> = chosen
            .fits
            .iter()
            .map(|(site, _)| site.node.name.as_str())
            .collect();
        reasons.push(format!(
            "fits {} of {} candidate nodes: {}",
            fit_names.len(),
            candidates,
            fit_names.join(", ")
        ));
        if self.overrides.strategy != StrategyChoice::Auto
            || self.overrides.dp.is_some()
            || self.overrides.sp.is_some()
            || self.overrides.slots.is_some()
        {
            reasons.push("strategy, dp, sp or slots fixed by the spec".into());
        }
        reasons
    }

    /// Why the chosen strategy: for `sharded`, whether fewer ranks would fit too.
    fn strategy_reason(&self, chosen: &Chosen) -> String {
        let o = &chosen.option;
        match o.strategy {
            Strategy::Resident => {
                "the whole model and activations fit one device: nothing moves per step".into()
            }
            Strategy::Sharded => {
                let least = if o.sp >= 2 { 1 } else { 2 };
                let fewest = (least..o.dp).find(|&dp| {
                    let fewer = Option_::new(o.strategy, dp, o.sp, self.k_first);
                    chosen
                        .fits
                        .iter()
                        .any(|(site, _)| check(site, &fewer, self.limits).is_ok())
                });
                match (fewest, self.overrides.dp) {
                    (Some(dp), None) => format!(
                        "1/{} of the blocks plus slots fit each device; {} ranks would fit too, but {} divides the node's accelerators, so its pods leave none idle",
                        o.ranks(),
                        dp * o.sp,
                        o.ranks()
                    ),
                    _ => format!(
                        "1/{} of the blocks plus slots fit each device; the fewest ranks that fit",
                        o.ranks()
                    ),
                }
            }
            Strategy::OffloadSharded => format!(
                "weights stream from the host, each of {} ranks copies 1/{} of a block and all-gathers",
                o.ranks(),
                o.ranks()
            ),
            Strategy::Offload => {
                "weights stream from the host, each rank copies whole blocks".into()
            }
        }
    }

    /// How many slots a streaming plan got, where the spec left them to the planner.
    fn slots_reason(&self, o: &Option_) -> Option<String> {
        if !o.strategy.streams() || self.overrides.slots.is_some() {
            return None;
        }
        Some(if o.k > self.limits.min_slots {
            format!(
                "{} slots (cap {}): they predict a shorter request than fewer, by more than the tie",
                o.k, self.limits.max_slots
            )
        } else {
            format!(
                "{} slots: more predict no shorter request (or do not fit), so their memory stays free",
                o.k
            )
        })
    }
}

/// The chosen option and the nodes it fits, each sized with its own profile. The plan holds
/// the most any of them needs (they differ only if their agents report different copies of
/// the model).
struct Chosen<'s, 'a> {
    option: Option_,
    /// The profile of the node the option was chosen on.
    profile: &'a Profile,
    /// The node the option was chosen on.
    site: &'s Site<'a>,
    /// Every node the option fits, with what it needs there.
    fits: Vec<(&'s Site<'a>, Need)>,
    /// The node that needs the most, and its need: the plan's figures.
    largest: &'s Site<'a>,
    need: Need,
}

impl<'s, 'a> Chosen<'s, 'a> {
    /// `option`, chosen on `sites[site]`, over every one of `sites` it fits.
    fn new(sites: &'s [Site<'a>], option: Option_, site: usize, limits: &Limits) -> Self {
        let fits: Vec<(&Site, Need)> = sites
            .iter()
            .filter_map(|site| check(site, &option, limits).ok().map(|n| (site, n)))
            .collect();
        let (largest, need) = fits
            .iter()
            .max_by_key(|(_, n)| (device_total(&n.device), n.host_per_pod, n.host_shared))
            .map(|(site, n)| (*site, n.clone()))
            .expect("the chosen option fits its own node");
        Chosen {
            option,
            profile: sites[site].profile,
            site: &sites[site],
            fits,
            largest,
            need,
        }
    }

    /// Where the nodes report different copies of the model, which ones and which the plan
    /// holds.
    fn copies_reason(&self) -> Option<String> {
        let mut copies: Vec<(u64, &str)> = self
            .fits
            .iter()
            .map(|(site, _)| (site.profile.total_bytes, site.node.name.as_str()))
            .collect();
        copies.sort();
        copies.dedup_by_key(|(b, _)| *b);
        (copies.len() > 1).then(|| {
            format!(
                "the nodes report different copies of the model ({}): the plan holds the largest, {}",
                copies
                    .iter()
                    .map(|(b, name)| format!("{:.2} GiB on {name}", *b as f64 / GIB))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.largest.node.name
            )
        })
    }
}

/// What the search found of each sp, for [`sp_reason`].
struct SpOutcome<'s> {
    /// The profile of a node the plan fits.
    profile: &'s Profile,
    workload: &'s Workload,
    /// Whether the spec fixed sp.
    fixed: bool,
    /// Each sp tried, in order: its predicted latency, or why nothing fit.
    tried: &'s [(u32, Result<f64, Refusal>)],
    /// The plan's sp and predicted latency.
    sp: u32,
    latency: f64,
    /// Whether the latency meets the workload's bound (true where it sets none).
    bound_met: bool,
}

/// Why the plan splits each request over the ranks it does: the activations per rank on
/// one device and on the chosen sp, the latency against the bound, and what the smaller
/// sp gave.
fn sp_reason(o: &SpOutcome) -> String {
    let w = o.workload;
    let gib = |b: Option<u64>| {
        b.map_or("more than any device holds".into(), |b| {
            format!("{:.2} GiB", b as f64 / GIB)
        })
    };
    let request = format!(
        "a {}x{}x{} request",
        w.max_width, w.max_height, w.max_frames
    );
    let act = |sp| activation_bytes_per_rank(o.profile, w, sp);
    let (one, per_rank) = (act(1), act(o.sp));
    let bound = w.max_latency_seconds;
    let against = bound.map_or(String::new(), |b| {
        format!(
            "; it predicts {} a request against maxLatencySeconds {b}",
            secs(o.latency)
        )
    });
    let mut out = format!("sp {}: ", o.sp);
    if !splits_sequence(o.profile) {
        out += &format!(
            "the {} family does not split a request's sequence over ranks (sequence parallelism is for wan and cosmos3), so each request runs on one rank; {request} needs {} of activations{against}",
            o.profile.family,
            gib(one)
        );
    } else if o.sp == 1 {
        out += &format!(
            "{request}'s {} of activations fit one device beside the weights{against}",
            gib(one)
        );
        if o.fixed {
            out += " (sp fixed by the spec)";
        }
    } else {
        out += &format!(
            "{request} needs {} of activations on one device; {} per rank with sp {} fits{against}",
            gib(one),
            gib(per_rank),
            o.sp
        );
        if o.fixed {
            out += " (sp fixed by the spec)";
        }
    }
    let smaller: Vec<String> = o
        .tried
        .iter()
        .filter(|(sp, _)| *sp != o.sp)
        .map(|(sp, r)| match r {
            Ok(t) => format!("sp {sp} predicts {}", secs(*t)),
            Err(e) => format!(
                "sp {sp} does not fit ({} of activations per rank; {e})",
                gib(act(*sp))
            ),
        })
        .collect();
    if !smaller.is_empty() {
        out += &format!("; {}", smaller.join("; "));
    }
    if let (Some(b), false) = (bound, o.bound_met) {
        out += &format!(
            "; no sp that fits meets maxLatencySeconds {b}: the fastest, sp {}, is planned (predicted {})",
            o.sp,
            secs(o.latency)
        );
    }
    if o.sp > 1 {
        out += &format!(
            "; the profile carries no attention-head count, so the engine checks at start that the transformer has at least {} heads (cosmos3: key/value heads) and refuses to start otherwise",
            o.sp
        );
    }
    out
}

/// What `o` needs (`n`) per rank, term by term, and per pod and node on the host, with the
/// pods decoding at `decode`.
fn memory_reason(o: &Option_, n: &Need, decode: DecodeSite) -> String {
    format!(
        "{o}: {:.2} GiB per rank (block weights {:.2}, slots {:.2}, resident {:.2}, activations {:.2}, overhead {:.2}, decoder {:.2} decoding on the {}), {:.2} GiB host per pod beside the model's {:.2} GiB page-cache copy that the pods of a node share",
        device_total(&n.device) as f64 / GIB,
        n.device.block_weights as f64 / GIB,
        n.device.slots as f64 / GIB,
        n.device.resident_weights as f64 / GIB,
        n.device.activations as f64 / GIB,
        n.device.overhead as f64 / GIB,
        n.device.decoder as f64 / GIB,
        decode,
        n.host_per_pod as f64 / GIB,
        n.host_shared as f64 / GIB
    )
}

/// Seconds as the reasons print them.
fn secs(t: f64) -> String {
    if t < 1.0 {
        format!("{:.0} ms", t * 1e3)
    } else {
        format!("{t:.2} s")
    }
}

/// What the step-time model predicts of the plan on `site` at rates from `rates_from`:
/// per step, compute against copy and what of the copy is exposed; each per-request
/// group's pass; the request.
fn timing_reason(p: &Prediction, site: &Site, sp: u32, rates_from: &str) -> String {
    let r = &site.node.rates;
    let w = &site.work(sp);
    let split = if sp > 1 {
        format!(
            ", each of {sp} ranks computing {} of them",
            layerwise_core::topology::largest_share(w.tokens, u64::from(sp))
        )
    } else {
        String::new()
    };
    let hidden = if p.step_exposed <= 1e-3 * p.step.max(1e-9) {
        "every streamed copy hides behind compute".to_string()
    } else {
        format!(
            "{} of copy per step is exposed (the copies outrun the compute)",
            secs(p.step_exposed)
        )
    };
    let once: Vec<String> = p
        .groups
        .iter()
        .filter(|g| g.runs == timing::Runs::PerRequest)
        .map(|g| {
            format!(
                "{} once per request computes {}, copies {}, {} exposed",
                g.component,
                secs(g.compute),
                secs(g.copy),
                secs(g.exposed)
            )
        })
        .collect();
    format!(
        "predicted at {rates_from} ({:.0} TFLOP/s, {:.0} GB/s host to device, {:.0} GB/s between peers) for a request at the bounds ({} latent tokens x {} samples{split}, {} steps): a step computes {} and copies {} per rank, so {hidden}{}; a request {}",
        r.device_flops / 1e12,
        r.host_to_device / 1e9,
        r.peer / 1e9,
        w.tokens,
        w.samples,
        w.steps,
        secs(p.step_compute),
        secs(p.step_copy),
        if once.is_empty() {
            String::new()
        } else {
            format!("; {}", once.join("; "))
        },
        secs(p.request)
    )
}

/// Why `c` stays whole or streams under `chosen` (predicted as `choice`): against the
/// best of `found` that does the other, or what keeping it whole would need (`miss`).
fn component_note(
    c: &str,
    chosen: &Option_,
    choice: &Choice,
    found: &[(Option_, Choice)],
    miss: Option<&Miss>,
) -> String {
    let kept = chosen.resident.iter().any(|r| r == c);
    let other = timing::pick(
        found
            .iter()
            .filter(|(o, _)| o.resident.iter().any(|r| r == c) != kept)
            .map(|(_, ch)| ch.clone()),
    );
    let (t, gib) = (choice.prediction.request, |b: u64| b as f64 / GIB);
    match (kept, other, miss) {
        (true, Some(o), _) => format!(
            "{c} stays whole on every device (copied once at start, never streamed): a request predicts {} against {} streaming it",
            secs(t),
            secs(o.prediction.request)
        ),
        (true, None, _) => format!(
            "{c} stays whole on every device (copied once at start, never streamed): it fits beside the slots"
        ),
        (false, Some(o), _) if o.prediction.request <= t * (1.0 + timing::TIE_TOLERANCE) => format!(
            "{c} streams: keeping it whole ({:.2} GiB more per rank) predicts {} a request against {}, within the {:.0}% tie, so its memory stays free",
            gib(o.device_bytes.saturating_sub(choice.device_bytes)),
            secs(o.prediction.request),
            secs(t),
            100.0 * timing::TIE_TOLERANCE
        ),
        (false, Some(o), _) => format!(
            "{c} streams: kept whole it predicts {} a request against {}: its memory saves more holding other blocks",
            secs(o.prediction.request),
            secs(t)
        ),
        (false, None, Some(m)) => format!(
            "{c} streams: keeping it whole needs {} bytes per rank, the device has {}",
            m.needed, m.available
        ),
        (false, None, None) => format!("{c} streams: keeping it whole does not fit"),
    }
}

/// Why each streamed component keeps the blocks it does: the predicted request time
/// with one fewer and one more.
fn kept_blocks_reason(t: &Timed, profile: &Profile) -> Vec<String> {
    let now = t.choice.prediction.request;
    t.around
        .iter()
        .map(|(c, n, fewer, more)| {
            let blocks = profile
                .groups
                .iter()
                .filter(|g| g.component == *c)
                .map(|g| g.blocks())
                .max()
                .unwrap_or(0);
            let fewer = fewer.map_or(String::new(), |f| {
                format!(", one fewer predicts {} more per request", secs(f - now))
            });
            let more = match more {
                None => "one more does not fit".to_string(),
                Some(m) if now - m <= 1e-6 * now => {
                    "one more saves nothing (the remaining copies hide behind compute)".into()
                }
                Some(m) => format!(
                    "one more saves {} per request, within the {:.0}% tie, so its memory stays free",
                    secs(now - m),
                    100.0 * timing::TIE_TOLERANCE
                ),
            };
            if *n == 0 {
                format!("no block of {c}'s {blocks} stays on the device: {more}")
            } else {
                format!(
                    "{n} of {c}'s {blocks} blocks stay on the device, spread evenly (copied once, never streamed){fewer}; {more}"
                )
            }
        })
        .collect()
}

/// Why the strategies other than `chosen` lost: for each better-ranked one the closest of
/// its `misses`, for each worse one what it costs.
fn rejected(chosen: Strategy, misses: &[Miss]) -> Vec<String> {
    let mut rejected = Vec::new();
    for s in PREFERENCE {
        if s == chosen {
            continue;
        }
        if rank(s) < rank(chosen) {
            let closest = misses
                .iter()
                .filter(|m| m.option.strategy == s)
                .min_by_key(|m| m.needed.saturating_sub(m.available));
            match closest {
                Some(m) => rejected.push(format!("{}: {}", s.as_str(), refusal(vec![m.clone()]))),
                None => rejected.push(format!(
                    "{}: not applicable to these nodes or settings",
                    s.as_str()
                )),
            }
        } else {
            rejected.push(format!(
                "{}: moves more data per step than {}",
                s.as_str(),
                chosen.as_str()
            ));
        }
    }
    rejected
}

/// Each component of `profile` under `o`: kept whole or streamed, and its block bytes over
/// all its groups.
fn components(o: &Option_, profile: &Profile) -> Vec<ComponentPlan> {
    let groups = o.resident_groups(profile);
    let mut components: Vec<ComponentPlan> = Vec::new();
    for (g, resident) in profile.groups.iter().zip(groups) {
        let placement = if resident || o.strategy == Strategy::Resident {
            ComponentPlacement::Resident
        } else {
            ComponentPlacement::Streamed
        };
        match components.iter_mut().find(|c| c.name == g.component) {
            Some(c) => c.block_bytes += g.bytes(),
            None => components.push(ComponentPlan {
                name: g.component.clone(),
                placement,
                block_bytes: g.bytes(),
            }),
        }
    }
    components
}

/// The refusal for a set of misses: from the option that got furthest (host memory is
/// checked after accelerators and device memory passed), the one closest to fitting.
fn refusal(misses: Vec<Miss>) -> Refusal {
    let stage = |s: Shortage| match s {
        Shortage::HostMemory => 0,
        Shortage::DeviceMemory => 1,
        _ => 2,
    };
    let pick = misses
        .iter()
        .min_by_key(|m| (stage(m.shortage), m.needed.saturating_sub(m.available)));
    match pick {
        Some(m) => Refusal {
            shortage: m.shortage,
            node: Some(m.node.clone()),
            needed: m.needed,
            available: m.available,
            option: m.option.to_string(),
        },
        None => Refusal {
            shortage: Shortage::Spec,
            node: None,
            needed: 0,
            available: 0,
            option: "no strategy applies to these nodes with the fixed settings".into(),
        },
    }
}

#[cfg(test)]
#[path = "planner_tests.rs"]
mod tests;
