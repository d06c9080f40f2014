//! A DiT checkpoint mapped once for every rank, its requests, and one denoising step's
//! math around the streamed blocks. `Model::run` generates a fixed list of requests by
//! dealing them to the ranks round-robin and driving the one rank loop of [`super::rank`],
//! the same loop the server drives from its scheduler.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

use super::cuda::{DeviceChoice, HostMode, SlotsChoice};
use super::pipeline::{candle_dtype, Hook};
use super::rank::{Taken, Work, WorkKey, WorkSource};
use super::rss::RssSampler;
use super::trace::Trace;
use crate::checkpoint::Mapped;
use crate::families::autoencoder_kl::decoder::VaeDecoder;
use crate::families::dit::model::{Dit, DitState};
use crate::families::dit::DitCheckpoint;
use crate::families::dit::DitConfig;
use crate::layout::ModelLayout;
use crate::samplers::ddim::{Ddim, DdimConfig};
use crate::{Error, Result, Strategy};

/// A checkpoint opened, checked and mapped once for every rank.
pub struct Model {
    pub checkpoint: DitCheckpoint,
    pub transformer: Mapped,
    pub vae: Mapped,
    pub scheduler: DdimConfig,
}

impl Model {
    pub fn open(root: &Path) -> Result<Model> {
        let checkpoint = DitCheckpoint::open(root)?;
        let sched_path = checkpoint.folder.scheduler_config();
        let scheduler = if sched_path.is_file() {
            DdimConfig::load(&sched_path)?
        } else {
            DdimConfig::dit()
        };
        let transformer = Mapped::map(checkpoint.transformer.clone())?;
        let vae = Mapped::map(checkpoint.vae.clone())?;
        Ok(Model {
            checkpoint,
            transformer,
            vae,
            scheduler,
        })
    }

    pub fn config(&self) -> &DitConfig {
        &self.checkpoint.config
    }

    /// Pixels per latent per side.
    pub fn upscale(&self) -> usize {
        self.checkpoint.vae_config.upscale()
    }

    /// The block layout for `dp` ranks.
    pub fn layout(&self, dp: usize) -> Result<ModelLayout> {
        let cfg = self.config();
        ModelLayout::new(
            &self.checkpoint.transformer,
            &cfg.block_specs(),
            cfg.num_layers,
            DitConfig::block_prefix,
            dp,
        )
    }

    /// Bytes of the transformer's tensors outside the blocks (resident on every device).
    pub fn outside_block_bytes(&self) -> u64 {
        self.config()
            .resident_specs()
            .iter()
            .map(|s| {
                self.transformer
                    .component
                    .get(&s.name)
                    .map_or(0, |(_, t)| t.len)
            })
            .sum()
    }

    /// Names and bytes of the VAE decoder's weights.
    pub fn vae_decoder_weights(&self) -> (Vec<String>, u64) {
        let names = self
            .vae
            .component
            .index
            .keys()
            .filter(|n| n.starts_with("decoder.") || n.starts_with("post_quant_conv."))
            .cloned()
            .collect::<Vec<_>>();
        let bytes = names
            .iter()
            .map(|n| self.vae.component.get(n).map_or(0, |(_, t)| t.len))
            .sum();
        (names, bytes)
    }

    /// Loads the VAE decoder onto `device` (accounting is the caller's).
    pub fn vae_decoder(&self, device: &Device) -> Result<VaeDecoder> {
        let (names, _) = self.vae_decoder_weights();
        let w = Model::load(&self.vae, names.into_iter(), device)?;
        VaeDecoder::load_from(&self.checkpoint.vae_config, &w, &self.vae.component.dir)
    }

    /// Loads named tensors from a mapping into f32 device tensors.
    pub(crate) fn load(
        mapped: &Mapped,
        names: impl Iterator<Item = String>,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for name in names {
            let (h, info) = mapped.component.get(&name).ok_or_else(|| {
                Error::tensor(&mapped.component.dir, &name, "missing from the checkpoint")
            })?;
            let bytes = mapped.bytes(&name).expect("indexed tensor");
            let t = Tensor::from_raw_buffer(
                bytes,
                candle_dtype(info.dtype)
                    .map_err(|e| Error::tensor(&h.path, &name, e.to_string()))?,
                &info.shape,
                device,
            )?;
            out.insert(name, t.to_dtype(DType::F32)?);
        }
        Ok(out)
    }
}

