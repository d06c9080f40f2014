//! Opening a sized run's devices: on the CPU or on CUDA GPUs, each backend chooses K and
//! the host path, checks the plan's memory, builds the collective group and each
//! sequence-parallel group's exchange, and spawns the ranks with the poison that stops
//! them all when one fails.

use std::sync::Arc;

use candle_core::DType;

use super::options::EngineOptions;
use super::report::RankResult;
use super::sizing::{check_budget, Sizing};
use super::state::Run;
use crate::execution::backend::Collective;
use crate::execution::cpu::{CpuBackend, LocalGroup};
#[cfg(feature = "cuda")]
use crate::execution::cuda;
use crate::execution::cuda::HostMode;
use crate::execution::family::FamilyRuntime;
use crate::execution::seq::{LocalExchange, Rendezvous, SeqExchange};
use crate::execution::work::WorkSource;
use crate::{Error, Result};

/// A sized run about to open its devices: each backend chooses K and the host path, checks
/// the plan's memory and spawns the ranks.
pub(super) struct Start<'a> {
    pub(super) family: &'a dyn FamilyRuntime,
    pub(super) opts: &'a EngineOptions,
    pub(super) source: &'a dyn WorkSource,
    /// The dtype blocks compute in.
    pub(super) dtype: DType,
    pub(super) sizing: Sizing,
}

impl<'a> Start<'a> {
    /// The ranks compute on the CPU (`why`: what chose it): K from the plan's budget in
    /// the plan's terms, copies from the mapping or staged through a ring (`--host-memory
    /// pin`), and one thread-backed group.
    pub(super) fn on_cpu(self, why: &str) -> Result<Vec<RankResult>> {
        tracing::info!(%why, "computing on the CPU");
        let opts = self.opts;
        let staging = match opts.host {
            HostMode::Auto => None,
            HostMode::Pin => Some(opts.staging_buffers),
            HostMode::Register | HostMode::Pageable => {
                return Err(Error::invalid(
                    "host-memory",
                    format!(
                        "`--host-memory {}` applies to CUDA devices, but the ranks compute on the CPU ({why}), which reads weights from the mapped checkpoint; use auto, or pin to stage them through a ring",
                        opts.host
                    ),
                ))
            }
        };
        let Sizing {
            streamed,
            groups,
            outside,
            weights_budget,
        } = &self.sizing;
        let planned =
            crate::slots::DeviceNeeds::of(groups, &streamed.placement(opts.strategy, 0), *outside);
        let slots = crate::slots::cpu_slots(opts.slots, opts.strategy, planned, *weights_budget)?;
        check_budget(groups, streamed, opts, slots, *outside)?;
        let backend = Arc::new(CpuBackend::new(opts.timeout));
        let group = LocalGroup::new(opts.dp * opts.sp, opts.timeout);
        let capacity = weights_budget.unwrap_or(u64::MAX);
        let exchanges = (opts.sp > 1).then(|| {
            (0..opts.dp)
                .map(|_| {
                    Arc::new(LocalExchange(Rendezvous::new(opts.sp, opts.timeout)))
                        as Arc<dyn SeqExchange>
                })
                .collect::<Vec<_>>()
        });
        let ranks = group
            .comms()
            .into_iter()
            .map(|comm| {
                let x = exchanges.as_ref().map(|x| x[comm.rank() / opts.sp].clone());
                (backend.clone(), comm, capacity, x)
            })
            .collect();
        let poison = |why: String| {
            for x in exchanges.iter().flatten() {
                x.poison(why.clone());
            }
            group.poison(why)
        };
        let r = self.run(slots, staging).spawn(ranks, &poison);
        match (r, group.dropped_before_poison()) {
            (Err(e), Some(rank)) => Err(Error::Rank {
                rank,
                msg: format!(
                    "dropped its communicator before the group was poisoned, after the run failed with: {e} (an ordering bug in the rank loop: on a GPU this hangs in ncclCommDestroy)"
                ),
            }),
            (r, _) => r,
        }
    }

    /// The ranks compute on `devices` CUDA GPUs: K sized from what the weights take in
    /// the compute dtype, and an NCCL group.
    #[cfg(feature = "cuda")]
    pub(super) fn on_cuda(self, devices: usize) -> Result<Vec<RankResult>> {
        tracing::info!(devices, "computing on CUDA GPUs");
        let opts = self.opts;

        let Sizing {
            streamed,
            groups,
            outside,
            weights_budget,
        } = &self.sizing;
        // The same weights outside the slots at the size they take in the compute dtype
        // (a bf16 Wan computes in f32 and holds them at twice their file size). `--slots
        // auto` sizes K from this, so it never overcommits; the profile has no per-dtype
        // figure for them yet, so the planner and the start check cannot.
        let stored_outside = self.family.stored_resident_bytes(opts.decode, self.dtype);
        let needs = crate::slots::DeviceNeeds::of(
            groups,
            &streamed.placement(opts.strategy, 0),
            stored_outside,
        );
        let r = cuda::setup(
            streamed,
            &cuda::CudaOptions {
                strategy: opts.strategy,
                slots: opts.slots,
                weights_budget: *weights_budget,
                needs,
                host: opts.host,
                timeout: opts.timeout,
                dtype: self.dtype,
                // The decoder's weights are on the device already (the server loads
                // them before the ranks start), so free memory has them gone; its
                // decode peak runs beside the passes and stays free with theirs.
                activations: opts.activations.saturating_add(opts.decoder.peak),
            },
        )?;
        check_budget(groups, streamed, opts, r.slots, *outside)?;
        // Each group's members exchange over communicators of their own.
        let exchanges = if opts.sp > 1 {
            let contexts: Vec<_> = r
                .ranks
                .iter()
                .map(|x| x.backend.context().clone())
                .collect();
            Some(
                contexts
                    .chunks(opts.sp)
                    .map(|c| {
                        cuda::seq::NcclExchange::init(c, opts.timeout)
                            .map(|x| x as Arc<dyn SeqExchange>)
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        } else {
            None
        };
        let ranks = r
            .ranks
            .into_iter()
            .map(|x| {
                let exchange = exchanges
                    .as_ref()
                    .map(|e| e[x.comm.rank() / opts.sp].clone());
                (x.backend, x.comm, x.capacity, exchange)
            })
            .collect();
        let group = r.group;
        let staging = r.host.stages().then_some(opts.staging_buffers);
        let poison = |why: String| {
            for x in exchanges.iter().flatten() {
                x.poison(why.clone());
            }
            group.poison(why)
        };
        self.run(r.slots, staging).spawn(ranks, &poison)
    }

    /// The run the ranks share, with K = `slots` and a staging ring of `staging` buffers.
    fn run(self, slots: usize, staging: Option<usize>) -> Run<'a> {
        Run {
            family: self.family,
            streamed: self.sizing.streamed,
            source: self.source,
            opts: self.opts,
            slots,
            outside: self.sizing.outside,
            dtype: self.dtype,
            staging,
        }
    }
}
