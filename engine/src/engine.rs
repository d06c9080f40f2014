//! A pipeline folder opened once for every rank, whatever its family, and `Model::run`:
//! a fixed list of requests dealt to the ranks round-robin, driven through the one rank
//! loop of [`crate::execution::rank`] (the loop the server drives from its scheduler).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Device;
use serde::Serialize;

use crate::checkpoint::{PhaseBytes, RequestShape};
use crate::execution::family::{Decoder, FamilyRuntime};
use crate::execution::rank::{self, EngineOptions, RankResult};
use crate::execution::rss::RssSampler;
use crate::execution::work::{Condition, Output, Request, Taken, Work, WorkKey, WorkSource};
use crate::families::Checkpoint;
use crate::layout::GroupLayout;
use crate::measure::{PhaseKind, PhasePeaks};
use crate::memory::GroupBytes;
use crate::{Error, Result, Strategy};
use layerwise_core::compute_dtype::ComputeElement;

/// A checkpoint opened, checked and mapped once for every rank.
pub struct Model {
    pub checkpoint: Checkpoint,
    pub family: Box<dyn FamilyRuntime>,
}

impl Model {
    /// Opens the pipeline folder at `root`; `model_index.json` chooses the family.
    pub fn open(root: &Path) -> Result<Model> {
        let checkpoint = Checkpoint::open(root)?;
        let family = checkpoint.runtime()?;
        Ok(Model { checkpoint, family })
    }

    /// Each streamed group's block layout for `dp` ranks.
    pub fn layouts(&self, dp: usize) -> Result<Vec<GroupLayout>> {
        self.family.layouts(dp)
    }

    /// The element a run of `opts` computes its blocks in: the device it resolves to and
    /// `--compute-dtype`, decided as its ranks decide ([`rank::compute_dtype`], the
    /// planner's [`ComputeElement::auto`] under `auto`).
    pub fn compute_element(&self, opts: &EngineOptions) -> Result<ComputeElement> {
        let ranks = opts.dp.max(1) * opts.sp.max(1);
        let device = crate::execution::cuda::resolve(opts.device, ranks)?;
        let gpu = matches!(device, crate::execution::cuda::Resolved::Cuda { .. });
        let d = rank::compute_dtype(
            &*self.family,
            opts.compute_dtype,
            gpu,
            &self.layouts(ranks)?,
        )?;
        crate::execution::dtype::element(d)
            .ok_or_else(|| Error::invalid("compute-dtype", format!("{d:?} is not a compute dtype")))
    }

    /// Device bytes a run of `opts` keeps free on each rank for the largest of `requests`:
    /// [`Self::activation_bytes`] at its `sp` in the element it computes in.
    pub fn reserved_activations(&self, requests: &[Request], opts: &EngineOptions) -> Result<u64> {
        self.activation_bytes(requests, opts.sp, self.compute_element(opts)?)
    }

    /// Device bytes the largest of `requests` needs for activations on each rank of a
    /// group of `sp` whose blocks compute in `element` (each request runs on one group,
    /// one output at a time): what a rank keeps free of its budget for them.
    pub fn activation_bytes(
        &self,
        requests: &[Request],
        sp: usize,
        element: ComputeElement,
    ) -> Result<u64> {
        Ok(self.phase_bytes(requests, sp, element.bytes())?.peak())
    }

    /// Each phase's predicted peak over `requests` on each rank of a group of `sp`, for
    /// blocks computing in elements of `compute_bytes` bytes: what a run's measured peaks
    /// are set beside.
    pub fn phase_bytes(
        &self,
        requests: &[Request],
        sp: usize,
        compute_bytes: u64,
    ) -> Result<PhaseBytes> {
        let cost = self.checkpoint.activation_cost();
        requests
            .iter()
            .try_fold(PhaseBytes::default(), |most, r| {
                let text_tokens = match r.condition {
                    Condition::Prompt { .. } => r.max_sequence_length as u64,
                    Condition::Class(_) => 0,
                };
                let b = cost
                    .checked_phases(
                        &RequestShape {
                            width: r.width as u64,
                            height: r.height as u64,
                            frames: r.frames as u64,
                            batch: 1,
                            guidance: self.family.guided(r),
                            text_tokens,
                            cache: r.cache.as_ref().map_or_else(Default::default, |c| c.hold()),
                        },
                        sp as u64,
                        compute_bytes,
                    )
                    .ok_or_else(|| {
                        Error::invalid(
                            "size",
                            format!(
                                "{}x{} with {} frames needs more activation memory than any device holds",
                                r.width, r.height, r.frames
                            ),
                        )
                    })?;
                Ok(PhaseBytes {
                    text_encoder: most.text_encoder.max(b.text_encoder),
                    transformer: most.transformer.max(b.transformer),
                    decode: most.decode.max(b.decode),
                })
            })
    }