/// One image to generate.
#[derive(Debug, Clone)]
pub struct Request {
    pub class_label: u32,
    pub seed: u64,
    pub steps: usize,
    pub guidance: f32,
    pub width: usize,
    pub height: usize,
    /// Start from these latents [1, C, h, w] instead of seeded noise.
    pub init_latents: Option<Tensor>,
}

/// What a request produced.
pub struct Output {
    /// Final latents [1, C, h, w] before the VAE.
    pub latents: Tensor,
    /// The decoded image [3, H, W] in [-1, 1], when decoding was asked for.
    pub image: Option<Tensor>,
}

/// How the engine runs.
#[derive(Clone)]
pub struct EngineOptions {
    pub strategy: Strategy,
    pub dp: usize,
    /// K, or `auto`: as many as the device memory holds (on the CPU, `device_memory`).
    pub slots: SlotsChoice,
    /// Device memory per rank, in bytes (the CPU backend enforces it like a GPU would).
    pub device_memory: u64,
    /// How weights reach a GPU from the mapped checkpoint; the CPU takes only `auto`.
    pub host: HostMode,
    /// Longest any rank may wait on a transfer or a peer before failing.
    pub timeout: Duration,
    pub hook: Option<Hook>,
    /// Decode latents into images with the VAE.
    pub decode: bool,
    /// Record copy, gather and compute spans here.
    pub trace: Option<Arc<Trace>>,
    /// Where the ranks compute: the CPU backend, CUDA GPUs (the `cuda` feature), or
    /// whichever is there.
    pub device: DeviceChoice,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            strategy: Strategy::OffloadSharded,
            dp: 1,
            slots: SlotsChoice::default(),
            device_memory: u64::MAX,
            host: HostMode::Auto,
            timeout: Duration::from_secs(120),
            hook: None,
            decode: true,
            trace: None,
            device: DeviceChoice::Cpu,
        }
    }
}

/// Figures of one run (the `--stats` JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunStats {
    pub strategy: String,
    pub dp: usize,
    /// K the ranks ran with (what `--slots auto` chose).
    pub slots: usize,
    pub wall_seconds: f64,
    /// Mean wall time of a denoising step (one pass over the blocks with work in it).
    pub step_seconds: f64,
    /// Compute waiting for weights, worst rank.
    pub stall_seconds: f64,
    pub stall_fraction: f64,
    pub bytes_copied: u64,
    pub bytes_gathered: u64,
    /// Largest accounted device bytes over ranks.
    pub peak_device_bytes: u64,
    /// Peak accounted device bytes per kind (slots, resident blocks, ...), worst rank.
    pub peak_device_bytes_by_kind: BTreeMap<String, u64>,
    pub peak_anon_rss_bytes: u64,
    pub checkpoint_bytes: u64,
    pub largest_padded_block_bytes: u64,
    pub images: usize,
}

/// A request a rank is stepping.
pub(crate) struct Active {
    pub req: Request,
    pub ddim: Ddim,
    /// Steps done.
    pub step: usize,
    pub latents: Tensor,
    pub key: WorkKey,
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Active {
    pub fn total(&self) -> usize {
        self.ddim.timesteps.len()
    }
}

/// Seeded Gaussian latents [1, C, h, w].
pub fn seeded_latents(seed: u64, c: usize, h: usize, w: usize, device: &Device) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..c * h * w)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    Ok(Tensor::from_vec(v, (1, c, h, w), device)?)
}

impl Model {
    /// Checks a request against the model before it takes a rank.
    pub fn validate(&self, r: &Request) -> Result<()> {
        let cfg = self.config();
        let unit = self.upscale() * cfg.patch();
        for (field, v) in [("width", r.width), ("height", r.height)] {
            if v == 0 || v % unit != 0 {
                return Err(Error::invalid(
                    field,
                    format!("{v}: must be a positive multiple of {unit}"),
                ));
            }
        }
        if r.class_label as usize >= cfg.num_classes() {
            return Err(Error::invalid(
                "class_label",
                format!(
                    "{}: this model has classes 0..{}",
                    r.class_label,
                    cfg.num_classes() - 1
                ),
            ));
        }
        if !(r.guidance.is_finite() && r.guidance >= 0.0) {
            return Err(Error::invalid(
                "guidance",
                format!("{}: must be a finite number ≥ 0", r.guidance),
            ));
        }
        Ddim::new(self.scheduler.clone(), r.steps)?;
        if let Some(l) = &r.init_latents {
            let want = [
                1,
                cfg.in_channels,
                r.height / self.upscale(),
                r.width / self.upscale(),
            ];
            if l.dims() != want {
                return Err(Error::invalid(
                    "init_latents",
                    format!("shape {:?}, expected {want:?}", l.dims()),
                ));
            }
        }
        Ok(())
    }

