//! The blocks to keep on the device ([`choose`]): the placements on the way from none to
//! the most that fit, each predicted, and the [`pick`] among them (the least device bytes
//! within [`TIE_TOLERANCE`] of the fastest).

use std::collections::BTreeMap;

use super::predict::{predict, Prediction};
use super::rates::Rates;
use super::work::Work;
use crate::family::GroupCompute;
use crate::memory::{GroupBytes, Placement};

/// What [`choose`] picked: the placement and its prediction, and the device bytes the
/// `fits` check gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub placement: Placement,
    pub prediction: Prediction,
    pub device_bytes: u64,
    /// Per component that streams, the blocks kept of each of its groups.
    pub kept: BTreeMap<String, u64>,
}

/// Request times within this share of the best count as a tie, which goes to the option
/// that leaves the most device memory free: differences this small are below what the
/// model leaves out (prologues, the sampler, the decode, launch gaps).
pub const TIE_TOLERANCE: f64 = 0.02;

/// The blocks to keep of each streamed component of `base` (which fixes the strategy,
/// dp, K and the components kept whole): the counts with the least predicted request
/// time among those `fits` accepts (it returns the rank's device bytes, or `None` where
/// they do not fit), ties within [`TIE_TOLERANCE`] going to the fewest device bytes.
/// `None` when `base` itself does not fit.
///
/// Blocks are added where the next ones save the most time per byte (a component's
/// saving as a function of its count, the others at none; a jump over several blocks
/// counts, as the even spread makes savings come in steps), while they fit and save
/// anything; every point on the way is a candidate.
pub fn choose(
    groups: &[GroupBytes],
    compute: &[GroupCompute],
    work: &Work,
    base: &Placement,
    rates: &Rates,
    fits: &dyn Fn(&Placement) -> Option<u64>,
) -> Option<Choice> {
    let components = streamed_components(groups, base);
    let with = |kept: &BTreeMap<String, u64>| {
        let mut p = base.clone().with_component_blocks(groups, kept);
        p.resident_blocks = 0;
        p
    };
    let evaluate = |kept: &BTreeMap<String, u64>| {
        let p = with(kept);
        if !p.streams(groups) {
            // Keeping every block of every group is the resident strategy, not this.
            return None;
        }
        let bytes = fits(&p)?;
        let prediction = predict(groups, compute, work, &p, rates);
        Some(Choice {
            placement: p,
            prediction,
            device_bytes: bytes,
            kept: kept.clone(),
        })
    };
    let none: BTreeMap<String, u64> = components.iter().map(|(c, _)| (c.clone(), 0)).collect();
    let first = evaluate(&none)?;
    // Each component's request time by its count, the others at none.
    let curves: Vec<Vec<f64>> = components
        .iter()
        .map(|(c, most)| {
            (0..=*most)
                .map(|n| {
                    let mut k = none.clone();
                    k.insert(c.clone(), n);
                    let p = with(&k);
                    predict(groups, compute, work, &p, rates).request
                })
                .collect()
        })
        .collect();
    let mut path = vec![first];
    let mut at: Vec<u64> = vec![0; components.len()];
    loop {
        // The best jump by time saved per block, among the components.
        let mut best: Option<(f64, usize, u64)> = None;
        for (i, curve) in curves.iter().enumerate() {
            let from = at[i] as usize;
            for to in from + 1..curve.len() {
                let saved = curve[from] - curve[to];
                if saved <= 0.0 {
                    continue;
                }
                let rate = saved / (to - from) as f64;
                if best.is_none_or(|(r, _, _)| rate > r) {
                    best = Some((rate, i, to as u64));
                }
            }
        }
        let Some((_, i, to)) = best else { break };
        let mut kept = path.last().expect("first").kept.clone();
        kept.insert(components[i].0.clone(), to);
        match evaluate(&kept) {
            Some(c) => {
                at[i] = to;
                path.push(c);
            }
            // That jump does not fit: no further on this component.
            None => {
                at[i] = curves[i].len() as u64 - 1;
            }
        }
    }
    pick(path)
}

/// The candidate with the least device bytes among those within [`TIE_TOLERANCE`] of
/// the best predicted request time.
pub fn pick(candidates: impl IntoIterator<Item = Choice>) -> Option<Choice> {
    let all: Vec<Choice> = candidates.into_iter().collect();
    let best = all
        .iter()
        .map(|c| c.prediction.request)
        .fold(f64::INFINITY, f64::min);
    all.into_iter()
        .filter(|c| c.prediction.request <= best * (1.0 + TIE_TOLERANCE))
        .min_by(|a, b| {
            a.device_bytes
                .cmp(&b.device_bytes)
                .then(a.prediction.request.total_cmp(&b.prediction.request))
        })
}

/// The components with a group that streams under `base`, each with the most blocks any
/// of its groups has short of all of them (keeping all would make it whole).
fn streamed_components(groups: &[GroupBytes], base: &Placement) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        if base.resident.get(g).copied().unwrap_or(false) || !base.strategy.streams() {
            continue;
        }
        let most = group.blocks().saturating_sub(1) as u64;
        match out.iter_mut().find(|(c, _)| *c == group.component) {
            Some((_, m)) => *m = (*m).max(most),
            None => out.push((group.component.clone(), most)),
        }
    }
    out
}
