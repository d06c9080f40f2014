//! `transformer/config.json` of diffusers' `Cosmos3OmniTransformer`, the checks on it, and
//! the names and shapes of every tensor its checkpoint holds.
//!
//! Each decoder layer has two pathways with their own weights: the understanding (text)
//! pathway, which attends causally to itself alone, and the generation (latent) pathway,
//! which attends to the understanding pathway's keys and values and its own. They stream
//! as two groups of blocks over the same `layers.{i}.` prefix: block `i` of
//! [`Cosmos3Config::understanding_group`] holds layer `i`'s understanding tensors, block `i`
//! of [`Cosmos3Config::generation_group`] its generation tensors.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::{at_most, MAX_CONFIG_LAYERS};
use crate::components::config_checks::{self, ClassWording};
use crate::families::{BlockGroup, TensorSpec};
use crate::{Error, Result};

/// The only class this module understands.
pub const CLASS_NAME: &str = "Cosmos3OmniTransformer";
/// Prefix of both pathways' block tensors.
pub const LAYER_PREFIX: &str = "layers.";
/// The text embedding table, read row by row from the host mapping.
pub const EMBED_TOKENS: &str = "embed_tokens.weight";

/// Bounds on config values no published model comes near, so absurd values are refused
/// before anything is sized by them.
const MAX_WIDTH: usize = 65_536;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 1024;
const MAX_VOCAB: usize = 4_194_304;
const MAX_PATCH: usize = 16;
const MAX_LATENT_CHANNELS: usize = 1024;

/// A diffusers `Cosmos3OmniTransformer` config. Defaults are diffusers' own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cosmos3Config {
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub attention_bias: bool,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// The frame rate the rotary time axis is measured in (`fps` requests are rescaled to it).
    pub base_fps: usize,
    /// Positions are floats and a video's time axis is rescaled by `fps / base_fps`.
    pub enable_fps_modulation: bool,
    pub latent_channel: usize,
    /// Vision tokens' rows and columns start at 0 (else at the time offset).
    pub unified_3d_mrope_reset_spatial_ids: bool,
    /// Positions left between the text and the first latent frame.
    pub unified_3d_mrope_temporal_modality_margin: usize,
    pub latent_patch_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: usize,
    pub patch_latent_dim: usize,
    pub rms_norm_eps: f64,
    /// Read for `mrope_section` when `rope_axes_dim` is absent.
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_theta: f64,
    pub action_dim: Option<usize>,
    pub action_gen: bool,
    pub num_embodiment_domains: usize,
    pub sound_dim: Option<usize>,
    pub sound_gen: bool,
    pub timestep_scale: f64,
    pub vocab_size: usize,
    /// `silu` (Qwen3's gated MLP) or `relu2` (Nemotron's squared ReLU, no gate).
    pub hidden_act: String,
    /// The understanding pathway's per-head q/k RMS norms.
    pub qk_norm_for_text: bool,
    /// A norm of the understanding keys as the generation pathway reads them (only
    /// without `qk_norm_for_text`).
    pub use_und_k_norm_for_gen: bool,
    /// Rotary frequencies per axis (time, rows, columns), interleaved.
    pub rope_axes_dim: Option<Vec<usize>>,
}

impl Default for Cosmos3Config {
    fn default() -> Self {
        Cosmos3Config {
            class_name: String::new(),
            attention_bias: false,
            head_dim: 128,
            hidden_size: 4096,
            intermediate_size: 12288,
            base_fps: 24,
            enable_fps_modulation: true,
            latent_channel: 48,
            unified_3d_mrope_reset_spatial_ids: true,
            unified_3d_mrope_temporal_modality_margin: 15000,
            latent_patch_size: 2,
            num_attention_heads: 32,
            num_hidden_layers: 36,
            num_key_value_heads: 8,
            patch_latent_dim: 192,
            rms_norm_eps: 1e-6,
            rope_scaling: None,
            rope_theta: 5_000_000.0,
            action_dim: None,
            action_gen: false,
            num_embodiment_domains: 32,
            sound_dim: None,
            sound_gen: false,
            timestep_scale: 0.001,
            vocab_size: 151936,
            hidden_act: "silu".into(),
            qk_norm_for_text: true,
            use_und_k_norm_for_gen: false,
            rope_axes_dim: None,
        }
    }
}

impl Cosmos3Config {
    /// diffusers' defaults, which are the published Nano's shapes (a Qwen3-VL 8B backbone):
    /// 36 layers of width 4096, 32 query heads over 8 key/value heads of 128.
    pub fn nano() -> Self {
        serde_json::from_value(serde_json::json!({ "_class_name": CLASS_NAME }))
            .expect("defaults parse")
    }

