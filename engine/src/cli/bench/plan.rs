//! `--resident-blocks plan`: this machine's rates, calibrated in the run, and the counts per
//! component the step-time model ([`crate::timing::choose`], the planner's code) chooses at
//! them, for bench to measure beside the manual counts.

use anyhow::{bail, Context, Result};

use super::args::BenchArgs;
use super::args::KeptBlocks;
use super::options::Config;
use crate::bounds::RequestBounds;
use crate::contract::ResidentBlocks;
use crate::contract::SlotsChoice;
use crate::engine::Model;
use crate::execution::work::{Condition, Request};
use crate::memory::{self, GroupBytes, Placement};
use crate::timing::{self, Choice, GroupCompute, Rates, Work};
use crate::Strategy;

/// This machine's rates for the CPU backend, measured in this run: the ranks' FLOP/s from
/// a `resident` run of `requests` (nothing copied: its step time is compute, which the
/// model's FLOPs of a step divide), the copy rate from the mapped checkpoint into a
/// block-sized buffer (what a rank's copy does), the rate between two buffers (what the
/// all-gather does on the CPU), and the share of copying that runs beside compute (the
/// CPU backend's copies take cores the compute uses): the one at which the model predicts
/// the step time of a `strategy` run with K = `k` and no block kept. Each run the best of
/// three.
#[allow(clippy::too_many_arguments)]
fn calibrate(
    a: &BenchArgs,
    model: &Model,
    requests: &[Request],
    groups: &[GroupBytes],
    compute: &[GroupCompute],
    work: &Work,
    strategy: Strategy,
    k: u64,
) -> Result<Rates> {
    let best_step = |strategy: Strategy, memory: u64| -> Result<f64> {
        let mut opts = a.engine.options(strategy, ResidentBlocks::Fixed(0));
        opts.device_memory = memory;
        opts.slots = SlotsChoice::Fixed(k as usize);
        opts.activations = model.reserved_activations(requests, &opts)?;
        opts.decode = false;
        let mut step = f64::INFINITY;
        for _ in 0..3 {
            let (_, stats) = model
                .run(requests.to_vec(), &opts)
                .with_context(|| format!("calibrating: {strategy}"))?;
            step = step.min(stats.step_seconds);
        }
        Ok(step)
    };
    let step = best_step(Strategy::Resident, u64::MAX)?;
    let unit = Rates {
        device_flops: 1.0,
        host_to_device: f64::INFINITY,
        peer: f64::INFINITY,
        overlap: 1.0,
    };
    let all = Placement::new(Strategy::Resident, 1, 0, groups.len());
    let flops = timing::predict(groups, compute, work, &all, &unit).step_compute;
    let block = groups
        .iter()
        .flat_map(|g| {
            g.blocks_by_dtype
                .values()
                .map(|b| b.iter().max().copied().unwrap_or(0))
        })
        .max()
        .unwrap_or(0)
        .max(1 << 20) as usize;
    let (host_to_device, peer) = super::rates::copy_rates(Some(&a.engine.run.model), block)?;
    let mut rates = Rates {
        device_flops: flops / step.max(1e-9),
        host_to_device,
        peer,
        overlap: 1.0,
    };
    // The share that runs beside compute: the predicted step falls as it grows, so
    // bisect for the measured one (clamped to what 0 and 1 predict).
    let streamed = best_step(
        strategy,
        a.engine.run.device_memory_mib.map_or(u64::MAX, |m| m << 20),
    )?;
    let ranks = (a.engine.run.dp * a.engine.run.sp) as u64;
    let base = Placement::new(strategy, ranks, k, groups.len()).with_resident_components(
        groups,
        &a.engine
            .options(strategy, ResidentBlocks::Fixed(0))
            .resident_components,
    );
    let predicted = |overlap: f64| {
        timing::predict(groups, compute, work, &base, &Rates { overlap, ..rates }).step
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        if predicted(mid) > streamed {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    rates.overlap = (lo + hi) / 2.0;
    Ok(rates)
}

/// Per configuration, the counts the step-time model chooses where it asks for `plan`
/// (with its prediction and the calibrated rates): `timing::choose` over the counts whose
/// weights fit `--device-memory-mib` beside the activations and the overhead, as the
/// engine checks them at start.
pub(super) fn plan_rows(
    a: &BenchArgs,
    model: &Model,
    configs: &[Config],
    requests: &[Request],
) -> Result<Vec<Option<(Choice, Rates)>>> {
    if !configs.iter().any(|c| c.kept == Some(KeptBlocks::Plan)) {
        return Ok(vec![None; configs.len()]);
    }
    let k = match a.engine.run.slots {
        SlotsChoice::Fixed(k) => k as u64,
        SlotsChoice::Auto => {
            bail!("--resident-blocks plan: give --slots a number (the model times a fixed K)")
        }
    };
    let groups = model.group_bytes()?;
    let compute = model.checkpoint.inner.group_compute();
    let r = requests.first().context("no request")?;
    let bounds = RequestBounds {
        max_width: r.width as u64,
        max_height: r.height as u64,
        max_frames: r.frames as u64,
        max_steps: r.steps as u64,
        max_n: 1,
        guidance: model.family.guided(r),
        max_prompt_tokens: match r.condition {
            Condition::Prompt { .. } => r.max_sequence_length as u64,
            Condition::Class(_) => 0,
        },
    };
    // Each rank computes its share of the tokens when requests split (the planner's term).
    let work = Work::at_bounds(&model.checkpoint.activation_cost(), &bounds)
        .with_sp(a.engine.run.sp as u64);
    let first = configs
        .iter()
        .find(|c| c.kept == Some(KeptBlocks::Plan))
        .map_or(Strategy::Offload, |c| c.strategy);
    let rates = calibrate(a, model, requests, &groups, &compute, &work, first, k)?;
    let opts = a
        .engine
        .options(Strategy::Offload, ResidentBlocks::Fixed(0));
    let budget = opts
        .device_memory
        .saturating_sub(model.reserved_activations(requests, &opts)?)
        .saturating_sub(opts.overhead);
    let outside = model.family.resident_bytes(false);
    let fits = |p: &Placement| {
        let w = memory::device_bytes(&groups, p, outside, 0, 0).weights();
        (w <= budget).then_some(w)
    };
    configs
        .iter()
        .map(|c| {
            if c.kept != Some(KeptBlocks::Plan) {
                return Ok(None);
            }
            let ranks = (a.engine.run.dp * c.sp) as u64;
            let base = Placement::new(c.strategy, ranks, k, groups.len())
                .with_resident_components(&groups, &opts.resident_components);
            let choice = timing::choose(&groups, &compute, &work, &base, &rates, &fits)
                .with_context(|| {
                    format!("--resident-blocks plan: {} does not fit --device-memory-mib with no block kept", c.strategy)
                })?;
            Ok(Some((choice, rates)))
        })
        .collect()
}
