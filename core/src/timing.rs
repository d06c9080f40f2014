//! The one step-time model: how long a request takes under a placement, from the bytes of
//! the streamed groups, what each group computes ([`GroupCompute`], declared by the family
//! and carried in the profile), the request at the workload's bounds ([`Work`]) and the
//! node's rates ([`Rates`]). The planner ranks the options that fit with it, and the
//! engine's `bench` predicts its `--resident-blocks plan` row with it, so both choose by
//! the same figures ([`choose`]).
//!
//! The model, and what it leaves out:
//! - a request is its per-request passes (a text encoder's, once per request) followed by
//!   its steps, each step one pass over every per-step group (two passes where guidance
//!   runs its samples one after the other); the experts of a two-expert model share the
//!   steps evenly, in pipeline order;
//! - a block computes for `(flops_per_token · T + flops_per_token_pair · T²) · S / F`
//!   seconds: T its tokens per sample (the prompt's for a text encoder, the latent's
//!   otherwise), S the samples of a pass, F the device's sustained FLOP/s;
//! - under sequence parallelism ([`crate::topology`], [`Work::sp`] ranks per request) a
//!   rank of a per-step group on the latent computes its largest share `t` of the tokens
//!   (`flops_per_token · t + flops_per_token_pair · T · t`: its heads see every key), and
//!   each block adds the all-to-alls of the attention's q, k, v and output,
//!   `S · t · exchange_bytes_per_token · (sp−1)/sp` bytes at the peer rate, to its
//!   compute (attention waits for them); a per-request group (a text encoder, Cosmos3's
//!   understanding pathway) runs whole on every rank of the group, no faster;
//! - the weights shard over every rank of the process, `dp × sp` of them, which is what
//!   the placement's `dp` counts here (as in [`crate::memory`]): [`predict_for`] takes a
//!   [`Topology`] and sets both;
//! - a streamed block is copied in two stages on two queues, each serial: this rank's
//!   share from the host (`bytes/dp` under `offload-sharded`, `bytes` under `offload`)
//!   at the host-to-device rate, then the all-gather of the rest (`bytes·(dp−1)/dp`) at
//!   the peer rate; `sharded` only gathers, `resident` moves nothing; where copies share
//!   the compute's cores (the CPU backend), the part of a copy that cannot run beside
//!   compute ([`Rates::overlap`]) lengthens the block's compute instead;
//! - the copy of the j-th streamed block waits for a free slot (the compute of the
//!   (j−K)-th streamed block to end), and a block computes once the previous one has and
//!   its weights are in; copies run ahead across passes, as the engine prefetches across
//!   steps and groups. Kept blocks sit where the engine keeps them
//!   ([`crate::memory::resident_block_mask`]) and copy nothing;
//! - time outside the blocks (prologues, the sampler, the decode), launch gaps, and
//!   contention between the copy and the compute for memory bandwidth (or between the
//!   all-gather and the all-to-all for the peer link) are left out: the model compares
//!   placements, which they do not tell apart.
//!
//! A request's latency is its per-request passes plus its steps ([`Prediction::request`]):
//! what the planner holds against a latency bound.
//!
//! Identical steps are simulated three times and the rest extrapolated from the last,
//! which the pipeline's steady state makes exact.

use std::collections::BTreeMap;

use crate::bounds::RequestBounds;
use crate::checkpoint::ActivationCost;
use crate::memory::{GroupBytes, Placement};
use crate::topology::{largest_share, Topology};
use crate::Strategy;

pub use crate::family::{experts, GroupCompute, Runs, Tokens};

/// [`GroupCompute::of_params`] for each of `groups`, their weights counted from their bytes
/// by dtype: what a profile whose agent predates the families' declaration is timed with.
pub fn default_compute(groups: &[GroupBytes]) -> Vec<GroupCompute> {
    let experts = experts(groups.iter().map(|g| g.component.as_str()));
    groups
        .iter()
        .map(|g| {
            let blocks = g.blocks().max(1) as u64;
            let params: u64 = g
                .blocks_by_dtype
                .iter()
                .map(|(d, b)| b.iter().sum::<u64>() / dtype_bytes(d))
                .sum();
            GroupCompute::of_params(&g.component, params / blocks, experts)
        })
        .collect()
}

