//! Wan behind the family seam. A request is one pass over the text encoder (the prompt
//! and, under guidance, the negative prompt as a batch of two), then one pass per
//! denoising step over the expert its timestep selects, then the VAE decode. Conditioning
//! follows diffusers' `WanPipeline`: prompts cleaned, tokenized to `max_sequence_length`,
//! encoded, rows past each prompt's length zeroed; guidance as `uncond + g (cond − uncond)`
//! with the second expert's own scale; the flow sampler from the saved scheduler config.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::transformer::model::{WanState, WanTransformer};
use super::transformer::WanTransformerConfig;
use super::{WanCheckpoint, TEXT_ENCODER, TRANSFORMER, TRANSFORMER_2};
use crate::cache::{CacheKind, StepCacheRun};
use crate::checkpoint::Mapped;
use crate::components::resident::load_component;
use crate::components::umt5::model::zero_padding;
use crate::components::umt5::{embedding_table, PromptTokenizer, Umt5Encoder, Umt5State};
use crate::components::wan_vae::decoder::WanVaeDecoder;
use crate::execution::family::{Decoder, FamilyRuntime, RankModel, Task, VideoSpec};
use crate::execution::seq::Split;
use crate::execution::weights::Weights;
use crate::execution::work::{Condition, Output, Request};
use crate::families::encode_once::{EncodeOnce, EncodeThenSteps};
use crate::families::steps::{guide, output};
use crate::families::FamilyCheckpoint;
use crate::samplers::flow::{FlowScheduler, Sampler};
use crate::{Error, Result};

/// A Wan pipeline folder, checked and mapped once for every rank.
pub struct WanRuntime {
    pub checkpoint: WanCheckpoint,
    /// Mapped text encoder, transformer and (two experts) transformer_2, by group index.
    streamed: Vec<Mapped>,
    vae: Mapped,
    scheduler: FlowScheduler,
    tokenizer: Arc<PromptTokenizer>,
    /// The text encoder's embedding table, read row by row from the mapping.
    table: &'static str,
}

impl WanRuntime {
    pub fn new(checkpoint: WanCheckpoint) -> Result<WanRuntime> {
        let scheduler = FlowScheduler::load(&checkpoint.folder.scheduler_config())?;
        let tokenizer = Arc::new(PromptTokenizer::load(
            &checkpoint.tokenizer,
            crate::execution::work::DEFAULT_MAX_SEQUENCE_LENGTH,
        )?);
        let table = embedding_table(&checkpoint.text_encoder)?;
        let mut streamed = vec![
            Mapped::map(checkpoint.text_encoder.clone())?,
            Mapped::map(checkpoint.transformer.clone())?,
        ];
        if let Some(c) = &checkpoint.transformer_2 {
            streamed.push(Mapped::map(c.clone())?);
        }
        Ok(WanRuntime {
            vae: Mapped::map(checkpoint.vae.clone())?,
            table,
            streamed,
            scheduler,
            tokenizer,
            checkpoint,
        })
    }

    fn vae_decoder(&self, device: &Device) -> Result<WanVaeDecoder> {
        WanVaeDecoder::from_mapped(&self.vae, &self.checkpoint.vae_config, device)
    }
}

