//! Refusals: why no plan fits (the resource that falls short, on which node, by how much),
//! and the fixed settings the planner refuses before it searches, as the engine would refuse
//! them at start.

use std::fmt;

use crds::{Strategy, StrategyChoice, Workload};
use layerwise_core::topology::MAX_SP;

use super::inputs::{NodeShape, Overrides};
use super::need::GIB;

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

    /// Of `refusals`, the one that got furthest (host memory is checked after accelerators
    /// and device memory passed), closest to fitting; the first of those.
    pub(super) fn furthest(refusals: impl IntoIterator<Item = Refusal>) -> Option<Refusal> {
        let stage = |s: Shortage| match s {
            Shortage::HostMemory => 0,
            Shortage::DeviceMemory => 1,
            _ => 2,
        };
        refusals
            .into_iter()
            .min_by_key(|r| (stage(r.shortage), r.shortfall()))
    }

    /// This refusal as the `Planned` condition states it for requests up to `w`.
    pub fn for_workload(&self, w: &Workload) -> String {
        format!(
            "cannot serve {}x{}x{} (batch {}) requests: {self}",
            w.max_width, w.max_height, w.max_frames, w.max_batch
        )
    }

    /// A refusal of settings that contradict each other or what the engine accepts.
    pub(super) fn invalid(why: String) -> Refusal {
        Refusal {
            shortage: Shortage::Spec,
            node: None,
            needed: 0,
            available: 0,
            option: why,
        }
    }

    /// A refusal of a figure that overflows on `node`: more than any device holds.
    pub(super) fn beyond_any_device(node: &NodeShape, what: String) -> Refusal {
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

/// Refuses fixed settings that contradict each other, or that the engine would refuse at
/// start.
pub(super) fn check_overrides(overrides: &Overrides) -> Result<(), Refusal> {
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
