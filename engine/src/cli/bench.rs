//! `layerwise bench`: the same requests under each strategy and, for the streaming ones,
//! each number of blocks kept on the device, run interleaved round by round so that the
//! machine's noise falls on every configuration alike. Each configuration's best round is
//! reported against `resident`'s: step time, stalls, bytes moved per step, device and
//! pinned host bytes, and whether its latents are bit-identical to the reference.
//!
//! `--resident-blocks each,plan` measures every manual count beside the one the
//! step-time model chooses ([`crate::timing::choose`], the planner's code) from rates this
//! run calibrates first ([`calibrate`]), and prints each against the best.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde::Serialize;

use super::commands::gib;
use super::BenchArgs;
use crate::bounds::RequestBounds;
use crate::engine::{Model, RunStats};
use crate::execution::cuda::plan::ResidentBlocks;
use crate::execution::cuda::SlotsChoice;
use crate::execution::work::{Condition, Request};
use crate::memory::{self, GroupBytes, Placement};
use crate::timing::{self, Choice, GroupCompute, Rates, Work};
use crate::Strategy;

/// One value of bench's `--resident-blocks`: blocks of each streamed group kept on the
/// device, as a number, `auto`, or a share of the deepest group (`L/k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptBlocks {
    Fixed(usize),
    /// As many as the device memory budget holds (the engine's `--resident-blocks auto`).
    Auto,
    /// The deepest streamed group's blocks ÷ k, rounded down.
    Share(usize),
    /// Every count from 0 to one short of the deepest group's blocks, one row each.
    Each,
    /// The counts per component the step-time model chooses, at rates calibrated in this
    /// run ([`calibrate`]).
    Plan,
}

impl FromStr for KeptBlocks {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s {
            "auto" => return Ok(KeptBlocks::Auto),
            "each" => return Ok(KeptBlocks::Each),
            "plan" => return Ok(KeptBlocks::Plan),
            _ => {}
        }
        if let Some(k) = s.strip_prefix("L/") {
            return match k.parse::<usize>() {
                Ok(k) if k > 0 => Ok(KeptBlocks::Share(k)),
                _ => Err(format!(
                    "`{s}`: expected L/k with k ≥ 1 (the deepest group's blocks ÷ k)"
                )),
            };
        }
        s.parse().map(KeptBlocks::Fixed).map_err(|_| {
            format!("`{s}`: expected a number of blocks, `auto`, L/k (e.g. L/2), `each` or `plan`")
        })
    }
}

impl fmt::Display for KeptBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeptBlocks::Fixed(n) => write!(f, "{n}"),
            KeptBlocks::Auto => f.write_str("auto"),
            KeptBlocks::Share(k) => write!(f, "L/{k}"),
            KeptBlocks::Each => f.write_str("each"),
            KeptBlocks::Plan => f.write_str("plan"),
        }
    }
}

impl KeptBlocks {
    /// The engine's `--resident-blocks` for a model whose deepest streamed group has
    /// `deepest` blocks (`plan` keeps none beside its counts per component; `each` is
    /// expanded into numbers before anything runs).
    pub fn resolve(self, deepest: usize) -> ResidentBlocks {
        match self {
            KeptBlocks::Fixed(n) => ResidentBlocks::Fixed(n),
            KeptBlocks::Auto => ResidentBlocks::Auto,
            KeptBlocks::Share(k) => ResidentBlocks::Fixed(deepest / k),
            KeptBlocks::Each | KeptBlocks::Plan => ResidentBlocks::Fixed(0),
        }
    }
}

/// One configuration bench runs: a strategy and, when it streams, the blocks it keeps.
#[derive(Debug, Clone, Copy)]
struct Config {
    strategy: Strategy,
    /// `None` for `resident`, which keeps every block whatever the flag says.
    kept: Option<KeptBlocks>,
    /// Ranks per request.
    sp: usize,
}

/// One row of the table (and of `--json`): a configuration's best round.
#[derive(Serialize)]
struct Row {
    /// `--resident-blocks` as asked (`-` for `resident`); `resident_blocks` below is what
    /// the engine kept.
    resident_blocks_asked: String,
    /// Best step time over the reference's best (`resident`'s, else the first row's).
    vs_resident: f64,
    /// The median over rounds of step time over the reference's in the same round: on a
    /// machine whose load changes from minute to minute, the steadier figure.
    vs_resident_paired: f64,
    /// Best step time over the best of the rows of the same strategy.
    vs_best: f64,
    /// Latents bit-identical to the reference's.
    identical: bool,
    /// Device bytes each rank keeps for the activations of the largest request (the
    /// memory model's figure at this row's sp), and over the reference's.
    activations_per_rank: u64,
    activations_vs_reference: f64,
    host_memory: String,
    #[serde(flatten)]
    stats: RunStats,
}

