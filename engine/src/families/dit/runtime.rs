//! DiT behind the family seam: one streamed group (the transformer's blocks), the patch
//! embedding and final layer resident, DDIM steps with classifier-free guidance as
//! diffusers' `DiTPipeline` takes them, and the AutoencoderKL decoder.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::model::{Dit, DitState};
use super::{DitCheckpoint, DitConfig};
use crate::checkpoint::Mapped;
use crate::components::autoencoder_kl::decoder::VaeDecoder;
use crate::execution::family::{Decoder, FamilyRuntime, RankModel, Task};
use crate::execution::seq::Split;
use crate::execution::weights::{self, seeded_noise, Weights};
use crate::execution::work::{Condition, Output, Request};
use crate::families::steps::{guide, output};
use crate::families::FamilyCheckpoint;
use crate::samplers::ddim::{Ddim, DdimConfig};
use crate::{Error, Result};

/// A DiT pipeline folder, checked and mapped once for every rank.
pub struct DitRuntime {
    pub checkpoint: DitCheckpoint,
    transformer: Mapped,
    vae: Mapped,
    scheduler: DdimConfig,
}

impl DitRuntime {
    pub fn new(checkpoint: DitCheckpoint) -> Result<DitRuntime> {
        let sched_path = checkpoint.folder.scheduler_config();
        let scheduler = if sched_path.is_file() {
            DdimConfig::load(&sched_path)?
        } else {
            DdimConfig::dit()
        };
        Ok(DitRuntime {
            transformer: Mapped::map(checkpoint.transformer.clone())?,
            vae: Mapped::map(checkpoint.vae.clone())?,
            checkpoint,
            scheduler,
        })
    }

    fn config(&self) -> &DitConfig {
        &self.checkpoint.config
    }

    /// Pixels per latent per side.
    fn upscale(&self) -> usize {
        self.checkpoint.vae_config.upscale()
    }

    fn vae_decoder(&self, device: &Device) -> Result<VaeDecoder> {
        let names = self.checkpoint.decoder_names();
        // The decoder runs once per image and in f32 whatever the blocks compute in.
        let w = weights::load(&self.vae, names.into_iter(), device, DType::F32)?;
        VaeDecoder::load_from(&self.checkpoint.vae_config, &w, &self.vae.component.dir)
    }
}

