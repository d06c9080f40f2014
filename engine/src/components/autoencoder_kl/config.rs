//! AutoencoderKL's `vae/config.json`: the fields with diffusers' defaults, the presets,
//! reading and the checks that refuse what the decoder cannot compute (naming the field),
//! and the JSON written back. The node agent needs this without the compute runtime.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::components::config_checks::{self, ClassWording};
use crate::{Error, Result};

/// The only class this module understands.
pub const CLASS_NAME: &str = "AutoencoderKL";
/// The diffusers release whose `save_pretrained` layout `tensor_specs` follows.
pub const DIFFUSERS_VERSION: &str = "0.42.1";
/// Every encoder and decoder GroupNorm in AutoencoderKL uses this epsilon.
pub const NORM_EPS: f64 = 1e-6;

const DOWN_BLOCK: &str = "DownEncoderBlock2D";
const UP_BLOCK: &str = "UpDecoderBlock2D";

/// `sample_size` is a number in most configs and a pair in a few.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SampleSize {
    Square(usize),
    HeightWidth(Vec<usize>),
}

/// A diffusers `AutoencoderKL` `config.json`. Defaults are diffusers' own, so a config that
/// omits a field means what it means to diffusers; fields this engine does not use
/// (`force_upcast`, `latents_mean`, ...) are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VaeConfig {
    /// Empty when the file has no `_class_name`; `validate` rejects that.
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub in_channels: usize,
    pub out_channels: usize,
    pub latent_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub norm_num_groups: usize,
    pub act_fn: String,
    /// The sampler works on `latents * scaling_factor`; decoding divides it back out.
    pub scaling_factor: f64,
    /// Added after the division by `scaling_factor` (SD3/Flux-style VAEs); DiT's has none.
    pub shift_factor: Option<f64>,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub sample_size: SampleSize,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl Default for VaeConfig {
    fn default() -> Self {
        VaeConfig {
            class_name: String::new(),
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels: vec![64],
            layers_per_block: 1,
            norm_num_groups: 32,
            act_fn: "silu".into(),
            scaling_factor: 0.18215,
            shift_factor: None,
            down_block_types: vec![DOWN_BLOCK.into()],
            up_block_types: vec![UP_BLOCK.into()],
            sample_size: SampleSize::Square(32),
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl VaeConfig {
    fn with_blocks(
        block_out_channels: Vec<usize>,
        layers_per_block: usize,
        norm_num_groups: usize,
    ) -> Self {
        let n = block_out_channels.len();
        VaeConfig {
            class_name: CLASS_NAME.into(),
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels,
            layers_per_block,
            norm_num_groups,
            act_fn: "silu".into(),
            scaling_factor: 0.18215,
            shift_factor: None,
            down_block_types: vec![DOWN_BLOCK.into(); n],
            up_block_types: vec![UP_BLOCK.into(); n],
            sample_size: SampleSize::Square(32),
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }

    /// A VAE for tests and fixtures: the real one's 8× upscale and four levels, a channel
    /// change (so `conv_shortcut` exists) and two-channel norm groups at width 16, at sizes
    /// where an 8×8 latent decodes in milliseconds and the checkpoint is ~340 KB.
    pub fn tiny() -> Self {
        VaeConfig {
            sample_size: SampleSize::Square(64),
            ..Self::with_blocks(vec![8, 16, 16, 16], 1, 8)
        }
    }

    /// The shapes of `stabilityai/sd-vae-ft-ema`, the VAE DiT-XL/2 ships with.
    pub fn sd() -> Self {
        VaeConfig {
            sample_size: SampleSize::Square(256),
            ..Self::with_blocks(vec![128, 256, 512, 512], 2, 32)
        }
    }

    /// Reads and validates `config.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = crate::checkpoint::read_small(path)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| Error::config(path, "(document)", "not UTF-8 text"))?;
        let cfg = Self::parse(&text, path)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Parses `config.json` text without validating it; `path` only labels the errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
        serde_json::from_value(value.clone())
            .map_err(|e| Error::config(path, field_at_fault(&value), e.to_string()))
    }

    /// Checks everything the decoder relies on; `path` only labels the errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        config_checks::class_name(
            path,
            &self.class_name,
            CLASS_NAME,
            ClassWording::ExpectedFound,
        )?;
        // diffusers maps both names to nn.SiLU.
        if self.act_fn != "silu" && self.act_fn != "swish" {
            return bad(
                "act_fn",
                format!("only \"silu\" is supported, found {:?}", self.act_fn),
            );
        }
        config_checks::at_least_one(
            path,
            &config_checks::named!(self: in_channels, out_channels, latent_channels, layers_per_block, norm_num_groups),
        )?;
        crate::checkpoint::at_most(
            path,
            &[
                (
                    "layers_per_block",
                    self.layers_per_block,
                    crate::checkpoint::MAX_CONFIG_BLOCKS_PER_LEVEL,
                ),
                (
                    "block_out_channels",
                    self.block_out_channels.len(),
                    crate::checkpoint::MAX_CONFIG_LEVELS,
                ),
            ],
        )?;
        if self.block_out_channels.is_empty() {
            return bad("block_out_channels", "must name at least one block".into());
        }
        for (i, &c) in self.block_out_channels.iter().enumerate() {
            if c == 0 || c % self.norm_num_groups != 0 {
                return bad(
                    "block_out_channels",
                    format!(
                        "entry {i} ({c}) must be a positive multiple of norm_num_groups ({})",
                        self.norm_num_groups
                    ),
                );
            }
        }
        for (field, types, expected) in [
            ("down_block_types", &self.down_block_types, DOWN_BLOCK),
            ("up_block_types", &self.up_block_types, UP_BLOCK),
        ] {
            if types.len() != self.block_out_channels.len() {
                return bad(
                    field,
                    format!(
                        "has {} entries but block_out_channels has {}",
                        types.len(),
                        self.block_out_channels.len()
                    ),
                );
            }
            if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| *t != expected) {
                return bad(
                    field,
                    format!("entry {i} is {t:?}; only {expected} is supported"),
                );
            }
        }
        if !self.scaling_factor.is_finite() || self.scaling_factor == 0.0 {
            return bad(
                "scaling_factor",
                format!("must be finite and non-zero, found {}", self.scaling_factor),
            );
        }
        if let Some(s) = self.shift_factor.filter(|s| !s.is_finite()) {
            return bad("shift_factor", format!("must be finite, found {s}"));
        }
        match &self.sample_size {
            SampleSize::Square(_) => {}
            SampleSize::HeightWidth(v) if v.len() == 2 => {}
            SampleSize::HeightWidth(v) => {
                return bad(
                    "sample_size",
                    format!("expected a number or [height, width], found {v:?}"),
                );
            }
        }
        Ok(())
    }

    /// Output pixels per latent, per side.
    pub fn upscale(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// The contents of a `config.json` diffusers can load.
    pub fn to_config_json(&self) -> serde_json::Value {
        crate::components::config_json::with_fields(
            self,
            &[
                ("_class_name", CLASS_NAME.into()),
                ("_diffusers_version", DIFFUSERS_VERSION.into()),
            ],
        )
    }
}

/// The first field that fails to parse on its own. serde_json's messages carry a line and
/// column but not the field, and every field has a default, so each one parses alone.
fn field_at_fault(value: &serde_json::Value) -> String {
    let Some(map) = value.as_object() else {
        return "config.json".into();
    };
    map.iter()
        .find(|(key, v)| {
            let alone = serde_json::json!({ key.as_str(): v });
            serde_json::from_value::<VaeConfig>(alone).is_err()
        })
        .map(|(key, _)| key.clone())
        .unwrap_or_else(|| "config.json".into())
}