    /// Each streamed group's block bytes, for the memory model (the same figures the
    /// node's profile carries).
    pub fn group_bytes(&self) -> Result<Vec<GroupBytes>> {
        Ok(self
            .layouts(1)?
            .iter()
            .zip(self.family.group_components())
            .map(|(l, c)| GroupBytes::of(&c, l))
            .collect())
    }

    /// Checks a request against the model before it takes a rank.
    pub fn validate(&self, r: &Request) -> Result<()> {
        if let Some(fps) = r.fps {
            crate::bounds::check_fps("fps", fps)?;
        }
        crate::cache::check(self.family.name(), self.family.step_caches(), r)?;
        self.family.validate(r)
    }

    /// The decoder alone, on `device` (the server decodes off the ranks).
    pub fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        self.family.decoder(device)
    }

    /// Runs `opts.dp` rank threads on `source` until it closes and every rank is idle.
    pub fn drive(&self, opts: &EngineOptions, source: &dyn WorkSource) -> Result<Vec<RankResult>> {
        rank::drive(self.family.as_ref(), opts, source)
    }

    /// Generates `requests` with `opts`; outputs come back in request order.
    pub fn run(
        &self,
        requests: Vec<Request>,
        opts: &EngineOptions,
    ) -> Result<(Vec<Output>, RunStats)> {
        rank::topology(self.family.as_ref(), opts)?;
        for r in &requests {
            self.validate(r)?;
        }
        let requests_shapes = requests.clone();
        let rss = RssSampler::start();
        let start = Instant::now();
        let mut queues: Vec<VecDeque<(usize, Request)>> = vec![VecDeque::new(); opts.dp];
        for (i, r) in requests.into_iter().enumerate() {
            queues[i % opts.dp].push_back((i, r));
        }
        let source = FixedSource {
            queues: queues.into_iter().map(Mutex::new).collect(),
            outputs: Mutex::new(Vec::new()),
            error: Mutex::new(None),
            step_seconds: Mutex::new(Vec::new()),
        };
        let ranks = self.drive(opts, &source)?;
        if let Some(e) = source.error.into_inner().expect("source lock") {
            return Err(e);
        }
        let wall = start.elapsed();
        let step_seconds_each = source.step_seconds.into_inner().expect("source lock");
        let mut outputs = source.outputs.into_inner().expect("source lock");
        outputs.sort_by_key(|(i, _)| *i);
        let steps: usize = ranks.iter().map(|r| r.steps).sum();
        let step_time: Duration = ranks.iter().map(|r| r.step_time).sum();
        let stall = ranks.iter().map(|r| r.stall).max().unwrap_or_default();
        let mut by_kind = BTreeMap::new();
        for r in &ranks {
            for (k, v) in &r.peak_by_kind {
                let e = by_kind.entry(k.to_string()).or_insert(0);
                *e = (*e).max(*v);
            }
        }
        let layouts = self.layouts(opts.dp * opts.sp)?;
        let mut measured = PhasePeaks::default();
        for r in &ranks {
            measured.merge(&r.measured);
        }
        let compute_bytes = ranks.first().map_or(4, |r| r.compute_bytes);
        let predicted = self.phase_bytes(&requests_shapes, opts.sp, compute_bytes)?;
        let stats = RunStats {
            family: self.family.name().to_string(),
            strategy: opts.strategy,
            dp: opts.dp,
            sp: opts.sp,
            slots: ranks.first().map_or(0, |r| r.slots),
            resident_blocks: if opts.strategy.streams() {
                ranks.first().map_or(0, |r| r.resident_blocks)
            } else {
                0
            },
            wall_seconds: wall.as_secs_f64(),
            step_seconds: if steps > 0 {
                step_time.as_secs_f64() / steps as f64
            } else {
                0.0
            },
            step_seconds_each,
            stall_seconds: stall.as_secs_f64(),
            // The worst rank's share of its own busy time spent waiting for weights.
            stall_fraction: ranks
                .iter()
                .filter(|r| r.busy_time > Duration::ZERO)
                .map(|r| r.stall.as_secs_f64() / r.busy_time.as_secs_f64())
                .fold(0.0, f64::max),
            switch_stall_fraction: ranks
                .iter()
                .filter(|r| r.switch_time > Duration::ZERO)
                .map(|r| r.switch_stall.as_secs_f64() / r.switch_time.as_secs_f64())
                .fold(0.0, f64::max),
            bytes_copied: ranks.iter().map(|r| r.bytes_copied).sum(),
            bytes_gathered: ranks.iter().map(|r| r.bytes_gathered).sum(),
            bytes_copied_per_step: per_step(ranks.iter().map(|r| r.bytes_copied).sum(), steps),
            bytes_gathered_per_step: per_step(ranks.iter().map(|r| r.bytes_gathered).sum(), steps),
            bytes_staged: ranks.iter().map(|r| r.bytes_staged).sum(),
            blocks_computed: ranks.iter().map(|r| r.blocks_computed).sum(),
            blocks_saved: ranks.iter().map(|r| r.blocks_saved).sum(),
            blocks_dropped: ranks.iter().map(|r| r.blocks_dropped).sum(),
            peak_pinned_host_bytes: ranks.iter().map(|r| r.pinned_host_bytes).max().unwrap_or(0),
            peak_device_bytes: ranks.iter().map(|r| r.peak).max().unwrap_or(0),
            peak_device_bytes_by_kind: by_kind,
            peak_anon_rss_bytes: rss.peak(),
            checkpoint_bytes: self.checkpoint.total_bytes(),
            largest_padded_block_bytes: layouts
                .iter()
                .map(GroupLayout::largest_padded_block)
                .max()
                .unwrap_or(0),
            outputs: outputs.len(),
            measured_peak_bytes: measured,
            predicted_peak_bytes: predicted,
        };
        Ok((outputs.into_iter().map(|(_, o)| o).collect(), stats))
    }
}