/// Bytes of one element of a safetensors dtype named `d` (1 for the 8-bit ones).
fn dtype_bytes(d: &str) -> u64 {
    match d {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        _ => 1,
    }
}

/// What a node's devices sustain: the inputs the model turns bytes and FLOPs into time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Sustained dense FLOP/s of one device in the compute dtype.
    pub device_flops: f64,
    /// Host-to-device bytes/s of one device's copy queue.
    pub host_to_device: f64,
    /// All-gather bytes/s each rank receives over the peer link.
    pub peer: f64,
    /// The share of a copy's time that runs beside compute: 1 where copies have engines
    /// of their own (a GPU's copy engines and links); less where they take the cores that
    /// compute (the CPU backend, whose share `bench` measures). The rest of each streamed
    /// block's copy time lengthens its compute.
    pub overlap: f64,
}

/// Figures for one accelerator product: the substring of the product name the node agent
/// reports that selects them, and the rates. Sustained, not data-sheet: about 60 % of the
/// dense bf16 peak, and what a pinned host-to-device copy and an NCCL all-gather reach in
/// practice (PCIe Gen4 x16 ~25 GB/s, Gen5 ~50 GB/s; a PCIe-only part gathers at about
/// its host rate).
pub const PRODUCT_RATES: &[(&str, Rates)] = &[
    (
        "B200",
        Rates {
            device_flops: 1.3e15,
            host_to_device: 50e9,
            peer: 700e9,
            overlap: 1.0,
        },
    ),
    (
        "H200",
        Rates {
            device_flops: 6.0e14,
            host_to_device: 50e9,
            peer: 350e9,
            overlap: 1.0,
        },
    ),
    (
        "H100",
        Rates {
            device_flops: 6.0e14,
            host_to_device: 50e9,
            peer: 350e9,
            overlap: 1.0,
        },
    ),
    (
        "A100",
        Rates {
            device_flops: 1.9e14,
            host_to_device: 25e9,
            peer: 230e9,
            overlap: 1.0,
        },
    ),
    (
        "L40S",
        Rates {
            device_flops: 2.2e14,
            host_to_device: 25e9,
            peer: 20e9,
            overlap: 1.0,
        },
    ),
    (
        "L4",
        Rates {
            device_flops: 7.0e13,
            host_to_device: 25e9,
            peer: 20e9,
            overlap: 1.0,
        },
    ),
];

impl Rates {
    /// What the planner assumes of a product it has no figures for: an A100's.
    pub const DEFAULT: Rates = Rates {
        device_flops: 1.9e14,
        host_to_device: 25e9,
        peer: 230e9,
        overlap: 1.0,
    };

    /// The figures of the first [`PRODUCT_RATES`] entry whose name `product` contains
    /// (case-insensitive), with that name; [`Self::DEFAULT`] and `None` otherwise.
    pub fn for_product(product: &str) -> (Rates, Option<&'static str>) {
        let p = product.to_ascii_uppercase();
        PRODUCT_RATES
            .iter()
            .find(|(name, _)| p.contains(name))
            .map_or((Rates::DEFAULT, None), |(name, r)| (*r, Some(*name)))
    }
}

/// The request the model times: the workload at its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    /// Latent tokens of one sample.
    pub tokens: u64,
    /// Prompt tokens of one sequence.
    pub text_tokens: u64,
    pub steps: u64,
    /// Samples one pass computes at once (outputs × guidance's batched samples).
    pub samples: u64,
    /// Passes over the per-step groups per step (2 where guidance runs its samples one
    /// after the other).
    pub passes_per_step: u64,
    /// Ranks that split the request's latent sequence (1: no sequence parallelism).
    pub sp: u64,
    /// Bytes per latent token per sample one block's all-to-alls move under sequence
    /// parallelism ([`ActivationCost::exchange_bytes_per_token`]: q, k, v and the
    /// attention's output).
    pub exchange_bytes_per_token: u64,
}

