//! Qwen-Image behind the family seam. A request is one pass over the text encoder (the
//! prompt and, under guidance, the negative prompt: two sequences of their own lengths), then
//! one pass per denoising step over the transformer, then the VAE decode. Conditioning
//! follows diffusers' `QwenImagePipeline`: the prompt template, the encoder's last hidden
//! states past the template's first 34 tokens, packed 2×2 latent patches, sigmas
//! `linspace(1, 1/steps, steps)` shifted by the image's sequence length, and true
//! classifier-free guidance when the scale is above 1 and a negative prompt is given (an
//! empty one counts; without one the pipeline runs unguided), its result rescaled to the
//! conditional prediction's norm per token.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use candle_core::{DType, Device, Tensor, D};

use super::transformer::model::{QwenImageState, QwenImageTransformer};
use super::QwenImageCheckpoint;
use super::{TEXT_ENCODER, TRANSFORMER};
use crate::checkpoint::Mapped;
use crate::components::qwen2_5_vl::prompt::prompt_embeds;
use crate::components::qwen2_5_vl::{Qwen25VlEncoder, Qwen25VlState, QwenTokenizer};
use crate::components::resident::load_component;
use crate::components::wan_vae::decoder::WanVaeDecoder;
use crate::execution::family::{Decoder, FamilyRuntime, RankModel, Task};
use crate::execution::seq::Split;
use crate::execution::weights::Weights;
use crate::execution::work::{Condition, Output, Request};
use crate::families::encode_once::{EncodeOnce, EncodeThenSteps};
use crate::cache::{CacheKind, StepCacheRun};
use crate::families::steps::{guided_rows, output};
use crate::families::FamilyCheckpoint;
use crate::samplers::flow::{FlowMatchEulerConfig, Sampler};
use crate::{Error, Result};

/// Reads `scheduler/scheduler_config.json`: the pipeline drives a
/// `FlowMatchEulerDiscreteScheduler` with its own sigmas and the image's `mu`.
fn load_scheduler(path: &Path) -> Result<FlowMatchEulerConfig> {
    let doc: Value = crate::checkpoint::read_json(path)?;
    match doc.get("_class_name").and_then(Value::as_str) {
        Some("FlowMatchEulerDiscreteScheduler") => {}
        other => {
            return Err(Error::config(
                path,
                "_class_name",
                format!(
                    "{}: QwenImagePipeline drives FlowMatchEulerDiscreteScheduler",
                    other.map_or("missing".to_string(), |c| format!("`{c}`"))
                ),
            ))
        }
    }
    let c: FlowMatchEulerConfig = crate::samplers::flow::parse(path, doc)?;
    c.validate_for_image(path)?;
    Ok(c)
}

/// `QwenImagePipeline.__call__`'s num_inference_steps (its true_cfg_scale is 4).
const DEFAULT_STEPS: usize = 50;

/// A Qwen-Image pipeline folder, checked and mapped once for every rank.
pub struct QwenImageRuntime {
    pub checkpoint: QwenImageCheckpoint,
    /// Mapped text encoder and transformer, by group index.
    streamed: Vec<Mapped>,
    vae: Mapped,
    prompt: Arc<QwenTokenizer>,
    scheduler: FlowMatchEulerConfig,
}

impl QwenImageRuntime {
    /// Loads the tokenizer and the scheduler and checks that every request the model's
    /// limits allow can run on them ([`super::start_checks`]), then maps the weights.
    pub fn new(checkpoint: QwenImageCheckpoint) -> Result<QwenImageRuntime> {
        let prompt = Arc::new(QwenTokenizer::load(&checkpoint.tokenizer)?);
        super::start_checks::tokenizer(&prompt)?;
        let scheduler_path = checkpoint.folder.scheduler_config();
        let scheduler = load_scheduler(&scheduler_path)?;
        super::start_checks::scheduler(
            &scheduler,
            &scheduler_path,
            DEFAULT_STEPS,
            native_tokens(&checkpoint),
        )?;
        Ok(QwenImageRuntime {
            streamed: vec![
                Mapped::map(checkpoint.text_encoder.clone())?,
                Mapped::map(checkpoint.transformer.clone())?,
            ],
            vae: Mapped::map(checkpoint.vae.clone())?,
            prompt,
            scheduler,
            checkpoint,
        })
    }

