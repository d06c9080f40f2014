//! What a request costs under one placement ([`predict`], [`predict_for`]): each group's
//! pass turned into blocks (compute, the all-to-alls of sequence parallelism, the two copy
//! stages by strategy), run through the [`Pipe`], per-request passes once and identical
//! steps three times, the rest extrapolated.

use super::pipe::{Block, Pipe};
use super::rates::Rates;
use super::work::Work;
use crate::family::{GroupCompute, Runs, Tokens};
use crate::memory::{GroupBytes, Placement};
use crate::topology::{largest_share, Topology};
use crate::Strategy;

/// One group's predicted figures per pass.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupTime {
    pub component: String,
    pub runs: Runs,
    /// Passes over it in one request.
    pub passes: u64,
    pub blocks: usize,
    /// Its blocks kept on the device.
    pub kept: u64,
    /// Seconds per pass computing (with the all-to-alls of sequence parallelism),
    /// copying (the slower of its two stages, summed over the streamed blocks), and the
    /// exposed part: the pass's time beyond its compute.
    pub compute: f64,
    pub copy: f64,
    pub exposed: f64,
}

/// What a request costs under one placement.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Per streamed group, in pipeline order.
    pub groups: Vec<GroupTime>,
    /// Seconds of one step in the steady state (every per-step pass of it), and how much
    /// of it is compute, copy and exposed copy.
    pub step: f64,
    pub step_compute: f64,
    pub step_copy: f64,
    pub step_exposed: f64,
    /// Seconds of the whole request's passes: its predicted latency (the time outside
    /// the blocks aside).
    pub request: f64,
}

/// [`predict`] of a request served by one group of `topology`: the request's sequence
/// split over its `sp` ranks, the weights sharded over all `dp × sp` ranks of the process
/// (`p.dp` and `work.sp` are set from it). Its `request` is the predicted latency of one
/// request, which the planner holds against `maxLatencySeconds`.
pub fn predict_for(
    groups: &[GroupBytes],
    compute: &[GroupCompute],
    work: &Work,
    p: &Placement,
    rates: &Rates,
    topology: Topology,
) -> Prediction {
    let p = Placement {
        dp: topology.ranks() as u64,
        ..p.clone()
    };
    predict(
        groups,
        compute,
        &work.with_sp(topology.sp as u64),
        &p,
        rates,
    )
}

/// Predicts a request of `work` under `p` for `groups` (with what each computes,
/// `compute`, in the same order) at `rates`. `p.dp` counts the ranks the weights shard
/// over (every rank of the process), `work.sp` those the request's sequence splits over.
pub fn predict(
    groups: &[GroupBytes],
    compute: &[GroupCompute],
    work: &Work,
    p: &Placement,
    rates: &Rates,
) -> Prediction {
    let passes = pass_blocks(groups, compute, work, p, rates);
    let experts: Vec<usize> = (0..groups.len())
        .filter(|&g| runs(compute, g) == Runs::ExpertSteps)
        .collect();
    let mut pipe = Pipe::new(if p.streams(groups) {
        p.slots as usize
    } else {
        1
    });
    let mut durations = vec![0.0f64; groups.len()];
    let mut request = 0.0f64;
    for (g, blocks) in passes.iter().enumerate() {
        if runs(compute, g) == Runs::PerRequest {
            durations[g] = pipe.pass(blocks);
            request += durations[g];
        }
    }
    // The steps, in runs of identical steps: each expert's share, or all of them.
    let steps = work.steps.max(1);
    let shares: Vec<(Option<usize>, u64)> = if experts.is_empty() {
        vec![(None, steps)]
    } else {
        let e = experts.len() as u64;
        experts
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                let (lo, hi) = (steps * i as u64 / e, steps * (i as u64 + 1) / e);
                (Some(g), hi - lo)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    };
    let mut step_time = 0.0f64;
    for (expert, n) in shares {
        let mut last = 0.0;
        for _ in 0..n.min(3) {
            last = 0.0;
            for (g, blocks) in passes.iter().enumerate() {
                let here = match runs(compute, g) {
                    Runs::PerRequest => false,
                    Runs::PerStep => true,
                    Runs::ExpertSteps => expert == Some(g),
                };
                if here {
                    for _ in 0..work.passes_per_step.max(1) {
                        let d = pipe.pass(blocks);
                        durations[g] = d;
                        last += d;
                    }
                }
            }
            request += last;
        }
        request += n.saturating_sub(3) as f64 * last;
        step_time = step_time.max(last);
    }
    let mut out = Prediction {
        groups: Vec::with_capacity(groups.len()),
        step: step_time,
        step_compute: 0.0,
        step_copy: 0.0,
        step_exposed: 0.0,
        request,
    };
    let mut expert = (0.0f64, 0.0f64, 0.0f64);
    for (g, blocks) in passes.iter().enumerate() {
        let r = runs(compute, g);
        let copy_s: f64 = blocks.iter().map(|b| b.full_copy).sum();
        let serial = (1.0 - rates.overlap.clamp(0.0, 1.0)) * copy_s;
        let compute_s: f64 = blocks.iter().map(|b| b.compute).sum::<f64>() - serial;
        let per_request = match r {
            Runs::PerRequest => 1,
            Runs::PerStep => steps * work.passes_per_step.max(1),
            Runs::ExpertSteps => {
                let e = experts.len() as u64;
                let i = experts.iter().position(|&x| x == g).unwrap_or(0) as u64;
                (steps * (i + 1) / e - steps * i / e) * work.passes_per_step.max(1)
            }
        };
        let t = GroupTime {
            component: groups[g].component.clone(),
            runs: r,
            passes: per_request,
            blocks: groups[g].blocks(),
            kept: blocks.iter().filter(|b| b.copy.is_none()).count() as u64,
            compute: compute_s,
            copy: copy_s,
            exposed: (durations[g] - compute_s).max(0.0),
        };
        let n = work.passes_per_step.max(1) as f64;
        let per_step = (n * t.compute, n * t.copy, n * t.exposed);
        match r {
            Runs::PerRequest => {}
            Runs::PerStep => {
                out.step_compute += per_step.0;
                out.step_copy += per_step.1;
                out.step_exposed += per_step.2;
            }
            // A step runs one expert: the one that computes the longest stands for it.
            Runs::ExpertSteps => {
                if per_step.0 > expert.0 {
                    expert = per_step;
                }
            }
        }
        out.groups.push(t);
    }
    out.step_compute += expert.0;
    out.step_copy += expert.1;
    out.step_exposed += expert.2;
    out
}

