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
use crate::{Error, Result};
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
    let dtype = compute_dtype(family, opts.compute_dtype, &device, &layouts)?;
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

/// The dtype a run computes in: `--compute-dtype` resolved for the device and the dtypes
/// the streamed blocks hold. An explicit dtype the family cannot compute in is refused;
/// `auto` falls back to f32 for such a family, saying so.
fn compute_dtype(
    family: &dyn FamilyRuntime,
    choice: ComputeDtype,
    device: &Resolved,
    layouts: &[GroupLayout],
) -> Result<DType> {
    let mut stored: Vec<safetensors::Dtype> = Vec::new();
    for d in layouts.iter().flat_map(|l| l.dtypes.iter()) {
        if !stored.contains(d) {
            stored.push(*d);
        }
    }
    let gpu = matches!(device, Resolved::Cuda { .. });
    let want = choice.resolve(gpu, &stored);
    let dtype = if family.compute_dtypes().contains(&want) {
        want
    } else if choice == ComputeDtype::Auto {
        tracing::info!(
            family = family.name(),
            checkpoint = dtype::name(want),
            "the family computes in f32 only: computing in f32"
        );
        DType::F32
    } else {
        return Err(Error::invalid(
            "compute-dtype",
            format!(
                "{choice}: the {} family computes in {} only",
                family.name(),
                family
                    .compute_dtypes()
                    .iter()
                    .map(|d| dtype::name(*d))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    tracing::info!(compute_dtype = dtype::name(dtype), ?stored, "compute dtype");
    Ok(dtype)
}