    fn vae_decoder(&self, device: &Device) -> Result<WanVaeDecoder> {
        WanVaeDecoder::from_mapped(&self.vae, &self.checkpoint.vae_config, device)
    }

    /// The packed latents of a request: [1, (H/16)·(W/16), 4·z].
    fn packed_shape(&self, r: &Request) -> [usize; 3] {
        let side = self.checkpoint.pixels_per_token_side();
        [
            1,
            (r.height / side) * (r.width / side),
            self.checkpoint.transformer_config.in_channels,
        ]
    }
}

/// Packed tokens of an image at the model's native size: the largest the scheduler must
/// shift for the folder to open.
fn native_tokens(ck: &QwenImageCheckpoint) -> usize {
    let (w, h) = ck.native_size();
    let side = ck.pixels_per_token_side();
    (w / side) * (h / side)
}

/// The latents of a request as the VAE reads them (and as requests give and receive them):
/// [1, z, 1, H/8, W/8].
fn latent_shape(ck: &QwenImageCheckpoint, r: &Request) -> [usize; 5] {
    let up = ck.vae_config.upscale();
    [1, ck.vae_config.z_dim, 1, r.height / up, r.width / up]
}

/// `QwenImagePipeline._pack_latents`: [1, C, 1, H, W] to [1, (H/2)(W/2), 4C], each token a
/// 2×2 patch (channel-major within the patch).
pub fn pack(latents: &Tensor) -> Result<Tensor> {
    let (b, c, t, h, w) = latents.dims5()?;
    if t != 1 || h % 2 != 0 || w % 2 != 0 {
        return Err(Error::bug(format!(
            "pack: latents {:?}, expected one frame of even height and width",
            latents.dims()
        )));
    }
    Ok(latents
        .reshape((b, c, h / 2, 2, w / 2, 2))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((b, (h / 2) * (w / 2), c * 4))?)
}

/// `QwenImagePipeline._unpack_latents`: the inverse of [`pack`] for an image of `h × w`
/// latents.
pub fn unpack(latents: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let (b, s, c4) = latents.dims3()?;
    if s != (h / 2) * (w / 2) || c4 % 4 != 0 {
        return Err(Error::bug(format!(
            "unpack: latents {:?} are not {h}×{w} latents in 2×2 patches",
            latents.dims()
        )));
    }
    Ok(latents
        .reshape((b, h / 2, w / 2, c4 / 4, 2, 2))?
        .permute((0, 3, 1, 4, 2, 5))?
        .reshape((b, c4 / 4, 1, h, w))?)
}

/// The pipeline's guidance: `uncond + g (cond − uncond)`, rescaled per token to the
/// conditional prediction's norm over its channels.
fn guide(cond: &Tensor, uncond: &Tensor, scale: f32) -> Result<Tensor> {
    let comb = crate::families::steps::guide(cond, uncond, scale)?;
    let cond_norm = cond.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    let comb_norm = comb.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    Ok(comb.broadcast_mul(&(cond_norm / comb_norm)?)?)
}

