//! What bench reports: a row per configuration against the reference (`resident`, else the
//! first), as `--json` or as the table, with the `plan` rows against the best manual count
//! and what each streamed group costs.

use std::collections::BTreeMap;

use anyhow::Result;
use candle_core::Tensor;
use serde::Serialize;

use super::args::BenchArgs;
use super::args::KeptBlocks;
use super::options::Config;
use super::runs::Rounds;
use crate::cli::commands::gib;
use crate::contract::ResidentBlocks;
use crate::engine::{Model, RunStats};
use crate::execution::work::Request;
use crate::memory::GroupBytes;
use crate::timing::{Choice, Rates};
use crate::Strategy;

/// One row of the table (and of `--json`): a configuration's best round.
#[derive(Serialize)]
pub(super) struct Row {
    /// `--resident-blocks` as asked (`-` for `resident`); `resident_blocks` below is what
    /// the engine kept.
    pub(super) resident_blocks_asked: String,
    /// Best step time over the reference's best (`resident`'s, else the first row's).
    pub(super) vs_resident: f64,
    /// The median over rounds of step time over the reference's in the same round: on a
    /// machine whose load changes from minute to minute, the steadier figure.
    pub(super) vs_resident_paired: f64,
    /// Best step time over the best of the rows of the same strategy.
    pub(super) vs_best: f64,
    /// Latents bit-identical to the reference's.
    pub(super) identical: bool,
    /// Device bytes each rank keeps for the activations of the largest request (the
    /// memory model's figure at this row's sp), and over the reference's.
    pub(super) activations_per_rank: u64,
    pub(super) activations_vs_reference: f64,
    pub(super) host_memory: String,
    #[serde(flatten)]
    pub(super) stats: RunStats,
}

/// What `bench --json` prints.
#[derive(Serialize)]
pub(super) struct Report {
    pub(super) model: String,
    pub(super) dp: usize,
    pub(super) outputs: usize,
    pub(super) steps: usize,
    pub(super) rounds: usize,
    pub(super) rows: Vec<Row>,
}

fn bits(latents: &[Tensor]) -> Option<Vec<Vec<u32>>> {
    latents
        .iter()
        .map(|t| {
            let v = t.flatten_all().ok()?.to_vec1::<f32>().ok()?;
            Some(v.iter().map(|f| f.to_bits()).collect())
        })
        .collect()
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The median of `times`' ratios to `base`, round by round (NaN without a round).
fn paired_median(times: &[f64], base: &[f64]) -> f64 {
    let mut r: Vec<f64> = times.iter().zip(base).map(|(t, base)| t / base).collect();
    r.sort_by(f64::total_cmp);
    match r.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => r[n / 2],
        n => (r[n / 2 - 1] + r[n / 2]) / 2.0,
    }
}

/// One row per configuration, against the reference: `resident`, else the first.
pub(super) fn rows(
    a: &BenchArgs,
    model: &Model,
    requests: &[Request],
    configs: &[Config],
    rounds: Rounds,
) -> Result<Vec<Row>> {
    let Rounds { best, times } = rounds;
    let reference = configs
        .iter()
        .position(|c| c.strategy == Strategy::Resident)
        .unwrap_or(0);
    let ref_step = best[reference].0.step_seconds;
    // Every configuration runs on the same device and dtype: one element for all rows.
    let element = model.compute_element(
        &a.engine
            .options(Strategy::Resident, ResidentBlocks::Fixed(0)),
    )?;
    let ref_act = model.activation_bytes(requests, configs[reference].sp, element)?;
    let ref_bits = bits(&best[reference].1);
    // "Of the same strategy": at the same sp, so rows of one sp compare among themselves.
    let family = |c: &Config| format!("{} sp {}", c.strategy, c.sp);
    let mut best_of: BTreeMap<String, f64> = BTreeMap::new();
    for (c, (stats, _)) in configs.iter().zip(&best) {
        let e = best_of.entry(family(c)).or_insert(f64::INFINITY);
        *e = e.min(stats.step_seconds);
    }
    configs
        .iter()
        .zip(best)
        .enumerate()
        .map(|(i, (c, (stats, latents)))| {
            let act = model.activation_bytes(requests, c.sp, element)?;
            Ok(Row {
                resident_blocks_asked: c.kept.map_or("-".into(), |k| k.to_string()),
                vs_resident: stats.step_seconds / ref_step,
                vs_best: stats.step_seconds / best_of[&family(c)],
                vs_resident_paired: paired_median(&times[i], &times[reference]),
                identical: ref_bits.is_some() && bits(&latents) == ref_bits,
                activations_per_rank: act,
                activations_vs_reference: act as f64 / ref_act.max(1) as f64,
                host_memory: a.engine.backend.host_memory.to_string(),
                stats,
            })
        })
        .collect()
}

