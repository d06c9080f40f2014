//! The one rank loop. Each dp rank is a thread with its own pipeline and device budget;
//! all share one mapping of the checkpoint and move in lockstep by group and block index.
//! A rank pulls requests from a [`WorkSource`] (a fixed list for `Model::run`, the
//! scheduler for the server) at pass boundaries, so a rank whose request finishes takes
//! the next one at once while the others carry on with theirs. At every pass boundary the
//! ranks meet at the [`Coordinator`] and take the same decision: run a pass over one
//! group (ranks whose request wants another group, or that have none, join it without
//! computing, so the collectives line up), or pause together until work arrives, or exit.
//! Nothing here knows the family: requests are [`Task`]s of a [`FamilyRuntime`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::DType;

use super::backend::{Backend, Collective};
use super::budget::DeviceBudget;
use super::cpu::{CpuBackend, LocalGroup};
use super::cuda::plan::ResidentBlocks;
use super::cuda::{self, DeviceChoice, HostMode, Resolved, SlotsChoice};
use super::dtype::{self, ComputeDtype};
use super::family::{FamilyRuntime, RankModel, Task};
use super::lockstep::{Coordinator, Decision, Flags, Handoff};
use super::pipeline::{Hook, Pipeline, PipelineOptions, Streamed};
use super::seq::{LocalExchange, Rendezvous, SeqExchange, Split};
use super::trace::{Lane, Trace};
use super::work::{Output, PassReport, WorkKey, WorkSource};
use crate::decode::DecoderBytes;
use crate::layout::GroupLayout;
use crate::memory::{self, GroupBytes};
use crate::{Error, Result, Strategy};
use layerwise_core::topology::Topology;

/// How the engine runs.
#[derive(Clone)]
pub struct EngineOptions {
    pub strategy: Strategy,
    /// Requests served at once: groups of `sp` ranks, each on its own request.
    pub dp: usize,
    /// Ranks per group, splitting each request's sequence ([`layerwise_core::topology`]).
    /// The run uses `dp × sp` devices, and the weights shard over all of them.
    pub sp: usize,
    /// K, or `auto`: as many as the device memory holds (on the CPU, `device_memory`).
    pub slots: SlotsChoice,
    /// Device memory per rank, in bytes, for everything: weights, `activations` and
    /// `overhead` (the CPU backend enforces it like a GPU would). The engine refuses to
    /// start when the memory model's need is larger.
    pub device_memory: u64,
    /// Device bytes each rank keeps free for the largest request it accepts
    /// ([`crate::checkpoint::ActivationCost::checked_bytes`] of its bounds).
    pub activations: u64,
    /// Device bytes each rank keeps free for the runtime (context, kernels, allocator).
    pub overhead: u64,
    /// Components whose blocks stay whole on every device under a streaming strategy.
    pub resident_components: Vec<String>,
    /// Blocks of each other streamed group that stay on the device, spread evenly.
    pub resident_blocks: ResidentBlocks,
    /// Blocks kept of each group of the components named, in place of `resident_blocks`
    /// for them (`--resident-blocks-by-component`).
    pub resident_blocks_by_component: BTreeMap<String, u64>,
    /// How weights reach the device from the mapped checkpoint. The CPU takes `auto`
    /// (copy from the mapping) and `pin` (stage through the ring, as a GPU that cannot
    /// register the mapping does).
    pub host: HostMode,
    /// Buffers in each rank's staging ring when copies stage through one
    /// ([`memory::STAGING_BUFFERS`], the planner's figure, unless a test asks otherwise).
    pub staging_buffers: usize,
    /// Longest any rank may wait on a transfer or a peer before failing.
    pub timeout: Duration,
    pub hook: Option<Hook>,
    /// Decode latents into pixels on the ranks.
    pub decode: bool,
    /// Device bytes each rank's device keeps for a decoder beside the ranks (`serve`
    /// decoding on the device, [`crate::decode`]): its weights, loaded before the ranks
    /// start, and its decode peak, kept free. Counted in `device_memory`; zero when
    /// nothing decodes beside the ranks on their devices.
    pub decoder: DecoderBytes,
    /// Record copy, gather and compute spans here.
    pub trace: Option<Arc<Trace>>,
    /// Where the ranks compute: the CPU backend, CUDA GPUs (the `cuda` feature), or
    /// whichever is there.
    pub device: DeviceChoice,
    /// The dtype blocks compute in ([`super::dtype`]).
    pub compute_dtype: ComputeDtype,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            strategy: Strategy::OffloadSharded,
            dp: 1,
            sp: 1,
            slots: SlotsChoice::default(),
            device_memory: u64::MAX,
            activations: 0,
            overhead: 0,
            resident_components: Vec::new(),
            resident_blocks: ResidentBlocks::default(),
            resident_blocks_by_component: BTreeMap::new(),
            host: HostMode::Auto,
            staging_buffers: memory::STAGING_BUFFERS as usize,
            timeout: Duration::from_secs(120),
            hook: None,
            decode: true,
            decoder: DecoderBytes::default(),
            trace: None,
            device: DeviceChoice::Cpu,
            compute_dtype: ComputeDtype::Auto,
        }
    }
}