    /// The published Super's shapes (a Qwen3 32B backbone): 64 layers of width 5120, 64
    /// query heads over 8 key/value heads of 128, MLP width 25600.
    pub fn super_() -> Self {
        Cosmos3Config {
            hidden_size: 5120,
            intermediate_size: 25600,
            num_attention_heads: 64,
            num_hidden_layers: 64,
            ..Self::nano()
        }
    }

    /// The tiny transformer of the parity fixture (`engine/parity/cosmos3_reference.py`
    /// builds the same): 2 layers of width 32, 4 query heads over 2 key/value heads of 16.
    pub fn tiny(vocab_size: usize) -> Self {
        Cosmos3Config {
            head_dim: 16,
            hidden_size: 32,
            intermediate_size: 48,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            num_hidden_layers: 2,
            rope_axes_dim: Some(vec![4, 2, 2]),
            vocab_size,
            ..Self::nano()
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        config_checks::load(path, Self::validate)
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("config serializes")
    }

    /// Rotary frequencies per axis (time, rows, columns): `rope_axes_dim`, else
    /// `rope_scaling.mrope_section`, else [24, 20, 20], as diffusers reads them.
    pub fn axes(&self) -> [usize; 3] {
        let from = |v: &[usize]| -> [usize; 3] {
            let mut a = [0; 3];
            for (d, s) in a.iter_mut().zip(v) {
                *d = *s;
            }
            a
        };
        if let Some(v) = &self.rope_axes_dim {
            return from(v);
        }
        let section = self
            .rope_scaling
            .as_ref()
            .and_then(|r| r.get("mrope_section"))
            .and_then(|s| serde_json::from_value::<Vec<usize>>(s.clone()).ok());
        from(section.as_deref().unwrap_or(&[24, 20, 20]))
    }

    /// Whether the MLPs are Qwen3's gated SiLU (else Nemotron's squared ReLU).
    pub fn gated(&self) -> bool {
        self.hidden_act == "silu"
    }

    /// Query heads per key/value head.
    pub fn groups_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads.max(1)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        config_checks::class_name(
            path,
            &self.class_name,
            CLASS_NAME,
            ClassWording::FoundExpected,
        )?;
        self.validate_sizes(path)?;
        self.validate_layer(path)?;
        self.validate_rotary(path)?;
        self.validate_constants(path)
    }

    /// Every size and count: within the bounds no published model comes near, and not 0.
    fn validate_sizes(&self, path: &Path) -> Result<()> {
        at_most(
            path,
            &[
                (
                    "num_hidden_layers",
                    self.num_hidden_layers,
                    MAX_CONFIG_LAYERS,
                ),
                ("hidden_size", self.hidden_size, MAX_WIDTH),
                ("intermediate_size", self.intermediate_size, 4 * MAX_WIDTH),
                ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
                ("num_key_value_heads", self.num_key_value_heads, MAX_HEADS),
                ("head_dim", self.head_dim, MAX_HEAD_DIM),
                ("vocab_size", self.vocab_size, MAX_VOCAB),
                ("latent_patch_size", self.latent_patch_size, MAX_PATCH),
                ("latent_channel", self.latent_channel, MAX_LATENT_CHANNELS),
                ("base_fps", self.base_fps, 1000),
                (
                    "unified_3d_mrope_temporal_modality_margin",
                    self.unified_3d_mrope_temporal_modality_margin,
                    1 << 24,
                ),
            ],
        )?;
        config_checks::at_least_one(
            path,
            &config_checks::named!(self: num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, latent_channel, latent_patch_size, vocab_size, base_fps),
        )?;
        Ok(())
    }

