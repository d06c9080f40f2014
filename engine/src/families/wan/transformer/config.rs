//! `transformer/config.json` of diffusers' `WanTransformer3DModel` (text to video), the
//! checks on it, and the names and shapes of every tensor its checkpoint holds: what the
//! node agent and the planner need without the compute runtime.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::components::config_checks::{self, ClassWording};
use crate::families::TensorSpec;
use crate::{Error, Result};

/// The only class this module understands.
pub const CLASS_NAME: &str = "WanTransformer3DModel";
/// The diffusers release whose `save_pretrained` layout the specs follow.
pub const DIFFUSERS_VERSION: &str = "0.42.1";
/// The only query/key norm diffusers' Wan attention computes (RMSNorm over all heads).
pub const QK_NORM: &str = "rms_norm_across_heads";
/// Prefix of the streamed blocks' tensors.
pub const BLOCK_PREFIX: &str = "blocks.";

/// A diffusers `WanTransformer3DModel` config. Defaults are diffusers' own (they are the
/// 14B model's), so a config that omits a field means what it means to diffusers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WanTransformerConfig {
    /// Empty when the file has no `_class_name`; `validate` rejects that.
    #[serde(rename = "_class_name")]
    pub class_name: String,
    /// (frames, height, width) of one patch.
    pub patch_size: Vec<usize>,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    /// diffusers reads `out_channels or in_channels`: null (or 0) means `in_channels`.
    pub out_channels: Option<usize>,
    /// Width of the text encoder's hidden states (UMT5-XXL: 4096).
    pub text_dim: usize,
    /// Width of the sinusoidal timestep projection.
    pub freq_dim: usize,
    pub ffn_dim: usize,
    pub num_layers: usize,
    /// Whether cross-attention's input goes through an affine LayerNorm (`norm2`).
    pub cross_attn_norm: bool,
    pub qk_norm: Option<String>,
    /// Epsilon of every LayerNorm and RMSNorm in the model.
    pub eps: f64,
    /// CLIP image embedding width of the image-to-video models; T2V has none.
    pub image_dim: Option<usize>,
    /// Image key/value projections of the image-to-video models; T2V has none.
    pub added_kv_proj_dim: Option<usize>,
    /// Positions the rotary tables cover, per axis (latent frames, patch rows, columns).
    pub rope_max_seq_len: usize,
    /// Position embedding of the image embedder (first-last-frame models); T2V has none.
    pub pos_embed_seq_len: Option<usize>,
}

impl Default for WanTransformerConfig {
    fn default() -> Self {
        WanTransformerConfig {
            class_name: String::new(),
            patch_size: vec![1, 2, 2],
            num_attention_heads: 40,
            attention_head_dim: 128,
            in_channels: 16,
            out_channels: Some(16),
            text_dim: 4096,
            freq_dim: 256,
            ffn_dim: 13824,
            num_layers: 40,
            cross_attn_norm: true,
            qk_norm: Some(QK_NORM.into()),
            eps: 1e-6,
            image_dim: None,
            added_kv_proj_dim: None,
            rope_max_seq_len: 1024,
            pos_embed_seq_len: None,
        }
    }
}

impl WanTransformerConfig {
    /// The tiny transformer of the parity fixtures (`engine/parity/wan_reference.py` and
    /// `wan_transformer_reference.py` build the same): 2 heads × 12, 2 layers.
    pub fn tiny() -> Self {
        WanTransformerConfig {
            num_attention_heads: 2,
            attention_head_dim: 12,
            text_dim: 32,
            ffn_dim: 32,
            num_layers: 2,
            rope_max_seq_len: 32,
            ..Self::wan21_14b()
        }
    }

    /// Wan 2.1 T2V 1.3B (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`): 12 heads × 128, 30 layers.
    pub fn wan21_1_3b() -> Self {
        WanTransformerConfig {
            num_attention_heads: 12,
            ffn_dim: 8960,
            num_layers: 30,
            ..Self::wan21_14b()
        }
    }

    /// Wan 2.1 T2V 14B (`Wan-AI/Wan2.1-T2V-14B-Diffusers`): 40 heads × 128, 40 layers,
    /// which are also diffusers' defaults.
    pub fn wan21_14b() -> Self {
        WanTransformerConfig {
            class_name: CLASS_NAME.into(),
            ..Self::default()
        }
    }

    /// Either expert (`transformer`, `transformer_2`) of Wan 2.2 T2V A14B: each has the
    /// shapes of Wan 2.1 14B.
    pub fn wan22_a14b() -> Self {
        Self::wan21_14b()
    }

    pub fn load(path: &Path) -> Result<Self> {
        config_checks::load(path, Self::validate)
    }

