//! `layerwise bench`: the same requests under each strategy and, for the streaming ones,
//! each number of blocks kept on the device, run interleaved round by round so that the
//! machine's noise falls on every configuration alike. Each configuration's best round is
//! reported against `resident`'s: step time, stalls, bytes moved per step, device and
//! pinned host bytes, and whether its latents are bit-identical to the reference.
//!
//! `--resident-blocks each,plan` measures every manual count beside the one the
//! step-time model chooses ([`crate::timing::choose`], the planner's code) from rates this
//! run calibrates first ([`plan`]), and prints each against the best.
//!
//! It ends with this machine's rates, measured, in the form `spec.accelerator.rates` takes
//! ([`rates`], which `layerwise rates` prints alone).
//!
//! `--cache KIND` compares the step cache off and on instead ([`cache`]).
//!
//! By concern: what runs ([`options`]), running it ([`runs`]), `plan`'s calibration
//! ([`plan`]), the report ([`report`]) and the measured rates ([`rates`]).

mod args;
mod cache;
mod options;
mod plan;
mod rates;
mod report;
mod runs;

pub(crate) use args::BenchArgs;
pub(crate) use rates::{rates, RatesArgs};

use std::collections::BTreeMap;

use anyhow::{bail, Result};

use super::commands::gib;
use crate::engine::Model;
use crate::memory::GroupBytes;
use options::configs;
use plan::plan_rows;
use report::{print_groups, print_phases, print_plans, print_table, rows, Report};
use runs::{run_rounds, warm_page_cache};

pub(super) fn bench(a: BenchArgs) -> Result<()> {
    let model = Model::open(&a.engine.run.model)?;
    if let Some(c) = &a.request.cache {
        warm_page_cache(&model)?;
        return cache::bench_cache(&a, &model, c);
    }
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
        a.engine.run
            .device_memory_mib
            .map_or("unbounded".into(), |m| format!("{m} MiB")),
        a.request.n,
        a.rounds.max(1)
    );
    let most_sp = configs.iter().map(|c| c.sp).max().unwrap_or(1);
    print_table(&rows, a.engine.run.dp * most_sp > 1);
    print_phases(&rows);
    print_plans(&configs, &rows, &planned);
    print_groups(&model, &rows, steps)?;
    // The CPU backend's rates: the dtype its ranks compute in there (`auto`: f32).
    rates::print_measured(
        &a.engine.run.model,
        a.engine.backend.compute_dtype.resolve(false, &[]),
    )?;
    if !rows.iter().all(|r| r.identical) {
        bail!("configurations produced different latents");
    }
    Ok(())
}
