//! DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers") in the diffusers
//! `DiTTransformer2DModel` layout: a patch embedding (prologue), `num_layers` adaLN-Zero
//! blocks that each carry their own timestep/class embedder, and a final adaLN layer
//! (epilogue) that reuses block 0's conditioning.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::components::config_checks;
use crate::families::TensorSpec;
use crate::{Error, Result};

/// Width of the sinusoidal timestep projection diffusers uses for DiT.
pub const TIMESTEP_CHANNELS: usize = 256;

/// `transformer/config.json` of a DiT, with diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DitConfig {
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub attention_bias: bool,
    pub sample_size: usize,
    pub patch_size: Option<usize>,
    pub activation_fn: String,
    pub num_embeds_ada_norm: Option<usize>,
    pub norm_type: String,
    pub norm_elementwise_affine: bool,
    pub norm_eps: f64,
}

impl Default for DitConfig {
    fn default() -> Self {
        DitConfig {
            class_name: "DiTTransformer2DModel".into(),
            num_attention_heads: 16,
            attention_head_dim: 72,
            in_channels: 4,
            out_channels: None,
            num_layers: 28,
            attention_bias: true,
            sample_size: 32,
            patch_size: Some(2),
            activation_fn: "gelu-approximate".into(),
            num_embeds_ada_norm: Some(1000),
            norm_type: "ada_norm_zero".into(),
            norm_elementwise_affine: false,
            norm_eps: 1e-5,
        }
    }
}

impl DitConfig {
    /// A DiT small enough to run end to end in well under a second on a laptop CPU.
    pub fn tiny() -> Self {
        DitConfig {
            num_attention_heads: 4,
            attention_head_dim: 16,
            num_layers: 4,
            sample_size: 8,
            ..Self::xl()
        }
    }

