//! The AutoencoderKL (diffusers layout) that turns latents into pixels, shared by the
//! families that use it (DiT today): its `vae/config.json`, the checks on it, and the
//! names and shapes of every tensor its checkpoint holds, which the node agent needs
//! without the compute runtime; and the decoder itself (`decoder`, with `runtime`).

#[cfg(feature = "runtime")]
pub mod decoder;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};
use layerwise_core::family::TensorSpec;

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
        crate::components::config_checks::ensure(
            path,
            "_class_name",
            self.class_name == CLASS_NAME,
            || format!("expected {CLASS_NAME}, found {:?}", self.class_name),
        )?;
        // diffusers maps both names to nn.SiLU.
        if self.act_fn != "silu" && self.act_fn != "swish" {
            return bad(
                "act_fn",
                format!("only \"silu\" is supported, found {:?}", self.act_fn),
            );
        }
        crate::components::config_checks::at_least_one(
            path,
            &[
                ("in_channels", self.in_channels),
                ("out_channels", self.out_channels),
                ("latent_channels", self.latent_channels),
                ("layers_per_block", self.layers_per_block),
                ("norm_num_groups", self.norm_num_groups),
            ],
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

    /// Every tensor of the full AutoencoderKL (encoder, quant convs, decoder) under the
    /// names diffusers' `save_pretrained` writes today.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        let blocks = &self.block_out_channels;
        let (first, last) = (blocks[0], blocks[blocks.len() - 1]);
        let latent = self.latent_channels;

        conv(&mut out, "encoder.conv_in", self.in_channels, first, 3);
        let mut channels = first;
        for (i, &c) in blocks.iter().enumerate() {
            for j in 0..self.layers_per_block {
                let cin = if j == 0 { channels } else { c };
                resnet(
                    &mut out,
                    &format!("encoder.down_blocks.{i}.resnets.{j}"),
                    cin,
                    c,
                );
            }
            if i + 1 < blocks.len() {
                conv(
                    &mut out,
                    &format!("encoder.down_blocks.{i}.downsamplers.0.conv"),
                    c,
                    c,
                    3,
                );
            }
            channels = c;
        }
        self.mid_block(&mut out, "encoder.mid_block", last);
        norm(&mut out, "encoder.conv_norm_out", last);
        // Mean and log-variance, hence twice the latent channels.
        conv(&mut out, "encoder.conv_out", last, 2 * latent, 3);
        if self.use_quant_conv {
            conv(&mut out, "quant_conv", 2 * latent, 2 * latent, 1);
        }
        self.decoder_specs_into(&mut out);
        out
    }

    /// The tensors decoding needs: `post_quant_conv` (when used) and `decoder.*`.
    pub fn decoder_tensor_specs(&self) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        self.decoder_specs_into(&mut out);
        out
    }

    fn decoder_specs_into(&self, out: &mut Vec<TensorSpec>) {
        let blocks = &self.block_out_channels;
        let (first, last) = (blocks[0], blocks[blocks.len() - 1]);
        let latent = self.latent_channels;
        if self.use_post_quant_conv {
            conv(out, "post_quant_conv", latent, latent, 1);
        }
        conv(out, "decoder.conv_in", latent, last, 3);
        self.mid_block(out, "decoder.mid_block", last);
        let mut channels = last;
        for (i, &c) in blocks.iter().rev().enumerate() {
            for j in 0..=self.layers_per_block {
                let cin = if j == 0 { channels } else { c };
                resnet(out, &format!("decoder.up_blocks.{i}.resnets.{j}"), cin, c);
            }
            if i + 1 < blocks.len() {
                conv(
                    out,
                    &format!("decoder.up_blocks.{i}.upsamplers.0.conv"),
                    c,
                    c,
                    3,
                );
            }
            channels = c;
        }
        norm(out, "decoder.conv_norm_out", first);
        conv(out, "decoder.conv_out", first, self.out_channels, 3);
    }

    fn mid_block(&self, out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
        resnet(out, &format!("{prefix}.resnets.0"), c, c);
        if self.mid_block_add_attention {
            let attn = format!("{prefix}.attentions.0");
            norm(out, &format!("{attn}.group_norm"), c);
            for proj in ATTENTION_PROJECTIONS.iter().map(|(current, _)| current) {
                out.push(TensorSpec::new(format!("{attn}.{proj}.weight"), &[c, c]));
                out.push(TensorSpec::new(format!("{attn}.{proj}.bias"), &[c]));
            }
        }
        resnet(out, &format!("{prefix}.resnets.1"), c, c);
    }
}