/// What one rank did, for `RunStats`.
pub struct RankResult {
    /// K this rank ran with.
    pub slots: usize,
    /// Blocks of each streamed group this rank kept on the device (what
    /// `--resident-blocks auto` chose).
    pub resident_blocks: usize,
    /// Compute waiting for weights, in passes where this rank had work.
    pub stall: Duration,
    /// Time of this rank's denoising steps (passes that completed a step).
    pub step_time: Duration,
    pub steps: usize,
    /// Time of the passes where this rank computed (steps and other passes alike).
    pub busy_time: Duration,
    /// Stall and time of the busy passes that switched groups (the pass after a pass
    /// over another group: text encoder to transformer, one expert to the other).
    pub switch_stall: Duration,
    pub switch_time: Duration,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    /// Bytes of `bytes_copied` that went through the staging ring.
    pub bytes_staged: u64,
    /// Page-locked host bytes this rank held for staging, at their peak.
    pub pinned_host_bytes: u64,
    pub peak: u64,
    pub peak_by_kind: BTreeMap<&'static str, u64>,
}

/// Where one rank computes: its backend, its communicator, its device memory and K, and
/// its sequence-parallel group's exchange (none when `sp` is 1).
struct Placement<B: Backend, C: Collective<B>> {
    backend: Arc<B>,
    comm: C,
    capacity: u64,
    slots: usize,
    exchange: Option<Arc<dyn SeqExchange>>,
}

/// One rank's backend, communicator, device memory capacity and group exchange, as
/// [`Run::spawn`] takes them.
type RankParts<B, C> = (Arc<B>, C, u64, Option<Arc<dyn SeqExchange>>);

/// A request a rank is working on.
struct Active {
    key: WorkKey,
    task: Box<dyn Task>,
    cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The request, kept by a sequence-parallel group's leader to hand its followers.
    req: Option<Arc<crate::execution::work::Request>>,
}

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

/// What a run streams and the device bytes around it, known before any device is open.
struct Sizing {
    /// The groups it streams, with the blocks `--resident-blocks` keeps.
    streamed: Streamed,
    /// Each group's block bytes, for the memory model.
    groups: Vec<GroupBytes>,
    /// Device bytes outside the slots that every rank keeps (prologues, epilogues,
    /// decoder), in the memory model's term: the profile's file sizes, which the
    /// operator's plan uses, so that a plan it records is one this engine starts with and
    /// accounts to the byte.
    outside: u64,
    /// What the weights may take of `--device-memory-mib`: the rest is the activations',
    /// the runtime's and the decoder's beside the ranks. None without a budget.
    weights_budget: Option<u64>,
}

impl Sizing {
    /// Sizes a run of `family` over `layouts` (its groups for `opts.dp`), with the blocks
    /// kept on the device that `--resident-blocks` asks for.
    fn new(
        family: &dyn FamilyRuntime,
        opts: &EngineOptions,
        layouts: Vec<GroupLayout>,
    ) -> Result<Sizing> {
        let outside = family.resident_bytes(opts.decode);
        let weights_budget = (opts.device_memory != u64::MAX).then(|| {
            opts.device_memory
                .saturating_sub(opts.activations)
                .saturating_sub(opts.overhead)
                .saturating_sub(opts.decoder.total())
        });
        let streamed_with = |n: usize| {
            Streamed::new(
                layouts.clone(),
                family.mappings(),
                family.group_components(),
                &opts.resident_components,
                n,
                &opts.resident_blocks_by_component,
            )
        };
        let resident_blocks = match opts.resident_blocks {
            ResidentBlocks::Fixed(n) => n,
            ResidentBlocks::Auto if !opts.strategy.streams() => 0,
            ResidentBlocks::Auto => {
                let Some(budget) = weights_budget else {
                    return Err(Error::invalid(
                        "resident-blocks",
                        "`--resident-blocks auto` keeps as many blocks as the device memory budget holds after the slots: give --device-memory-mib, or a number of blocks",
                    ));
                };
                auto_resident_blocks(&streamed_with(0)?, opts, outside, budget)?
            }
        };
        let streamed = streamed_with(resident_blocks)?;
        if resident_blocks > 0 {
            tracing::info!(
                resident_blocks,
                "blocks of each streamed group kept on the device"
            );
        }
        Ok(Sizing {
            groups: streamed.bytes(),
            streamed,
            outside,
            weights_budget,
        })
    }
}

