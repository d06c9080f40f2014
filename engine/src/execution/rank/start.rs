//! Starting a run: [`drive`] checks the dp × sp topology the family allows, resolves the
//! device and the dtype blocks compute in, sizes the run, and hands it to the device kind
//! that opens the ranks ([`super::devices`]).

use candle_core::DType;

use super::devices::Start;
use super::options::EngineOptions;
use super::report::RankResult;
use super::sizing::Sizing;
use crate::execution::cuda::{self, Resolved};
use crate::execution::dtype::{self, ComputeDtype};
use crate::execution::family::FamilyRuntime;
use crate::execution::work::WorkSource;
use crate::layout::GroupLayout;
use crate::memory::GroupBytes;
use crate::{Error, Result};
use layerwise_core::compute_dtype::{Backend, ComputeElement};
use layerwise_core::topology::Topology;

/// Runs `opts.dp × opts.sp` rank threads of `family` on `source` until it closes and
/// every rank is idle. Returns the root cause when a rank fails (not a peer's
/// [`Error::Abandoned`]).
///
/// The source sees `dp` ranks, one per group: a group's first rank (its leader) takes its
/// requests, reports their progress and returns their outputs; the others follow it,
/// each computing its share of the same request.
pub fn drive(
    family: &dyn FamilyRuntime,
    opts: &EngineOptions,
    source: &dyn WorkSource,
) -> Result<Vec<RankResult>> {
    let topology = topology(family, opts)?;
    let device = cuda::resolve(opts.device, topology.ranks())?;
    let layouts = family.layouts(topology.ranks())?;
    let gpu = matches!(device, Resolved::Cuda { .. });
    let dtype = compute_dtype(family, opts.compute_dtype, gpu, &layouts)?;
    let sizing = Sizing::new(family, opts, layouts)?;
    let start = Start {
        family,
        opts,
        source,
        dtype,
        sizing,
    };
    match device {
        Resolved::Cpu { why } => start.on_cpu(&why),
        #[cfg(feature = "cuda")]
        Resolved::Cuda { devices } => start.on_cuda(devices),
        #[cfg(not(feature = "cuda"))]
        Resolved::Cuda { .. } => unreachable!("resolve never picks CUDA without the feature"),
    }
}

/// `opts`' topology, refused where `family` cannot split a request's sequence `sp` ways.
pub fn topology(family: &dyn FamilyRuntime, opts: &EngineOptions) -> Result<Topology> {
    let t = Topology::new(opts.dp, opts.sp)?;
    if t.sp > 1 {
        match family.sequence_parallel() {
            None => {
                return Err(Error::invalid(
                    "sp",
                    format!(
                        "{}: the {} family computes each request's sequence on one rank (sequence parallelism runs for the video families)",
                        t.sp,
                        family.name()
                    ),
                ))
            }
            Some((most, why)) if t.sp > most => {
                return Err(Error::invalid(
                    "sp",
                    format!("{}: at most {most} for this model: {why}", t.sp),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(t)
}

/// The dtype a run computes in: `--compute-dtype` resolved for the device (`gpu` or the
/// CPU) and the dtypes the streamed blocks hold. An explicit dtype the family cannot
/// compute in is refused; `auto` is the planner's own decision
/// ([`ComputeElement::auto`]), f32 for a family that computes in f32 only. The engine's
/// activation budget reads it too ([`crate::engine::Model::compute_element`]).
pub(crate) fn compute_dtype(
    family: &dyn FamilyRuntime,
    choice: ComputeDtype,
    gpu: bool,
    layouts: &[GroupLayout],
) -> Result<DType> {
    let groups: Vec<GroupBytes> = layouts.iter().map(|l| GroupBytes::of("", l)).collect();
    let dtype = if choice == ComputeDtype::Auto {
        let backend = if gpu { Backend::Gpu } else { Backend::Cpu };
        let family_dtypes = family.checkpoint().compute_dtypes();
        let e = ComputeElement::auto(backend, &groups, family_dtypes);
        let stored = groups
            .iter()
            .flat_map(|g| g.blocks_by_dtype.keys().map(String::as_str));
        if ComputeElement::for_checkpoint(backend, stored) != e {
            tracing::info!(
                family = family.name(),
                "the family computes in f32 only: computing in f32"
            );
        }
        dtype::candle(e)
    } else {
        let want = choice.resolve(gpu, &[]);
        let supported = family.compute_dtypes();
        if !supported.contains(&want) {
            return Err(Error::invalid(
                "compute-dtype",
                format!(
                    "{choice}: the {} family computes in {} only",
                    family.name(),
                    supported
                        .iter()
                        .map(|d| dtype::name(*d))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        want
    };
    tracing::info!(compute_dtype = dtype::name(dtype), "compute dtype");
    Ok(dtype)
}
