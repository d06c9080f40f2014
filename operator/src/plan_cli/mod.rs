//! `layerwise-operator plan`: the operator's planner as a command, for sizing without a
//! cluster ("what does Wan 2.2 at 720p need on L40S or H100?"). It reads a checkpoint's
//! profile (a pipeline folder, profiled from its headers as the node agent does, or the
//! JSON `layerwise inspect --json` prints), one node described by flags, and a workload (a
//! DiffusionDeployment file, flags, or both), and prints the plan the operator would record
//! in the deployment's status, or the refusal it would state.
//!
//! It is no second planner: the node becomes the planner's [`NodeShape`] through
//! [`NodeShape::for_spec`] and the plan comes from [`plan_deployment`], the two
//! calls the reconcile makes; the spec is read with the CRD's own types and checked against
//! the rules its schema carries ([`schema`]). The flags are [`args`]; [`inputs`] reads them
//! into the planner's inputs, [`planned`] plans, [`render`] prints the record; this file
//! runs the command.
//!
//! [`NodeShape`]: crate::planner::NodeShape
//! [`NodeShape::for_spec`]: crate::planner::NodeShape::for_spec
//! [`plan_deployment`]: crate::planner::plan_deployment

pub mod args;
pub mod inputs;
pub mod planned;
pub mod render;
pub mod schema;

use std::io::Write as _;

use anyhow::Result;

pub use args::{LimitArgs, Link, NodeArgs, PlanArgs, WorkloadArgs};
pub use planned::{plan, Planned};

/// Runs the command: prints the plan (text, or JSON with `--json`) and returns the exit
/// code: 0 for a plan, [`REFUSED`] for a refusal.
pub fn run(args: &PlanArgs) -> Result<i32> {
    let planned = plan(args)?;
    let out = if args.json {
        serde_json::to_string_pretty(&render::record(&planned))?
    } else {
        render::text(&planned)
    };
    // A closed pipe (`| head`) ends the output, not the command.
    match writeln!(std::io::stdout().lock(), "{out}") {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
        _ => {}
    }
    Ok(if planned.outcome.is_ok() { 0 } else { REFUSED })
}

/// The exit code of a refusal (a usage or input error exits 1 or 2).
pub const REFUSED: i32 = 3;
