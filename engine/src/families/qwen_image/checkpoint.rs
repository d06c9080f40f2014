//! A Qwen-Image pipeline folder opened and checked from its headers and configs alone:
//! `model_index.json`, each component's config and every tensor against what the configs imply. Nothing here reads weight data.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::transformer::QwenImageTransformerConfig;
use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{ActivationCost, Component, ModelFolder};
use crate::components::pipeline_index::listed;
use crate::components::qwen2_5_vl::{Qwen25VlConfig, TensorPrefix};
use crate::components::wan_vae::WanVaeConfig;
use crate::families::{BlockGroup, FamilyCheckpoint};
use crate::{Error, Result};

/// The class diffusers writes in `model_index.json`.
pub const CLASS_NAME: &str = "QwenImagePipeline";

/// A checked Qwen-Image pipeline folder.
#[derive(Debug, Clone)]
pub struct QwenImageCheckpoint {
    pub folder: ModelFolder,
    /// `tokenizer/`.
    pub tokenizer: PathBuf,
    pub text_encoder_config: Qwen25VlConfig,
    /// Where the text encoder's language-model tensors are named (`model.` as transformers
    /// saves them, or `model.language_model.`).
    pub text_encoder_prefix: TensorPrefix,
    pub transformer_config: QwenImageTransformerConfig,
    pub vae_config: WanVaeConfig,
    pub text_encoder: Component,
    pub transformer: Component,
    pub vae: Component,
}

/// Checks that the components of `root` fit together: the transformer reads the text
/// encoder's width and 2×2 patches of the VAE's latents, and the VAE decodes RGB.
fn check_agreement(
    root: &Path,
    te: &Qwen25VlConfig,
    tr: &QwenImageTransformerConfig,
    vae: &WanVaeConfig,
) -> Result<()> {
    let config = |c: &str| root.join(c).join("config.json");
    if te.hidden_size != tr.joint_attention_dim {
        return Err(Error::config(
            config("transformer"),
            "joint_attention_dim",
            format!(
                "{} but the text encoder's hidden_size is {}",
                tr.joint_attention_dim, te.hidden_size
            ),
        ));
    }
    let p2 = tr.patch_size * tr.patch_size;
    if tr.in_channels != vae.z_dim * p2 || tr.out() != vae.z_dim {
        return Err(Error::config(
            config("transformer"),
            "in_channels",
            format!(
                "in {} / out {} channels, but the VAE's latents have {} channels: the transformer reads {p2} of them per token and writes one",
                tr.in_channels, tr.out(), vae.z_dim
            ),
        ));
    }
    if vae.video_channels() != 3 {
        return Err(Error::config(
            config("vae"),
            "input_channels",
            format!("{}: images are RGB (3 channels)", vae.video_channels()),
        ));
    }
    Ok(())
}

impl QwenImageCheckpoint {
    /// Opens `root` and checks every component against its config.
    pub fn open(root: &Path) -> Result<QwenImageCheckpoint> {
        let folder = ModelFolder::new(root)?;
        let index_path = root.join("model_index.json");
        let index: Value = crate::checkpoint::read_json(&index_path)?;
        for part in [
            "tokenizer",
            "text_encoder",
            "transformer",
            "vae",
            "scheduler",
        ] {
            if !listed(&index, part) {
                return Err(Error::config(
                    &index_path,
                    part,
                    "missing; a Qwen-Image pipeline needs a tokenizer, text_encoder, transformer, vae and scheduler",
                ));
            }
        }
        let tokenizer = root.join("tokenizer");
        let dir = |c: &str| root.join(c);
        let text_encoder_config = Qwen25VlConfig::load(&dir("text_encoder").join("config.json"))?;
        let transformer_config =
            QwenImageTransformerConfig::load(&dir("transformer").join("config.json"))?;
        let vae_config = super::vae::load(&dir("vae").join("config.json"))?;
        let text_encoder = Component::open(&dir("text_encoder"))?;
        let transformer = Component::open(&dir("transformer"))?;
        let vae = Component::open(&dir("vae"))?;
        let text_encoder_prefix = text_encoder_config.check(&text_encoder)?;
        check_tensors(&transformer, &transformer_config.all_specs(), |_| None)?;
        check_tensors(&vae, &vae_config.tensor_specs(), |_| None)?;
        check_agreement(root, &text_encoder_config, &transformer_config, &vae_config)?;
        Ok(QwenImageCheckpoint {
            folder,
            tokenizer,
            text_encoder_config,
            text_encoder_prefix,
            transformer_config,
            vae_config,
            text_encoder,
            transformer,
            vae,
        })
    }

    /// Tensors outside the blocks that every rank keeps on its device: the transformer's
    /// prologue and epilogue, and the text encoder's final norm (its embedding table is read
    /// from the host mapping; its vision tower and language head are never read).
    pub fn resident_device_names(&self) -> Vec<(&'static str, String)> {
        let mut v: Vec<(&'static str, String)> = self
            .transformer_config
            .resident_specs()
            .into_iter()
            .map(|s| ("transformer", s.name))
            .collect();
        v.extend(
            self.text_encoder_config
                .resident_specs(self.text_encoder_prefix)
                .into_iter()
                .map(|s| ("text_encoder", s.name)),
        );
        v
    }

    fn resident_bytes_at(&self, elem: Option<u64>) -> u64 {
        self.resident_device_names()
            .iter()
            .map(|(comp, name)| match *comp {
                "transformer" => self.transformer.bytes_of([name], elem),
                _ => self.text_encoder.bytes_of([name], elem),
            })
            .sum()
    }

    /// The VAE's decoder tensors, which every rank that decodes keeps on its device.
    pub fn decoder_names(&self) -> Vec<String> {
        self.vae_config.decoder_names()
    }

    /// Output pixels per token across: the VAE's upscale times the transformer's patch.
    pub fn pixels_per_token_side(&self) -> usize {
        self.vae_config.upscale() * self.transformer_config.patch_size
    }
}

impl FamilyCheckpoint for QwenImageCheckpoint {
    /// [`FamilyCheckpoint::resident_device_bytes`] once loaded at `elem` bytes per element.
    fn resident_stored_bytes(&self, elem: u64) -> u64 {
        self.resident_bytes_at(Some(elem))
    }
    /// [`FamilyCheckpoint::decoder_bytes`] once loaded at `elem` bytes per element.
    fn decoder_stored_bytes(&self, elem: u64) -> u64 {
        self.vae.bytes_of(self.decoder_names(), Some(elem))
    }