impl FamilyRuntime for QwenImageRuntime {
    fn name(&self) -> &'static str {
        "qwen-image"
    }

    fn checkpoint(&self) -> &dyn FamilyCheckpoint {
        &self.checkpoint
    }

    fn mappings(&self) -> Vec<Mapped> {
        self.streamed.clone()
    }

    fn defaults(&self) -> (usize, f32) {
        (DEFAULT_STEPS, 4.0)
    }

    fn guided(&self, r: &Request) -> bool {
        runs_guided(r)
    }

    fn step_caches(&self) -> &'static [CacheKind] {
        &[CacheKind::FirstBlock, CacheKind::Mag, CacheKind::Taylorseer]
    }

    fn validate(&self, r: &Request) -> Result<()> {
        let ck = &self.checkpoint;
        let Condition::Prompt { prompt, negative } = &r.condition else {
            return Err(Error::invalid(
                "class_label",
                "Qwen-Image is text-conditioned: give a prompt, not a class label",
            ));
        };
        if r.frames != 1 {
            return Err(Error::invalid(
                "frames",
                format!("{}: Qwen-Image makes images (1 frame)", r.frames),
            ));
        }
        crate::families::checks::clip_shape(r, ck.pixels_per_token_side(), 1)?;
        crate::families::checks::within_limits(r, &ck.limits(), false)?;
        crate::families::checks::guidance(r, 1)?;
        if r.max_sequence_length > super::MAX_SEQUENCE_LENGTH {
            return Err(Error::invalid(
                "max_sequence_length",
                format!(
                    "{}: QwenImagePipeline reads at most {} prompt tokens",
                    r.max_sequence_length,
                    super::MAX_SEQUENCE_LENGTH
                ),
            ));
        }
        super::start_checks::schedule(
            &self.scheduler,
            &self.checkpoint.folder.scheduler_config(),
            r.steps,
            self.packed_shape(r)[1],
            native_tokens(ck),
        )?;
        if r.max_sequence_length == 0 {
            return Err(Error::invalid("max_sequence_length", "must be at least 1"));
        }
        self.prompt.check(prompt, "prompt", r.max_sequence_length)?;
        if let Some(negative) = negative.as_deref().filter(|_| runs_guided(r)) {
            self.prompt
                .check(negative, "negative_prompt", r.max_sequence_length)?;
        }
        crate::families::checks::init_latents(r, &latent_shape(ck, r))
    }

    // Qwen-Image computes in f32 only (the default `compute_dtypes`), as Wan does.

    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>> {
        let ck = &self.checkpoint;
        let names = ck.resident_device_names();
        let load = |g: usize, comp| load_component(&self.streamed[g], &names, comp, device, dtype);
        let te = load(TEXT_ENCODER, "text_encoder")?;
        let tr = load(TRANSFORMER, "transformer")?;
        Ok(Box::new(QwenImageRank(Arc::new(RankShared {
            encoder: Qwen25VlEncoder::new(
                ck.text_encoder_config.clone(),
                ck.text_encoder_prefix,
                &te,
            )?,
            transformer: QwenImageTransformer::new(ck.transformer_config.clone(), Box::new(tr)),
            vae: decode.then(|| self.vae_decoder(device)).transpose()?,
            prompt: self.prompt.clone(),
            mapping: self.streamed[TEXT_ENCODER].clone(),
            checkpoint: ck.clone(),
            scheduler: self.scheduler.clone(),
            device: device.clone(),
        }))))
    }

    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        Ok(Box::new(self.vae_decoder(device)?))
    }
}

/// The pipeline's `do_true_cfg`: a scale above 1 and a negative prompt given (an empty one
/// counts). Without one `QwenImagePipeline` runs unguided, whatever the scale.
fn runs_guided(r: &Request) -> bool {
    r.guidance > 1.0
        && matches!(
            &r.condition,
            Condition::Prompt {
                negative: Some(_),
                ..
            }
        )
}

struct RankShared {
    encoder: Qwen25VlEncoder,
    transformer: QwenImageTransformer,
    vae: Option<WanVaeDecoder>,
    prompt: Arc<QwenTokenizer>,
    /// The text encoder's mapping, for the embedding rows a prompt needs.
    mapping: Mapped,
    checkpoint: QwenImageCheckpoint,
    scheduler: FlowMatchEulerConfig,
    device: Device,
}

struct QwenImageRank(Arc<RankShared>);