fn runs(compute: &[GroupCompute], g: usize) -> Runs {
    compute.get(g).map_or(Runs::PerStep, |c| c.runs)
}

/// Each group's pass as blocks to simulate.
fn pass_blocks(
    groups: &[GroupBytes],
    compute: &[GroupCompute],
    work: &Work,
    p: &Placement,
    rates: &Rates,
) -> Vec<Vec<Block>> {
    let dp = p.dp.max(1) as f64;
    let (host_share, gather_share) = match p.strategy {
        Strategy::Resident => (0.0, 0.0),
        Strategy::Sharded => (0.0, (dp - 1.0) / dp),
        Strategy::Offload => (1.0, 0.0),
        Strategy::OffloadSharded => (1.0 / dp, (dp - 1.0) / dp),
    };
    groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let c = compute.get(g);
            let text = c.is_some_and(|c| c.tokens == Tokens::Text);
            let t = if text { work.text_tokens } else { work.tokens };
            // Sequence parallelism splits the latent of the per-step groups; a
            // per-request group runs whole on every rank of the request's group.
            let sp = if text || runs(compute, g) == Runs::PerRequest {
                1
            } else {
                work.sp.max(1)
            };
            let share = largest_share(t, sp);
            // A group on the prompt has no prompt beside it.
            let prompt = if text { 0 } else { work.text_tokens };
            let samples = work.samples.max(1) as f64;
            let flops = c.map_or(0.0, |c| c.flops(t, share, prompt) * samples);
            let share = share as f64;
            let exchange = if sp > 1 {
                let sp = sp as f64;
                samples * share * work.exchange_bytes_per_token as f64 * (sp - 1.0)
                    / sp
                    / rates.peer.max(1.0)
            } else {
                0.0
            };
            let secs = flops / rates.device_flops.max(1.0) + exchange;
            let kept = if p.strategy.streams() {
                p.kept(g, group.blocks())
            } else {
                vec![true; group.blocks()]
            };
            let bytes = block_bytes(group);
            let beside = rates.overlap.clamp(0.0, 1.0);
            kept.iter()
                .zip(bytes)
                .map(|(&k, b)| {
                    let host = b as f64 * host_share / rates.host_to_device.max(1.0);
                    let gather = b as f64 * gather_share / rates.peer.max(1.0);
                    Block {
                        compute: secs
                            + if k {
                                0.0
                            } else {
                                (1.0 - beside) * host.max(gather)
                            },
                        copy: (!k).then_some((beside * host, beside * gather)),
                        full_copy: if k { 0.0 } else { host.max(gather) },
                    }
                })
                .collect()
        })
        .collect()
}

/// Bytes of each block of `g`, over its dtypes.
fn block_bytes(g: &GroupBytes) -> Vec<u64> {
    let mut out = vec![0u64; g.blocks()];
    for b in g.blocks_by_dtype.values() {
        for (i, x) in b.iter().enumerate() {
            out[i] += x;
        }
    }
    out
}
