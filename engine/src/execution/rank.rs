//! The one rank loop. Each dp rank is a thread with its own pipeline and device budget;
//! all share one mapping of the checkpoint and move in lockstep by block index. A rank
//! pulls requests from a [`WorkSource`] (a fixed list for `Model::run`, the scheduler for
//! the server) at step boundaries, so a rank whose request finishes takes the next one at
//! once while the others carry on with theirs. At every pass boundary the ranks meet at
//! the [`Coordinator`] and take the same decision: run a pass (idle ranks join it without
//! computing, so the collectives line up), or pause together until work arrives, or exit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;

use super::backend::{Backend, Collective};
use super::budget::DeviceBudget;
use super::cpu::{CpuBackend, LocalGroup};
use super::cuda::{self, Resolved};
use super::engine::{Active, EngineOptions, Model, Output, Request};
use super::lockstep::{Coordinator, Flags};
use super::pipeline::{Pipeline, PipelineOptions, PipelineStats};
use super::trace::Lane;
use crate::families::dit::model::Dit;
use crate::layout::ModelLayout;
use crate::{Error, Result};

/// Which image of which request: every message between ranks and their source carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkKey {
    pub id: u64,
    pub index: u32,
}

impl std::fmt::Display for WorkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.id, self.index)
    }
}

/// One image to generate, as a rank receives it.
pub struct Work {
    pub key: WorkKey,
    pub req: Request,
    /// Set by the source to stop the work at the rank's next step boundary.
    pub cancel: Option<Arc<AtomicBool>>,
}

/// The answer to [`WorkSource::take`].
pub struct Taken {
    pub work: Option<Work>,
    /// The source's arrival generation seen before looking (for [`WorkSource::wait`]).
    pub generation: u64,
    /// The source will never hand this rank work again.
    pub closed: bool,
}

/// Figures of one pass of one rank, for live metrics.
pub struct PassReport<'a> {
    /// The rank computed (it had a request) rather than only joining the collectives.
    pub busy: bool,
    pub elapsed: Duration,
    pub pipeline: &'a PipelineStats,
    pub device_bytes: u64,
}

/// Where ranks get requests and where they report. Called from rank threads.
pub trait WorkSource: Sync {
    /// The next request for `rank`, if one is waiting (does not block on arrivals).
    fn take(&self, rank: usize) -> Result<Taken>;
    /// Work is queued that a free rank could take (a prefetch hint).
    fn pending(&self, rank: usize) -> bool;
    /// Blocks until an arrival newer than `generation`, or until the source closes.
    fn wait(&self, rank: usize, generation: u64) -> Result<()>;
    /// `rank` has its pipeline and can serve.
    fn ready(&self, _rank: usize) {}
    /// `key` has finished step `step` of `total`.
    fn step_done(&self, _rank: usize, _key: WorkKey, _step: usize, _total: usize, _took: Duration) {
    }
    /// `rank` has finished a pass.
    fn pass_done(&self, _rank: usize, _report: &PassReport) {}
    /// `key` is done: its output, or why not (a failure of its own, or cancellation).
    fn finished(&self, rank: usize, key: WorkKey, out: Result<Output>);
    /// `rank` failed; the group is poisoned and every rank will stop.
    fn failed(&self, _rank: usize, _error: &Error) {}
}

/// What one rank did, for `RunStats`.
pub struct RankResult {
    /// K this rank ran with.
    pub slots: usize,
    /// Compute waiting for weights, in passes where this rank had work.
    pub stall: Duration,
    pub step_time: Duration,
    pub steps: usize,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    pub peak: u64,
    pub peak_by_kind: BTreeMap<&'static str, u64>,
}

/// Where one rank computes: its backend, its communicator, its device memory and K.
struct Placement<B: Backend, C: Collective<B>> {
    backend: Arc<B>,
    comm: C,
    capacity: u64,
    slots: usize,
}

