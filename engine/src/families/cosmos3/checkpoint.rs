//! A Cosmos3 pipeline folder opened and checked from its headers and configs alone:
//! `model_index.json`, the text tokenizer's files, the transformer's and the VAE's configs
//! and every tensor against what they imply. Nothing here reads weight data.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::{Cosmos3Config, EMBED_TOKENS};
use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{ActivationCost, Component, ModelFolder};
use crate::components::pipeline_index::listed;
use crate::components::wan_vae::WanVaeConfig;
use crate::families::{BlockGroup, FamilyCheckpoint};
use crate::{Error, Result};

/// A checked Cosmos3 pipeline folder.
#[derive(Debug, Clone)]
pub struct Cosmos3Checkpoint {
    pub folder: ModelFolder,
    /// `text_tokenizer/`: its `tokenizer.json`, `tokenizer_config.json` and chat template.
    pub tokenizer: PathBuf,
    pub config: Cosmos3Config,
    pub vae_config: WanVaeConfig,
    pub transformer: Component,
    pub vae: Component,
    /// The pipeline prepends its system prompt (`default_use_system_prompt`).
    pub system_prompt: bool,
    /// Tokens the chat template and metadata sentences add to a prompt, at most
    /// ([`super::prompt::Cosmos3Tokenizer::template_tokens`]).
    pub template_tokens: u64,
}

impl Cosmos3Checkpoint {
    pub fn open(root: &Path) -> Result<Cosmos3Checkpoint> {
        let folder = ModelFolder::new(root)?;
        let index_path = root.join("model_index.json");
        let index: Value = crate::checkpoint::read_json(&index_path)?;
        for part in ["text_tokenizer", "transformer", "vae", "scheduler"] {
            if !listed(&index, part) {
                return Err(Error::config(
                    &index_path,
                    part,
                    "missing; a Cosmos3 pipeline needs a text_tokenizer, transformer, vae and scheduler",
                ));
            }
        }
        if index
            .get("use_native_flow_schedule")
            .and_then(Value::as_bool)
            == Some(true)
        {
            return Err(Error::config(
                &index_path,
                "use_native_flow_schedule",
                "the native flow schedule (sigmas set by the pipeline) is not supported; the scheduler's own schedule is",
            ));
        }
        let system_prompt = index
            .get("default_use_system_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let tokenizer = root.join("text_tokenizer");
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            if !tokenizer.join(file).is_file() {
                return Err(Error::checkpoint(
                    tokenizer.join(file),
                    "missing: a Cosmos3 pipeline folder holds text_tokenizer/tokenizer.json and tokenizer_config.json",
                ));
            }
        }
        let config = Cosmos3Config::load(&root.join("transformer").join("config.json"))?;
        let vae_config = WanVaeConfig::load(&root.join("vae").join("config.json"))?;
        let transformer = Component::open(&root.join("transformer"))?;
        let vae = Component::open(&root.join("vae"))?;
        check_tensors(&transformer, &config.all_specs(), |_| None)?;
        check_tensors(&vae, &vae_config.tensor_specs(), |_| None)?;
        if vae_config.z_dim != config.latent_channel {
            return Err(Error::config(
                root.join("transformer").join("config.json"),
                "latent_channel",
                format!(
                    "{} but the VAE's latents have {} channels",
                    config.latent_channel, vae_config.z_dim
                ),
            ));
        }
        let patch = vae_config.patch_size.unwrap_or(1);
        if vae_config.out_channels != 3 * patch * patch {
            return Err(Error::config(
                root.join("vae").join("config.json"),
                "out_channels",
                format!(
                    "{}: frames are RGB, 3 channels in each of the {patch} × {patch} pixels of a patch",
                    vae_config.out_channels
                ),
            ));
        }
        let template_tokens = template_tokens(&tokenizer, system_prompt)? as u64;
        Ok(Cosmos3Checkpoint {
            folder,
            template_tokens,
            tokenizer,
            config,
            vae_config,
            transformer,
            vae,
            system_prompt,
        })
    }

    /// Tensors of the transformer outside the blocks that every rank keeps on its device
    /// (the embedding table is read from the host mapping; the language head and the
    /// understanding pathway's final norm are never read).
    pub fn resident_device_names(&self) -> Vec<String> {
        self.config
            .resident_specs()
            .into_iter()
            .map(|s| s.name)
            .collect()
    }

    /// The VAE's decoder tensors.
    pub fn decoder_names(&self) -> Vec<String> {
        self.vae_config.decoder_names()
    }

    /// The name of the text embedding table.
    pub fn embedding_table(&self) -> &'static str {
        EMBED_TOKENS
    }
}

/// Tokens the pipeline's templates add to a prompt, at most: counted by the folder's own
/// tokenizer where the runtime is built (the engine, `inspect`), else bounded by their
/// bytes ([`super::template::byte_bound`], the agent's and operator's reading).
#[cfg(feature = "runtime")]
fn template_tokens(tokenizer: &Path, system_prompt: bool) -> Result<usize> {
    super::prompt::Cosmos3Tokenizer::load(tokenizer, system_prompt)?.template_tokens()
}

#[cfg(not(feature = "runtime"))]
fn template_tokens(_: &Path, system_prompt: bool) -> Result<usize> {
    Ok(super::template::byte_bound(system_prompt))
}