/// For each strategy with a `plan` row: the rates it was chosen at, what it kept and
/// predicted, and its measured step time against the best manual count's.
pub(super) fn print_plans(configs: &[Config], rows: &[Row], planned: &[Option<(Choice, Rates)>]) {
    for (i, p) in planned.iter().enumerate() {
        let Some((choice, rates)) = p else { continue };
        let strategy = configs[i].strategy;
        let manual = configs
            .iter()
            .zip(rows)
            .filter(|(c, _)| c.strategy == strategy && matches!(c.kept, Some(KeptBlocks::Fixed(_))))
            .min_by(|(_, x), (_, y)| x.stats.step_seconds.total_cmp(&y.stats.step_seconds));
        let kept: Vec<String> = choice
            .kept
            .iter()
            .map(|(c, n)| format!("{c}={n}"))
            .collect();
        let pr = &choice.prediction;
        println!(
            "{strategy} plan: calibrated {:.1} GFLOP/s, {:.2} GB/s copy, {:.2} GB/s gather, {:.0}% of copying beside compute; keeps {}; predicted {:.3} s/step (compute {:.3}, copy {:.3}, exposed {:.3})",
            rates.device_flops / 1e9,
            rates.host_to_device / 1e9,
            rates.peer / 1e9,
            100.0 * rates.overlap,
            kept.join(", "),
            pr.step,
            pr.step_compute,
            pr.step_copy,
            pr.step_exposed
        );
        if let Some((c, best)) = manual {
            let n = c.kept.map_or(String::new(), |k| k.to_string());
            println!(
                "{strategy} plan: measured {:.3} s/step = {:.3}x the best manual choice (N={n}, {:.3} s/step; target within 1.05x)",
                rows[i].stats.step_seconds,
                rows[i].stats.step_seconds / best.stats.step_seconds,
                best.stats.step_seconds
            );
        }
    }
}

/// Each streamed group's bytes, and what `offload` copied per step beside a pass over every
/// group each step: the saving of a family whose groups stream at different rates (a text
/// encoder, or Cosmos3's understanding pathway, once per request; the denoiser every step).
pub(super) fn print_groups(model: &Model, rows: &[Row], steps: usize) -> Result<()> {
    let bytes = model.group_bytes()?;
    if bytes.len() < 2 {
        return Ok(());
    }
    let all: u64 = bytes.iter().map(GroupBytes::bytes).sum();
    let parts: Vec<String> = model
        .checkpoint
        .groups()
        .iter()
        .zip(&bytes)
        .map(|((_, g), b)| format!("{} {}", g.name, mib(b.bytes())))
        .collect();
    println!(
        "streamed groups: {} ({} in all)",
        parts.join(", "),
        mib(all)
    );
    if let Some(r) = rows.iter().find(|r| r.stats.strategy == Strategy::Offload) {
        // Every output's steps, whichever rank ran them.
        let output_steps = (steps * r.stats.outputs).max(1) as u64;
        let per_step = r.stats.bytes_copied / output_steps;
        println!(
            "offload copies {}/step per output: {:.1}% of what streaming every group every step would ({})",
            mib(per_step),
            100.0 * per_step as f64 / all as f64,
            mib(all)
        );
    }
    Ok(())
}

/// Per configuration, each phase's measured peak beside what the memory model reserves.
pub(super) fn print_phases(rows: &[Row]) {
    for r in rows {
        let s = &r.stats;
        println!(
            "memory by phase, {} N={} sp={}: {}",
            s.strategy,
            r.resident_blocks_asked,
            s.sp,
            crate::cli::commands::phases_line(s)
        );
    }
}

/// The table: one line per configuration; the gathered column only where ranks gather.
/// `vs resident` is best over best; `paired med` the median of the rounds' own ratios.
pub(super) fn print_table(rows: &[Row], gathers: bool) {
    let gathered = |s: String| {
        if gathers {
            format!(" {s:>14}")
        } else {
            String::new()
        }
    };
    println!(
        "{:<16} {:>9} {:>3} {:>3} {:>9} {:>11} {:>8} {:>11} {:>7} {:>12} {:>14}{} {:>13} {:>13} {:>13} {:>5} {:>13} {:>9}",
        "strategy",
        "N",
        "K",
        "sp",
        "s/step",
        "vs resident",
        "vs best",
        "paired med",
        "stall",
        "switch stall",
        "copied/step",
        gathered("gathered/step".into()),
        "act/rank",
        "peak device",
        "pinned host",
        "host",
        "anon RSS",
        "identical"
    );
    for r in rows {
        let s = &r.stats;
        // What auto or L/k resolved to, beside what was asked.
        let n = match r.resident_blocks_asked.as_str() {
            "-" => "-".to_string(),
            "plan" => "plan".to_string(),
            asked if asked == s.resident_blocks.to_string() => asked.to_string(),
            asked => format!("{asked}={}", s.resident_blocks),
        };
        println!(
            "{:<16} {:>9} {:>3} {:>3} {:>9.3} {:>10.3}x {:>7.3}x {:>10.3}x {:>6.1}% {:>11.1}% {:>14}{} {:>13} {:>13} {:>13} {:>5} {:>13} {:>9}",
            s.strategy,
            n,
            s.slots,
            s.sp,
            s.step_seconds,
            r.vs_resident,
            r.vs_best,
            r.vs_resident_paired,
            100.0 * s.stall_fraction,
            100.0 * s.switch_stall_fraction,
            mib(s.bytes_copied_per_step),
            gathered(mib(s.bytes_gathered_per_step)),
            format!("{} {:.2}x", mib(r.activations_per_rank), r.activations_vs_reference),
            gib(s.peak_device_bytes),
            gib(s.peak_pinned_host_bytes),
            r.host_memory,
            gib(s.peak_anon_rss_bytes),
            if r.identical { "yes" } else { "NO" }
        );
    }
}
