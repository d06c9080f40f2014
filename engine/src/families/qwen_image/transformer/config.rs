//! `transformer/config.json` of diffusers' `QwenImageTransformer2DModel` (Qwen-Image, text
//! to image), the checks on it, the names and shapes of every tensor its checkpoint holds,
//! where its rotary embedding places image and text tokens, and what a block's activations
//! cost: what the node agent and the planner need without the compute runtime.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::components::config_checks::{self, ClassWording};
use crate::families::TensorSpec;
use crate::{Error, Result};

/// The only class this module understands.
pub const CLASS_NAME: &str = "QwenImageTransformer2DModel";
/// The diffusers release whose `save_pretrained` layout the specs follow.
pub const DIFFUSERS_VERSION: &str = "0.42.1";
/// Prefix of the streamed blocks' tensors.
pub const BLOCK_PREFIX: &str = "transformer_blocks.";
/// Epsilon of every LayerNorm and RMSNorm in the model (diffusers fixes it; no field).
pub const EPS: f64 = 1e-6;
/// Width of the sinusoidal timestep projection (diffusers' `Timesteps(num_channels=256)`).
pub const TIMESTEP_DIM: usize = 256;
/// The timestep projection multiplies its input by this: the pipeline passes t / 1000.
pub const TIMESTEP_SCALE: f32 = 1000.0;
/// Feed-forward width per model width (diffusers' `FeedForward` default `mult=4`).
pub const FFN_MULT: usize = 4;
/// Positions `QwenEmbedRope` precomputes per sign (0..4096 and -4096..-1), on every axis.
/// Diffusers slices these tables without checking, so a request outside them fails there;
/// [`QwenImageTransformerConfig::check_positions`] refuses it up front.
pub const ROPE_POSITIONS: usize = 4096;

/// A diffusers `QwenImageTransformer2DModel` config. Defaults are diffusers' own (the
/// published 20B model's), so a config that omits a field means what it means to diffusers.
/// Unknown fields (the published file's `pooled_projection_dim`, which diffusers ignores)
/// are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct QwenImageTransformerConfig {
    /// Empty when the file has no `_class_name`; `validate` rejects that.
    #[serde(rename = "_class_name")]
    pub class_name: String,
    /// Side of the square patch the pipeline packs latents into (2 × 2 latent pixels per
    /// token); the output projection yields `patch_size² × out_channels` per token.
    pub patch_size: usize,
    /// Width of one packed token (latent channels × patch_size²).
    pub in_channels: usize,
    /// diffusers reads `out_channels or in_channels`: null (or 0) means `in_channels`.
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    /// Width of the text encoder's hidden states (Qwen2.5-VL 7B: 3584).
    pub joint_attention_dim: usize,
    /// The guidance-distilled variant. diffusers 0.42.1 builds no guidance embedder for
    /// it and its forward cannot take a guidance value, so it is refused.
    pub guidance_embeds: bool,
    /// How each head's channels split between the frame, row and column rotary parts.
    pub axes_dims_rope: Vec<usize>,
    /// Qwen-Image-Edit 2511's per-token modulation of condition images; refused.
    pub zero_cond_t: bool,
    /// Qwen-Image-Layered's extra timestep condition (a tensor more); refused.
    pub use_additional_t_cond: bool,
    /// Qwen-Image-Layered's layered rotary embedding; refused.
    pub use_layer3d_rope: bool,
}

impl Default for QwenImageTransformerConfig {
    fn default() -> Self {
        QwenImageTransformerConfig {
            class_name: String::new(),
            patch_size: 2,
            in_channels: 64,
            out_channels: Some(16),
            num_layers: 60,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 3584,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
            zero_cond_t: false,
            use_additional_t_cond: false,
            use_layer3d_rope: false,
        }
    }
}

impl QwenImageTransformerConfig {
    /// The tiny transformer of the parity fixture
    /// (`engine/parity/qwen_image_transformer_reference.py` builds the same): 2 heads × 16,
    /// 2 layers, 4 latent channels packed 2 × 2.
    pub fn tiny() -> Self {
        QwenImageTransformerConfig {
            in_channels: 16,
            out_channels: Some(4),
            num_layers: 2,
            attention_head_dim: 16,
            num_attention_heads: 2,
            joint_attention_dim: 24,
            axes_dims_rope: vec![4, 6, 6],
            ..Self::published()
        }
    }