/// `--resident-blocks auto`: as many blocks of each streamed group as `budget` holds
/// beside the slots, with K first chosen from the budget with no block kept. `none` is
/// the run's groups with no block kept.
fn auto_resident_blocks(
    none: &Streamed,
    opts: &EngineOptions,
    outside: u64,
    budget: u64,
) -> Result<usize> {
    let groups = none.bytes();
    let needs = cuda::plan::DeviceNeeds::of(&groups, &none.placement(opts.strategy, 0), outside);
    let k = cuda::plan::cpu_slots(opts.slots, opts.strategy, needs, Some(budget))?;
    Ok(cuda::plan::auto_resident_blocks(
        &groups,
        &none.placement(opts.strategy, k),
        outside,
        budget,
    ))
}

/// A sized run about to open its devices: each backend chooses K and the host path, checks
/// the plan's memory and spawns the ranks.
struct Start<'a> {
    family: &'a dyn FamilyRuntime,
    opts: &'a EngineOptions,
    source: &'a dyn WorkSource,
    /// The dtype blocks compute in.
    dtype: DType,
    sizing: Sizing,
}

impl<'a> Start<'a> {
    /// The ranks compute on the CPU (`why`: what chose it): K from the plan's budget in
    /// the plan's terms, copies from the mapping or staged through a ring (`--host-memory
    /// pin`), and one thread-backed group.
    fn on_cpu(self, why: &str) -> Result<Vec<RankResult>> {
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
            cuda::plan::DeviceNeeds::of(groups, &streamed.placement(opts.strategy, 0), *outside);
        let slots = cuda::plan::cpu_slots(opts.slots, opts.strategy, planned, *weights_budget)?;
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
    fn on_cuda(self, devices: usize) -> Result<Vec<RankResult>> {
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
        let needs = cuda::plan::DeviceNeeds::of(
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

/// Refuses to start when the memory model's need for this run (K = `slots`) is larger
/// than the device memory budget, naming both figures and the terms.
fn check_budget(
    groups: &[GroupBytes],
    streamed: &Streamed,
    opts: &EngineOptions,
    slots: usize,
    outside: u64,
) -> Result<()> {
    if opts.device_memory == u64::MAX {
        return Ok(());
    }
    let need = memory::device_bytes(
        groups,
        &streamed.placement(opts.strategy, slots),
        outside,
        opts.activations,
        opts.overhead,
    )
    .with_decoder(opts.decoder);
    if need.total() > opts.device_memory {
        return Err(Error::invalid(
            "device-memory",
            format!(
                "{} with dp {} and {slots} slots needs {} bytes per rank (block weights {}, slots {}, resident {}, activations {}, overhead {}, decoder {}), but the budget is {} bytes (--device-memory-mib)",
                opts.strategy,
                opts.dp,
                need.total(),
                need.block_weights,
                need.slots,
                need.resident_weights,
                need.activations,
                need.overhead,
                need.decoder,
                opts.device_memory
            ),
        ));
    }
    Ok(())
}

/// What every rank thread of one run shares.
struct Run<'a> {
    family: &'a dyn FamilyRuntime,
    streamed: Streamed,
    source: &'a dyn WorkSource,
    opts: &'a EngineOptions,
    slots: usize,
    /// Device bytes each rank keeps outside the slots (what it charges for them).
    outside: u64,
    /// The dtype blocks compute in.
    dtype: DType,
    /// Buffers of each rank's staging ring, when copies stage through one.
    staging: Option<usize>,
}

impl Run<'_> {
    /// Runs one thread per rank on its backend and communicator (with the device budget
    /// capacity each has), and gathers their results. `poison` fails the collective
    /// group when a rank fails, so its peers stop instead of waiting.
    fn spawn<B: Backend, C: Collective<B>>(
        &self,
        ranks: Vec<RankParts<B, C>>,
        poison: &(dyn Fn(String) + Sync),
    ) -> Result<Vec<RankResult>> {
        let coord = Coordinator::new(self.opts.dp * self.opts.sp, self.opts.timeout);
        let results: Vec<Result<RankResult>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|(backend, comm, capacity, exchange)| {
                    let coord = &coord;
                    let span = tracing::info_span!("rank", rank = comm.rank());
                    std::thread::Builder::new()
                        .name(format!("rank-{}", comm.rank()))
                        .spawn_scoped(scope, move || {
                            let _g = span.enter();
                            let rank = comm.rank();
                            let place = Placement {
                                backend,
                                comm,
                                capacity,
                                slots: self.slots,
                                exchange,
                            };
                            // Poisons the collective group (which aborts every
                            // communicator) and the coordinator. Called by the failing
                            // rank *before* its pipeline and communicator drop: a
                            // communicator destroyed while peers wait in collectives, or
                            // with its own still queued, blocks forever.
                            let fail = |e: &Error| {
                                if matches!(e, Error::Abandoned(_)) {
                                    tracing::warn!(rank, error = %e, "rank gave up");
                                } else {
                                    tracing::error!(rank, error = %e, "rank failed");
                                }
                                let cause = first_cause(rank, e);
                                poison(cause.clone());
                                coord.poison(cause);
                            };
                            let r = self.rank_loop(place, coord, &fail);
                            if let Err(e) = &r {
                                self.source.failed(rank / self.opts.sp, e);
                            }
                            r
                        })
                        .expect("spawn rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank threads catch their panics"))
                .collect()
        });
        let mut ranks = Vec::new();
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(x) => ranks.push(x),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            let root = errors
                .iter()
                .position(|e| !matches!(e, Error::Abandoned(_)))
                .unwrap_or(0);
            return Err(errors.swap_remove(root));
        }
        Ok(ranks)
    }

    /// One rank from start to exit. On failure (an error or a panic, which is a rank
    /// failure like any other) `fail` runs while the rank's pipeline — its streams, slots
    /// and communicator — is still alive, and only then is it dropped.
    fn rank_loop<B: Backend, C: Collective<B>>(
        &self,
        place: Placement<B, C>,
        coord: &Coordinator,
        fail: &dyn Fn(&Error),
    ) -> Result<RankResult> {
        let rank = place.comm.rank();
        let mut held = None;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.rank_body(place, coord, &mut held)
        }))
        .unwrap_or_else(|p| {
            Err(Error::Rank {
                rank,
                msg: format!("panicked: {}", crate::error::panic_message(p.as_ref())),
            })
        });
        if let Err(e) = &r {
            fail(e);
        }
        drop(held);
        r
    }

    /// One rank's work: loads its weights and pipeline (left in `held`, for
    /// [`Run::rank_loop`] to drop after a failure), then meets its peers at every pass
    /// boundary and runs the pass they decide, until they decide to exit.
    fn rank_body<B: Backend, C: Collective<B>>(
        &self,
        place: Placement<B, C>,
        coord: &Coordinator,
        held: &mut Option<Pipeline<B, C>>,
    ) -> Result<RankResult> {
        let Placement {
            backend,
            comm,
            capacity,
            slots,
            exchange,
        } = place;
        let opts = self.opts;
        let rank = comm.rank();
        let (group, member) = (rank / opts.sp, rank % opts.sp);
        let budget = DeviceBudget::new(rank, capacity);
        let dev = backend.device().clone();
        let _resident_alloc = budget.charge(
            "resident_outside_blocks",
            "prologues, epilogues and the decoder",
            self.outside,
        )?;
        // A group's leader returns its outputs, so only it decodes them.
        let model = self
            .family
            .load_rank(&dev, self.dtype, opts.decode && member == 0)?;
        let pipe = held.insert(Pipeline::new(
            backend,
            comm,
            self.streamed.clone(),
            &budget,
            PipelineOptions {
                strategy: opts.strategy,
                slots,
                hook: opts.hook.clone(),
                trace: opts.trace.clone(),
                dtype: self.dtype,
                staging: self.staging,
            },
        )?);
        if member == 0 {
            self.source.ready(group);
        }
        let mut work = RankWork {
            run: self,
            rank,
            group,
            member,
            exchange,
            model: &*model,
            pipe,
            budget: &budget,
            active: None,
            failed: None,
            tally: Tally::default(),
        };
        let leader = group * opts.sp;
        loop {
            let (flags, handoff) = if member == 0 {
                let flags = work.at_boundary()?;
                (flags, work.handoff())
            } else {
                (Flags::following(), None)
            };
            let (d, handoffs) = coord.sync_handing(rank, flags, handoff)?;
            if member > 0 {
                work.follow(handoffs[leader].clone());
            }
            if d.exit {
                break;
            }
            if !d.run {
                self.source.wait(group, d.generation)?;
                continue;
            }
            let busy = work.active.as_ref().and_then(|a| a.task.wants()) == Some(d.group);
            work.pass(&d, busy)?;
        }
        work.finish(slots)
    }
}