    /// DiT-XL/2 at 256 px, as `facebook/DiT-XL-2-256` ships it.
    pub fn xl() -> Self {
        DitConfig {
            out_channels: Some(8),
            ..Self::default()
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        config_checks::load(path, Self::validate)
    }

    /// Rejects configurations this family implementation does not compute.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        if !matches!(
            self.class_name.as_str(),
            "DiTTransformer2DModel" | "Transformer2DModel"
        ) {
            return bad(
                "_class_name",
                format!("`{}` is not a DiT transformer", self.class_name),
            );
        }
        if self.norm_type != "ada_norm_zero" {
            return bad(
                "norm_type",
                format!("`{}`: DiT uses ada_norm_zero", self.norm_type),
            );
        }
        if !matches!(self.activation_fn.as_str(), "gelu-approximate" | "gelu") {
            return bad(
                "activation_fn",
                format!("`{}` is not supported", self.activation_fn),
            );
        }
        if self.norm_elementwise_affine {
            return bad(
                "norm_elementwise_affine",
                "DiT blocks have no affine norm parameters".into(),
            );
        }
        if self.num_embeds_ada_norm.unwrap_or(0) == 0 {
            return bad(
                "num_embeds_ada_norm",
                "a class-conditional DiT needs the number of classes".into(),
            );
        }
        crate::checkpoint::layers_at_most(path, self.num_layers)?;
        crate::checkpoint::at_most(
            path,
            &[(
                "sample_size",
                self.sample_size,
                crate::checkpoint::MAX_CONFIG_LATENT_SIDE,
            )],
        )?;
        let p = self.patch();
        if p == 0 {
            return bad("patch_size", "must be at least 1".into());
        }
        if self.num_layers == 0 || self.num_attention_heads == 0 || self.attention_head_dim == 0 {
            return bad(
                "num_layers",
                "layers, heads and head width must all be at least 1".into(),
            );
        }
        if !self.sample_size.is_multiple_of(p) {
            return bad(
                "sample_size",
                format!("{} is not a multiple of patch_size {p}", self.sample_size),
            );
        }
        let out = self.out();
        if out != self.in_channels && out != 2 * self.in_channels {
            return bad(
                "out_channels",
                format!(
                    "{out}: must equal in_channels ({}) or twice it (learned sigma)",
                    self.in_channels
                ),
            );
        }
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            return bad("norm_eps", "must be positive".into());
        }
        Ok(())
    }

    pub fn patch(&self) -> usize {
        self.patch_size.unwrap_or(0)
    }
    pub fn out(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }
    pub fn num_classes(&self) -> usize {
        self.num_embeds_ada_norm.unwrap_or(0)
    }
    /// Whether the model predicts a variance beside the noise (the DiT "learned sigma").
    pub fn learned_sigma(&self) -> bool {
        self.out() == 2 * self.in_channels
    }

    /// Prefix of block `i`'s tensors.
    pub fn block_prefix(i: usize) -> String {
        format!("transformer_blocks.{i}.")
    }

    /// Tensors outside the blocks that stay resident: patch embedding and final layer.
    pub fn resident_specs(&self) -> Vec<TensorSpec> {
        let (d, p) = (self.hidden(), self.patch());
        vec![
            TensorSpec::new("pos_embed.proj.weight", &[d, self.in_channels, p, p]),
            TensorSpec::new("pos_embed.proj.bias", &[d]),
            TensorSpec::new("proj_out_1.weight", &[2 * d, d]),
            TensorSpec::new("proj_out_1.bias", &[2 * d]),
            TensorSpec::new("proj_out_2.weight", &[p * p * self.out(), d]),
            TensorSpec::new("proj_out_2.bias", &[p * p * self.out()]),
        ]
    }

    /// One block's tensors, named relative to [`Self::block_prefix`].
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let d = self.hidden();
        let mut v = vec![
            TensorSpec::new(
                "norm1.emb.timestep_embedder.linear_1.weight",
                &[d, TIMESTEP_CHANNELS],
            ),
            TensorSpec::new("norm1.emb.timestep_embedder.linear_1.bias", &[d]),
            TensorSpec::new("norm1.emb.timestep_embedder.linear_2.weight", &[d, d]),
            TensorSpec::new("norm1.emb.timestep_embedder.linear_2.bias", &[d]),
            // One extra row: the "null" class used for classifier-free guidance.
            TensorSpec::new(
                "norm1.emb.class_embedder.embedding_table.weight",
                &[self.num_classes() + 1, d],
            ),
            TensorSpec::new("norm1.linear.weight", &[6 * d, d]),
            TensorSpec::new("norm1.linear.bias", &[6 * d]),
        ];
        for proj in ["to_q", "to_k", "to_v"] {
            v.push(TensorSpec::new(format!("attn1.{proj}.weight"), &[d, d]));
            if self.attention_bias {
                v.push(TensorSpec::new(format!("attn1.{proj}.bias"), &[d]));
            }
        }
        v.extend([
            TensorSpec::new("attn1.to_out.0.weight", &[d, d]),
            TensorSpec::new("attn1.to_out.0.bias", &[d]),
            TensorSpec::new("ff.net.0.proj.weight", &[4 * d, d]),
            TensorSpec::new("ff.net.0.proj.bias", &[4 * d]),
            TensorSpec::new("ff.net.2.weight", &[d, 4 * d]),
            TensorSpec::new("ff.net.2.bias", &[d]),
        ]);
        v
    }
}

crate::components::config_json::transformer_specs!(
    DitConfig,
    prefix: "transformer_blocks.",
    json: [
        ("_diffusers_version", "0.30.0"),
        ("dropout", 0.0),
        ("upcast_attention", false),
        ("norm_num_groups", 32),
    ],
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xl_has_the_published_parameter_count() {
        // DiT-XL/2 has 675M parameters; diffusers' layout repeats the embedder per block.
        let n = DitConfig::xl().parameter_count();
        assert!(n > 670_000_000 && n < 700_000_000 * 2, "{n}");
    }

    #[test]
    fn block_of_parses_indices() {
        assert_eq!(
            DitConfig::block_of("transformer_blocks.12.attn1.to_q.weight"),
            Some(12)
        );
        assert_eq!(DitConfig::block_of("proj_out_1.weight"), None);
        assert_eq!(DitConfig::block_of("transformer_blocks.x.y"), None);
    }

    #[test]
    fn validate_names_the_field() {
        let mut c = DitConfig::tiny();
        c.out_channels = Some(5);
        let e = c.validate(Path::new("cfg.json")).unwrap_err().to_string();
        assert!(e.contains("out_channels"), "{e}");
    }
}