impl FamilyRuntime for DitRuntime {
    fn name(&self) -> &'static str {
        "dit"
    }

    fn checkpoint(&self) -> &dyn FamilyCheckpoint {
        &self.checkpoint
    }

    fn mappings(&self) -> Vec<Mapped> {
        vec![self.transformer.clone()]
    }

    fn classes(&self) -> Option<usize> {
        Some(self.config().num_classes())
    }

    fn class_named(&self, name: &str) -> Option<u32> {
        let want = name.trim();
        self.checkpoint
            .folder
            .id2label
            .iter()
            .find(|(_, names)| {
                names
                    .split(',')
                    .any(|n| n.trim().eq_ignore_ascii_case(want))
            })
            .map(|(label, _)| *label)
    }

    fn defaults(&self) -> (usize, f32) {
        // What `generate` and the server have always defaulted to for DiT (diffusers'
        // `DiTPipeline` defaults to 50 steps at the same guidance).
        (25, 4.0)
    }

    fn validate(&self, r: &Request) -> Result<()> {
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
        match &r.condition {
            Condition::Class(c) if (*c as usize) < cfg.num_classes() => {}
            Condition::Class(c) => {
                return Err(Error::invalid(
                    "class_label",
                    format!("{c}: this model has classes 0..{}", cfg.num_classes() - 1),
                ))
            }
            Condition::Prompt { .. } => {
                return Err(Error::invalid(
                    "prompt",
                    "this model family (DiT) is class-conditional and takes no prompt; give a class label",
                ))
            }
        }
        if r.frames != 1 {
            return Err(Error::invalid(
                "frames",
                format!("{}: DiT makes images (1 frame)", r.frames),
            ));
        }
        if r.guidance_2.is_some() {
            return Err(Error::invalid(
                "guidance_2",
                "DiT has one transformer; a second guidance scale is for two-expert models",
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

    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>> {
        let cfg = self.config().clone();
        let names = cfg.resident_specs().into_iter().map(|s| s.name);
        let resident = weights::load(&self.transformer, names, device, dtype)?;
        let vae = decode.then(|| self.vae_decoder(device)).transpose()?;
        Ok(Box::new(DitRank(Arc::new(RankShared {
            dit: Dit::new(cfg, Box::new(resident)),
            vae,
            scheduler: self.scheduler.clone(),
            upscale: self.upscale(),
            device: device.clone(),
        }))))
    }

    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        Ok(Box::new(ImageDecoder(self.vae_decoder(device)?)))
    }
}

/// The AutoencoderKL as a [`Decoder`]: [1, C, h, w] latents to a [3, H, W] image.
struct ImageDecoder(VaeDecoder);

impl Decoder for ImageDecoder {
    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        Ok(self.0.decode(latents)?.squeeze(0)?)
    }
}

struct RankShared {
    dit: Dit,
    vae: Option<VaeDecoder>,
    scheduler: DdimConfig,
    upscale: usize,
    device: Device,
}

struct DitRank(Arc<RankShared>);

impl RankModel for DitRank {
    fn start(&self, req: Request, _: Split) -> Result<Box<dyn Task>> {
        let r = &self.0;
        let c = r.dit.cfg.in_channels;
        let latents = match &req.init_latents {
            Some(l) => l.to_dtype(DType::F32)?,
            None => seeded_noise(
                req.seed,
                &[1, c, req.height / r.upscale, req.width / r.upscale],
            )?,
        };
        let class = match req.condition {
            Condition::Class(c) => c,
            Condition::Prompt { .. } => return Err(Error::invalid("prompt", "DiT takes a class")),
        };
        Ok(Box::new(DitTask {
            ddim: Ddim::new(r.scheduler.clone(), req.steps)?,
            latents: latents.to_device(&r.device)?,
            rank: self.0.clone(),
            class,
            guidance: req.guidance,
            step: 0,
            state: None,
        }))
    }
}

/// One image's denoising on a rank: one pass over the transformer per DDIM step.
struct DitTask {
    rank: Arc<RankShared>,
    class: u32,
    guidance: f32,
    ddim: Ddim,
    step: usize,
    latents: Tensor,
    state: Option<DitState>,
}

impl DitTask {
    fn total(&self) -> usize {
        self.ddim.timesteps.len()
    }
    /// Classifier-free guidance doubles the batch: the class, then the null class.
    fn guided(&self) -> bool {
        self.guidance > 1.0
    }
}

impl Task for DitTask {
    fn wants(&self) -> Option<usize> {
        (self.step < self.total()).then_some(0)
    }

    fn wants_after(&self) -> Option<usize> {
        (self.step + 1 < self.total()).then_some(0)
    }

    fn begin(&mut self) -> Result<()> {
        let t = self.ddim.timesteps[self.step];
        let (input, labels) = if self.guided() {
            (
                Tensor::cat(&[&self.latents, &self.latents], 0)?,
                vec![self.class, self.rank.dit.cfg.num_classes() as u32],
            )
        } else {
            (self.latents.clone(), vec![self.class])
        };
        self.state = Some(self.rank.dit.prologue(&input, t as f32, &labels)?);
        Ok(())
    }

    fn block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        let st = self
            .state
            .as_mut()
            .ok_or_else(|| Error::bug("step: block before the prologue"))?;
        self.rank.dit.block(index, w, st)
    }

    fn end(&mut self) -> Result<Option<(usize, usize)>> {
        let st = self
            .state
            .take()
            .ok_or_else(|| Error::bug("step: no activations after the pass"))?;
        let c = self.rank.dit.cfg.in_channels;
        let out = self.rank.dit.epilogue(st)?;
        let eps = out.narrow(1, 0, c)?;
        let eps = if self.guided() {
            guide(&eps.narrow(0, 0, 1)?, &eps.narrow(0, 1, 1)?, self.guidance)?
        } else {
            eps
        };
        let t = self.ddim.timesteps[self.step];
        self.latents = self.ddim.step(&eps, t, &self.latents)?;
        self.step += 1;
        Ok(Some((self.step, self.total())))
    }

    fn finish(self: Box<Self>) -> Result<Output> {
        let image = self.rank.vae.as_ref().map(|v| Ok(v.decode(&self.latents)?.squeeze(0)?));
        output(&self.latents, image, None)
    }
}