/// What one rank measures of its passes, for its [`RankResult`].
#[derive(Default)]
struct Tally {
    /// Compute waiting for weights, counted only in passes where this rank computes: an
    /// idle rank also waits on its gathers, but nothing of its own is held up.
    stall: Duration,
    step_time: Duration,
    steps: usize,
    busy_time: Duration,
    switch_stall: Duration,
    switch_time: Duration,
    /// The group of the last pass that ran (busy or not): a different group next is a
    /// switch, whose first blocks only a prefetch keeps from stalling.
    last_group: Option<usize>,
    last_busy: bool,
}

/// One rank between its start and its exit: the request it works on, its pipeline, and
/// what it measures.
struct RankWork<'r, B: Backend, C: Collective<B>> {
    run: &'r Run<'r>,
    rank: usize,
    /// The group this rank serves requests in (what the source calls a rank), and its
    /// place there (0 leads: it alone talks to the source).
    group: usize,
    member: usize,
    /// The group's exchange, when requests split their sequence (`sp` > 1).
    exchange: Option<Arc<dyn SeqExchange>>,
    model: &'r dyn RankModel,
    pipe: &'r mut Pipeline<B, C>,
    budget: &'r DeviceBudget,
    active: Option<Active>,
    /// A follower's request that failed here: not started again when its leader, which
    /// learns of it at its next exchange, still hands it over.
    failed: Option<WorkKey>,
    tally: Tally,
}

