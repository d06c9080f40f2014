//! `AutoencoderKLWan`: its config and tensor specs (metadata) and its causal 3D decoder.
//!
//! The metadata half (this file and `specs`) is what the node agent needs without the
//! compute runtime: `vae/config.json` as diffusers 0.42.1 writes it, the checks that refuse
//! what the decoder cannot compute (naming the field), and the exact names and shapes of
//! every tensor in the checkpoint. The decoder (`decoder`, with `runtime`) turns the
//! pipeline's latents into video frames one latent frame at a time, as diffusers does.

#[cfg(test)]
mod config_tests;
#[cfg(feature = "runtime")]
pub mod decoder;
#[cfg(feature = "runtime")]
mod layers;
#[cfg(all(test, feature = "runtime"))]
mod parity_tests;
pub mod specs;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub use specs::{DecoderLayout, EncoderLayer, UpBlockLayout, Upsample};

/// The only class this module understands.
pub const CLASS_NAME: &str = "AutoencoderKLWan";
/// The diffusers release whose `save_pretrained` layout the specs follow.
pub const DIFFUSERS_VERSION: &str = "0.42.1";

/// A diffusers `AutoencoderKLWan` `config.json`, every field 0.42.1 writes, with its
/// defaults (which are the published Wan 2.1 VAE's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WanVaeConfig {
    /// Empty when the file has no `_class_name`; `validate` rejects that.
    #[serde(rename = "_class_name", default)]
    pub class_name: String,
    #[serde(default = "default_base_dim")]
    pub base_dim: usize,
    /// The decoder's base width when it differs from the encoder's.
    #[serde(default)]
    pub decoder_base_dim: Option<usize>,
    #[serde(default = "default_z_dim")]
    pub z_dim: usize,
    #[serde(default = "default_dim_mult")]
    pub dim_mult: Vec<usize>,
    #[serde(default = "default_num_res_blocks")]
    pub num_res_blocks: usize,
    /// Encoder levels (1, 0.5, 0.25, ...) that get an attention block after each resnet.
    #[serde(default)]
    pub attn_scales: Vec<f64>,
    /// diffusers' spelling. The decoder upsamples in time where this, reversed, says so.
    #[serde(default = "default_temperal_downsample")]
    pub temperal_downsample: Vec<bool>,
    /// Training only: the decoder runs in eval mode.
    #[serde(default)]
    pub dropout: f64,
    /// `WanPipeline` decodes `latents * latents_std + latents_mean`, per channel.
    #[serde(default = "default_latents_mean")]
    pub latents_mean: Vec<f64>,
    #[serde(default = "default_latents_std")]
    pub latents_std: Vec<f64>,
    /// Wan 2.2's residual up/down blocks (the TI2V 5B VAE); refused.
    #[serde(default)]
    pub is_residual: bool,
    #[serde(default = "default_channels")]
    pub in_channels: usize,
    #[serde(default = "default_channels")]
    pub out_channels: usize,
    /// Wan 2.2's pixel (un)shuffle around the VAE; only none (or 1, the identity) is run.
    #[serde(default)]
    pub patch_size: Option<usize>,
    /// What the pipeline divides frame counts and sizes by; must agree with the layers.
    #[serde(default = "default_scale_factor_temporal")]
    pub scale_factor_temporal: Option<usize>,
    #[serde(default = "default_scale_factor_spatial")]
    pub scale_factor_spatial: Option<usize>,
    /// Not a 0.42.1 field: later releases may write it. `false` (no final clamp) is refused
    /// because 0.42.1 always clamps and that is what this decoder reproduces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_output: Option<bool>,
}

fn default_base_dim() -> usize {
    96
}
fn default_z_dim() -> usize {
    16
}
fn default_dim_mult() -> Vec<usize> {
    vec![1, 2, 4, 4]
}
fn default_num_res_blocks() -> usize {
    2
}
fn default_temperal_downsample() -> Vec<bool> {
    vec![false, true, true]
}
fn default_channels() -> usize {
    3
}
fn default_scale_factor_temporal() -> Option<usize> {
    Some(4)
}
fn default_scale_factor_spatial() -> Option<usize> {
    Some(8)
}

/// The published Wan 2.1 VAE's latent statistics (also Wan 2.2 A14B's, which reuses it).
const WAN21_LATENTS_MEAN: [f64; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
];
const WAN21_LATENTS_STD: [f64; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
    1.6382, 1.1253, 2.8251, 1.9160,
];

fn default_latents_mean() -> Vec<f64> {
    WAN21_LATENTS_MEAN.to_vec()
}
fn default_latents_std() -> Vec<f64> {
    WAN21_LATENTS_STD.to_vec()
}

impl WanVaeConfig {
    /// The published Wan 2.1 VAE (`Wan-AI/Wan2.1-T2V-*-Diffusers/vae`), which is also
    /// diffusers' default config.
    pub fn wan21() -> Self {
        WanVaeConfig {
            class_name: CLASS_NAME.into(),
            base_dim: 96,
            decoder_base_dim: None,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: vec![],
            temperal_downsample: vec![false, true, true],
            dropout: 0.0,
            latents_mean: default_latents_mean(),
            latents_std: default_latents_std(),
            is_residual: false,
            in_channels: 3,
            out_channels: 3,
            patch_size: None,
            scale_factor_temporal: Some(4),
            scale_factor_spatial: Some(8),
            clip_output: None,
        }
    }

