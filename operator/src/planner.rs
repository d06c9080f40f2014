//! The planner: a pure function from a checkpoint profile, the candidate nodes' shapes and the
//! workload bounds (plus any fixed strategy, dp or slots) to a plan or a refusal.
//!
//! Memory is counted per rank on the device (block weights kept there, K slots of one padded
//! block, prologue/epilogue and VAE, activations of the largest allowed request, runtime
//! overhead) and per pod on the host (one copy of the model, mapped, plus pinned staging
//! buffers for the offload strategies, plus runtime). Slot sizes and activation cost come
//! from the engine's [`Profile`], so there is one formula. A plan is only ever recorded for
//! nodes it fits; a refusal names the resource that falls short and by how many bytes.

use std::fmt;

use crds::{
    DiffusionDeploymentSpec, MemoryBreakdown, Plan, PlannedStrategy, Profile, Strategy, Workload,
};

const GIB: f64 = (1u64 << 30) as f64;

/// One candidate node as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// What the spec fixes; `Strategy::Auto` and `None` leave the choice to the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overrides {
    pub strategy: Strategy,
    pub dp: Option<u32>,
    pub slots: Option<u32>,
}

impl Overrides {
    /// What `spec` fixes.
    pub fn of(spec: &DiffusionDeploymentSpec) -> Overrides {
        Overrides {
            strategy: spec.strategy,
            dp: spec.dp,
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
    /// The most ranks per pod the planner chooses on its own.
    pub max_dp: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            device_overhead: 1 << 30,
            host_overhead: 2 << 30,
            min_slots: layerwise_engine::strategy::MIN_STREAMING_SLOTS,
            max_slots: 4,
            max_dp: 8,
        }
    }
}

impl Limits {
    /// These allowances, with what `spec` sets in their place (its device overhead).
    pub fn for_spec(self, spec: &DiffusionDeploymentSpec) -> Limits {
        Limits {
            device_overhead: spec
                .engine
                .device_overhead_bytes
                .unwrap_or(self.device_overhead),
            ..self
        }
    }
}

/// The resource a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortage {
    /// No node offers the accelerator (or matches the selector).
    NoNodes,
    /// Fewer accelerators on every node than the plan's dp.
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
                    "host memory per pod"
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
}

/// Peak activation bytes for the largest allowed request, or `None` when the engine's formula
/// would overflow (a request no device could hold).
pub fn activation_bytes(profile: &Profile, w: &Workload) -> Option<u64> {
    profile.activation.checked_bytes(
        w.max_width,
        w.max_height,
        w.max_frames,
        w.max_batch,
        w.guidance,
    )
}

/// Device bytes per rank and host bytes per pod for one option.
pub fn need(
    profile: &Profile,
    activations: u64,
    strategy: PlannedStrategy,
    dp: u32,
    k: u32,
    limits: &Limits,
) -> Need {
    let dp64 = u64::from(dp.max(1));
    let k64 = u64::from(k);
    let blocks = profile.blocks as u64;
    let all_blocks: u64 = profile.block_bytes.iter().sum();
    let (block_weights, slots, pinned) = match strategy {
        PlannedStrategy::Resident => (all_blocks, 0, 0),
        // Every rank keeps its 1/dp of every (padded) block, and gathers into K full slots.
        PlannedStrategy::Sharded => {
            let slot = profile.slot_bytes(dp64);
            (
                blocks.saturating_mul(slot.div_ceil(dp64)),
                k64.saturating_mul(slot),
                0,
            )
        }
        // Every rank copies whole blocks from pinned staging into its K slots.
        PlannedStrategy::Offload => {
            let slot = profile.slot_bytes(1);
            (
                0,
                k64.saturating_mul(slot),
                dp64.saturating_mul(k64).saturating_mul(slot),
            )
        }
        // Every rank copies its 1/dp into a slot, then all-gathers the rest.
        PlannedStrategy::OffloadSharded => {
            let slot = profile.slot_bytes(dp64);
            (0, k64.saturating_mul(slot), k64.saturating_mul(slot))
        }
    };
    let device = MemoryBreakdown {
        block_weights,
        slots,
        resident_weights: profile
            .outside_block_bytes
            .saturating_add(profile.vae_bytes),
        activations,
        overhead: limits.device_overhead,
    };
    let host_per_pod = profile
        .total_bytes
        .saturating_add(pinned)
        .saturating_add(limits.host_overhead);
    Need {
        device,
        host_per_pod,
    }
}

fn device_total(b: &MemoryBreakdown) -> u64 {
    [
        b.block_weights,
        b.slots,
        b.resident_weights,
        b.activations,
        b.overhead,
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add)
}

/// One (strategy, dp, K) the planner may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Option_ {
    strategy: PlannedStrategy,
    dp: u32,
    k: u32,
}