/// What `bench --json` prints.
#[derive(Serialize)]
struct Report {
    model: String,
    dp: usize,
    outputs: usize,
    steps: usize,
    rounds: usize,
    rows: Vec<Row>,
}

/// The configurations `a` asks for, in the order they run and print: `resident` once,
/// every other strategy once per `--resident-blocks` value. A fixed number that keeps
/// every block of every group is refused before anything runs: that is `resident`.
fn configs(a: &BenchArgs, deepest: usize) -> Result<Vec<Config>> {
    let strategies = a
        .strategies
        .iter()
        .map(|s| s.parse::<Strategy>())
        .collect::<Result<Vec<_>, _>>()?;
    let sps = if a.sp_each.is_empty() {
        vec![a.engine.run.sp]
    } else {
        a.sp_each.clone()
    };
    if sps.len() > 1 && a.resident_blocks.contains(&KeptBlocks::Plan) {
        bail!("--resident-blocks plan times one topology: give --sp rather than --sp-each");
    }
    let kept = if a.resident_blocks.is_empty() {
        vec![KeptBlocks::Fixed(0)]
    } else {
        a.resident_blocks.clone()
    };
    let mut out = Vec::new();
    for (sp, strategy) in sps
        .iter()
        .flat_map(|&sp| strategies.iter().map(move |&s| (sp, s)))
    {
        if !strategy.streams() {
            out.push(Config {
                strategy,
                kept: None,
                sp,
            });
            continue;
        }
        let expanded = kept.iter().flat_map(|&k| match k {
            KeptBlocks::Each => (0..deepest).map(KeptBlocks::Fixed).collect(),
            k => vec![k],
        });
        for k in expanded {
            if let ResidentBlocks::Fixed(n) = k.resolve(deepest) {
                if n >= deepest {
                    bail!(
                        "--resident-blocks {k}: keeps {n} blocks, every block of the deepest group ({deepest}), so {strategy} would stream nothing; `resident` is the row that keeps them all"
                    );
                }
            }
            out.push(Config {
                strategy,
                kept: Some(k),
                sp,
            });
        }
    }
    Ok(out)
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

pub(super) fn bench(a: BenchArgs) -> Result<()> {
    let model = Model::open(&a.engine.run.model)?;
    let deepest = model
        .group_bytes()?
        .iter()
        .map(GroupBytes::blocks)
        .max()
        .unwrap_or(0);
    let configs = configs(&a, deepest)?;
    warm_page_cache(&model)?;
    let requests = a.request.requests(&model, None)?;
    let planned = plan_rows(&a, &model, &configs, &requests)?;
    let kept: Vec<Option<BTreeMap<String, u64>>> = planned
        .iter()
        .map(|p| p.as_ref().map(|(c, _)| c.kept.clone()))
        .collect();
    let rounds = run_rounds(&a, &model, &configs, deepest, &requests, &kept)?;
    let rows = rows(&a, &model, &requests, &configs, rounds)?;
    let steps = requests.first().map_or(0, |r| r.steps);
    if a.json {
        let report = Report {
            model: a.engine.run.model.display().to_string(),
            dp: a.engine.run.dp,
            outputs: a.request.n,
            steps,
            rounds: a.rounds.max(1),
            rows,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        if !report.rows.iter().all(|r| r.identical) {
            bail!("configurations produced different latents");
        }
        return Ok(());
    }
    println!(
        "model {} ({}, {deepest} blocks in its deepest group), dp={}, sp={}, --slots {}, --host-memory {}, device memory {}, {} output(s) of {steps} steps, best of {} rounds",
        a.engine.run.model.display(),
        gib(rows[0].stats.checkpoint_bytes),
        a.engine.run.dp,
        configs
            .iter()
            .map(|c| c.sp.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
            .join(","),
        a.engine.run.slots,
        a.engine.backend.host_memory,
        a.engine
            .run
            .device_memory_mib
            .map_or("unbounded".into(), |m| format!("{m} MiB")),
        a.request.n,
        a.rounds.max(1)
    );
    let most_sp = configs.iter().map(|c| c.sp).max().unwrap_or(1);
    print_table(&rows, a.engine.run.dp * most_sp > 1);
    print_plans(&configs, &rows, &planned);
    print_groups(&model, &rows, steps)?;
    if !rows.iter().all(|r| r.identical) {
        bail!("configurations produced different latents");
    }
    Ok(())
}

/// Brings the checkpoint into the page cache first so no configuration pays the disk;
/// reads through one small buffer, so the warm-up holds no copy of the model.
fn warm_page_cache(model: &Model) -> Result<()> {
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
struct Rounds {
    best: Vec<(RunStats, Vec<Tensor>)>,
    times: Vec<Vec<f64>>,
}

/// Runs `requests` under every one of `configs`, round by round, and logs each run.
fn run_rounds(
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
            opts.activations = model.activation_bytes(requests, c.sp)?;
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
fn rows(
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
    let ref_act = model.activation_bytes(requests, configs[reference].sp)?;
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
            let act = model.activation_bytes(requests, c.sp)?;
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
        opts.activations = model.activation_bytes(requests, a.engine.run.sp)?;
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
    let files: Vec<std::path::PathBuf> = model
        .checkpoint
        .components()
        .into_iter()
        .flat_map(|(_, c)| c.files.iter().map(|f| f.path.clone()))
        .collect();
    let largest = files
        .iter()
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .context("calibrating: the checkpoint has no files")?;
    let file =
        std::fs::File::open(largest).with_context(|| format!("reading {}", largest.display()))?;
    // SAFETY: the checkpoint's files are not written while the engine maps them (the
    // engine maps them the same way to run).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("mapping {}", largest.display()))?;
    let len = block.min(map.len()).max(1);
    let mut slot = vec![0u8; len];
    let rate = |src: &[u8], dst: &mut [u8]| {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            let mut moved = 0usize;
            while moved < (256 << 20).max(len) {
                dst.copy_from_slice(src);
                moved += len;
            }
            std::hint::black_box(&dst);
            best = best.min(t.elapsed().as_secs_f64() / moved as f64);
        }
        1.0 / best
    };
    let host_to_device = rate(&map[..len], &mut slot);
    let other = vec![1u8; len];
    let peer = rate(&other, &mut slot);
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
fn plan_rows(
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
        guidance: r.guidance > 1.0,
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
        .saturating_sub(model.activation_bytes(requests, a.engine.run.sp)?)
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

/// For each strategy with a `plan` row: the rates it was chosen at, what it kept and
/// predicted, and its measured step time against the best manual count's.
fn print_plans(configs: &[Config], rows: &[Row], planned: &[Option<(Choice, Rates)>]) {
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
fn print_groups(model: &Model, rows: &[Row], steps: usize) -> Result<()> {
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

/// The table: one line per configuration; the gathered column only where ranks gather.
/// `vs resident` is best over best; `paired med` the median of the rounds' own ratios.
fn print_table(rows: &[Row], gathers: bool) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_blocks_parse_and_resolve() {
        for (s, want, resolved) in [
            ("0", KeptBlocks::Fixed(0), ResidentBlocks::Fixed(0)),
            ("5", KeptBlocks::Fixed(5), ResidentBlocks::Fixed(5)),
            ("auto", KeptBlocks::Auto, ResidentBlocks::Auto),
            ("L/2", KeptBlocks::Share(2), ResidentBlocks::Fixed(6)),
            (" L/5 ", KeptBlocks::Share(5), ResidentBlocks::Fixed(2)),
            ("each", KeptBlocks::Each, ResidentBlocks::Fixed(0)),
            ("plan", KeptBlocks::Plan, ResidentBlocks::Fixed(0)),
        ] {
            let k: KeptBlocks = s.parse().unwrap();
            assert_eq!(k, want, "{s}");
            assert_eq!(k.resolve(12), resolved, "{s}");
            assert_eq!(k.to_string().parse::<KeptBlocks>().unwrap(), k);
        }
        for bad in ["L/0", "L/x", "half", "-1", "L"] {
            let e = bad.parse::<KeptBlocks>().unwrap_err();
            assert!(e.contains(bad.trim()), "{e}");
        }
    }
}
