//! A DiT pipeline folder opened and checked from its headers and configs alone: the
//! transformer and VAE configs, and every tensor's name, shape and dtype against what
//! the configs imply. Nothing here reads weight data.

use std::path::{Path, PathBuf};

use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{ActivationCost, Component, ModelFolder};
use layerwise_core::compute_dtype::ComputeElement;
use crate::components::autoencoder_kl::{legacy_attention_alias, VaeConfig};
use crate::families::dit::DitConfig;
use crate::families::{BlockGroup, FamilyCheckpoint};
use crate::Result;

/// A checked DiT pipeline folder.
#[derive(Debug, Clone)]
pub struct DitCheckpoint {
    pub folder: ModelFolder,
    pub config: DitConfig,
    pub vae_config: VaeConfig,
    pub transformer: Component,
    pub vae: Component,
}

impl DitCheckpoint {
    /// Opens `root` and checks every tensor against the configs.
    pub fn open(root: &Path) -> Result<DitCheckpoint> {
        let folder = ModelFolder::new(root)?;
        let config = DitConfig::load(&folder.transformer().join("config.json"))?;
        let vae_config = VaeConfig::load(&folder.vae().join("config.json"))?;
        let transformer = Component::open(&folder.transformer())?;
        let vae = Component::open(&folder.vae())?;
        check_block_count(&transformer, &config)?;
        check_tensors(&transformer, &config.all_specs(), |_| None)?;
        check_tensors(&vae, &vae_config.tensor_specs(), legacy_attention_alias)?;
        Ok(DitCheckpoint {
            folder,
            config,
            vae_config,
            transformer,
            vae,
        })
    }

    pub fn root(&self) -> &PathBuf {
        &self.folder.root
    }

    /// The VAE's decoder tensors (`decoder.*` and `post_quant_conv.*`), which every rank
    /// that decodes keeps on its device.
    pub fn decoder_names(&self) -> Vec<String> {
        self.vae
            .index
            .keys()
            .filter(|n| n.starts_with("decoder.") || n.starts_with("post_quant_conv."))
            .cloned()
            .collect()
    }
}

impl FamilyCheckpoint for DitCheckpoint {
    /// [`Self::resident_device_bytes`] once loaded at `elem` bytes per element.
    fn resident_stored_bytes(&self, elem: u64) -> u64 {
        let names = self.config.resident_specs().into_iter().map(|s| s.name);
        self.transformer.bytes_of(names, Some(elem))
    }
    /// [`Self::decoder_bytes`] once loaded at `elem` bytes per element.
    fn decoder_stored_bytes(&self, elem: u64) -> u64 {
        self.vae.bytes_of(self.decoder_names(), Some(elem))
    }

    fn components(&self) -> Vec<(&'static str, &Component)> {
        vec![("transformer", &self.transformer), ("vae", &self.vae)]
    }
    fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        vec![("transformer", self.config.block_group())]
    }
    /// Transformer bytes outside the blocks, which every rank keeps on its device: the
    /// patch embedding and the final layer.
    fn resident_device_bytes(&self) -> u64 {
        let names = self.config.resident_specs().into_iter().map(|s| s.name);
        self.transformer.bytes_of(names, None)
    }
    /// Bytes of [`Self::decoder_names`].
    fn decoder_bytes(&self) -> u64 {
        self.vae.bytes_of(self.decoder_names(), None)
    }
    /// The image size the model was trained at, in pixels.
    fn native_size(&self) -> (usize, usize) {
        let side = self.config.sample_size * self.vae_config.upscale();
        (side, side)
    }
    /// Its forward passes run in f32, bf16 and f16 alike.
    fn compute_dtypes(&self) -> &'static [ComputeElement] {
        &[ComputeElement::F32, ComputeElement::Bf16, ComputeElement::F16]
    }
    /// What a request costs in activations (f32), from the shapes the engine computes.
    fn activation_cost(&self) -> ActivationCost {
        let cfg = &self.config;
        let up = self.vae_config.upscale() as u64;
        let d = cfg.hidden() as u64;
        let p = cfg.patch() as u64;
        let ch = &self.vae_config.block_out_channels;
        ActivationCost {
            pixels_per_token: (up * p) * (up * p),
            // x, norm(x), q, k, v, attention out, 4d MLP hidden before and after GELU,
            // plus the unpatchified output: f32 each.
            bytes_per_token: 4 * (10 * d + 2 * p * p * cfg.out() as u64),
            // Scores and their softmax, per head.
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 4 * 2 * cfg.num_attention_heads as u64,
            // At full resolution the decoder holds about four maps of the first block's
            // width plus the upsampled map of the second's.
            vae_bytes_per_pixel: 4 * (4 * ch[0] as u64 + *ch.get(1).unwrap_or(&ch[0]) as u64),
            attention_bytes: 0,
            frames_per_latent: 1,
            decoder_frames: 1,
            // Class-conditional: no prompt. Guidance batches the null class beside each.
            bytes_per_text_token: 0,
            template_tokens: 0,
            encoder_bytes_per_token: 0,
            encoder_attention_bytes_per_token: 0,
            encoder_bytes_per_token_pair: 0,
            guidance_samples: 2,
            samples_in_turn: false,
            waiting_bytes_per_token: 0,
            waiting_bytes_per_text_token: 0,
            encoder_waiting_bytes_per_token: 0,
            exchange_bytes_per_token: 0,
            hidden_bytes_per_token: 0,
            output_bytes_per_token: 0,
            cache_states: 1,
        }
    }
    /// The blocks by [`super::flops::transformer_block`].
    fn group_compute(&self) -> Vec<layerwise_core::family::GroupCompute> {
        layerwise_core::family::default_group_compute(self)
            .into_iter()
            .map(|g| super::flops::transformer_block(&self.config, g))
            .collect()
    }
    // No `limits`: DiT computes its sin-cos positions for any grid.
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A config whose depth disagrees with the weights gets one clear message, rather than
/// a missing-tensor error for the first absent block.
fn check_block_count(c: &Component, cfg: &DitConfig) -> Result<()> {
    crate::components::config_checks::depth_matches(
        c,
        "num_layers",
        cfg.num_layers,
        DitConfig::block_of,
        "blocks",
    )
}