impl RankModel for QwenImageRank {
    fn start(&self, req: Request, split: Split) -> Result<Box<dyn Task>> {
        let r = &self.0;
        let Condition::Prompt { prompt, negative } = &req.condition else {
            return Err(Error::invalid("prompt", "Qwen-Image is text-conditioned"));
        };
        let ck = &r.checkpoint;
        let shape = latent_shape(ck, &req);
        let latents = crate::families::checks::start_latents(&req, &shape)?;
        let mut ids = vec![r.prompt.ids(prompt, "prompt")?];
        if let Some(negative) = negative.as_deref().filter(|_| runs_guided(&req)) {
            ids.push(r.prompt.ids(negative, "negative_prompt")?);
        }
        let up = ck.vae_config.upscale();
        let (h, w) = (req.height / up, req.width / up);
        let packed = pack(&latents.to_device(&r.device)?)?;
        let cache = req
            .cache
            .as_ref()
            .map(|c| StepCacheRun::new(c, req.steps, split.size()))
            .transpose()?;
        Ok(Box::new(EncodeOnce::new(QwenImageTask {
            sampler: Box::new(super::start_checks::schedule(
                &r.scheduler,
                &ck.folder.scheduler_config(),
                req.steps,
                packed.dim(1)?,
                native_tokens(ck),
            )?),
            latents: packed,
            latent_hw: (h, w),
            rank: self.0.clone(),
            ids,
            max_len: req.max_sequence_length,
            guidance: req.guidance,
            encoder: Vec::new(),
            states: Vec::new(),
            cached: None,
        })
        .with_cache(cache)))
    }
}

/// One image's generation on a rank.
struct QwenImageTask {
    rank: Arc<RankShared>,
    /// Token ids of the prompt and, under guidance, the negative prompt (template applied).
    ids: Vec<Vec<u32>>,
    /// The request's `max_sequence_length`: prompt embeddings past it are cut, as the
    /// pipeline cuts them (the request's check refuses prompts that would lose any).
    max_len: usize,
    guidance: f32,
    sampler: Box<dyn Sampler>,
    /// Packed latents [1, S, 4z].
    latents: Tensor,
    /// The latents' height and width, for unpacking.
    latent_hw: (usize, usize),
    /// The text encoder's pass in flight, one state per sequence.
    encoder: Vec<Qwen25VlState>,
    /// The transformer's pass in flight, one state per sequence.
    states: Vec<QwenImageState>,
    /// Under a step cache, the sequences' image streams stacked [rows, S, D] as the cache
    /// last saw them (and may have replaced them): the step's output reads them back.
    cached: Option<Tensor>,
}

impl EncodeThenSteps for QwenImageTask {
    /// Each sequence's prompt embeddings [1, M, D].
    type Text = Vec<Tensor>;

    fn encoder_group(&self) -> usize {
        TEXT_ENCODER
    }

    fn step_group(&self, step: usize) -> Option<usize> {
        (step < self.total()).then_some(TRANSFORMER)
    }

    fn total(&self) -> usize {
        self.sampler.timesteps().len()
    }