impl FamilyRuntime for WanRuntime {
    fn name(&self) -> &'static str {
        "wan"
    }

    fn checkpoint(&self) -> &dyn FamilyCheckpoint {
        &self.checkpoint
    }

    fn mappings(&self) -> Vec<Mapped> {
        self.streamed.clone()
    }

    fn video(&self) -> Option<VideoSpec> {
        Some(VideoSpec {
            frames_per_latent: self.checkpoint.vae_config.temporal_upscale(),
            // diffusers' `WanPipeline` defaults: 81 frames, written at 16 fps.
            default_frames: 81,
            default_fps: 16.0,
        })
    }

    fn defaults(&self) -> (usize, f32) {
        // `WanPipeline.__call__`'s num_inference_steps and guidance_scale.
        (50, 5.0)
    }

    fn validate(&self, r: &Request) -> Result<()> {
        let ck = &self.checkpoint;
        let (prompt, negative) = match &r.condition {
            // `WanPipeline`: no negative prompt reads as an empty one.
            Condition::Prompt { prompt, negative } => {
                (prompt.as_str(), negative.as_deref().unwrap_or(""))
            }
            Condition::Class(_) => {
                return Err(Error::invalid(
                    "class_label",
                    "Wan is text-conditioned: give a prompt, not a class label",
                ))
            }
        };
        crate::families::checks::clip_shape(
            r,
            ck.vae_config.upscale() * ck.transformer_config.patch_size[1],
            ck.vae_config.temporal_upscale(),
        )?;
        // Within the rotary tables: the grid a request makes must have its positions.
        crate::families::checks::within_limits(r, &ck.limits(), true)?;
        crate::families::checks::guidance(r, 1 + ck.transformer_2.is_some() as usize)?;
        self.scheduler.sampler(r.steps)?;
        crate::families::checks::prompt_lengths(
            r,
            [prompt, negative],
            " (with the end token)",
            |t| self.tokenizer.token_count(t),
        )?;
        crate::families::checks::init_latents(
            r,
            &crate::families::checks::clip_latents(
                r,
                ck.transformer_config.in_channels,
                (ck.vae_config.upscale(), ck.vae_config.temporal_upscale()),
            ),
        )
    }

    // Wan computes in f32 only (the default `compute_dtypes`): its transformer and text
    // encoder build f32 activations throughout; half precision for them is future work.

    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>> {
        let ck = &self.checkpoint;
        let names = ck.resident_device_names();
        let te = load_component(
            &self.streamed[TEXT_ENCODER],
            &names,
            "text_encoder",
            device,
            dtype,
        )?;
        let mut experts = Vec::new();
        for (g, comp) in [
            (TRANSFORMER, "transformer"),
            (TRANSFORMER_2, "transformer_2"),
        ] {
            if let Some(m) = self.streamed.get(g) {
                let w = load_component(m, &names, comp, device, dtype)?;
                experts.push(WanTransformer::new(
                    ck.transformer_config.clone(),
                    Box::new(w),
                ));
            }
        }
        Ok(Box::new(WanRank(Arc::new(RankShared {
            encoder: Umt5Encoder::new(ck.text_encoder_config.clone(), &te)?,
            experts,
            vae: decode.then(|| self.vae_decoder(device)).transpose()?,
            runtime: RankConsts {
                tokenizer: self.tokenizer.clone(),
                mapping: self.streamed[TEXT_ENCODER].clone(),
                table: self.table,
                scheduler: self.scheduler.clone(),
                boundary: ck.boundary_ratio,
                train_timesteps: self.scheduler.num_train_timesteps(),
                config: ck.transformer_config.clone(),
                latent: (ck.vae_config.upscale(), ck.vae_config.temporal_upscale()),
            },
            device: device.clone(),
        }))))
    }

    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        Ok(Box::new(self.vae_decoder(device)?))
    }

    fn step_caches(&self) -> &'static [CacheKind] {
        &[CacheKind::FirstBlock, CacheKind::Mag, CacheKind::Taylorseer]
    }

    fn sequence_parallel(&self) -> Option<(usize, String)> {
        let heads = self.checkpoint.transformer_config.num_attention_heads;
        Some((
            heads,
            format!("the transformer has {heads} attention heads"),
        ))
    }
}

/// What every task on a rank reads.
struct RankConsts {
    tokenizer: Arc<PromptTokenizer>,
    /// The text encoder's mapping and its embedding table's name, for the rows a
    /// prompt needs.
    mapping: Mapped,
    table: &'static str,
    scheduler: FlowScheduler,
    boundary: Option<f64>,
    train_timesteps: usize,
    config: WanTransformerConfig,
    /// Pixels per latent (space, time).
    latent: (usize, usize),
}

struct RankShared {
    encoder: Umt5Encoder,
    /// One or two experts, resident parts only.
    experts: Vec<WanTransformer>,
    vae: Option<WanVaeDecoder>,
    runtime: RankConsts,
    device: Device,
}

struct WanRank(Arc<RankShared>);

impl RankModel for WanRank {
    fn start(&self, req: Request, split: Split) -> Result<Box<dyn Task>> {
        let r = &self.0;
        let Condition::Prompt { prompt, negative } = &req.condition else {
            return Err(Error::invalid("prompt", "Wan is text-conditioned"));
        };
        let c = &r.runtime;
        let shape = crate::families::checks::clip_latents(&req, c.config.in_channels, c.latent);
        let (pt, ph, pw) = c.config.patch();
        crate::families::checks::split_tokens(
            shape[2] / pt * (shape[3] / ph) * (shape[4] / pw),
            split.size(),
        )?;
        let latents = crate::families::checks::start_latents(&req, &shape)?;
        let guided = req.guidance > 1.0;
        let mut prompts = vec![prompt.clone()];
        if guided {
            prompts.push(negative.clone().unwrap_or_default());
        }
        let cache = req
            .cache
            .as_ref()
            .map(|c| StepCacheRun::new(c, req.steps, split.size()))
            .transpose()?;
        Ok(Box::new(EncodeOnce::new(WanTask {
            sampler: c.scheduler.sampler(req.steps)?,
            latents: latents.to_device(&r.device)?,
            rank: self.0.clone(),
            prompts,
            max_len: req.max_sequence_length,
            guidance: req.guidance,
            guidance_2: req.guidance_2.unwrap_or(req.guidance),
            guided,
            encoder: None,
            state: None,
            split,
        })
        .with_cache(cache)))
    }
}