impl Model {
    /// Runs `opts.dp` rank threads on `source` until it closes and every rank is idle.
    /// Returns the root cause when a rank fails (not a peer's "abandoned" error).
    pub fn drive(&self, opts: &EngineOptions, source: &dyn WorkSource) -> Result<Vec<RankResult>> {
        if opts.dp == 0 {
            return Err(Error::invalid("dp", "must be at least 1"));
        }
        let layout = Arc::new(self.layout(opts.dp)?);
        // Device bytes outside the slots that every rank keeps: prologue, epilogue, VAE.
        let outside = self.outside_block_bytes()
            + if opts.decode {
                self.vae_decoder_weights().1
            } else {
                0
            };
        match cuda::resolve(opts.device, opts.dp)? {
            Resolved::Cpu { why } => {
                tracing::info!(%why, "computing on the CPU");
                if opts.host != cuda::HostMode::Auto {
                    return Err(Error::invalid(
                        "host-memory",
                        format!(
                            "`--host-memory {}` applies to CUDA devices, but the ranks compute on the CPU ({why}), which reads weights from the mapped checkpoint; use auto",
                            opts.host
                        ),
                    ));
                }
                let budget = (opts.device_memory != u64::MAX).then_some(opts.device_memory);
                let needs = cuda::plan::DeviceNeeds::of(&layout, opts.strategy, outside);
                let slots = cuda::plan::cpu_slots(opts.slots, opts.strategy, needs, budget)?;
                let backend = Arc::new(CpuBackend::new(opts.timeout));
                let group = LocalGroup::new(opts.dp, opts.timeout);
                let ranks = group
                    .comms()
                    .into_iter()
                    .map(|comm| (backend.clone(), comm, opts.device_memory))
                    .collect();
                self.spawn_ranks(ranks, slots, layout, source, opts, &|why| group.poison(why))
            }
            #[cfg(feature = "cuda")]
            Resolved::Cuda { devices } => {
                tracing::info!(devices, "computing on CUDA GPUs");
                let r = cuda::setup(
                    &self.transformer,
                    &layout,
                    &cuda::CudaOptions {
                        strategy: opts.strategy,
                        slots: opts.slots,
                        device_memory: (opts.device_memory != u64::MAX)
                            .then_some(opts.device_memory),
                        host: opts.host,
                        timeout: opts.timeout,
                        outside_blocks: outside,
                    },
                )?;
                let ranks = r
                    .ranks
                    .into_iter()
                    .map(|x| (x.backend, x.comm, x.capacity))
                    .collect();
                let group = r.group;
                self.spawn_ranks(ranks, r.slots, layout, source, opts, &|why| {
                    group.poison(why)
                })
            }
            #[cfg(not(feature = "cuda"))]
            Resolved::Cuda { .. } => unreachable!("resolve never picks CUDA without the feature"),
        }
    }