fn conv(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize, k: usize) {
    out.push(TensorSpec::new(
        format!("{prefix}.weight"),
        &[cout, cin, k, k],
    ));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[cout]));
}

fn norm(out: &mut Vec<TensorSpec>, prefix: &str, c: usize) {
    out.push(TensorSpec::new(format!("{prefix}.weight"), &[c]));
    out.push(TensorSpec::new(format!("{prefix}.bias"), &[c]));
}

fn resnet(out: &mut Vec<TensorSpec>, prefix: &str, cin: usize, cout: usize) {
    norm(out, &format!("{prefix}.norm1"), cin);
    conv(out, &format!("{prefix}.conv1"), cin, cout, 3);
    norm(out, &format!("{prefix}.norm2"), cout);
    conv(out, &format!("{prefix}.conv2"), cout, cout, 3);
    if cin != cout {
        conv(out, &format!("{prefix}.conv_shortcut"), cin, cout, 1);
    }
}

/// Mid-block attention projections: today's name, and the name older checkpoints (among
/// them the DiT-XL/2 releases) still store, which diffusers renames at load time.
const ATTENTION_PROJECTIONS: [(&str, &str); 4] = [
    ("to_q", "query"),
    ("to_k", "key"),
    ("to_v", "value"),
    ("to_out.0", "proj_attn"),
];

/// Splits `…attentions.N.<proj>.<weight|bias>` into (`…attentions.N`, proj, param).
fn split_attention_name(name: &str) -> Option<(&str, &str, &str)> {
    let (rest, param) = name.rsplit_once('.')?;
    if param != "weight" && param != "bias" {
        return None;
    }
    let at = rest.find(".attentions.")?;
    let index_start = at + ".attentions.".len();
    let index_len = rest[index_start..].find('.')?;
    let block_end = index_start + index_len;
    if index_len == 0
        || !rest[index_start..block_end]
            .bytes()
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some((&rest[..block_end], &rest[block_end + 1..], param))
}

/// The legacy name of a current mid-block attention tensor
/// (`….attentions.0.to_q.weight` → `….attentions.0.query.weight`); `None` for any other name.
pub fn legacy_attention_alias(name: &str) -> Option<String> {
    let (block, proj, param) = split_attention_name(name)?;
    let (_, legacy) = ATTENTION_PROJECTIONS
        .iter()
        .find(|(current, _)| *current == proj)?;
    Some(format!("{block}.{legacy}.{param}"))
}

/// The current name of a legacy mid-block attention tensor (inverse of
/// `legacy_attention_alias`), for checking a checkpoint's listing against `tensor_specs`.
pub fn current_attention_name(legacy_name: &str) -> Option<String> {
    let (block, proj, param) = split_attention_name(legacy_name)?;
    let (current, _) = ATTENTION_PROJECTIONS
        .iter()
        .find(|(_, legacy)| *legacy == proj)?;
    Some(format!("{block}.{current}.{param}"))
}