impl FamilyCheckpoint for Cosmos3Checkpoint {
    /// [`FamilyCheckpoint::resident_device_bytes`] once loaded at `elem` bytes per element.
    fn resident_stored_bytes(&self, elem: u64) -> u64 {
        self.transformer
            .bytes_of(self.resident_device_names(), Some(elem))
    }
    /// [`FamilyCheckpoint::decoder_bytes`] once loaded at `elem` bytes per element.
    fn decoder_stored_bytes(&self, elem: u64) -> u64 {
        self.vae.bytes_of(self.decoder_names(), Some(elem))
    }

    fn components(&self) -> Vec<(&'static str, &Component)> {
        vec![("transformer", &self.transformer), ("vae", &self.vae)]
    }
    /// The understanding pathway ([`super::UNDERSTANDING`]), then the generation pathway
    /// ([`super::GENERATION`]), both over the transformer's layers.
    fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        vec![
            ("transformer", self.config.understanding_group()),
            ("transformer", self.config.generation_group()),
        ]
    }
    fn resident_device_bytes(&self) -> u64 {
        self.transformer
            .bytes_of(self.resident_device_names(), None)
    }
    fn decoder_bytes(&self) -> u64 {
        self.vae.bytes_of(self.decoder_names(), None)
    }
    /// The pipeline's default size, 1280 × 720.
    fn native_size(&self) -> (usize, usize) {
        (1280, 720)
    }
    /// The understanding pathway ([`super::UNDERSTANDING`]) once per request over the
    /// prompt's tokens, the generation pathway every step over the vision tokens
    /// ([`super::flops`]).
    fn group_compute(&self) -> Vec<layerwise_core::family::GroupCompute> {
        layerwise_core::family::default_group_compute(self)
            .into_iter()
            .enumerate()
            .map(|(i, g)| match i {
                super::UNDERSTANDING => super::flops::understanding_block(&self.config, g),
                _ => super::flops::generation_block(&self.config, g),
            })
            .collect()
    }
    fn decode_cost(&self) -> Option<crate::decode::DecodeCost> {
        Some(self.vae_config.decode_cost())
    }

    /// What a request costs in activations (f32), from the shapes the engine computes.
    fn activation_cost(&self) -> ActivationCost {
        let c = &self.config;
        let (d, ff) = (c.hidden_size as u64, c.intermediate_size as u64);
        let qw = (c.num_attention_heads * c.head_dim) as u64;
        let kvw = (c.num_key_value_heads * c.head_dim) as u64;
        let spatial = (self.vae_config.upscale() * c.latent_patch_size) as u64;
        let layers = c.num_hidden_layers as u64;
        ActivationCost {
            pixels_per_token: spatial * spatial,
            // A generation layer: x, its norm, q, k, v, rotary temporaries, the attention
            // out, the MLP's two projections and their product. Attention runs in query
            // chunks within a fixed budget.
            bytes_per_token: 4 * (3 * d + 2 * qw + 3 * kvw + 3 * ff),
            // One chunk's scores and their softmax, all heads, f32: what a sequence short
            // enough for a single chunk holds in place of the budget. Measured on the CPU
            // at the published widths, the two overlap: 7 bytes a pair and head, not 8
            // (engine/tests/memory_measured.rs).
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 7 * c.num_attention_heads as u64,
            attention_bytes: crate::components::attention::ATTENTION_CHUNK_BYTES,
            vae_bytes_per_pixel: 4
                * 3
                * (self
                    .vae_config
                    .decoder_base_dim
                    .unwrap_or(self.vae_config.base_dim)
                    * self.vae_config.dim_mult[0]) as u64,
            frames_per_latent: self.vae_config.temporal_upscale() as u64,
            decoder_frames: self.vae_config.temporal_upscale() as u64 + 2,
            // The understanding pathway's keys (normed, rotated) and values, kept for every
            // layer for the whole request, and the layer's key/value concatenation.
            bytes_per_text_token: 4 * 2 * kvw * (layers + 1),
            // The prompt is not padded: a sequence is its own tokens and the templates'.
            template_tokens: self.template_tokens,
            // An understanding layer over the prompt: x, its norm, q, k, v, attention out
            // and the MLP, and the keys and values of the layers behind it.
            encoder_bytes_per_token: 4 * (3 * d + 2 * qw + 3 * kvw + 3 * ff) + 4 * 2 * kvw * layers,
            encoder_attention_bytes_per_token: 0,
            // Its causal attention over a short prompt in one chunk: the scores, the mask
            // added to them and their softmax, which overlap to 6 bytes a pair and head
            // (measured as above).
            encoder_bytes_per_token_pair: 6 * c.num_attention_heads as u64,
            // The conditional and unconditional sequences run one after the other through
            // each block: the one waiting holds its hidden states (and, generating, its
            // rotary tables and its prompt's keys and values; understanding, the keys and
            // values of the layers behind it).
            guidance_samples: 2,
            samples_in_turn: true,
            waiting_bytes_per_token: 4 * (d + 2 * c.head_dim as u64),
            waiting_bytes_per_text_token: 4 * 2 * kvw * layers,
            encoder_waiting_bytes_per_token: 4 * d + 4 * 2 * kvw * layers,
            // Under sequence parallelism: the generation pathway's q, k, v and attention
            // output alive in both layouts across an all-to-all.
            exchange_bytes_per_token: 4 * (2 * qw + 2 * kvw),
            // A step cache keeps residuals of the generation stream (hidden wide) and
            // TaylorSeer the transformer's output, a patch's latents a token.
            hidden_bytes_per_token: 4 * d,
            output_bytes_per_token: 4 * c.patch_latent_dim as u64,
            cache_states: 1,
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