    /// Rejects configurations this implementation does not compute, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        config_checks::class_name(path, &self.class_name, CLASS_NAME, ClassWording::IsNot)?;
        if self.patch_size.len() != 3 || self.patch_size.contains(&0) {
            return bad(
                "patch_size",
                format!(
                    "{:?}: must be three sizes of at least 1 (frames, height, width)",
                    self.patch_size
                ),
            );
        }
        config_checks::at_least_one(
            path,
            &config_checks::named!(self: num_attention_heads, attention_head_dim, in_channels, text_dim, ffn_dim, num_layers, rope_max_seq_len),
        )?;
        crate::checkpoint::layers_at_most(path, self.num_layers)?;
        config_checks::rotary_head_dim(path, self.attention_head_dim)?;
        if self.freq_dim < 2 || !self.freq_dim.is_multiple_of(2) {
            return bad(
                "freq_dim",
                format!("{}: must be even and at least 2", self.freq_dim),
            );
        }
        if self.qk_norm.as_deref() != Some(QK_NORM) {
            return bad(
                "qk_norm",
                format!("{:?}: only `{QK_NORM}` is supported", self.qk_norm),
            );
        }
        if !self.eps.is_finite() || self.eps <= 0.0 {
            return bad("eps", format!("{}: must be positive", self.eps));
        }
        let image_only = [
            ("image_dim", self.image_dim),
            ("added_kv_proj_dim", self.added_kv_proj_dim),
            ("pos_embed_seq_len", self.pos_embed_seq_len),
        ];
        for (field, v) in image_only {
            if let Some(v) = v {
                return bad(
                    field,
                    format!("{v}: image conditioning (Wan image-to-video) is not supported; text-to-video models have null here"),
                );
            }
        }
        Ok(())
    }

    pub fn out(&self) -> usize {
        match self.out_channels {
            Some(0) | None => self.in_channels,
            Some(c) => c,
        }
    }
    /// (frames, height, width) of one patch; (1, 1, 1) where the config is invalid.
    pub fn patch(&self) -> (usize, usize, usize) {
        match self.patch_size[..] {
            [t, h, w] => (t, h, w),
            _ => (1, 1, 1),
        }
    }
    /// Latent values per patch token: pt × ph × pw.
    pub fn patch_volume(&self) -> usize {
        let (t, h, w) = self.patch();
        t * h * w
    }
    /// How the head width splits between the frame, row and column rotary parts, as
    /// diffusers' `WanRotaryPosEmbed` does: rows and columns get 2⌊d/6⌋ each.
    pub fn rope_dims(&self) -> (usize, usize, usize) {
        let hw = 2 * (self.attention_head_dim / 6);
        (self.attention_head_dim - 2 * hw, hw, hw)
    }

    /// Tensors outside the blocks, which stay resident: the patch embedding, the
    /// timestep and text embedders, and the output modulation and projection.
    pub fn resident_specs(&self) -> Vec<TensorSpec> {
        let d = self.hidden();
        let (pt, ph, pw) = self.patch();
        let mut v = vec![TensorSpec::new(
            "patch_embedding.weight",
            &[d, self.in_channels, pt, ph, pw],
        )];
        v.push(TensorSpec::new("patch_embedding.bias", &[d]));
        let ce = "condition_embedder";
        for (name, out, inp) in [
            ("time_embedder.linear_1", d, self.freq_dim),
            ("time_embedder.linear_2", d, d),
            ("time_proj", 6 * d, d),
            ("text_embedder.linear_1", d, self.text_dim),
            ("text_embedder.linear_2", d, d),
        ] {
            v.push(TensorSpec::new(format!("{ce}.{name}.weight"), &[out, inp]));
            v.push(TensorSpec::new(format!("{ce}.{name}.bias"), &[out]));
        }
        let po = self.out() * self.patch_volume();
        v.extend([
            TensorSpec::new("proj_out.weight", &[po, d]),
            TensorSpec::new("proj_out.bias", &[po]),
            TensorSpec::new("scale_shift_table", &[1, 2, d]),
        ]);
        v
    }

    /// One block's tensors, named relative to its prefix (`blocks.{i}.`).
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let (d, f) = (self.hidden(), self.ffn_dim);
        let mut v = vec![TensorSpec::new("scale_shift_table", &[1, 6, d])];
        for attn in ["attn1", "attn2"] {
            for proj in ["to_q", "to_k", "to_v", "to_out.0"] {
                v.push(TensorSpec::new(format!("{attn}.{proj}.weight"), &[d, d]));
                v.push(TensorSpec::new(format!("{attn}.{proj}.bias"), &[d]));
            }
            v.push(TensorSpec::new(format!("{attn}.norm_q.weight"), &[d]));
            v.push(TensorSpec::new(format!("{attn}.norm_k.weight"), &[d]));
        }
        if self.cross_attn_norm {
            v.push(TensorSpec::new("norm2.weight", &[d]));
            v.push(TensorSpec::new("norm2.bias", &[d]));
        }
        v.extend([
            TensorSpec::new("ffn.net.0.proj.weight", &[f, d]),
            TensorSpec::new("ffn.net.0.proj.bias", &[f]),
            TensorSpec::new("ffn.net.2.weight", &[d, f]),
            TensorSpec::new("ffn.net.2.bias", &[d]),
        ]);
        v
    }
}