    /// diffusers' own test config: the real 8× / 4× scales at widths of 3 (and 1 after the
    /// upsamplers halve them), so a 3-frame 4×4 latent decodes in milliseconds.
    pub fn tiny() -> Self {
        WanVaeConfig {
            base_dim: 3,
            dim_mult: vec![1, 1, 1, 1],
            num_res_blocks: 1,
            ..Self::wan21()
        }
    }

    /// Reads and validates `config.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let cfg: WanVaeConfig = crate::checkpoint::read_json(path)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Refuses what the decoder (or the specs) cannot compute; `path` labels the errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        if self.class_name != CLASS_NAME {
            return bad(
                "_class_name",
                format!("expected {CLASS_NAME}, found {:?}", self.class_name),
            );
        }
        if self.is_residual {
            return bad(
                "is_residual",
                "Wan 2.2's residual VAE (TI2V 5B) is not implemented".into(),
            );
        }
        if let Some(p) = self.patch_size.filter(|&p| p != 1) {
            return bad(
                "patch_size",
                format!("{p}: patchified VAEs (Wan 2.2 TI2V 5B) are not implemented"),
            );
        }
        if self.clip_output == Some(false) {
            return bad(
                "clip_output",
                "false: diffusers 0.42.1 always clamps the decoded frames to [-1, 1]".into(),
            );
        }
        for (field, value) in [
            ("base_dim", self.base_dim),
            ("decoder_base_dim", self.decoder_dim()),
            ("z_dim", self.z_dim),
            ("num_res_blocks", self.num_res_blocks),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
        ] {
            if value == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.dim_mult.is_empty() || self.dim_mult.contains(&0) {
            return bad(
                "dim_mult",
                format!("must be non-empty and positive, found {:?}", self.dim_mult),
            );
        }
        crate::checkpoint::at_most(
            path,
            &[
                (
                    "num_res_blocks",
                    self.num_res_blocks,
                    crate::checkpoint::MAX_CONFIG_BLOCKS_PER_LEVEL,
                ),
                (
                    "dim_mult",
                    self.dim_mult.len(),
                    crate::checkpoint::MAX_CONFIG_LEVELS,
                ),
            ],
        )?;
        let levels = self.dim_mult.len() - 1;
        if self.temperal_downsample.len() != levels {
            return bad(
                "temperal_downsample",
                format!(
                    "has {} entries; dim_mult's {} levels need {levels}",
                    self.temperal_downsample.len(),
                    self.dim_mult.len()
                ),
            );
        }
        // Each upsampler halves its block's width; a width of 1 would leave no channels.
        let decoder_field = if self.decoder_base_dim.is_some() {
            "decoder_base_dim"
        } else {
            "base_dim"
        };
        if let Some(block) = self
            .decoder_layout()
            .up_blocks
            .iter()
            .find(|b| b.upsample.is_some() && b.dim < 2)
        {
            return bad(
                decoder_field,
                format!(
                    "an upsampling block {} channel wide would halve to none",
                    block.dim
                ),
            );
        }
        if let Some(s) = self.attn_scales.iter().find(|s| !s.is_finite()) {
            return bad("attn_scales", format!("must be finite, found {s}"));
        }
        if !(0.0..=1.0).contains(&self.dropout) {
            return bad(
                "dropout",
                format!("must be in [0, 1], found {}", self.dropout),
            );
        }
        for (field, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if values.len() != self.z_dim {
                return bad(
                    field,
                    format!("has {} entries but z_dim is {}", values.len(), self.z_dim),
                );
            }
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return bad(field, format!("must be finite, found {v}"));
            }
        }
        if let Some(s) = self.latents_std.iter().find(|&&s| s == 0.0) {
            return bad("latents_std", format!("must be non-zero, found {s}"));
        }
        for (field, given, actual) in [
            (
                "scale_factor_spatial",
                self.scale_factor_spatial,
                self.upscale() * self.patch_size.unwrap_or(1),
            ),
            (
                "scale_factor_temporal",
                self.scale_factor_temporal,
                self.temporal_upscale(),
            ),
        ] {
            if let Some(given) = given.filter(|&g| g != actual) {
                return bad(
                    field,
                    format!("{given} disagrees with the layers, which scale by {actual}"),
                );
            }
        }
        Ok(())
    }

    /// The decoder's base width: `decoder_base_dim`, else `base_dim`.
    pub fn decoder_dim(&self) -> usize {
        self.decoder_base_dim.unwrap_or(self.base_dim)
    }

    /// Output pixels per latent, per side (8 for Wan 2.1).
    pub fn upscale(&self) -> usize {
        1 << self.dim_mult.len().saturating_sub(1)
    }

    /// Output frames per latent frame after the first (4 for Wan 2.1): a clip of `T` latent
    /// frames decodes to `1 + temporal_upscale() * (T - 1)` frames.
    pub fn temporal_upscale(&self) -> usize {
        1 << self.temperal_downsample.iter().filter(|&&t| t).count()
    }

    /// The decoder's time upsampling per level, outermost (latent side) first.
    pub fn temperal_upsample(&self) -> Vec<bool> {
        self.temperal_downsample.iter().rev().copied().collect()
    }

    /// The `config.json` diffusers writes for this config (loadable by
    /// `AutoencoderKLWan.from_pretrained`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("WanVaeConfig always serializes");
        let map = value
            .as_object_mut()
            .expect("WanVaeConfig serializes to an object");
        map.insert("_class_name".into(), CLASS_NAME.into());
        map.insert("_diffusers_version".into(), DIFFUSERS_VERSION.into());
        value
    }
}