    /// A layer's shapes: the heads, the latent patch the embedder reads, the MLP's
    /// activation.
    fn validate_layer(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, why: String| Err(Error::config(path, field, why));
        if self.head_dim < 2 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("{}: rotary needs an even head dim", self.head_dim),
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            );
        }
        let p = self.latent_patch_size;
        if self.patch_latent_dim != p * p * self.latent_channel {
            return bad(
                "patch_latent_dim",
                format!(
                    "{}: a {p} × {p} patch of {} latent channels has {}",
                    self.patch_latent_dim,
                    self.latent_channel,
                    p * p * self.latent_channel
                ),
            );
        }
        if !matches!(self.hidden_act.as_str(), "silu" | "relu2") {
            return bad(
                "hidden_act",
                format!("`{}`: Cosmos3 has `silu` or `relu2`", self.hidden_act),
            );
        }
        Ok(())
    }

    /// The rotary axes: three, sharing the head's frequencies.
    fn validate_rotary(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, why: String| Err(Error::config(path, field, why));
        if let Some(v) = &self.rope_axes_dim {
            if v.len() != 3 {
                return bad(
                    "rope_axes_dim",
                    format!("{v:?}: want three axes (time, rows, columns)"),
                );
            }
        }
        let axes = self.axes();
        if axes.iter().sum::<usize>() != self.head_dim / 2 {
            return bad(
                "rope_axes_dim",
                format!(
                    "{axes:?} sums to {}, but a head of {} has {} rotary frequencies",
                    axes.iter().sum::<usize>(),
                    self.head_dim,
                    self.head_dim / 2
                ),
            );
        }
        Ok(())
    }

    /// The constants (finite and positive) and the sizes the optional heads need.
    fn validate_constants(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, why: String| Err(Error::config(path, field, why));
        for (field, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("timestep_scale", self.timestep_scale),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, format!("{v}: must be a finite number > 0"));
            }
        }
        if self.sound_gen && self.sound_dim.is_none() {
            return bad("sound_dim", "required with sound_gen".into());
        }
        if self.action_gen && self.action_dim.is_none() {
            return bad("action_dim", "required with action_gen".into());
        }
        Ok(())
    }

    fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// One pathway's projections and MLP, named as that pathway names them.
    #[allow(clippy::too_many_arguments)]
    fn pathway(
        &self,
        q: &str,
        k: &str,
        v: &str,
        out: &str,
        norms: &[&str],
        mlp: &str,
        layer_norms: [&str; 2],
    ) -> Vec<TensorSpec> {
        let (d, hd) = (self.hidden_size, self.head_dim);
        let (qw, kvw, ff) = (self.q_width(), self.kv_width(), self.intermediate_size);
        let mut v_specs = Vec::new();
        for (name, rows, cols) in [(q, qw, d), (k, kvw, d), (v, kvw, d), (out, d, qw)] {
            v_specs.push(TensorSpec::new(
                format!("self_attn.{name}.weight"),
                &[rows, cols],
            ));
            if self.attention_bias {
                v_specs.push(TensorSpec::new(format!("self_attn.{name}.bias"), &[rows]));
            }
        }
        for n in norms {
            v_specs.push(TensorSpec::new(format!("self_attn.{n}.weight"), &[hd]));
        }
        if self.gated() {
            v_specs.push(TensorSpec::new(format!("{mlp}.gate_proj.weight"), &[ff, d]));
        }
        v_specs.push(TensorSpec::new(format!("{mlp}.up_proj.weight"), &[ff, d]));
        v_specs.push(TensorSpec::new(format!("{mlp}.down_proj.weight"), &[d, ff]));
        for n in layer_norms {
            v_specs.push(TensorSpec::new(format!("{n}.weight"), &[d]));
        }
        v_specs
    }

    /// Layer `i`'s understanding tensors, relative to `layers.{i}.`.
    pub fn understanding_block(&self) -> Vec<TensorSpec> {
        let mut norms = Vec::new();
        if self.qk_norm_for_text {
            norms.extend(["norm_q", "norm_k"]);
        } else if self.use_und_k_norm_for_gen {
            norms.push("k_norm_und_for_gen");
        }
        self.pathway(
            "to_q",
            "to_k",
            "to_v",
            "to_out",
            &norms,
            "mlp",
            ["input_layernorm", "post_attention_layernorm"],
        )
    }

    /// Layer `i`'s generation tensors, relative to `layers.{i}.`.
    pub fn generation_block(&self) -> Vec<TensorSpec> {
        self.pathway(
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
            &["norm_added_q", "norm_added_k"],
            "mlp_moe_gen",
            [
                "input_layernorm_moe_gen",
                "post_attention_layernorm_moe_gen",
            ],
        )
    }

    pub fn understanding_group(&self) -> BlockGroup {
        BlockGroup {
            name: "understanding".into(),
            prefix: LAYER_PREFIX.into(),
            count: self.num_hidden_layers,
            block: self.understanding_block(),
        }
    }

    pub fn generation_group(&self) -> BlockGroup {
        BlockGroup {
            name: "generation".into(),
            prefix: LAYER_PREFIX.into(),
            count: self.num_hidden_layers,
            block: self.generation_block(),
        }
    }

    /// What every rank keeps on its device: the latent projections in and out, the
    /// timestep embedder and the generation pathway's final norm.
    pub fn resident_specs(&self) -> Vec<TensorSpec> {
        let (d, pd) = (self.hidden_size, self.patch_latent_dim);
        vec![
            TensorSpec::new("proj_in.weight", &[d, pd]),
            TensorSpec::new("proj_in.bias", &[d]),
            TensorSpec::new("proj_out.weight", &[pd, d]),
            TensorSpec::new("proj_out.bias", &[pd]),
            TensorSpec::new("time_embedder.linear_1.weight", &[d, 256]),
            TensorSpec::new("time_embedder.linear_1.bias", &[d]),
            TensorSpec::new("time_embedder.linear_2.weight", &[d, d]),
            TensorSpec::new("time_embedder.linear_2.bias", &[d]),
            TensorSpec::new("norm_moe_gen.weight", &[d]),
        ]
    }

    /// Every tensor of the checkpoint: both groups, the resident set, the embedding table
    /// and what image and video generation never read (the language head, the
    /// understanding pathway's final norm, sound and action heads).
    pub fn all_specs(&self) -> Vec<TensorSpec> {
        let (d, v) = (self.hidden_size, self.vocab_size);
        let mut specs = self.understanding_group().tensor_specs();
        specs.extend(self.generation_group().tensor_specs());
        specs.extend(self.resident_specs());
        specs.push(TensorSpec::new(EMBED_TOKENS, &[v, d]));
        specs.push(TensorSpec::new("lm_head.weight", &[v, d]));
        specs.push(TensorSpec::new("norm.weight", &[d]));
        if let (true, Some(s)) = (self.sound_gen, self.sound_dim) {
            specs.push(TensorSpec::new("audio_proj_in.weight", &[d, s]));
            specs.push(TensorSpec::new("audio_proj_in.bias", &[d]));
            specs.push(TensorSpec::new("audio_proj_out.weight", &[s, d]));
            specs.push(TensorSpec::new("audio_proj_out.bias", &[s]));
            specs.push(TensorSpec::new("audio_modality_embed", &[d]));
        }
        if let (true, Some(a)) = (self.action_gen, self.action_dim) {
            let n = self.num_embodiment_domains;
            specs.push(TensorSpec::new("action_proj_in.fc.weight", &[n, d * a]));
            specs.push(TensorSpec::new("action_proj_in.bias.weight", &[n, d]));
            specs.push(TensorSpec::new("action_proj_out.fc.weight", &[n, a * d]));
            specs.push(TensorSpec::new("action_proj_out.bias.weight", &[n, a]));
            specs.push(TensorSpec::new("action_modality_embed", &[d]));
        }
        specs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(specs: &[TensorSpec]) -> u64 {
        specs.iter().map(|s| s.numel() as u64).sum()
    }

    #[test]
    fn published_blocks_have_the_measured_sizes() {
        // The design's tables: Nano streams 72 blocks of 368 MiB, Super 128 of 930 MiB
        // (bf16): one block per pathway of each layer.
        for (cfg, blocks, mib) in [
            (Cosmos3Config::nano(), 72, 368.0),
            (Cosmos3Config::super_(), 128, 930.0),
        ] {
            let (u, g) = (cfg.understanding_group(), cfg.generation_group());
            assert_eq!(u.count + g.count, blocks);
            for group in [&u, &g] {
                let bytes = 2.0 * params(&group.block) as f64 / (1u64 << 20) as f64;
                assert!((bytes / mib - 1.0).abs() < 0.02, "{bytes} MiB vs {mib}");
            }
        }
    }

    #[test]
    fn the_two_pathways_name_disjoint_tensors() {
        let cfg = Cosmos3Config::nano();
        let (u, g) = (cfg.understanding_group(), cfg.generation_group());
        for s in &u.block {
            assert!(!g.block.iter().any(|t| t.name == s.name), "{}", s.name);
        }
        assert_eq!(u.block_of("layers.3.self_attn.to_q.weight"), Some(3));
        assert_eq!(g.block_of("layers.3.self_attn.to_q.weight"), None);
        assert_eq!(g.block_of("layers.3.mlp_moe_gen.up_proj.weight"), Some(3));
        assert_eq!(u.block_of("layers.3.mlp_moe_gen.up_proj.weight"), None);
    }

    #[test]
    fn bad_configs_are_refused_naming_the_field() {
        let path = Path::new("transformer/config.json");
        let check = |cfg: Cosmos3Config, field: &str| {
            let err = cfg.validate(path).unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        };
        let tiny = Cosmos3Config::tiny(400);
        tiny.validate(path).unwrap();
        check(
            Cosmos3Config {
                num_key_value_heads: 3,
                ..tiny.clone()
            },
            "num_key_value_heads",
        );
        check(
            Cosmos3Config {
                rope_axes_dim: Some(vec![4, 2, 1]),
                ..tiny.clone()
            },
            "rope_axes_dim",
        );
        check(
            Cosmos3Config {
                patch_latent_dim: 100,
                ..tiny.clone()
            },
            "patch_latent_dim",
        );
        check(
            Cosmos3Config {
                hidden_act: "gelu".into(),
                ..tiny.clone()
            },
            "hidden_act",
        );
        check(
            Cosmos3Config {
                num_hidden_layers: 1_000_000_000,
                ..tiny.clone()
            },
            "num_hidden_layers",
        );
        check(
            Cosmos3Config {
                class_name: "Other".into(),
                ..tiny
            },
            "_class_name",
        );
    }
}