impl<B: Backend, C: Collective<B>> RankWork<'_, B, C> {
    /// This rank's share of request `key`: the whole of it without sequence parallelism.
    fn split(&self, key: WorkKey) -> Split {
        match &self.exchange {
            Some(x) => Split::member(x.clone(), self.member, key),
            None => Split::whole(),
        }
    }

    /// The request a leader holds, for its followers.
    fn handoff(&self) -> Option<Handoff> {
        let a = self.active.as_ref()?;
        Some(Handoff {
            key: a.key,
            req: a.req.clone()?,
        })
    }

    /// A follower at a pass boundary: holds the request its leader holds (`handoff`),
    /// starting its share of a new one and dropping one the leader finished, cancelled
    /// or failed.
    fn follow(&mut self, handoff: Option<Handoff>) {
        if self.active.as_ref().map(|a| a.key) == handoff.as_ref().map(|h| h.key) {
            return;
        }
        self.active = None;
        let Some(h) = handoff else { return };
        if self.failed == Some(h.key) {
            return;
        }
        match self.model.start((*h.req).clone(), self.split(h.key)) {
            Ok(task) => {
                self.active = Some(Active {
                    key: h.key,
                    task,
                    cancel: None,
                    req: None,
                })
            }
            Err(e) => self.fail_request(h.key, &e),
        }
    }

    /// Request `key` failed on this rank with `e`: its group's other ranks stop waiting
    /// for it (their exchanges fail, quoting `e`); a follower remembers not to restart it.
    fn fail_request(&mut self, key: WorkKey, e: &Error) {
        if let Some(x) = &self.exchange {
            x.abort(key, self.member, &e.to_string());
        }
        if self.member > 0 {
            tracing::debug!(rank = self.rank, %key, error = %e, "request failed on this rank of its group");
            self.failed = Some(key);
        }
    }

    /// At a pass boundary: drops cancelled work, finishes what streams no more, then takes
    /// new work if free. Returns this rank's view for the coordinator.
    fn at_boundary(&mut self) -> Result<Flags> {
        let (rank, source) = (self.group, self.run.source);
        if let Some(a) = self
            .active
            .take_if(|a| a.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)))
        {
            source.finished(
                rank,
                a.key,
                Err(Error::Conflict {
                    what: format!("request {} was cancelled", a.key.id),
                }),
            );
        }
        if let Some(a) = self.active.take_if(|a| a.task.wants().is_none()) {
            source.finished(rank, a.key, finite(a.task.finish()));
        }
        let (generation, closed) = self.take_work()?;
        let want = self.active.as_ref().and_then(|a| a.task.wants());
        let then = self
            .active
            .as_ref()
            .and_then(|a| a.task.wants_after())
            .or_else(|| source.pending(rank).then(|| self.run.family.first_group()));
        Ok(Flags {
            want,
            then,
            closed,
            generation,
        })
    }

    /// When free, takes requests until one wants a pass (one that wants none is finished
    /// at once, one that fails to start fails) or none is waiting. Returns the source's
    /// arrival generation and whether it is closed, as last seen (`u64::MAX` and open
    /// when busy, so it never asked).
    fn take_work(&mut self) -> Result<(u64, bool)> {
        let (rank, source) = (self.group, self.run.source);
        let (mut generation, mut closed) = (u64::MAX, false);
        while self.active.is_none() {
            let t = source.take(rank)?;
            (generation, closed) = (t.generation, t.closed);
            let Some(work) = t.work else { break };
            let key = work.key;
            let req = self.exchange.is_some().then(|| Arc::new(work.req.clone()));
            match self.model.start(work.req, self.split(key)) {
                Ok(task) if task.wants().is_some() => {
                    self.active = Some(Active {
                        key,
                        task,
                        cancel: work.cancel,
                        req,
                    })
                }
                Ok(task) => source.finished(rank, key, finite(task.finish())),
                Err(e) => source.finished(rank, key, Err(e)),
            }
        }
        Ok((generation, closed))
    }

    /// Runs the pass `d` decided, computing when `busy` (this rank's request wants its
    /// group), and reports it.
    fn pass(&mut self, d: &Decision, busy: bool) -> Result<()> {
        let t0 = Instant::now();
        let stall_before = self.pipe.stats().stall;
        let failure = self.compute(d, busy)?;
        let t = &mut self.tally;
        let switched = t.last_group.is_some_and(|g| g != d.group);
        t.last_group = Some(d.group);
        t.last_busy = busy;
        if busy {
            let stalled = self.pipe.stats().stall - stall_before;
            t.stall += stalled;
            if switched {
                t.switch_stall += stalled;
                t.switch_time += t0.elapsed();
            }
            self.end_step(failure, t0);
        }
        if self.member == 0 {
            self.run.source.pass_done(
                self.group,
                &PassReport {
                    busy,
                    elapsed: t0.elapsed(),
                    pipeline: self.pipe.stats(),
                    device_bytes: self.budget.used(),
                },
            );
        }
        Ok(())
    }

    /// The pass through the pipeline, with this rank's request computing each block when
    /// `busy`. A request's own failure ends that request, never the pass: the rank keeps
    /// joining the collectives so its peers are not disturbed. Returns that failure.
    fn compute(&mut self, d: &Decision, busy: bool) -> Result<Option<Error>> {
        let mut failure: Option<Error> = None;
        let key = self.active.as_ref().map(|a| a.key);
        let (exchange, member) = (self.exchange.as_deref(), self.member);
        // A failure stops this rank's share at once; its group's others stop waiting.
        let failed = |e: Error, failure: &mut Option<Error>| {
            if let (Some(x), Some(k)) = (exchange, key) {
                x.abort(k, member, &e.to_string());
            }
            *failure = Some(e);
        };
        let mut task = self.active.as_mut().filter(|_| busy).map(|a| &mut a.task);
        if let Some(t) = task.as_mut() {
            if let Err(e) = t.begin() {
                failed(e, &mut failure);
            }
        }
        let (trace, rank) = (self.run.opts.trace.as_deref(), self.rank);
        self.pipe.pass(d.group, d.next, |i, w| {
            if let (Some(t), None) = (task.as_mut(), &failure) {
                let start = trace.map(|t| t.now_us());
                if let Err(e) = t.block(i, w) {
                    failed(e, &mut failure);
                }
                if let (Some(t), Some(s)) = (trace, start) {
                    t.record(rank, Lane::Compute, i, s);
                }
            }
            Ok(())
        })?;
        Ok(failure)
    }

    /// After a busy pass (started at `t0`): the request's failure in it, or its own at
    /// the step's end, ends the request; a step it completed is reported.
    fn end_step(&mut self, failure: Option<Error>, t0: Instant) {
        let (rank, source) = (self.group, self.run.source);
        let mut a = self.active.take().expect("busy has a task");
        let ended = match failure {
            Some(e) => Err(e),
            None => a.task.end(),
        };
        let took = t0.elapsed();
        self.tally.busy_time += took;
        match ended {
            Err(e) => {
                // A failure in a block has aborted the request already (a repeat is a
                // no-op); one in `end` has not.
                self.fail_request(a.key, &e);
                if self.member == 0 {
                    source.finished(rank, a.key, Err(e));
                }
            }
            Ok(step) => {
                if let Some((step, total)) = step {
                    self.tally.step_time += took;
                    self.tally.steps += 1;
                    if self.member == 0 {
                        source.step_done(rank, a.key, step, total, took);
                    }
                }
                self.active = Some(a);
            }
        }
    }

    /// At exit: adds the stall the device measured but had not reported yet (its timing
    /// events are read back a few blocks late), counted when the last passes were busy,
    /// and returns what this rank did with K = `slots`.
    fn finish(self, slots: usize) -> Result<RankResult> {
        let late = self.pipe.drain_stall()?;
        let t = self.tally;
        let s = self.pipe.stats().clone();
        Ok(RankResult {
            slots,
            resident_blocks: self.run.streamed.resident_blocks,
            stall: if t.last_busy { t.stall + late } else { t.stall },
            step_time: t.step_time,
            steps: t.steps,
            busy_time: t.busy_time,
            switch_stall: t.switch_stall,
            switch_time: t.switch_time,
            bytes_copied: s.bytes_copied,
            bytes_gathered: s.bytes_gathered,
            bytes_staged: s.bytes_staged,
            pinned_host_bytes: s.pinned_host_bytes,
            peak: self.budget.peak(),
            peak_by_kind: self.budget.peak_by_kind(),
        })
    }
}