/// Figures of one run (the `--stats` JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunStats {
    pub family: String,
    pub strategy: Strategy,
    pub dp: usize,
    /// Ranks per request (sequence parallelism).
    pub sp: usize,
    /// K the ranks ran with (what `--slots auto` chose).
    pub slots: usize,
    /// Blocks of each streamed group a streaming strategy kept on the device (what
    /// `--resident-blocks auto` chose); 0 under `resident`, which keeps every block.
    pub resident_blocks: usize,
    pub wall_seconds: f64,
    /// Mean wall time of a denoising step (a pass that completed a step).
    pub step_seconds: f64,
    /// Wall time of each denoising step, every rank's, in the order they completed.
    pub step_seconds_each: Vec<f64>,
    /// Compute waiting for weights, worst rank.
    pub stall_seconds: f64,
    /// The worst rank's stall over the time of the passes it computed in (denoising
    /// steps, text encoding, and the switches between them).
    pub stall_fraction: f64,
    /// The worst rank's stall over the time of its passes that switched groups (text
    /// encoder to transformer, one expert to the other): what prefetching across the
    /// switch leaves.
    pub switch_stall_fraction: f64,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    /// Bytes copied (gathered) over all ranks per denoising step they completed, with
    /// text encoding and expert switches included: what `--resident-blocks` cuts by N/L.
    pub bytes_copied_per_step: u64,
    pub bytes_gathered_per_step: u64,
    /// Bytes of `bytes_copied` staged through the ranks' rings (`--host-memory pin`).
    pub bytes_staged: u64,
    /// Block computations over all ranks (a rank joining a pass its request does not
    /// want computes nothing), those the requests' step caches saved, and blocks moved
    /// ahead of a First-Block Cache decision that then skipped them (moved, unread).
    pub blocks_computed: u64,
    pub blocks_saved: u64,
    pub blocks_dropped: u64,
    /// Page-locked host bytes a rank held for staging at its peak, worst rank (its ring
    /// under `--host-memory pin`; 0 when copies read the mapping or its registration).
    pub peak_pinned_host_bytes: u64,
    /// Largest accounted device bytes over ranks.
    pub peak_device_bytes: u64,
    /// Peak accounted device bytes per kind (slots, resident blocks, ...), worst rank.
    pub peak_device_bytes_by_kind: BTreeMap<String, u64>,
    pub peak_anon_rss_bytes: u64,
    pub checkpoint_bytes: u64,
    pub largest_padded_block_bytes: u64,
    /// Images or clips generated.
    pub outputs: usize,
    /// Per phase (text encoding, a denoising pass, the decode), the most bytes a run of
    /// it held above its start, worst rank ([`crate::measure`]): heap bytes on the CPU
    /// (with the allocator installed; CPU ranks share the heap, so with dp > 1 each
    /// counts the others' concurrent phases), the device pool's on CUDA. A phase nothing
    /// measured is absent.
    pub measured_peak_bytes: PhasePeaks,
    /// What the memory model reserves for each phase of the largest request at the run's
    /// compute dtype ([`crate::checkpoint::ActivationCost::checked_phases`]).
    pub predicted_peak_bytes: PhaseBytes,
}