/// Whether a stored shape serves for an expected one. Legacy attention projections may be
/// stored as 1×1 convolutions ([C, C, 1, 1]) where a linear weight ([C, C]) is expected.
pub fn shape_compatible(expected: &[usize], stored: &[usize]) -> bool {
    expected == stored
        || (expected.len() == 2
            && stored.len() == 4
            && stored[..2] == *expected
            && stored[2..] == [1, 1])
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

#[cfg(test)]
mod tests {
    use super::*;

    fn path() -> &'static Path {
        Path::new("vae/config.json")
    }

    #[test]
    fn presets_validate_and_upscale_by_eight() {
        for cfg in [VaeConfig::tiny(), VaeConfig::sd()] {
            cfg.validate(path()).unwrap();
            assert_eq!(cfg.upscale(), 8);
        }
    }

    #[test]
    fn sd_preset_matches_the_released_checkpoint() {
        // sd-vae-ft-ema: 83,653,863 parameters in 248 tensors, 49,490,199 of them in
        // post_quant_conv + decoder.
        let specs = VaeConfig::sd().tensor_specs();
        assert_eq!(specs.len(), 248);
        assert_eq!(
            specs.iter().map(TensorSpec::numel).sum::<usize>(),
            83_653_863
        );
        let dec = VaeConfig::sd().decoder_tensor_specs();
        assert_eq!(dec.iter().map(TensorSpec::numel).sum::<usize>(), 49_490_199);
        let find = |n: &str| specs.iter().find(|s| s.name == n).map(|s| s.shape.clone());
        assert_eq!(find("decoder.conv_in.weight"), Some(vec![512, 4, 3, 3]));
        assert_eq!(
            find("decoder.up_blocks.2.resnets.0.conv_shortcut.weight"),
            Some(vec![256, 512, 1, 1])
        );
        assert_eq!(
            find("decoder.up_blocks.3.resnets.2.conv2.weight"),
            Some(vec![128, 128, 3, 3])
        );
        assert_eq!(find("decoder.up_blocks.3.upsamplers.0.conv.weight"), None);
        assert_eq!(
            find("encoder.down_blocks.1.resnets.0.conv_shortcut.weight"),
            Some(vec![256, 128, 1, 1])
        );
        assert_eq!(
            find("encoder.down_blocks.3.downsamplers.0.conv.weight"),
            None
        );
        assert_eq!(find("encoder.conv_out.weight"), Some(vec![8, 512, 3, 3]));
        assert_eq!(find("quant_conv.weight"), Some(vec![8, 8, 1, 1]));
        assert_eq!(
            find("decoder.mid_block.attentions.0.to_out.0.weight"),
            Some(vec![512, 512])
        );
    }

    #[test]
    fn names_are_unique() {
        let specs = VaeConfig::sd().tensor_specs();
        let names: std::collections::HashSet<_> = specs.iter().map(|s| &s.name).collect();
        assert_eq!(names.len(), specs.len());
    }

    #[test]
    fn optional_parts_follow_the_flags() {
        let cfg = VaeConfig {
            use_quant_conv: false,
            use_post_quant_conv: false,
            mid_block_add_attention: false,
            ..VaeConfig::tiny()
        };
        let specs = cfg.tensor_specs();
        assert!(specs
            .iter()
            .all(|s| !s.name.contains("quant_conv") && !s.name.contains("attentions")));
    }

    #[test]
    fn parses_a_diffusers_config_and_ignores_unknown_fields() {
        let json = r#"{
            "_class_name": "AutoencoderKL", "_diffusers_version": "0.12.0",
            "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
            "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
            "out_channels": 3, "sample_size": 256, "force_upcast": true,
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"]
        }"#;
        let cfg: VaeConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg, VaeConfig::sd());
        let rect: VaeConfig =
            serde_json::from_str(r#"{"_class_name": "AutoencoderKL", "sample_size": [64, 96]}"#)
                .unwrap();
        assert_eq!(rect.sample_size, SampleSize::HeightWidth(vec![64, 96]));
    }

    #[test]
    fn config_json_round_trips() {
        let value = VaeConfig::tiny().to_config_json();
        assert_eq!(value["_class_name"], "AutoencoderKL");
        assert!(value["_diffusers_version"].is_string());
        let back: VaeConfig = serde_json::from_value(value).unwrap();
        assert_eq!(back, VaeConfig::tiny());
    }

    #[test]
    fn load_reads_and_rejects_files() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, VaeConfig::sd().to_config_json().to_string()).unwrap();
        assert_eq!(VaeConfig::load(&file).unwrap(), VaeConfig::sd());

        std::fs::write(
            &file,
            r#"{"_class_name": "AutoencoderKL", "layers_per_block": "two"}"#,
        )
        .unwrap();
        let err = VaeConfig::load(&file).unwrap_err().to_string();
        assert!(err.contains("layers_per_block"), "{err}");
        assert!(err.contains("config.json"), "{err}");

        let err = VaeConfig::load(&dir.path().join("missing.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.json"), "{err}");
    }

    #[test]
    fn validation_names_the_field() {
        let cases: Vec<(&str, VaeConfig)> = vec![
            (
                "_class_name",
                VaeConfig {
                    class_name: "AutoencoderTiny".into(),
                    ..VaeConfig::tiny()
                },
            ),
            (
                "act_fn",
                VaeConfig {
                    act_fn: "gelu".into(),
                    ..VaeConfig::tiny()
                },
            ),
            (
                "block_out_channels",
                VaeConfig {
                    norm_num_groups: 32,
                    ..VaeConfig::tiny()
                },
            ),
            (
                "block_out_channels",
                VaeConfig {
                    block_out_channels: vec![],
                    ..VaeConfig::tiny()
                },
            ),
            (
                "up_block_types",
                VaeConfig {
                    up_block_types: vec!["UpDecoderBlock2D".into()],
                    ..VaeConfig::tiny()
                },
            ),
            (
                "down_block_types",
                VaeConfig {
                    down_block_types: vec!["AttnDownEncoderBlock2D".into(); 4],
                    ..VaeConfig::tiny()
                },
            ),
            (
                "scaling_factor",
                VaeConfig {
                    scaling_factor: 0.0,
                    ..VaeConfig::tiny()
                },
            ),
            (
                "shift_factor",
                VaeConfig {
                    shift_factor: Some(f64::NAN),
                    ..VaeConfig::tiny()
                },
            ),
            (
                "layers_per_block",
                VaeConfig {
                    layers_per_block: 0,
                    ..VaeConfig::tiny()
                },
            ),
            (
                "sample_size",
                VaeConfig {
                    sample_size: SampleSize::HeightWidth(vec![1]),
                    ..VaeConfig::tiny()
                },
            ),
        ];
        for (field, cfg) in cases {
            let err = cfg.validate(path()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
        }
        let missing: VaeConfig = serde_json::from_str("{}").unwrap();
        let err = missing.validate(path()).unwrap_err().to_string();
        assert!(err.contains("_class_name"), "{err}");
    }

    #[test]
    fn legacy_attention_names_map_both_ways() {
        let cases = [
            (
                "decoder.mid_block.attentions.0.to_q.weight",
                "decoder.mid_block.attentions.0.query.weight",
            ),
            (
                "decoder.mid_block.attentions.0.to_k.bias",
                "decoder.mid_block.attentions.0.key.bias",
            ),
            (
                "encoder.mid_block.attentions.0.to_v.weight",
                "encoder.mid_block.attentions.0.value.weight",
            ),
            (
                "decoder.mid_block.attentions.0.to_out.0.bias",
                "decoder.mid_block.attentions.0.proj_attn.bias",
            ),
        ];
        for (current, legacy) in cases {
            assert_eq!(legacy_attention_alias(current).as_deref(), Some(legacy));
            assert_eq!(current_attention_name(legacy).as_deref(), Some(current));
        }
        for other in [
            "decoder.mid_block.attentions.0.group_norm.weight",
            "decoder.conv_in.weight",
            "decoder.mid_block.attentions.x.to_q.weight",
            "to_q.weight",
        ] {
            assert_eq!(legacy_attention_alias(other), None, "{other}");
            assert_eq!(current_attention_name(other), None, "{other}");
        }
    }

    #[test]
    fn shape_compatibility_accepts_one_by_one_convs_for_linears() {
        assert!(shape_compatible(&[16, 16], &[16, 16]));
        assert!(shape_compatible(&[16, 16], &[16, 16, 1, 1]));
        assert!(!shape_compatible(&[16, 16], &[16, 16, 3, 3]));
        assert!(!shape_compatible(&[16, 16, 1, 1], &[16, 16]));
        assert!(!shape_compatible(&[16], &[8]));
    }
}