/// What a failed rank poisons its peers' collectives and the coordinator with, for them to
/// give up quoting, and what the server says of the engine's end: its failure, naming it;
/// for a rank that only gave up itself, the first failure it quotes, so every peer (and the
/// server, whichever rank it hears first) quotes the root cause however the poisons raced.
pub fn first_cause(rank: usize, e: &Error) -> String {
    match e {
        Error::Abandoned(a) => a.cause.clone(),
        // Named once: "rank 1 failed: panicked: ..." rather than "rank 1 failed: rank 1: ...".
        Error::Rank { rank: r, msg } if *r == rank => format!("rank {rank} failed: {msg}"),
        _ => format!("rank {rank} failed: {e}"),
    }
}

/// An output whose latents are not all finite is a failed request, not a black image: the
/// weights hold NaN or infinity, or the request overflows.
fn finite(out: Result<Output>) -> Result<Output> {
    let o = out?;
    let values = o
        .latents
        .flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?;
    if let Some(n) = values.iter().position(|x| !x.is_finite()) {
        return Err(Error::NotFinite {
            what: format!(
                "the final latents hold {} (value {n} of {}): the weights hold NaN or infinity, or the request overflows; the checkpoint may be corrupt",
                values[n],
                values.len()
            ),
        });
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Abandoned;

    /// A failure names its rank once; a rank that only gave up passes on the cause it quotes.
    #[test]
    fn the_first_cause_names_the_failed_rank_once() {
        let cause = "rank 1 failed: panicked: disk on fire";
        let gave_up = Error::Abandoned(Abandoned {
            rank: 0,
            what: "all-gather",
            cause: cause.into(),
        });
        assert_eq!(first_cause(0, &gave_up), cause);
        let own = Error::Rank {
            rank: 1,
            msg: "panicked: disk on fire".into(),
        };
        assert_eq!(first_cause(1, &own), cause);
        let transfer = Error::Transfer("no progress for 1s".into());
        assert_eq!(
            first_cause(2, &transfer),
            "rank 2 failed: weight transfer failed: no progress for 1s"
        );
    }
}