impl fmt::Display for Option_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.strategy.uses_slots() {
            write!(
                f,
                "{} with dp={} and {} slots",
                self.strategy.as_str(),
                self.dp,
                self.k
            )
        } else {
            write!(f, "{} with dp={}", self.strategy.as_str(), self.dp)
        }
    }
}

/// Strategies in the order the planner prefers them: nothing moves, then only peers talk,
/// then the host feeds all-gathering ranks, then every rank copies whole blocks.
const PREFERENCE: [PlannedStrategy; 4] = PlannedStrategy::ALL;

fn rank(s: PlannedStrategy) -> usize {
    PREFERENCE
        .iter()
        .position(|p| *p == s)
        .unwrap_or(PREFERENCE.len())
}

/// The (strategy, dp) pairs to try on `node`, best first; each is then tried with K from the
/// cap down.
fn candidates(node: &NodeShape, o: &Overrides, limits: &Limits) -> Vec<(PlannedStrategy, u32)> {
    let max_dp = node.devices.min(limits.max_dp).max(1);
    let strategies: Vec<PlannedStrategy> = match o.strategy {
        Strategy::Auto => PREFERENCE.to_vec(),
        Strategy::Resident => vec![PlannedStrategy::Resident],
        Strategy::Sharded => vec![PlannedStrategy::Sharded],
        Strategy::Offload => vec![PlannedStrategy::Offload],
        Strategy::OffloadSharded => vec![PlannedStrategy::OffloadSharded],
    };
    let mut out = Vec::new();
    for s in strategies {
        let auto = o.strategy == Strategy::Auto;
        match (s, o.dp) {
            (_, Some(dp)) => {
                let gathers = matches!(
                    s,
                    PlannedStrategy::Sharded | PlannedStrategy::OffloadSharded
                );
                // In auto mode offload-sharded needs a fast peer link; without it (or with
                // one rank) every rank copies whole blocks instead.
                if gathers && dp < 2 {
                    continue;
                }
                if auto && s == PlannedStrategy::OffloadSharded && !node.fast_peer_link {
                    continue;
                }
                if auto && s == PlannedStrategy::Offload && dp >= 2 && node.fast_peer_link {
                    // offload-sharded moves 1/dp per rank for the same memory: always better.
                    continue;
                }
                out.push((s, dp));
            }
            (PlannedStrategy::Resident | PlannedStrategy::Offload, None) => out.push((s, 1)),
            // The fewest ranks whose shards fit: each extra rank is an accelerator taken.
            (PlannedStrategy::Sharded, None) => out.extend((2..=max_dp).map(|dp| (s, dp))),
            // Memory per rank does not shrink with dp here, but copy traffic per rank does:
            // use every accelerator of the node (up to the cap).
            (PlannedStrategy::OffloadSharded, None) => {
                if max_dp >= 2 && (node.fast_peer_link || !auto) {
                    out.push((s, max_dp));
                }
            }
        }
    }
    out
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
fn check(
    profile: &Profile,
    act: u64,
    node: &NodeShape,
    opt: Option_,
    limits: &Limits,
) -> Result<Need, Miss> {
    let miss = |shortage, needed, available| Miss {
        shortage,
        node: node.name.clone(),
        needed,
        available,
        option: opt,
    };
    if opt.dp > node.devices {
        return Err(miss(
            Shortage::Accelerators,
            u64::from(opt.dp),
            u64::from(node.devices),
        ));
    }
    let n = need(profile, act, opt.strategy, opt.dp, opt.k, limits);
    let dev = device_total(&n.device);
    if dev > node.device_bytes {
        return Err(miss(Shortage::DeviceMemory, dev, node.device_bytes));
    }
    if n.host_per_pod > node.host_bytes {
        return Err(miss(Shortage::HostMemory, n.host_per_pod, node.host_bytes));
    }
    Ok(n)
}

/// Plans one replica of `profile` on the best of `nodes` for requests up to `workload`.
pub fn plan(
    profile: &Profile,
    nodes: &[NodeShape],
    workload: &Workload,
    overrides: &Overrides,
    limits: &Limits,
) -> Result<Plan, Refusal> {
    let spec_refusal = |why: String| Refusal {
        shortage: Shortage::Spec,
        node: None,
        needed: 0,
        available: 0,
        option: why,
    };
    if nodes.is_empty() {
        return Err(Refusal {
            shortage: Shortage::NoNodes,
            node: None,
            needed: 1,
            available: 0,
            option: "no node matches the node selector, offers the accelerator and has reported a profile".into(),
        });
    }
    if let (Some(dp), Strategy::Sharded | Strategy::OffloadSharded) =
        (overrides.dp, overrides.strategy)
    {
        if dp < 2 {
            return Err(spec_refusal(format!(
                "strategy {:?} needs dp >= 2, got {dp}",
                overrides.strategy
            )));
        }
    }
    if overrides.dp == Some(0) {
        return Err(spec_refusal("dp must be at least 1".into()));
    }
    let min_slots = layerwise_engine::strategy::MIN_STREAMING_SLOTS;
    if let Some(k) = overrides.slots.filter(|k| *k < min_slots) {
        // The engine would refuse to start with fewer: one block computes while the next
        // arrives.
        return Err(spec_refusal(format!(
            "slots {k}: streaming strategies need at least {min_slots}"
        )));
    }
    let Some(act) = activation_bytes(profile, workload) else {
        return Err(Refusal {
            shortage: Shortage::DeviceMemory,
            node: None,
            needed: u64::MAX,
            available: nodes.iter().map(|n| n.device_bytes).max().unwrap_or(0),
            option: format!(
                "activations of a {}x{}x{} request with batch {} (beyond any device)",
                workload.max_width, workload.max_height, workload.max_frames, workload.max_batch
            ),
        });
    };
    let ks: Vec<u32> = match overrides.slots {
        Some(k) => vec![k],
        None => (limits.min_slots.max(1)..=limits.max_slots.max(limits.min_slots.max(1)))
            .rev()
            .collect(),
    };

    // Best option per node, and every miss on the way.
    let mut misses: Vec<Miss> = Vec::new();
    let mut best: Option<(Option_, Need)> = None;
    for node in nodes {
        'node: for (strategy, dp) in candidates(node, overrides, limits) {
            let ks_here: &[u32] = if strategy.uses_slots() { &ks } else { &[0] };
            for &k in ks_here {
                let opt = Option_ { strategy, dp, k };
                match check(profile, act, node, opt, limits) {
                    Ok(n) => {
                        let better = match &best {
                            None => true,
                            Some((b, _)) => {
                                (rank(opt.strategy), opt.dp, u32::MAX - opt.k)
                                    < (rank(b.strategy), b.dp, u32::MAX - b.k)
                            }
                        };
                        if better {
                            best = Some((opt, n));
                        }
                        break 'node;
                    }
                    Err(m) => misses.push(m),
                }
            }
        }
    }
    let Some((chosen, n)) = best else {
        return Err(refusal(misses));
    };

    let dev = device_total(&n.device);
    let fitting: Vec<&NodeShape> = nodes
        .iter()
        .filter(|node| check(profile, act, node, chosen, limits).is_ok())
        .collect();
    let fast = fitting.iter().all(|n| n.fast_peer_link);
    let mut reasons = vec![format!(
        "{chosen}: {:.2} GiB per rank (block weights {:.2}, slots {:.2}, resident {:.2}, activations {:.2}, overhead {:.2}) and {:.2} GiB host per pod",
        dev as f64 / GIB,
        n.device.block_weights as f64 / GIB,
        n.device.slots as f64 / GIB,
        n.device.resident_weights as f64 / GIB,
        n.device.activations as f64 / GIB,
        n.device.overhead as f64 / GIB,
        n.host_per_pod as f64 / GIB
    )];
    reasons.push(match chosen.strategy {
        PlannedStrategy::Resident => {
            "the whole model and activations fit one device: nothing moves per step".into()
        }
        PlannedStrategy::Sharded => format!(
            "1/{} of the blocks plus slots fit each device; the fewest ranks that fit",
            chosen.dp
        ),
        PlannedStrategy::OffloadSharded => format!(
            "weights stream from the host, each of {} ranks copies 1/{} of a block and all-gathers",
            chosen.dp, chosen.dp
        ),
        PlannedStrategy::Offload => {
            "weights stream from the host, each rank copies whole blocks".into()
        }
    });
    if chosen.strategy.uses_slots() && overrides.slots.is_none() {
        reasons.push(if chosen.k > limits.min_slots {
            format!(
                "device memory allows {} slots (cap {}), so more blocks are in flight",
                chosen.k, limits.max_slots
            )
        } else {
            format!("{} slots: more do not fit", chosen.k)
        });
    }
    let fit_names: Vec<String> = fitting.iter().map(|n| n.name.clone()).collect();
    reasons.push(format!(
        "fits {} of {} candidate nodes: {}",
        fit_names.len(),
        nodes.len(),
        fit_names.join(", ")
    ));
    if overrides.strategy != Strategy::Auto || overrides.dp.is_some() || overrides.slots.is_some() {
        reasons.push("strategy, dp or slots fixed by the spec".into());
    }

    // Why better-ranked options lost (the closest miss of each), and what worse ones cost.
    let mut rejected = Vec::new();
    for s in PREFERENCE {
        if s == chosen.strategy {
            continue;
        }
        if rank(s) < rank(chosen.strategy) {
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
                chosen.strategy.as_str()
            ));
        }
    }

    Ok(Plan {
        strategy: chosen.strategy,
        dp: chosen.dp,
        slots: chosen.k,
        fast_peer_link: fast,
        device_bytes_per_rank: dev,
        host_bytes_per_pod: n.host_per_pod,
        device_breakdown: n.device,
        nodes: fit_names,
        reasons,
        rejected,
    })
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
