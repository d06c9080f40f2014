//! The candidates: which sp the planner tries, which (strategy, dp) layouts it considers on a
//! node, the options it builds from them, and what the workload costs on each candidate
//! node's profile ([`Site`]). It decides nothing between them; [`super::search`] does.

use std::collections::BTreeMap;
use std::fmt;

use crds::{Profile, Strategy, StrategyChoice, Workload};
use layerwise_core::bounds::RequestBounds;
use layerwise_core::decode::DecoderBytes;
use layerwise_core::memory::Placement;
use layerwise_core::timing::{self, GroupCompute, Work};
use layerwise_core::topology::MAX_SP;

use super::inputs::{Candidate, Limits, NodeShape, Overrides};
use super::need::{activation_bytes_per_rank, compute_element, decoder_bytes};
use super::refusal::Refusal;

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

/// The sp to try, in order: the spec's, or [`sp_candidates`] up to the most accelerators a
/// candidate has. Refuses an sp above 1 (fixed, or needed for a gathering strategy fixed
/// with dp 1) for a family that does not split its sequence, as the engine refuses it at
/// start.
pub(super) fn sp_choices(
    candidates: &[Candidate],
    overrides: &Overrides,
) -> Result<Vec<u32>, Refusal> {
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

/// One (strategy, dp, sp, K, components kept resident, blocks kept) the planner may choose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Option_ {
    pub strategy: Strategy,
    /// Groups: requests served at once.
    pub dp: u32,
    /// Ranks of a group, splitting its request's sequence.
    pub sp: u32,
    pub k: u32,
    /// Components whose blocks stay whole on the device although the strategy streams.
    pub resident: Vec<String>,
    /// Blocks kept on the device of each group of the streamed components named here
    /// (none of the others).
    pub kept: BTreeMap<String, u64>,
}

impl Option_ {
    pub(super) fn new(strategy: Strategy, dp: u32, sp: u32, k: u32) -> Option_ {
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
    pub(super) fn ranks(&self) -> u32 {
        self.dp.max(1).saturating_mul(self.sp.max(1))
    }

    /// Where this option puts `profile`'s weights, for the memory model: sharded over
    /// every rank of the pod.
    pub(super) fn placement(&self, profile: &Profile) -> Placement {
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
    pub(super) fn resident_groups(&self, profile: &Profile) -> Vec<bool> {
        profile
            .groups
            .iter()
            .map(|g| self.resident.contains(&g.component))
            .collect()
    }

    /// The blocks kept, as the plan records them: one count when every streamed component
    /// keeps the same, else per component (the rest keeping none).
    pub(super) fn kept_blocks(&self) -> (u64, BTreeMap<String, u64>) {
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
pub(super) fn residency_candidates(profile: &Profile) -> Vec<String> {
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
pub(super) const PREFERENCE: [Strategy; 4] = [
    Strategy::Resident,
    Strategy::Sharded,
    Strategy::OffloadSharded,
    Strategy::Offload,
];

pub(super) fn rank(s: Strategy) -> usize {
    PREFERENCE
        .iter()
        .position(|p| *p == s)
        .unwrap_or(PREFERENCE.len())
}

/// The (strategy, dp) pairs to try on `node` with groups of `sp` ranks, best first; each is
/// then tried with K from the cap down.
pub(super) fn options_for(
    node: &NodeShape,
    o: &Overrides,
    sp: u32,
    limits: &Limits,
) -> Vec<(Strategy, u32)> {
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
pub(super) struct Site<'a> {
    pub node: &'a NodeShape,
    pub profile: &'a Profile,
    /// The workload's bounds, which activations per rank are counted at.
    pub bounds: RequestBounds,
    pub decoder: DecoderBytes,
    /// The request the step-time model times: the workload at its bounds, on this
    /// profile's tokens (unsplit: [`Site::work`] splits it).
    pub work: Work,
    /// What the workload's step cache holds per sample.
    pub cache: layerwise_core::step_cache::CacheHold,
    /// What each of the profile's groups computes.
    pub compute: Vec<GroupCompute>,
}

impl Site<'_> {
    /// Activation bytes on each rank of a group of `sp`: the engine's formula.
    pub(super) fn act(&self, sp: u32) -> Option<u64> {
        self.bounds.cached_activation_bytes_per_rank(
            &self.profile.activation,
            u64::from(sp),
            self.cache,
            compute_element(self.profile),
        )
    }

    /// The request at the bounds, its sequence split over `sp` ranks.
    pub(super) fn work(&self, sp: u32) -> Work {
        self.work.with_sp(u64::from(sp))
    }

    /// The predicted latency of a request at the bounds under `opt`.
    pub(super) fn latency(&self, opt: &Option_) -> f64 {
        self.prediction(opt).request
    }

    /// What the step-time model predicts of a request at the bounds under `opt`.
    pub(super) fn prediction(&self, opt: &Option_) -> timing::Prediction {
        timing::predict(
            &self.profile.groups,
            &self.compute,
            &self.work(opt.sp),
            &opt.placement(self.profile),
            &self.node.rates,
        )
    }
}

/// Each candidate with what `workload` costs on its profile, or the refusal of the first
/// whose model cannot run the workload: the engine refuses to start with bounds its model
/// cannot run, and so does the plan.
pub(super) fn sites<'a>(
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
            // Under a step cache the steps timed are those it computes.
            work: Work::at_bounds(&c.profile.activation, &bounds).with_computed_share(
                workload
                    .cache
                    .as_ref()
                    .map_or(1.0, |cache| cache.terms(workload.max_steps).1),
            ),
            cache: super::need::cache_hold(workload),
            compute: c.profile.group_compute(),
        });
    }
    Ok(sites)
}