    /// Runs one thread per rank on its backend and communicator (with the device budget
    /// capacity each has), and gathers their results. `poison` fails the collective
    /// group when a rank fails, so its peers stop instead of waiting.
    fn spawn_ranks<B: Backend, C: Collective<B>>(
        &self,
        ranks: Vec<(Arc<B>, C, u64)>,
        slots: usize,
        layout: Arc<ModelLayout>,
        source: &dyn WorkSource,
        opts: &EngineOptions,
        poison: &(dyn Fn(String) + Sync),
    ) -> Result<Vec<RankResult>> {
        let coord = Coordinator::new(opts.dp, opts.timeout);
        let results: Vec<Result<RankResult>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|(backend, comm, capacity)| {
                    let (layout, coord) = (layout.clone(), &coord);
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
                                slots,
                            };
                            let r = self.rank_loop(place, layout, coord, source, opts);
                            if let Err(e) = &r {
                                tracing::error!(rank, error = %e, "rank failed");
                                poison(format!("rank {rank} failed: {e}"));
                                coord.poison(format!("rank {rank} failed: {e}"));
                                source.failed(rank, e);
                            }
                            r
                        })
                        .expect("spawn rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
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
                .position(|e| !e.to_string().contains("abandoned"))
                .unwrap_or(0);
            return Err(errors.swap_remove(root));
        }
        Ok(ranks)
    }

    fn rank_loop<B: Backend, C: Collective<B>>(
        &self,
        place: Placement<B, C>,
        layout: Arc<ModelLayout>,
        coord: &Coordinator,
        source: &dyn WorkSource,
        opts: &EngineOptions,
    ) -> Result<RankResult> {
        let Placement {
            backend,
            comm,
            capacity,
            slots,
        } = place;
        let rank = comm.rank();
        let budget = DeviceBudget::new(rank, capacity);
        let dev = backend.device().clone();
        let cfg = self.config().clone();
        let resident_names = cfg.resident_specs().into_iter().map(|s| s.name);
        let resident = Model::load(&self.transformer, resident_names, &dev)?;
        let resident_bytes = self.outside_block_bytes();
        let _resident_alloc = budget.charge(
            "resident_outside_blocks",
            "patch embedding and final layer",
            resident_bytes,
        )?;
        let (vae, _vae_alloc) = if opts.decode {
            let (_, bytes) = self.vae_decoder_weights();
            let alloc = budget.charge("vae", "VAE decoder", bytes)?;
            (Some(self.vae_decoder(&dev)?), Some(alloc))
        } else {
            (None, None)
        };
        let dit = Dit::new(cfg, Box::new(resident));
        let mut pipe = Pipeline::new(
            backend,
            comm,
            layout,
            self.transformer.clone(),
            &budget,
            PipelineOptions {
                strategy: opts.strategy,
                slots,
                hook: opts.hook.clone(),
                trace: opts.trace.clone(),
            },
        )?;
        source.ready(rank);
        let mut active: Option<Active> = None;
        let (mut step_time, mut steps) = (Duration::ZERO, 0usize);
        // Compute waiting for weights, counted only in passes with work to compute: an
        // idle rank also waits on its gathers, but nothing of its own is held up.
        let mut stall = Duration::ZERO;
        loop {
            // Step boundary: drop cancelled work, then take new work if free.
            if let Some(a) =
                active.take_if(|a| a.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)))
            {
                source.finished(
                    rank,
                    a.key,
                    Err(Error::Conflict {
                        what: format!("request {} was cancelled", a.key.id),
                    }),
                );
            }
            let (mut generation, mut closed) = (u64::MAX, false);
            while active.is_none() {
                let t = source.take(rank)?;
                (generation, closed) = (t.generation, t.closed);
                let Some(work) = t.work else { break };
                let key = work.key;
                // Noise is drawn on the host, so every device starts from the same bits.
                let started = self.start(work).and_then(|mut a| {
                    a.latents = a.latents.to_device(&dev)?;
                    Ok(a)
                });
                match started {
                    Ok(a) => active = Some(a),
                    Err(e) => source.finished(rank, key, Err(e)),
                }
            }
            let more =
                active.as_ref().is_some_and(|a| a.step + 1 < a.total()) || source.pending(rank);
            let d = coord.sync(
                rank,
                Flags {
                    has_work: active.is_some(),
                    more,
                    closed,
                    generation,
                },
            )?;
            if d.exit {
                break;
            }
            if !d.run {
                source.wait(rank, d.generation)?;
                continue;
            }
            let t0 = Instant::now();
            // A request's own failure ends that request, never the pass: the rank keeps
            // joining the collectives so its peers are not disturbed.
            let mut failure: Option<Error> = None;
            let mut state = match active
                .as_ref()
                .map(|a| self.prepare_step(&dit, a))
                .transpose()
            {
                Ok(s) => s,
                Err(e) => {
                    failure = Some(e);
                    None
                }
            };
            let trace = opts.trace.as_deref();
            let stall_before = pipe.stats().stall;
            pipe.pass(d.next_pass, |i, w| {
                if let Some(st) = state.as_mut() {
                    let start = trace.map(|t| t.now_us());
                    if let Err(e) = dit.block(i, w, st) {
                        failure = Some(e);
                        state = None;
                    }
                    if let (Some(t), Some(s)) = (trace, start) {
                        t.record(rank, Lane::Compute, i, s);
                    }
                }
                Ok(())
            })?;
            let busy = active.is_some();
            if busy {
                stall += pipe.stats().stall - stall_before;
            }
            if let Some(mut a) = active.take() {
                let r = match (failure, state) {
                    (Some(e), _) => Err(e),
                    (None, Some(st)) => self.finish_step(&dit, &mut a, st),
                    (None, None) => Err(Error::invalid("step", "no activations after the pass")),
                };
                let took = t0.elapsed();
                step_time += took;
                steps += 1;
                match r {
                    Err(e) => source.finished(rank, a.key, Err(e)),
                    Ok(()) => {
                        source.step_done(rank, a.key, a.step, a.total(), took);
                        if a.step == a.total() {
                            let image = match &vae {
                                Some(v) => v
                                    .decode(&a.latents)
                                    .and_then(|i| Ok(i.squeeze(0)?.to_device(&Device::Cpu)?))
                                    .map(Some),
                                None => Ok(None),
                            };
                            let out = image.and_then(|image| {
                                Ok(Output {
                                    latents: a.latents.to_device(&Device::Cpu)?,
                                    image,
                                })
                            });
                            source.finished(rank, a.key, out);
                        } else {
                            active = Some(a);
                        }
                    }
                }
            }
            source.pass_done(
                rank,
                &PassReport {
                    busy,
                    elapsed: t0.elapsed(),
                    pipeline: pipe.stats(),
                    device_bytes: budget.used(),
                },
            );
        }
        let s = pipe.stats().clone();
        Ok(RankResult {
            slots,
            stall,
            step_time,
            steps,
            bytes_copied: s.bytes_copied,
            bytes_gathered: s.bytes_gathered,
            peak: budget.peak(),
            peak_by_kind: budget.peak_by_kind(),
        })
    }
}