    /// Qwen-Image (`Qwen/Qwen-Image`, 20B): 60 layers of 24 heads × 128, text width 3584;
    /// also diffusers' defaults.
    pub fn published() -> Self {
        QwenImageTransformerConfig {
            class_name: CLASS_NAME.into(),
            ..Self::default()
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        config_checks::load(path, Self::validate)
    }

    /// Rejects configurations this implementation does not compute, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        config_checks::class_name(path, &self.class_name, CLASS_NAME, ClassWording::IsNot)?;
        config_checks::at_least_one(
            path,
            &config_checks::named!(self: patch_size, in_channels, num_layers, attention_head_dim, num_attention_heads, joint_attention_dim),
        )?;
        crate::checkpoint::layers_at_most(path, self.num_layers)?;
        config_checks::rotary_head_dim(path, self.attention_head_dim)?;
        let axes = &self.axes_dims_rope;
        if axes.len() != 3 || axes.iter().any(|d| !d.is_multiple_of(2)) {
            return bad(
                "axes_dims_rope",
                format!("{axes:?}: must be three even widths (frame, row, column)"),
            );
        }
        if axes.iter().sum::<usize>() != self.attention_head_dim {
            return bad(
                "axes_dims_rope",
                format!(
                    "{axes:?}: must sum to attention_head_dim {}, the channels each head rotates",
                    self.attention_head_dim
                ),
            );
        }
        let refused = [
            (
                "guidance_embeds",
                self.guidance_embeds,
                "the guidance-distilled variant is not supported (diffusers builds no guidance embedder for it)",
            ),
            (
                "zero_cond_t",
                self.zero_cond_t,
                "per-token modulation of condition images (image editing) is not supported",
            ),
            (
                "use_additional_t_cond",
                self.use_additional_t_cond,
                "the additional timestep condition (Qwen-Image-Layered) is not supported",
            ),
            (
                "use_layer3d_rope",
                self.use_layer3d_rope,
                "the layered rotary embedding (Qwen-Image-Layered) is not supported",
            ),
        ];
        for (field, on, why) in refused {
            if on {
                return bad(
                    field,
                    format!("true: {why}; text-to-image models have false"),
                );
            }
        }
        Ok(())
    }

    /// Latent channels per output pixel: `out_channels`, or `in_channels` when unset.
    pub fn out(&self) -> usize {
        match self.out_channels {
            Some(0) | None => self.in_channels,
            Some(c) => c,
        }
    }
    /// Width of one output token: patch_size² × out channels (still packed).
    pub fn packed_out(&self) -> usize {
        self.patch_size * self.patch_size * self.out()
    }
    /// Hidden width of both feed-forwards.
    pub fn ffn_dim(&self) -> usize {
        FFN_MULT * self.hidden()
    }
    /// (frame, row, column) widths of the rotary parts; zeros where the config is invalid.
    pub fn rope_dims(&self) -> (usize, usize, usize) {
        match self.axes_dims_rope[..] {
            [f, h, w] => (f, h, w),
            _ => (0, 0, 0),
        }
    }

    /// The rotary position the first text token takes on every axis for a patch grid of
    /// `(frames, rows, columns)`: diffusers (`scale_rope=True`) centres the image's rows
    /// and columns on 0, so text starts past the larger half side, `max(rows/2, cols/2)`
    /// (frames do not count), and token i of the prompt sits at that plus i.
    pub fn text_position_offset((_, rows, cols): (usize, usize, usize)) -> usize {
        (rows / 2).max(cols / 2)
    }

    /// Refuses a request whose positions fall outside diffusers' rotary tables
    /// ([`ROPE_POSITIONS`] per sign): frames at 0..frames, rows at
    /// -⌈rows/2⌉..⌊rows/2⌋ (columns alike), text at offset..offset + text_tokens.
    pub fn check_positions(grid: (usize, usize, usize), text_tokens: usize) -> Result<()> {
        let (frames, rows, cols) = grid;
        let n = ROPE_POSITIONS;
        let end = Self::text_position_offset(grid).saturating_add(text_tokens);
        if frames > n || rows.div_ceil(2) > n || cols.div_ceil(2) > n || end > n {
            return Err(Error::invalid(
                "size",
                format!(
                    "a {frames} × {rows} × {cols} patch grid with {text_tokens} prompt tokens \
                     needs rotary positions up to {end}: the model's tables hold {n} \
                     (the prompt starts at half the larger side)"
                ),
            ));
        }
        Ok(())
    }

