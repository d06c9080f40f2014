//! Cosmos3 behind the family seam. A request is one pass over the understanding pathway
//! (the prompt and, under guidance, the negative prompt: two sequences of their own
//! lengths), then one pass per denoising step over the generation pathway, then the VAE
//! decode. Conditioning follows diffusers' `Cosmos3OmniPipeline`: metadata sentences and
//! the chat template, positions from the text's length, guidance as
//! `uncond + g (cond − uncond)` whenever `g ≠ 1`, UniPC from the saved scheduler config,
//! latents denormalised with the VAE's statistics before decoding.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::model::{Cosmos3Transformer, Generation, Understanding};
use super::prompt::{Cosmos3Tokenizer, Target};
use super::{Cosmos3Checkpoint, GENERATION, UNDERSTANDING};
use crate::checkpoint::Mapped;
use crate::components::umt5::Umt5Encoder;
use crate::components::wan_vae::decoder::WanVaeDecoder;
use crate::execution::family::{Decoder, FamilyRuntime, RankModel, Task, VideoSpec};
use crate::execution::seq::Split;
use crate::execution::weights::{self, Weights};
use crate::execution::work::{Condition, Output, Request};
use crate::families::encode_once::{EncodeOnce, EncodeThenSteps};
use crate::families::steps::{guide, guided_rows, output};
use crate::families::FamilyCheckpoint;
use crate::samplers::flow::{FlowScheduler, Sampler};
use crate::cache::{CacheKind, StepCacheRun};
use crate::{Error, Result};

/// The pipeline's frame rate (`fps=24.0`), which its prompt templates and rotary time axis read.
pub const FPS: f64 = 24.0;

/// A Cosmos3 pipeline folder, checked and mapped once for every rank.
pub struct Cosmos3Runtime {
    pub checkpoint: Cosmos3Checkpoint,
    transformer: Mapped,
    vae: Mapped,
    scheduler: FlowScheduler,
    tokenizer: Arc<Cosmos3Tokenizer>,
}

impl Cosmos3Runtime {
    pub fn new(checkpoint: Cosmos3Checkpoint) -> Result<Cosmos3Runtime> {
        let scheduler = FlowScheduler::load(&checkpoint.folder.scheduler_config())?;
        let tokenizer = Arc::new(Cosmos3Tokenizer::load(
            &checkpoint.tokenizer,
            checkpoint.system_prompt,
        )?);
        Ok(Cosmos3Runtime {
            transformer: Mapped::map(checkpoint.transformer.clone())?,
            vae: Mapped::map(checkpoint.vae.clone())?,
            scheduler,
            tokenizer,
            checkpoint,
        })
    }

    fn vae_decoder(&self, device: &Device) -> Result<WanVaeDecoder> {
        WanVaeDecoder::from_mapped(&self.vae, &self.checkpoint.vae_config, device)
    }
}

fn target(r: &Request) -> Target {
    Target {
        frames: r.frames,
        width: r.width,
        height: r.height,
        fps: r.fps.unwrap_or(FPS),
    }
}

