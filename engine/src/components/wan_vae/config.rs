//! The `AutoencoderKLWan` config: `vae/config.json` as diffusers 0.42.1 writes it, the
//! published variants' values, and the checks that refuse what the decoder cannot compute
//! (naming the field). It lives beside `specs` rather than in the folder's `mod.rs` so that
//! the specs (which read it) and the module root (which re-exports both) form no loop.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The only class this module understands.
pub const CLASS_NAME: &str = "AutoencoderKLWan";
/// The diffusers release whose `save_pretrained` layout the specs follow.
pub const DIFFUSERS_VERSION: &str = "0.42.1";

/// A diffusers `AutoencoderKLWan` `config.json`, every field 0.42.1 writes, with its
/// defaults (which are the published Wan 2.1 VAE's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WanVaeConfig {
    /// Empty when the file has no `_class_name`; `validate` rejects that.
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub base_dim: usize,
    /// The decoder's base width when it differs from the encoder's.
    pub decoder_base_dim: Option<usize>,
    pub z_dim: usize,
    pub dim_mult: Vec<usize>,
    pub num_res_blocks: usize,
    /// Encoder levels (1, 0.5, 0.25, ...) that get an attention block after each resnet.
    pub attn_scales: Vec<f64>,
    /// diffusers' spelling. The decoder upsamples in time where this, reversed, says so.
    pub temperal_downsample: Vec<bool>,
    /// Training only: the decoder runs in eval mode.
    pub dropout: f64,
    /// `WanPipeline` decodes `latents * latents_std + latents_mean`, per channel.
    pub latents_mean: Vec<f64>,
    pub latents_std: Vec<f64>,
    /// Wan 2.2's residual blocks (the TI2V 5B VAE): each resampling block gets a weightless
    /// shortcut that spreads its input's channels over the upsampled frames and pixels, and
    /// its resampler keeps the width instead of halving it.
    pub is_residual: bool,
    pub in_channels: usize,
    pub out_channels: usize,
    /// Wan 2.2's pixel (un)shuffle around the VAE: the decoder's `out_channels` are
    /// `patch_size`² pixels of `out_channels / patch_size²` channels each. None (the
    /// identity, as is 1) or 2.
    pub patch_size: Option<usize>,
    /// What the pipeline divides frame counts and sizes by; must agree with the layers.
    pub scale_factor_temporal: Option<usize>,
    pub scale_factor_spatial: Option<usize>,
    /// Not a 0.42.1 field, but the published Wan 2.2 VAE configs (Wan2.2-TI2V-5B-Diffusers,
    /// Cosmos3's) carry `false`, written by the diffusers build that converted them. 0.42.1
    /// ignores it and always clamps, and so does this decoder; the pipeline's
    /// post-processing clamps to [0, 1] after, so the frames are the same either way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_output: Option<bool>,
}