impl RunStats {
    /// `phase  measured  predicted  ratio` lines, for `--stats` and `bench`.
    pub fn phase_table(&self) -> Vec<(PhaseKind, Option<u64>, u64)> {
        let p = &self.predicted_peak_bytes;
        PhaseKind::ALL
            .into_iter()
            .map(|k| {
                let predicted = match k {
                    PhaseKind::TextEncoder => p.text_encoder,
                    PhaseKind::Transformer => p.transformer,
                    PhaseKind::Decode => p.decode,
                };
                (k, self.measured_peak_bytes.get(k), predicted)
            })
            .filter(|(_, m, p)| m.is_some() || *p > 0)
            .collect()
    }
}

fn per_step(bytes: u64, steps: usize) -> u64 {
    bytes.checked_div(steps as u64).unwrap_or(0)
}

/// `run`'s source: requests dealt round-robin up front, outputs collected by index.
struct FixedSource {
    queues: Vec<Mutex<VecDeque<(usize, Request)>>>,
    outputs: Mutex<Vec<(usize, Output)>>,
    error: Mutex<Option<Error>>,
    step_seconds: Mutex<Vec<f64>>,
}

impl WorkSource for FixedSource {
    fn take(&self, rank: usize) -> Result<Taken> {
        let mut q = self.queues[rank].lock().expect("source lock");
        let work = q.pop_front().map(|(i, req)| Work {
            key: WorkKey {
                id: i as u64,
                index: 0,
            },
            req,
            cancel: None,
        });
        Ok(Taken {
            work,
            generation: 0,
            closed: q.is_empty(),
        })
    }
    fn pending(&self, rank: usize) -> bool {
        !self.queues[rank].lock().expect("source lock").is_empty()
    }
    fn wait(&self, _rank: usize, _generation: u64) -> Result<()> {
        Ok(())
    }
    fn step_done(&self, _rank: usize, _key: WorkKey, _step: usize, _total: usize, took: Duration) {
        self.step_seconds
            .lock()
            .expect("source lock")
            .push(took.as_secs_f64());
    }
    fn finished(&self, _rank: usize, key: WorkKey, out: Result<Output>) {
        match out {
            Ok(o) => self
                .outputs
                .lock()
                .expect("source lock")
                .push((key.id as usize, o)),
            Err(e) => {
                self.error.lock().expect("source lock").get_or_insert(e);
            }
        }
    }
}