    /// The most patches across either side a single-frame image may have with a prompt of
    /// `text_tokens` tokens (0 when the prompt alone fills the tables).
    pub fn max_grid_side(text_tokens: usize) -> usize {
        match ROPE_POSITIONS.checked_sub(text_tokens) {
            // side / 2 ≤ n - text, and ⌈side / 2⌉ ≤ n.
            Some(room) => (2 * room + 1).min(2 * ROPE_POSITIONS),
            None => 0,
        }
    }

    /// Bytes of activations (f32) live per token at the peak of a block, image and text
    /// tokens alike: the two streams run the same widths and attend jointly, so a request
    /// of S image and M text tokens holds this × (S + M), beside attention's scores,
    /// which run in query chunks within `components::attention::ATTENTION_CHUNK_BYTES`
    /// (over S + M keys, `num_attention_heads` heads) and so grow with no power of tokens.
    ///
    /// Counted, in model widths D: the stream itself, its modulated norm, q, k, v (per
    /// stream, then joined), the joined attention output and its transpose, the output
    /// projection (10 D); the feed-forward's hidden before and after its GELU
    /// (2 × 4 D); the rotary tables' cosines and sines (head_dim). The attention part
    /// (at most 8 D live at once) and the feed-forward part (at most 10 D: stream, norm,
    /// both hiddens) never peak together, so the sum is a bound with room for the
    /// temporaries between them, not an exact peak.
    pub fn activation_bytes_per_token(&self) -> u64 {
        let d = self.hidden() as u64;
        4 * (10 * d + 2 * self.ffn_dim() as u64 + self.attention_head_dim as u64)
    }

    /// Tensors outside the blocks, which stay resident: the timestep embedder, the text
    /// norm and input projections, and the output modulation and projection.
    pub fn resident_specs(&self) -> Vec<TensorSpec> {
        let d = self.hidden();
        let j = self.joint_attention_dim;
        let mut v = Vec::new();
        let linears = [
            (
                "time_text_embed.timestep_embedder.linear_1",
                d,
                TIMESTEP_DIM,
            ),
            ("time_text_embed.timestep_embedder.linear_2", d, d),
            ("img_in", d, self.in_channels),
            ("txt_in", d, j),
            ("norm_out.linear", 2 * d, d),
            ("proj_out", self.packed_out(), d),
        ];
        for (name, out, inp) in linears {
            v.push(TensorSpec::new(format!("{name}.weight"), &[out, inp]));
            v.push(TensorSpec::new(format!("{name}.bias"), &[out]));
        }
        v.push(TensorSpec::new("txt_norm.weight", &[j]));
        v
    }

    /// One block's tensors, named relative to its prefix (`transformer_blocks.{i}.`).
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let (d, f, hd) = (self.hidden(), self.ffn_dim(), self.attention_head_dim);
        let mut v = Vec::new();
        let mut linear = |name: &str, out: usize, inp: usize| {
            v.push(TensorSpec::new(format!("{name}.weight"), &[out, inp]));
            v.push(TensorSpec::new(format!("{name}.bias"), &[out]));
        };
        for stream in ["img", "txt"] {
            linear(&format!("{stream}_mod.1"), 6 * d, d);
            linear(&format!("{stream}_mlp.net.0.proj"), f, d);
            linear(&format!("{stream}_mlp.net.2"), d, f);
        }
        for proj in [
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        ] {
            linear(&format!("attn.{proj}"), d, d);
        }
        for norm in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            v.push(TensorSpec::new(format!("attn.{norm}.weight"), &[hd]));
        }
        v
    }
}