    fn begin_encode(&mut self) -> Result<()> {
        let r = self.rank.clone();
        self.encoder = self
            .ids
            .iter()
            .map(|ids| {
                let emb = Qwen25VlEncoder::embed(
                    &r.mapping,
                    r.checkpoint.text_encoder_prefix,
                    ids,
                    &r.device,
                )?;
                r.encoder.prologue(emb)
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn encode_block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        for st in &mut self.encoder {
            self.rank.encoder.block(index, w, st)?;
        }
        Ok(())
    }

    fn end_encode(&mut self) -> Result<Self::Text> {
        let r = self.rank.clone();
        std::mem::take(&mut self.encoder)
            .into_iter()
            .map(|st| prompt_embeds(&r.encoder.epilogue(st)?, self.max_len))
            .collect()
    }

    fn begin_step(&mut self, text: &mut Self::Text, step: usize) -> Result<()> {
        let r = self.rank.clone();
        // The pipeline passes `timestep / 1000` in the latents' dtype.
        let t = self.sampler.timesteps()[step] / 1000.0;
        let (h, w) = self.latent_hw;
        let grid = (1, h / 2, w / 2);
        self.states = text
            .iter()
            .map(|e| r.transformer.prologue(&self.latents, t, e, grid))
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn step_block(
        &mut self,
        _text: &Self::Text,
        _step: usize,
        index: usize,
        w: &dyn Weights,
    ) -> Result<()> {
        for st in &mut self.states {
            self.rank.transformer.block(index, w, st)?;
        }
        Ok(())
    }

    fn cache_hidden(&mut self) -> Option<&mut Tensor> {
        // The image stream: the blocks' `hidden_states` as diffusers' block registry names
        // them, which the caches' residuals are taken over.
        let rows: Vec<&Tensor> = self.states.iter().map(|st| &st.img).collect();
        self.cached = Tensor::cat(&rows, 0).ok();
        self.cached.as_mut()
    }

    fn step_output(&mut self, _text: &Self::Text, _step: usize) -> Result<Tensor> {
        if let Some(x) = self.cached.take() {
            for (r, st) in self.states.iter_mut().enumerate() {
                st.img = x.narrow(0, r, 1)?;
            }
        }
        let r = self.rank.clone();
        let v = std::mem::take(&mut self.states)
            .into_iter()
            .map(|st| r.transformer.epilogue(st))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&v, 0)?)
    }

    fn step_advance(&mut self, _text: &Self::Text, _step: usize, out: Tensor) -> Result<()> {
        let noise = guided_rows(&out, |c, u| guide(c, u, self.guidance))?;
        self.latents = self.sampler.step(&noise, &self.latents)?;
        Ok(())
    }

    fn finish(self, _text: Option<Self::Text>) -> Result<Output> {
        let (h, w) = self.latent_hw;
        let latents = unpack(&self.latents, h, w)?;
        let image = self.rank.vae.as_ref().map(|v| Ok(v.decode(&latents)?.squeeze(0)?));
        output(&latents, image, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_and_unpack_are_the_pipelines_and_inverse() {
        // [1, 2, 1, 2, 4]: channel c, row y, column x holds 100c + 10y + x.
        let v: Vec<f32> = (0..2)
            .flat_map(|c| {
                (0..2).flat_map(move |y| (0..4).map(move |x| (100 * c + 10 * y + x) as f32))
            })
            .collect();
        let l = Tensor::from_vec(v, (1, 2, 1, 2, 4), &Device::Cpu).unwrap();
        let p = pack(&l).unwrap();
        assert_eq!(p.dims(), &[1, 2, 8]);
        // Token 1 is the patch at columns 2..4: channel 0's four pixels, then channel 1's.
        assert_eq!(
            p.get(0).unwrap().get(1).unwrap().to_vec1::<f32>().unwrap(),
            vec![2.0, 3.0, 12.0, 13.0, 102.0, 103.0, 112.0, 113.0]
        );
        let back = unpack(&p, 2, 4).unwrap();
        let same = (back - &l).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(same.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn guidance_keeps_the_conditional_norm_per_token() {
        let cond = Tensor::new(&[[[3f32, 4.0], [1.0, 0.0]]], &Device::Cpu).unwrap();
        let uncond = Tensor::new(&[[[0f32, 0.0], [0.0, 1.0]]], &Device::Cpu).unwrap();
        let g = guide(&cond, &uncond, 2.0).unwrap();
        let n = g.sqr().unwrap().sum(D::Minus1).unwrap().sqrt().unwrap();
        let n = n.to_vec2::<f32>().unwrap();
        assert!(
            (n[0][0] - 5.0).abs() < 1e-6 && (n[0][1] - 1.0).abs() < 1e-6,
            "{n:?}"
        );
        // Token 0: the combination (6, 8), rescaled to norm 5.
        let v = g.to_vec3::<f32>().unwrap();
        assert!((v[0][0][0] - 3.0).abs() < 1e-6 && (v[0][0][1] - 4.0).abs() < 1e-6);
    }
}