    /// Turns a request taken from a source into a rank's running state.
    pub(crate) fn start(&self, work: Work) -> Result<Active> {
        let Work { key, req, cancel } = work;
        let (c, up) = (self.config().in_channels, self.upscale());
        let latents = match &req.init_latents {
            Some(l) => l.to_dtype(DType::F32)?,
            None => seeded_latents(req.seed, c, req.height / up, req.width / up, &Device::Cpu)?,
        };
        Ok(Active {
            ddim: Ddim::new(self.scheduler.clone(), req.steps)?,
            req,
            step: 0,
            latents,
            key,
            cancel,
        })
    }

    /// One denoising step of `a` on pipeline `pipe` (all blocks), as DiTPipeline does it.
    pub(crate) fn prepare_step(&self, dit: &Dit, a: &Active) -> Result<DitState> {
        let t = a.ddim.timesteps[a.step];
        let cfg = a.req.guidance > 1.0;
        let (input, labels) = if cfg {
            (
                Tensor::cat(&[&a.latents, &a.latents], 0)?,
                vec![a.req.class_label, self.config().num_classes() as u32],
            )
        } else {
            (a.latents.clone(), vec![a.req.class_label])
        };
        dit.prologue(&input, t as f32, &labels)
    }

    pub(crate) fn finish_step(&self, dit: &Dit, a: &mut Active, st: DitState) -> Result<()> {
        let c = self.config().in_channels;
        let out = dit.epilogue(st)?;
        let eps = out.narrow(1, 0, c)?;
        let eps = if a.req.guidance > 1.0 {
            let (cond, uncond) = (eps.narrow(0, 0, 1)?, eps.narrow(0, 1, 1)?);
            (&uncond + ((cond - &uncond)? * a.req.guidance as f64)?)?
        } else {
            eps
        };
        let t = a.ddim.timesteps[a.step];
        a.latents = a.ddim.step(&eps, t, &a.latents)?;
        a.step += 1;
        Ok(())
    }

    /// Generates `requests` with `opts`; outputs come back in request order.
    pub fn run(
        &self,
        requests: Vec<Request>,
        opts: &EngineOptions,
    ) -> Result<(Vec<Output>, RunStats)> {
        if opts.dp == 0 {
            return Err(Error::invalid("dp", "must be at least 1"));
        }
        for r in &requests {
            self.validate(r)?;
        }
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
        };
        let ranks = self.drive(opts, &source)?;
        if let Some(e) = source.error.into_inner().expect("source lock") {
            return Err(e);
        }
        let wall = start.elapsed();
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
        let stats = RunStats {
            strategy: opts.strategy.to_string(),
            dp: opts.dp,
            slots: ranks.first().map_or(0, |r| r.slots),
            wall_seconds: wall.as_secs_f64(),
            step_seconds: if steps > 0 {
                step_time.as_secs_f64() / steps as f64
            } else {
                0.0
            },
            stall_seconds: stall.as_secs_f64(),
            // The worst rank's share of its own step time spent waiting for weights.
            stall_fraction: ranks
                .iter()
                .filter(|r| r.step_time > Duration::ZERO)
                .map(|r| r.stall.as_secs_f64() / r.step_time.as_secs_f64())
                .fold(0.0, f64::max),
            bytes_copied: ranks.iter().map(|r| r.bytes_copied).sum(),
            bytes_gathered: ranks.iter().map(|r| r.bytes_gathered).sum(),
            peak_device_bytes: ranks.iter().map(|r| r.peak).max().unwrap_or(0),
            peak_device_bytes_by_kind: by_kind,
            peak_anon_rss_bytes: rss.peak(),
            checkpoint_bytes: self.checkpoint.transformer.tensor_bytes()
                + self.checkpoint.vae.tensor_bytes(),
            largest_padded_block_bytes: self.layout(opts.dp)?.largest_padded_block(),
            images: outputs.len(),
        };
        Ok((outputs.into_iter().map(|(_, o)| o).collect(), stats))
    }
}

/// `run`'s source: requests dealt round-robin up front, outputs collected by index.
struct FixedSource {
    queues: Vec<Mutex<VecDeque<(usize, Request)>>>,
    outputs: Mutex<Vec<(usize, Output)>>,
    error: Mutex<Option<Error>>,
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