crate::components::config_json::transformer_specs!(
    QwenImageTransformerConfig,
    prefix: BLOCK_PREFIX,
    json: [("_diffusers_version", DIFFUSERS_VERSION)],
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_preset_is_the_20b_model() {
        // 36 D² per block (two 6 D modulations, eight attention projections, two 4 D
        // feed-forwards) × 60 blocks at D = 3072: 20.43 B parameters as diffusers counts.
        let n = QwenImageTransformerConfig::published().parameter_count();
        assert!((20_300_000_000..20_500_000_000).contains(&n), "{n}");
        for c in [
            QwenImageTransformerConfig::tiny(),
            QwenImageTransformerConfig::published(),
        ] {
            c.validate(Path::new("config.json")).unwrap();
        }
    }

    #[test]
    fn the_published_config_parses_and_ignores_what_diffusers_ignores() {
        // Qwen/Qwen-Image's transformer/config.json, written by a diffusers that had
        // neither zero_cond_t nor the layered options, with a field diffusers never read.
        let text = r#"{"_class_name": "QwenImageTransformer2DModel",
            "_diffusers_version": "0.34.0.dev0", "attention_head_dim": 128,
            "axes_dims_rope": [16, 56, 56], "guidance_embeds": false, "in_channels": 64,
            "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60,
            "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 768}"#;
        let c: QwenImageTransformerConfig = serde_json::from_str(text).unwrap();
        assert_eq!(c, QwenImageTransformerConfig::published());
        assert_eq!(c.packed_out(), 64);
    }

    #[test]
    fn to_json_round_trips() {
        let c = QwenImageTransformerConfig::tiny();
        let j = c.to_json();
        assert_eq!(
            serde_json::from_value::<QwenImageTransformerConfig>(j.clone()).unwrap(),
            c
        );
        assert_eq!(j["_diffusers_version"], DIFFUSERS_VERSION);
        assert_eq!(j["_class_name"], CLASS_NAME);
    }

    #[test]
    fn validate_names_the_field() {
        type Break = fn(&mut QwenImageTransformerConfig);
        let cases: [(&str, Break); 12] = [
            ("_class_name", |c| {
                c.class_name = "FluxTransformer2DModel".into()
            }),
            ("patch_size", |c| c.patch_size = 0),
            ("num_layers", |c| c.num_layers = 0),
            ("joint_attention_dim", |c| c.joint_attention_dim = 0),
            ("attention_head_dim", |c| {
                c.attention_head_dim = 15;
                c.axes_dims_rope = vec![4, 6, 5];
            }),
            ("axes_dims_rope", |c| c.axes_dims_rope = vec![4, 12]),
            ("axes_dims_rope", |c| c.axes_dims_rope = vec![4, 5, 7]),
            ("axes_dims_rope", |c| c.axes_dims_rope = vec![4, 6, 8]),
            ("guidance_embeds", |c| c.guidance_embeds = true),
            ("zero_cond_t", |c| c.zero_cond_t = true),
            ("use_additional_t_cond", |c| c.use_additional_t_cond = true),
            ("use_layer3d_rope", |c| c.use_layer3d_rope = true),
        ];
        let tiny = QwenImageTransformerConfig::tiny();
        config_checks::assert_each_break_is_named(&tiny, QwenImageTransformerConfig::validate, &cases);
    }

    #[test]
    fn text_starts_past_half_the_larger_side() {
        type C = QwenImageTransformerConfig;
        assert_eq!(C::text_position_offset((1, 4, 6)), 3);
        assert_eq!(C::text_position_offset((1, 5, 3)), 2);
        // 1328 × 1328 pixels are 83 × 83 patches: text from 41.
        assert_eq!(C::text_position_offset((1, 83, 83)), 41);
        C::check_positions((1, 83, 83), 4096 - 41).unwrap();
        let e = C::check_positions((1, 83, 83), 4096 - 40)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rotary"), "{e}");
        assert_eq!(C::max_grid_side(1024), 6145);
        C::check_positions((1, 6145, 6145), 1024).unwrap();
        C::check_positions((1, 6146, 1), 1024).unwrap_err();
        assert_eq!(C::max_grid_side(0), 8192);
        C::check_positions((1, 8192, 8192), 0).unwrap();
        C::check_positions((1, 8193, 1), 0).unwrap_err();
        C::check_positions((4097, 1, 1), 0).unwrap_err();
        assert_eq!(C::max_grid_side(5000), 0);
    }

    #[test]
    fn specs_cover_the_block_and_the_rest_once() {
        let c = QwenImageTransformerConfig::tiny();
        c.assert_specs_cover_once();
        assert_eq!(
            QwenImageTransformerConfig::block_of("transformer_blocks.59.attn.to_add_out.bias"),
            Some(59)
        );
        assert_eq!(
            QwenImageTransformerConfig::block_of("proj_out.weight"),
            None
        );
    }

    #[test]
    fn activation_bytes_are_per_token_and_linear_in_width() {
        let c = QwenImageTransformerConfig::published();
        // 4 × (18 × 3072 + 128) bytes.
        assert_eq!(c.activation_bytes_per_token(), 4 * (18 * 3072 + 128));
    }
}