impl Work {
    /// The largest request `bounds` allow, by the family's activation cost (its tokens
    /// per pixel and how guidance batches).
    pub fn at_bounds(cost: &ActivationCost, b: &RequestBounds) -> Work {
        let latent_frames = (b.max_frames.max(1) - 1) / cost.frames_per_latent.max(1) + 1;
        let pixels = b.max_width.saturating_mul(b.max_height);
        let tokens = pixels
            .saturating_mul(latent_frames)
            .div_ceil(cost.pixels_per_token.max(1));
        let batched = b.guidance && cost.guidance_samples > 1;
        Work {
            tokens,
            text_tokens: b.max_prompt_tokens,
            steps: b.max_steps.max(1),
            samples: b.max_n.max(1) * if batched { cost.guidance_samples } else { 1 },
            passes_per_step: if b.guidance && !batched { 2 } else { 1 },
            sp: 1,
            exchange_bytes_per_token: cost.exchange_bytes_per_token,
        }
    }

    /// This request with its latent sequence split over `sp` ranks (at least 1).
    pub fn with_sp(self, sp: u64) -> Work {
        Work {
            sp: sp.max(1),
            ..self
        }
    }
}

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

/// One block in the simulated sequence.
#[derive(Clone, Copy)]
struct Block {
    /// Seconds of compute, with the part of its copy that cannot run beside it.
    compute: f64,
    /// Seconds of the two copy stages that run beside compute; `None` for a kept block.
    copy: Option<(f64, f64)>,
    /// Seconds of its copy, the slower stage, all of it.
    full_copy: f64,
}

/// The two-queue pipeline with a ring of `k` slots, carried across passes.
struct Pipe {
    k: usize,
    host_free: f64,
    gather_free: f64,
    compute_end: f64,
    /// Compute end of the streamed blocks, the last `k` of them.
    streamed_ends: std::collections::VecDeque<f64>,
}

impl Pipe {
    fn new(k: usize) -> Pipe {
        Pipe {
            k: k.max(1),
            host_free: 0.0,
            gather_free: 0.0,
            compute_end: 0.0,
            streamed_ends: Default::default(),
        }
    }

    /// Runs `b`; its compute's end.
    fn run(&mut self, b: Block) -> f64 {
        let mut ready = self.compute_end;
        if let Some((host, gather)) = b.copy {
            let slot_free = if self.streamed_ends.len() >= self.k {
                self.streamed_ends[self.streamed_ends.len() - self.k]
            } else {
                0.0
            };
            let host_done = self.host_free.max(slot_free) + host;
            self.host_free = host_done;
            let gathered = self.gather_free.max(host_done) + gather;
            self.gather_free = gathered;
            ready = ready.max(gathered);
        }
        self.compute_end = ready + b.compute;
        if b.copy.is_some() {
            self.streamed_ends.push_back(self.compute_end);
            if self.streamed_ends.len() > self.k {
                self.streamed_ends.pop_front();
            }
        }
        self.compute_end
    }

    /// Runs a pass over `blocks`; its duration from the end of the previous pass.
    fn pass(&mut self, blocks: &[Block]) -> f64 {
        let start = self.compute_end;
        for b in blocks {
            self.run(*b);
        }
        self.compute_end - start
    }
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
            let share = largest_share(t, sp) as f64;
            let t = t as f64;
            let samples = work.samples.max(1) as f64;
            let flops = c.map_or(0.0, |c| {
                (c.flops_per_token as f64 * share + c.flops_per_token_pair as f64 * t * share)
                    * samples
            });
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

#[cfg(test)]
#[path = "timing_tests.rs"]
mod tests;