impl FamilyRuntime for Cosmos3Runtime {
    fn name(&self) -> &'static str {
        "cosmos3"
    }

    fn checkpoint(&self) -> &dyn FamilyCheckpoint {
        &self.checkpoint
    }

    fn mappings(&self) -> Vec<Mapped> {
        vec![self.transformer.clone(), self.transformer.clone()]
    }

    fn video(&self) -> Option<VideoSpec> {
        Some(VideoSpec {
            frames_per_latent: self.checkpoint.vae_config.temporal_upscale(),
            // Cosmos3OmniPipeline's defaults: 189 frames at 24 fps.
            default_frames: 189,
            default_fps: FPS,
        })
    }

    fn defaults(&self) -> (usize, f32) {
        // `Cosmos3OmniPipeline.__call__`'s num_inference_steps and guidance_scale.
        (35, 6.0)
    }

    fn guided(&self, r: &Request) -> bool {
        runs_guided(r)
    }

    fn validate(&self, r: &Request) -> Result<()> {
        let ck = &self.checkpoint;
        let Condition::Prompt { prompt, negative } = &r.condition else {
            return Err(Error::invalid(
                "class_label",
                "Cosmos3 is text-conditioned: give a prompt, not a class label",
            ));
        };
        crate::families::checks::clip_shape(
            r,
            ck.vae_config.upscale(),
            ck.vae_config.temporal_upscale(),
        )?;
        crate::families::checks::guidance(r, 1)?;
        if let Some(fps) = r.fps.filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(Error::invalid(
                "fps",
                format!("{fps}: must be a positive frame rate"),
            ));
        }
        self.scheduler.sampler(r.steps)?;
        let negative = negative.as_deref().unwrap_or("");
        crate::families::checks::prompt_lengths(r, [prompt, negative], "", |t| {
            self.tokenizer.token_count(t)
        })?;
        // The memory model reserves the bound plus the templates' tokens at their widest
        // numbers; a frame rate or size whose sentences run longer would overrun it.
        let (cond, uncond) = self.tokenizer.request(prompt, negative, &target(r))?;
        let most = r.max_sequence_length + ck.template_tokens as usize;
        for (field, ids) in [("prompt", cond), ("negative_prompt", uncond)] {
            if ids.len() > most {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{} tokens with the pipeline's templates (its metadata sentences \
                         for this size and frame rate) is over the {most} reserved: \
                         max_sequence_length and {} for the templates",
                        ids.len(),
                        ck.template_tokens
                    ),
                ));
            }
        }
        crate::families::checks::init_latents(
            r,
            &crate::families::checks::clip_latents(
                r,
                ck.config.latent_channel,
                (ck.vae_config.upscale(), ck.vae_config.temporal_upscale()),
            ),
        )
    }

    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>> {
        let ck = &self.checkpoint;
        let w = weights::load(
            &self.transformer,
            ck.resident_device_names().into_iter(),
            device,
            dtype,
        )?;
        Ok(Box::new(Cosmos3Rank(Arc::new(RankShared {
            transformer: Cosmos3Transformer::new(ck.config.clone(), Box::new(w)),
            vae: decode.then(|| self.vae_decoder(device)).transpose()?,
            tokenizer: self.tokenizer.clone(),
            mapping: self.transformer.clone(),
            table: ck.embedding_table(),
            scheduler: self.scheduler.clone(),
            latent: (ck.vae_config.upscale(), ck.vae_config.temporal_upscale()),
            device: device.clone(),
        }))))
    }

    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        Ok(Box::new(self.vae_decoder(device)?))
    }

    fn step_caches(&self) -> &'static [CacheKind] {
        &[
            CacheKind::Sea,
            CacheKind::FirstBlock,
            CacheKind::Mag,
            CacheKind::Taylorseer,
        ]
    }

    fn sequence_parallel(&self) -> Option<(usize, String)> {
        let c = &self.checkpoint.config;
        Some((
            c.num_key_value_heads,
            format!(
                "the transformer has {} key/value heads (each rank of a request attends over whole ones)",
                c.num_key_value_heads
            ),
        ))
    }
}

struct RankShared {
    transformer: Cosmos3Transformer,
    vae: Option<WanVaeDecoder>,
    tokenizer: Arc<Cosmos3Tokenizer>,
    /// The transformer's mapping and its embedding table's name, for the rows a prompt needs.
    mapping: Mapped,
    table: &'static str,
    scheduler: FlowScheduler,
    /// Pixels per latent (space, time).
    latent: (usize, usize),
    device: Device,
}

/// The pipeline's `do_classifier_free_guidance`: any scale but 1, against the negative
/// prompt or an empty one.
fn runs_guided(r: &Request) -> bool {
    r.guidance != 1.0
}

struct Cosmos3Rank(Arc<RankShared>);

impl RankModel for Cosmos3Rank {
    fn start(&self, req: Request, split: Split) -> Result<Box<dyn Task>> {
        let r = &self.0;
        let Condition::Prompt { prompt, negative } = &req.condition else {
            return Err(Error::invalid("prompt", "Cosmos3 is text-conditioned"));
        };
        let shape =
            crate::families::checks::clip_latents(&req, r.transformer.cfg.latent_channel, r.latent);
        let p = r.transformer.cfg.latent_patch_size;
        crate::families::checks::split_tokens(
            shape[2] * shape[3].div_ceil(p) * shape[4].div_ceil(p),
            split.size(),
        )?;
        let latents = crate::families::checks::start_latents(&req, &shape)?;
        // The pipeline reads no negative prompt as an empty one.
        let negative = negative.as_deref().unwrap_or("");
        let (cond, uncond) = r.tokenizer.request(prompt, negative, &target(&req))?;
        let guided = runs_guided(&req);
        let mut ids = vec![cond];
        if guided {
            ids.push(uncond);
        }
        let cache = req
            .cache
            .as_ref()
            .map(|c| StepCacheRun::new(c, req.steps, split.size()))
            .transpose()?;
        Ok(Box::new(EncodeOnce::new(Cosmos3Task {
            sampler: r.scheduler.sampler(req.steps)?,
            latents: latents.to_device(&r.device)?,
            rank: self.0.clone(),
            ids,
            guidance: req.guidance,
            fps: target(&req).fps,
            understanding: Vec::new(),
            generation: Vec::new(),
            cached: None,
            split,
        })
        .with_cache(cache)))
    }
}

