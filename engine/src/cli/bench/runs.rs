//! Running the configurations: the checkpoint warmed into the page cache first, then every
//! configuration once a round, interleaved so the machine's noise falls on each alike; each
//! keeps its best round (with its latents) and every round's step time.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use candle_core::Tensor;

use super::args::BenchArgs;
use super::options::Config;
use crate::contract::ResidentBlocks;
use crate::engine::{Model, RunStats};
use crate::execution::work::Request;

/// Brings the checkpoint into the page cache first so no configuration pays the disk;
/// reads through one small buffer, so the warm-up holds no copy of the model.
pub(super) fn warm_page_cache(model: &Model) -> Result<()> {
    let mut buf = vec![0u8; 8 << 20];
    for h in model
        .checkpoint
        .components()
        .into_iter()
        .flat_map(|(_, c)| c.files.iter())
    {
        let mut f = std::fs::File::open(&h.path)
            .with_context(|| format!("reading {}", h.path.display()))?;
        while std::io::Read::read(&mut f, &mut buf)? > 0 {}
    }
    Ok(())
}

/// What the rounds measured of each configuration: its best round (with its latents) and
/// every round's step time.
pub(super) struct Rounds {
    pub(super) best: Vec<(RunStats, Vec<Tensor>)>,
    pub(super) times: Vec<Vec<f64>>,
}

/// Runs `requests` under every one of `configs`, round by round, and logs each run.
pub(super) fn run_rounds(
    a: &BenchArgs,
    model: &Model,
    configs: &[Config],
    deepest: usize,
    requests: &[Request],
    planned: &[Option<BTreeMap<String, u64>>],
) -> Result<Rounds> {
    let mut best: Vec<Option<(RunStats, Vec<Tensor>)>> = vec![None; configs.len()];
    // Every round's step time, per configuration.
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..a.rounds.max(1) {
        for (i, c) in configs.iter().enumerate() {
            let kept = c
                .kept
                .map_or(ResidentBlocks::Fixed(0), |k| k.resolve(deepest));
            let mut opts = a.engine.options(c.strategy, kept);
            if let Some(by_component) = &planned[i] {
                opts.resident_blocks_by_component = by_component.clone();
            }
            opts.sp = c.sp;
            opts.activations = model.reserved_activations(requests, &opts)?;
            opts.decode = false;
            let (out, stats) =
                model
                    .run(requests.to_vec(), &opts)
                    .with_context(|| match c.kept {
                        Some(k) => format!("{} with --resident-blocks {k}", c.strategy),
                        None => c.strategy.to_string(),
                    })?;
            let each: Vec<String> = stats
                .step_seconds_each
                .iter()
                .map(|t| format!("{t:.3}"))
                .collect();
            eprintln!(
                "round {round}: {} sp={} N={}: {:.3}s/step (steps: {})",
                c.strategy,
                c.sp,
                stats.resident_blocks,
                stats.step_seconds,
                each.join(" ")
            );
            times[i].push(stats.step_seconds);
            if best[i]
                .as_ref()
                .is_none_or(|(b, _)| stats.step_seconds < b.step_seconds)
            {
                best[i] = Some((stats, out.into_iter().map(|o| o.latents).collect()));
            }
        }
    }
    Ok(Rounds {
        best: best.into_iter().map(|b| b.expect("ran")).collect(),
        times,
    })
}