crate::components::config_json::transformer_specs!(
    WanTransformerConfig,
    prefix: BLOCK_PREFIX,
    json: [("_diffusers_version", DIFFUSERS_VERSION)],
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_parameter_counts() {
        // Wan 2.1 "1.3B" is 1.42 B parameters as diffusers counts them, "14B" 14.3 B.
        let small = WanTransformerConfig::wan21_1_3b().parameter_count();
        assert!((1_300_000_000..1_500_000_000).contains(&small), "{small}");
        let big = WanTransformerConfig::wan21_14b().parameter_count();
        assert!((14_000_000_000..14_500_000_000).contains(&big), "{big}");
        assert_eq!(WanTransformerConfig::wan22_a14b().parameter_count(), big);
        for c in [
            WanTransformerConfig::tiny(),
            WanTransformerConfig::wan21_1_3b(),
            WanTransformerConfig::wan21_14b(),
        ] {
            c.validate(Path::new("config.json")).unwrap();
        }
    }

    #[test]
    fn rope_splits_the_head_like_diffusers() {
        // 128 = 44 (frames) + 42 (rows) + 42 (columns); the tiny head 12 = 4 + 4 + 4.
        assert_eq!(WanTransformerConfig::wan21_14b().rope_dims(), (44, 42, 42));
        assert_eq!(WanTransformerConfig::tiny().rope_dims(), (4, 4, 4));
    }

    #[test]
    fn a_published_config_parses_with_defaults_for_what_it_omits() {
        // Wan 2.1 1.3B's values in a file from an older diffusers, which wrote neither
        // rope_max_seq_len nor pos_embed_seq_len: both take today's defaults.
        let text = r#"{"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
            "added_kv_proj_dim": null, "attention_head_dim": 128, "cross_attn_norm": true,
            "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": null, "in_channels": 16,
            "num_attention_heads": 12, "num_layers": 30, "out_channels": 16,
            "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "text_dim": 4096}"#;
        let c: WanTransformerConfig = serde_json::from_str(text).unwrap();
        assert_eq!(c, WanTransformerConfig::wan21_1_3b());
    }

    #[test]
    fn to_json_round_trips_and_carries_every_field_diffusers_writes() {
        let c = WanTransformerConfig::tiny();
        let j = c.to_json();
        let back: WanTransformerConfig = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(back, c);
        let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
        for k in [
            "_class_name",
            "_diffusers_version",
            "patch_size",
            "image_dim",
            "added_kv_proj_dim",
            "rope_max_seq_len",
            "pos_embed_seq_len",
            "qk_norm",
        ] {
            assert!(keys.contains(&k), "{k} missing from {keys:?}");
        }
    }

    #[test]
    fn validate_names_the_field() {
        type Break = fn(&mut WanTransformerConfig);
        let cases: [(&str, Break); 10] = [
            ("_class_name", |c| c.class_name = "WanVACE".into()),
            ("patch_size", |c| c.patch_size = vec![2, 2]),
            ("image_dim", |c| c.image_dim = Some(1280)),
            ("added_kv_proj_dim", |c| c.added_kv_proj_dim = Some(5120)),
            ("pos_embed_seq_len", |c| c.pos_embed_seq_len = Some(514)),
            ("qk_norm", |c| c.qk_norm = None),
            ("attention_head_dim", |c| c.attention_head_dim = 13),
            ("freq_dim", |c| c.freq_dim = 255),
            ("eps", |c| c.eps = 0.0),
            ("num_layers", |c| c.num_layers = 0),
        ];
        let tiny = WanTransformerConfig::tiny();
        config_checks::assert_each_break_is_named(&tiny, WanTransformerConfig::validate, &cases);
    }

    #[test]
    fn specs_cover_the_block_and_the_rest_once() {
        let c = WanTransformerConfig::tiny();
        c.assert_specs_cover_once();
        assert_eq!(
            WanTransformerConfig::block_of("blocks.7.ffn.net.2.bias"),
            Some(7)
        );
        assert_eq!(WanTransformerConfig::block_of("scale_shift_table"), None);
        // Without the cross-attention norm the block has no norm2.
        let plain = WanTransformerConfig {
            cross_attn_norm: false,
            ..c
        };
        assert!(plain
            .block_specs()
            .iter()
            .all(|s| !s.name.starts_with("norm2")));
    }
}