/// One clip's generation on a rank.
struct Cosmos3Task {
    rank: Arc<RankShared>,
    /// Token ids of the prompt and, under guidance, the negative prompt.
    ids: Vec<Vec<u32>>,
    guidance: f32,
    /// The clip's frame rate, which the rotary time axis is scaled by.
    fps: f64,
    sampler: Box<dyn Sampler>,
    latents: Tensor,
    /// The understanding pass in flight, one state per sequence.
    understanding: Vec<Understanding>,
    /// The generation pass in flight, one state per sequence.
    generation: Vec<Generation>,
    /// Under a step cache, the sequences' hidden states stacked [rows, n, d] as the cache
    /// last saw them (and may have replaced them): the step's output reads them back.
    cached: Option<Tensor>,
    /// This rank's share of the vision tokens, and the exchanges with its group's others.
    split: Split,
}

impl EncodeThenSteps for Cosmos3Task {
    /// Each sequence's understanding keys and values.
    type Text = Vec<Understanding>;

    fn encoder_group(&self) -> usize {
        UNDERSTANDING
    }

    fn step_group(&self, step: usize) -> Option<usize> {
        (step < self.total()).then_some(GENERATION)
    }

    fn total(&self) -> usize {
        self.sampler.timesteps().len()
    }

    fn begin_encode(&mut self) -> Result<()> {
        let r = self.rank.clone();
        self.understanding = self
            .ids
            .iter()
            .map(|ids| {
                let emb =
                    Umt5Encoder::embed(&r.mapping, r.table, std::slice::from_ref(ids), &r.device)?;
                r.transformer.understand(emb.get(0)?)
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn encode_block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        for st in &mut self.understanding {
            self.rank.transformer.understanding_block(index, w, st)?;
        }
        Ok(())
    }

    fn end_encode(&mut self) -> Result<Self::Text> {
        Ok(std::mem::take(&mut self.understanding))
    }

    fn begin_step(&mut self, text: &mut Self::Text, step: usize) -> Result<()> {
        let r = self.rank.clone();
        let t = self.sampler.timesteps()[step];
        let (latents, fps, split) = (&self.latents, self.fps, &self.split);
        self.generation = text
            .iter_mut()
            .map(|u| {
                r.transformer
                    .generate(latents, t, u, fps, r.latent.1, split)
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn step_block(
        &mut self,
        text: &Self::Text,
        _step: usize,
        index: usize,
        w: &dyn Weights,
    ) -> Result<()> {
        let tr = &self.rank.transformer;
        for (u, st) in text.iter().zip(&mut self.generation) {
            tr.generation_block(index, w, u, st, &mut self.split)?;
        }
        Ok(())
    }

    fn cache_hidden(&mut self) -> Option<&mut Tensor> {
        let rows: Vec<Tensor> = self.generation.iter().map(|g| g.hidden().clone()).collect();
        self.cached = Tensor::stack(&rows, 0).ok();
        self.cached.as_mut()
    }

    fn cache_normed_hidden(&mut self) -> Result<Option<&mut Tensor>> {
        let tr = &self.rank.transformer;
        for g in &mut self.generation {
            tr.final_norm(g)?;
        }
        Ok(self.cache_hidden())
    }

    fn cache_gate(&self, step: usize) -> Option<(Tensor, f64)> {
        // The pipeline's `vision_tokens` (the latents, in the compute dtype: f32 here) and
        // `float(scheduler.sigmas[i])`.
        let sigma = *self.sampler.sigmas().get(step)?;
        Some((self.latents.get(0).ok()?, sigma as f64))
    }

    fn step_output(&mut self, _text: &Self::Text, _step: usize) -> Result<Tensor> {
        if let Some(x) = self.cached.take() {
            for (r, g) in self.generation.iter_mut().enumerate() {
                g.set_hidden(x.get(r)?)?;
            }
        }
        let tr = &self.rank.transformer;
        let split = &mut self.split;
        let v = std::mem::take(&mut self.generation)
            .into_iter()
            .map(|g| tr.velocity(g, split))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&v, 0)?)
    }

    fn step_advance(&mut self, _text: &Self::Text, _step: usize, out: Tensor) -> Result<()> {
        let velocity = guided_rows(&out, |c, u| guide(c, u, self.guidance))?;
        self.latents = self.sampler.step(&velocity, &self.latents)?;
        Ok(())
    }

    fn finish(self, _text: Option<Self::Text>) -> Result<Output> {
        let image = self.rank.vae.as_ref().map(|v| v.decode(&self.latents));
        output(&self.latents, image, None)
    }
}
