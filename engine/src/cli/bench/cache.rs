//! `bench --cache KIND`: the same requests with the step cache off and on, side by side in
//! one run, under `offload` at dp 1 and `offload-sharded` at dp 2 and 4: step time, the bytes
//! each output moved (copied and gathered), the block computations the cache saved and
//! the steps it computed. MagCache without ratios first runs its calibration on the same
//! requests and then runs with the ratios it recorded, at diffusers' default threshold.

use anyhow::{Context, Result};

use super::args::BenchArgs;
use crate::cache::StepCache;
use crate::contract::ResidentBlocks;
use crate::engine::{Model, RunStats};
use crate::execution::work::Request;
use crate::Strategy;

/// The configurations compared: offload at dp 1, offload-sharded at dp 2 and 4 (where a
/// block moves when any rank's request computes it: the bytes saved are the union's).
const CONFIGS: [(Strategy, usize); 3] = [
    (Strategy::Offload, 1),
    (Strategy::OffloadSharded, 2),
    (Strategy::OffloadSharded, 4),
];

pub(super) fn bench_cache(a: &BenchArgs, model: &Model, cache: &StepCache) -> Result<()> {
    let plain: Vec<Request> = a
        .request
        .requests(model, None)?
        .into_iter()
        .map(|r| Request { cache: None, ..r })
        .collect();
    let cache = calibrated(a, model, &plain, cache)?;
    let cached: Vec<Request> = plain
        .iter()
        .map(|r| Request {
            cache: Some(cache.clone()),
            ..r.clone()
        })
        .collect();
    let n = plain.len().max(1) as u64;
    println!(
        "model {}, {} output(s) of {} steps, cache {}, best of {} rounds",
        a.engine.run.model.display(),
        plain.len(),
        plain.first().map_or(0, |r| r.steps),
        serde_json::to_string(&cache)?,
        a.rounds.max(1)
    );
    println!(
        "{:<22} {:>6} {:>10} {:>8} {:>14} {:>14} {:>12} {:>14}",
        "configuration",
        "cache",
        "s/step",
        "vs off",
        "copied/output",
        "gathered/out",
        "blocks saved",
        "steps computed"
    );
    for (strategy, dp) in CONFIGS {
        let off = best(a, model, &plain, strategy, dp)?;
        let on = best(a, model, &cached, strategy, dp)?;
        for (name, (s, computed)) in [("off", &off), ("on", &on)] {
            println!(
                "{:<22} {:>6} {:>10.4} {:>8.2} {:>14} {:>14} {:>12} {:>14}",
                format!("{strategy} dp={dp}"),
                name,
                s.step_seconds,
                s.step_seconds / off.0.step_seconds,
                mib(s.bytes_copied / n),
                mib(s.bytes_gathered / n),
                s.blocks_saved,
                computed
            );
        }
    }
    Ok(())
}

/// MagCache without ratios: the ratios its calibration records on the first request,
/// with diffusers' defaults otherwise; any other setting as it is.
fn calibrated(a: &BenchArgs, model: &Model, plain: &[Request], c: &StepCache) -> Result<StepCache> {
    let StepCache::Mag {
        calibrate: true,
        threshold,
        max_skip_steps,
        retention_ratio,
        ..
    } = c
    else {
        return Ok(c.clone());
    };
    let first = plain.first().context("no request to calibrate on")?;
    let req = Request {
        cache: Some(c.clone()),
        ..first.clone()
    };
    let mut opts = a
        .engine
        .options(Strategy::Offload, ResidentBlocks::Fixed(0));
    (opts.dp, opts.decode) = (1, false);
    let (out, _) = model.run(vec![req], &opts)?;
    let ratios = out[0]
        .cache
        .as_ref()
        .and_then(|r| r.calibration.first().cloned())
        .context("the calibration run recorded no ratios")?;
    eprintln!("calibrated ratios: {ratios:?}");
    Ok(StepCache::Mag {
        threshold: *threshold,
        max_skip_steps: *max_skip_steps,
        retention_ratio: *retention_ratio,
        ratios: Some(ratios),
        calibrate: false,
    })
}

/// The best round of `requests` under `strategy` at `dp`, with the steps its outputs
/// computed (`k/n` summed over outputs and guidance rows).
fn best(
    a: &BenchArgs,
    model: &Model,
    requests: &[Request],
    strategy: Strategy,
    dp: usize,
) -> Result<(RunStats, String)> {
    let mut best: Option<(RunStats, String)> = None;
    for _ in 0..a.rounds.max(1) {
        let mut opts = a.engine.options(strategy, ResidentBlocks::Fixed(0));
        (opts.dp, opts.decode) = (dp, false);
        opts.activations = model.reserved_activations(requests, &opts)?;
        let (out, stats) = model
            .run(requests.to_vec(), &opts)
            .with_context(|| format!("{strategy} dp={dp}"))?;
        let (mut ran, mut all) = (0, 0);
        for r in out.iter().filter_map(|o| o.cache.as_ref()) {
            ran += r.computed.iter().flatten().filter(|&&c| c).count();
            all += r.computed.iter().flatten().count();
        }
        let computed = if all == 0 {
            "all".to_string()
        } else {
            format!("{ran}/{all}")
        };
        if best
            .as_ref()
            .is_none_or(|(b, _)| stats.step_seconds < b.step_seconds)
        {
            best = Some((stats, computed));
        }
    }
    Ok(best.expect("one round at least"))
}

fn mib(bytes: u64) -> String {
    format!("{:.3} MiB", bytes as f64 / (1u64 << 20) as f64)
}