impl Default for WanVaeConfig {
    fn default() -> Self {
        WanVaeConfig {
            class_name: String::new(),
            base_dim: 96,
            decoder_base_dim: None,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: Vec::new(),
            temperal_downsample: vec![false, true, true],
            dropout: 0.0,
            latents_mean: WAN21_LATENTS_MEAN.to_vec(),
            latents_std: WAN21_LATENTS_STD.to_vec(),
            is_residual: false,
            in_channels: 3,
            out_channels: 3,
            patch_size: None,
            scale_factor_temporal: Some(4),
            scale_factor_spatial: Some(8),
            clip_output: None,
        }
    }
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

/// The published Wan 2.2 VAE's (z_dim 48) latent statistics.
const WAN22_LATENTS_MEAN: [f64; 48] = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
    0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
    -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
    -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
    0.3573, -0.0548, -0.1681, -0.0667,
];
const WAN22_LATENTS_STD: [f64; 48] = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
];

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
            latents_mean: WAN21_LATENTS_MEAN.to_vec(),
            latents_std: WAN21_LATENTS_STD.to_vec(),
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

    /// The published Wan 2.2 VAE (`Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae`, also Cosmos3's):
    /// residual, 2×2 patches, 48 latent channels, a wider decoder, 16× / 4×.
    pub fn wan22() -> Self {
        WanVaeConfig {
            base_dim: 160,
            decoder_base_dim: Some(256),
            z_dim: 48,
            latents_mean: WAN22_LATENTS_MEAN.to_vec(),
            latents_std: WAN22_LATENTS_STD.to_vec(),
            is_residual: true,
            in_channels: 12,
            out_channels: 12,
            patch_size: Some(2),
            scale_factor_spatial: Some(16),
            clip_output: Some(false),
            ..Self::wan21()
        }
    }

    /// diffusers' Wan 2.2 5B pipeline test VAE (its `Wan225BPipelineFastTests`), with the
    /// published latent statistics in place of its zeros and ones so the denormalisation is
    /// exercised: widths of 3 throughout, residual, 2×2 patches, 16× / 4×.
    pub fn tiny22() -> Self {
        WanVaeConfig {
            base_dim: 3,
            decoder_base_dim: None,
            dim_mult: vec![1, 1, 1, 1],
            num_res_blocks: 1,
            clip_output: None,
            ..Self::wan22()
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
        self.validate_widths(path)?;
        self.validate_layers(path)?;
        self.validate_numbers(path)?;
        self.validate_scale_factors(path)
    }

    /// The patch, every width and `dim_mult`: implemented, positive, within bounds, the
    /// output a whole number of patches.
    fn validate_widths(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        if let Some(p) = self.patch_size.filter(|&p| p != 1 && p != 2) {
            return bad(
                "patch_size",
                format!("{p}: only none, 1 and 2 (Wan 2.2's) are implemented"),
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
        let patch = self.patch();
        if !self.out_channels.is_multiple_of(patch * patch) {
            return bad(
                "out_channels",
                format!(
                    "{} is not a whole number of {patch}×{patch} patches",
                    self.out_channels
                ),
            );
        }
        Ok(())
    }

    /// The layers `dim_mult`'s levels build: a time step for each, no upsampling block
    /// halved to nothing, every shortcut's channels in whole groups.
    fn validate_layers(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
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
        // Wan 2.1's upsamplers halve their block's width; a width of 1 would leave none.
        let decoder_field = if self.decoder_base_dim.is_some() {
            "decoder_base_dim"
        } else {
            "base_dim"
        };
        let layout = self.decoder_layout();
        if let Some(block) = layout
            .up_blocks
            .iter()
            .find(|b| b.upsample.is_some() && b.out == 0)
        {
            return bad(
                decoder_field,
                format!(
                    "an upsampling block {} channel wide would halve to none",
                    block.dim
                ),
            );
        }
        // Wan 2.2's shortcuts regroup channels: each decoder one spreads its input over
        // factor × out channels, each encoder one averages factor × in into out, and both
        // need whole groups (diffusers refuses to build the model otherwise).
        let mut regroups = layout
            .up_blocks
            .iter()
            .filter_map(|b| b.shortcut)
            .map(|s| (s.cin, s.cout * s.factor()))
            .chain(
                self.residual_encoder_blocks()
                    .into_iter()
                    .map(|b| (b.cout, b.cin * b.factor())),
            );
        if let Some((unit, total)) = regroups.find(|(u, t)| t % u != 0) {
            return bad(
                "dim_mult",
                format!(
                    "{:?}: a residual block's shortcut would split {total} channels into groups of {unit}",
                    self.dim_mult
                ),
            );
        }
        Ok(())
    }

    /// The attention scales, the dropout and the latent statistics: finite, in range, one
    /// per latent channel.
    fn validate_numbers(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
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
        Ok(())
    }

    /// The scale factors the config states, where it states them, against the layers'.
    fn validate_scale_factors(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        for (field, given, actual) in [
            (
                "scale_factor_spatial",
                self.scale_factor_spatial,
                self.upscale(),
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

    /// The side of a patch: `patch_size`, 1 without one.
    pub fn patch(&self) -> usize {
        self.patch_size.unwrap_or(1)
    }

    /// Output pixels per latent, per side: the decoder's levels and the patch (8 for Wan 2.1,
    /// 16 for Wan 2.2's 2×2 patches).
    pub fn upscale(&self) -> usize {
        (1 << self.dim_mult.len().saturating_sub(1)) * self.patch()
    }

    /// Channels of the decoded frames: the decoder's `out_channels` over the patch's pixels
    /// (3 for both published VAEs).
    pub fn video_channels(&self) -> usize {
        self.out_channels / (self.patch() * self.patch())
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
        crate::components::config_json::with_fields(
            self,
            &[
                ("_class_name", CLASS_NAME.into()),
                ("_diffusers_version", DIFFUSERS_VERSION.into()),
            ],
        )
    }
}
