//! The plan the command makes: its inputs read ([`super::inputs`]) into the planner's, and
//! the planner called as the reconcile calls it.

use std::path::PathBuf;

use anyhow::Result;
use crds::{DiffusionDeploymentSpec, Profile};

use super::args::PlanArgs;
use super::inputs;
use crate::planner::{self, Candidate, NodeShape, Overrides, Recorded, Refusal};

/// What the command planned: its inputs as the planner saw them, and the plan or refusal.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Where the profile came from.
    pub model: PathBuf,
    pub profile: Profile,
    pub spec: DiffusionDeploymentSpec,
    /// The accelerator product, as `--gpu` names it.
    pub product: String,
    pub node: NodeShape,
    pub outcome: Result<Recorded, Refusal>,
}

/// Reads `args` into the planner's inputs and plans as the reconcile does.
pub fn plan(args: &PlanArgs) -> Result<Planned> {
    let profile = inputs::profile(&args.model)?;
    let spec = inputs::spec(
        args.deployment.as_deref(),
        &args.workload,
        &args.node,
        &profile,
    )?;
    let report = inputs::node(&args.node)?;
    let product = report.product.clone();
    let node = NodeShape::for_spec(report, &spec);
    let candidates = [Candidate {
        node: node.clone(),
        profile: &profile,
    }];
    let outcome = planner::plan_deployment(
        &spec,
        &candidates,
        &Overrides::of(&spec),
        &args.limits.limits(),
    );
    Ok(Planned {
        model: args.model.clone(),
        profile,
        spec,
        product,
        node,
        outcome,
    })
}