/// One clip's generation on a rank.
struct WanTask {
    rank: Arc<RankShared>,
    prompts: Vec<String>,
    max_len: usize,
    guidance: f32,
    guidance_2: f32,
    /// Classifier-free guidance is on (as WanPipeline decides: `guidance > 1`).
    guided: bool,
    sampler: Box<dyn Sampler>,
    latents: Tensor,
    /// The text encoder's pass: its activations and the prompts' attention masks.
    encoder: Option<(Umt5State, Vec<Vec<u32>>)>,
    state: Option<WanState>,
    /// This rank's share of the sequence, and the exchanges with its group's others.
    split: Split,
}

impl WanTask {
    /// The expert step `step` runs (the group of its blocks).
    fn expert_at(&self, step: usize) -> Option<usize> {
        let t = *self.sampler.timesteps().get(step)?;
        let c = &self.rank.runtime;
        Some(match c.boundary {
            Some(r) if (t as f64) < r * c.train_timesteps as f64 => TRANSFORMER_2,
            _ => TRANSFORMER,
        })
    }

    fn expert_group(&self, step: usize) -> usize {
        self.expert_at(step).unwrap_or(TRANSFORMER)
    }
}

impl EncodeThenSteps for WanTask {
    /// Text embeddings [B, M, D] (prompt, then negative prompt under guidance).
    type Text = Tensor;

    fn encoder_group(&self) -> usize {
        TEXT_ENCODER
    }

    fn step_group(&self, step: usize) -> Option<usize> {
        self.expert_at(step)
    }

    fn total(&self) -> usize {
        self.sampler.timesteps().len()
    }

    fn begin_encode(&mut self) -> Result<()> {
        let r = self.rank.clone();
        let refs: Vec<&str> = self.prompts.iter().map(String::as_str).collect();
        let (ids, mask) = r.runtime.tokenizer.encode_to(&refs, self.max_len)?;
        let emb = Umt5Encoder::embed(&r.runtime.mapping, r.runtime.table, &ids, &r.device)?;
        self.encoder = Some((r.encoder.prologue(emb, &mask)?, mask));
        Ok(())
    }

    fn encode_block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        let (st, _) = self
            .encoder
            .as_mut()
            .ok_or_else(|| Error::bug("encode: block before the prologue"))?;
        self.rank.encoder.block(index, w, st)
    }

    fn end_encode(&mut self) -> Result<Self::Text> {
        let (st, mask) = self
            .encoder
            .take()
            .ok_or_else(|| Error::bug("encode: no activations after the pass"))?;
        // WanPipeline keeps each prompt's own rows and zeroes the padding's.
        let hidden = self.rank.encoder.epilogue(st)?;
        zero_padding(&hidden, &mask)
    }

    fn begin_step(&mut self, text: &mut Self::Text, step: usize) -> Result<()> {
        let t = self.sampler.timesteps()[step];
        let input = if self.guided {
            Tensor::cat(&[&self.latents, &self.latents], 0)?
        } else {
            self.latents.clone()
        };
        let expert = &self.rank.experts[self.expert_group(step) - TRANSFORMER];
        self.state = Some(expert.prologue(&input, t, text, &self.split)?);
        Ok(())
    }

    fn step_block(
        &mut self,
        _text: &Self::Text,
        step: usize,
        index: usize,
        w: &dyn Weights,
    ) -> Result<()> {
        let rank = self.rank.clone();
        let expert = &rank.experts[self.expert_group(step) - TRANSFORMER];
        let st = self
            .state
            .as_mut()
            .ok_or_else(|| Error::bug("step: block before the prologue"))?;
        expert.block(index, w, st, &mut self.split)
    }

    fn cache_hidden(&mut self) -> Option<&mut Tensor> {
        self.state.as_mut().map(|s| &mut s.x)
    }

    fn step_output(&mut self, _text: &Self::Text, step: usize) -> Result<Tensor> {
        let st = self
            .state
            .take()
            .ok_or_else(|| Error::bug("step: no activations after the pass"))?;
        let g = self.expert_group(step);
        let rank = self.rank.clone();
        rank.experts[g - TRANSFORMER].epilogue(st, &mut self.split)
    }

    fn step_advance(&mut self, _text: &Self::Text, step: usize, out: Tensor) -> Result<()> {
        let g = self.expert_group(step);
        let noise = if self.guided {
            let scale = if g == TRANSFORMER {
                self.guidance
            } else {
                self.guidance_2
            };
            guide(&out.narrow(0, 0, 1)?, &out.narrow(0, 1, 1)?, scale)?
        } else {
            out
        };
        self.latents = self.sampler.step(&noise, &self.latents)?;
        Ok(())
    }

    fn finish(self, text: Option<Self::Text>) -> Result<Output> {
        let image = self.rank.vae.as_ref().map(|v| v.decode(&self.latents));
        output(&self.latents, image, text)
    }
}