    fn components(&self) -> Vec<(&'static str, &Component)> {
        vec![
            ("text_encoder", &self.text_encoder),
            ("transformer", &self.transformer),
            ("vae", &self.vae),
        ]
    }
    /// The streamed groups, by group index ([`super::TEXT_ENCODER`], [`super::TRANSFORMER`]).
    fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        vec![
            (
                "text_encoder",
                self.text_encoder_config
                    .block_group(self.text_encoder_prefix),
            ),
            ("transformer", self.transformer_config.block_group()),
        ]
    }
    fn resident_device_bytes(&self) -> u64 {
        self.resident_bytes_at(None)
    }
    fn decoder_bytes(&self) -> u64 {
        self.vae.bytes_of(self.decoder_names(), None)
    }
    /// QwenImagePipeline's default size: 128 latents of 8 pixels, 1024 × 1024.
    fn native_size(&self) -> (usize, usize) {
        (1024, 1024)
    }
    /// The largest image the transformer's rotary tables place with the longest prompt the
    /// pipeline reads: text positions follow the image's half-extent, so the side in patches
    /// is bounded by [`QwenImageTransformerConfig::max_grid_side`] of 1024 text tokens.
    fn limits(&self) -> crate::bounds::ModelLimits {
        let side = QwenImageTransformerConfig::max_grid_side(super::MAX_SEQUENCE_LENGTH) as u64
            * self.pixels_per_token_side() as u64;
        crate::bounds::ModelLimits {
            max_width: Some(side),
            max_height: Some(side),
            max_frames: Some(1),
            reason: format!(
                "its rotary tables hold {} positions per axis, shared by the image's half-extent and a prompt of up to {} tokens",
                super::transformer::config::ROPE_POSITIONS,
                super::MAX_SEQUENCE_LENGTH
            ),
        }
    }
    /// What a request costs in activations (f32), from the shapes the engine computes.
    fn decode_cost(&self) -> Option<crate::decode::DecodeCost> {
        Some(self.vae_config.decode_cost())
    }

    fn activation_cost(&self) -> ActivationCost {
        let tr = &self.transformer_config;
        let side = self.pixels_per_token_side() as u64;
        let base = self.vae_config.base_dim as u64;
        ActivationCost {
            pixels_per_token: side * side,
            bytes_per_token: tr.activation_bytes_per_token(),
            // One chunk's scores and softmax, all heads, f32: what a sequence short
            // enough for a single chunk holds in place of the budget.
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 8 * tr.num_attention_heads as u64,
            attention_bytes: crate::components::attention::ATTENTION_CHUNK_BYTES,
            // The decoder's first up block at full resolution: about three maps of its width
            // for the one frame and the two its causal cache holds.
            vae_bytes_per_pixel: 4 * 3 * base * self.vae_config.dim_mult[0] as u64,
            frames_per_latent: 1,
            decoder_frames: 3,
            // The text stream runs through every block beside the image's: the same live
            // tensors per token, and the prompt's embeddings kept for the whole request.
            bytes_per_text_token: tr.activation_bytes_per_token()
                + 4 * tr.joint_attention_dim as u64,
            template_tokens: 0,
            encoder_bytes_per_token: self.text_encoder_config.encoder_bytes_per_token(),
            encoder_attention_bytes_per_token: 0,
            encoder_bytes_per_token_pair: 0,
            // The prompt and the negative prompt run as two sequences of their own lengths,
            // both live through each block.
            guidance_samples: 2,
            samples_in_turn: false,
            waiting_bytes_per_token: 0,
            waiting_bytes_per_text_token: 0,
            encoder_waiting_bytes_per_token: 0,
            exchange_bytes_per_token: 0,
            // A step cache keeps residuals of the image stream (hidden wide) and TaylorSeer
            // the transformer's output, out channels × patch area a token.
            hidden_bytes_per_token: 4 * tr.hidden() as u64,
            output_bytes_per_token: 4 * tr.packed_out() as u64,
            cache_states: 1,
        }
    }
    /// The text encoder's layers ([`crate::components::qwen2_5_vl::flops::encoder_block`])
    /// and the transformer's double-stream blocks ([`super::flops::transformer_block`]).
    fn group_compute(&self) -> Vec<layerwise_core::family::GroupCompute> {
        layerwise_core::family::default_group_compute(self)
            .into_iter()
            .map(|g| match g.component.as_str() {
                "text_encoder" => crate::components::qwen2_5_vl::flops::encoder_block(
                    &self.text_encoder_config,
                    g,
                ),
                _ => super::flops::transformer_block(&self.transformer_config, g),
            })
            .collect()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
