//! `text_encoder/config.json` of a UMT5 encoder (transformers' `UMT5Config` as
//! `UMT5EncoderModel` reads it) and the tensors it implies: a shared embedding table and a
//! final RMS norm that stay resident, and `num_layers` blocks that stream, each with its
//! own relative position bias (UMT5's difference from T5, which shares block 0's).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::checkpoint::check::check_tensors;
use crate::checkpoint::Component;
use crate::components::config_checks;
use crate::{Error, Result};
use layerwise_core::family::{BlockGroup, TensorSpec};

/// Where block `i`'s tensors live: `encoder.block.{i}.…`.
pub const BLOCK_PREFIX: &str = "encoder.block.";
/// The final RMS norm, applied after the last block.
pub const FINAL_NORM: &str = "encoder.final_layer_norm.weight";
/// The names the token embedding table is stored under: transformers writes the tied
/// table once as `shared.weight`; exports that untie it write `encoder.embed_tokens.weight`
/// (alone or beside `shared.weight`, the same table).
pub const EMBEDDING_NAMES: [&str; 2] = ["shared.weight", "encoder.embed_tokens.weight"];

/// A token id, or several (transformers accepts both for `eos_token_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// `text_encoder/config.json` of `UMT5EncoderModel`, with transformers' defaults. Fields
/// that only matter for training or for the decoder are parsed (so a malformed value is
/// refused) and otherwise unused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Umt5Config {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    pub model_type: String,
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    /// The decoder's depth; `UMT5EncoderModel` has no decoder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_decoder_layers: Option<usize>,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub dropout_rate: f64,
    pub layer_norm_epsilon: f64,
    pub initializer_factor: f64,
    pub feed_forward_proj: String,
    pub is_encoder_decoder: bool,
    pub use_cache: bool,
    pub pad_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub decoder_start_token_id: Option<u32>,
    pub classifier_dropout: f64,
    pub is_decoder: bool,
    /// Derived by transformers from `feed_forward_proj` on load (a stored value is
    /// overwritten), so it is derived here too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dense_act_fn: Option<String>,
    /// Derived from `feed_forward_proj`, as `dense_act_fn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_gated_act: Option<bool>,
    /// transformers forces ties for the T5 family; only the (absent) decoder reads it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_decoder_outputs: Option<bool>,
    /// The t5x conversion flag for a relative position bias in every layer, which is what
    /// UMT5 is; `false` would describe T5's single shared bias.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scalable_attention: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_past: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer_class: Option<String>,
    /// The stored dtype as transformers ≥ 5 writes it (`torch_dtype` before); informative,
    /// the headers say what each tensor is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transformers_version: Option<String>,
}

impl Default for Umt5Config {
    fn default() -> Self {
        Umt5Config {
            architectures: None,
            model_type: "umt5".into(),
            vocab_size: 250112,
            d_model: 512,
            d_kv: 64,
            d_ff: 1024,
            num_layers: 8,
            num_decoder_layers: None,
            num_heads: 6,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            dropout_rate: 0.1,
            layer_norm_epsilon: 1e-6,
            initializer_factor: 1.0,
            feed_forward_proj: "gated-gelu".into(),
            is_encoder_decoder: true,
            use_cache: true,
            pad_token_id: Some(0),
            eos_token_id: Some(TokenIds::One(1)),
            decoder_start_token_id: Some(0),
            classifier_dropout: 0.0,
            is_decoder: false,
            dense_act_fn: None,
            is_gated_act: None,
            tie_word_embeddings: None,
            scale_decoder_outputs: None,
            scalable_attention: None,
            output_past: None,
            tokenizer_class: None,
            dtype: None,
            torch_dtype: None,
            transformers_version: None,
        }
    }
}

/// The classes whose weights are an encoder alone, in `UMT5EncoderModel`'s names.
const ENCODER_CLASSES: [&str; 1] = ["UMT5EncoderModel"];

impl Umt5Config {
    /// A UMT5 encoder small enough for unit tests; its vocabulary is the synthetic
    /// tokenizer's ([`super::synth::SYNTH_VOCAB_SIZE`]).
    pub fn tiny() -> Self {
        Umt5Config {
            vocab_size: super::synth::SYNTH_VOCAB_SIZE,
            d_model: 32,
            d_kv: 8,
            d_ff: 64,
            num_layers: 2,
            num_heads: 4,
            ..Self::umt5_xxl()
        }
    }

    /// The `google/umt5-xxl` encoder as the Wan 2.1 / 2.2 pipelines ship it.
    pub fn umt5_xxl() -> Self {
        Umt5Config {
            architectures: Some(vec!["UMT5EncoderModel".into()]),
            vocab_size: 256384,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            ..Self::transformers_defaults()
        }
    }

    /// `UMT5Config()`: every field at transformers' default.
    pub fn transformers_defaults() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }

    pub fn load(path: &Path) -> Result<Self> {
        config_checks::load(path, Self::validate)
    }

    /// Rejects configurations this implementation does not compute.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(path, field, msg));
        if self.model_type != "umt5" {
            return bad(
                "model_type",
                format!(
                    "`{}`: this is the UMT5 encoder (a relative position bias in every layer)",
                    self.model_type
                ),
            );
        }
        if let Some(other) = self
            .architectures
            .iter()
            .flatten()
            .find(|a| !ENCODER_CLASSES.contains(&a.as_str()))
        {
            return bad(
                "architectures",
                format!("`{other}`: the text encoder must be a UMT5EncoderModel"),
            );
        }
        // transformers splits `gated-ACT`; "gelu" is mapped to the tanh approximation.
        if !matches!(
            self.feed_forward_proj.as_str(),
            "gated-gelu" | "gated-gelu_new"
        ) {
            return bad(
                "feed_forward_proj",
                format!(
                    "`{}`: only the gated tanh-GELU feed-forward (\"gated-gelu\") is implemented",
                    self.feed_forward_proj
                ),
            );
        }
        if self.is_decoder {
            return bad(
                "is_decoder",
                "true makes the stack causal with cross-attention; a text encoder is not".into(),
            );
        }
        if self.scalable_attention == Some(false) {
            return bad(
                "scalable_attention",
                "false describes T5's one shared position bias; UMT5 has one per layer".into(),
            );
        }
        config_checks::at_least_one(
            path,
            &config_checks::named!(self: vocab_size, d_model, d_kv, d_ff, num_layers, num_heads),
        )?;
        crate::checkpoint::layers_at_most(path, self.num_layers)?;
        // Bidirectional bucketing halves the buckets, and half of those are exact offsets:
        // the log-spaced rest needs at least one exact bucket and room above it.
        let exact = self.max_exact();
        if exact == 0 {
            return bad(
                "relative_attention_num_buckets",
                format!(
                    "{}: needs at least 4 (two directions, exact and log-spaced)",
                    self.relative_attention_num_buckets
                ),
            );
        }
        if self.relative_attention_max_distance <= exact {
            return bad(
                "relative_attention_max_distance",
                format!(
                    "{} must exceed the {exact} exactly-bucketed offsets that relative_attention_num_buckets ({}) gives",
                    self.relative_attention_max_distance, self.relative_attention_num_buckets
                ),
            );
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon > 0.0) {
            return bad("layer_norm_epsilon", "must be positive".into());
        }
        Ok(())
    }

    /// Width of the attention's projections: `num_heads × d_kv`.
    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    /// Offsets below this get a bucket each (per direction); larger ones are log-spaced.
    pub fn max_exact(&self) -> usize {
        self.relative_attention_num_buckets / 2 / 2
    }

    /// Tensors outside the blocks, in transformers' names: the embedding table (which the
    /// pipeline gathers rows from in host memory) and the final norm.
    pub fn resident_specs(&self) -> Vec<TensorSpec> {
        vec![
            TensorSpec::new(EMBEDDING_NAMES[0], &[self.vocab_size, self.d_model]),
            TensorSpec::new(FINAL_NORM, &[self.d_model]),
        ]
    }

    /// One block's tensors, named relative to its prefix `encoder.block.{i}.`.
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let (d, inner, ff) = (self.d_model, self.inner_dim(), self.d_ff);
        let attn = "layer.0.SelfAttention";
        let ffn = "layer.1.DenseReluDense";
        vec![
            TensorSpec::new(format!("{attn}.q.weight"), &[inner, d]),
            TensorSpec::new(format!("{attn}.k.weight"), &[inner, d]),
            TensorSpec::new(format!("{attn}.v.weight"), &[inner, d]),
            TensorSpec::new(format!("{attn}.o.weight"), &[d, inner]),
            TensorSpec::new(
                format!("{attn}.relative_attention_bias.weight"),
                &[self.relative_attention_num_buckets, self.num_heads],
            ),
            TensorSpec::new("layer.0.layer_norm.weight", &[d]),
            TensorSpec::new(format!("{ffn}.wi_0.weight"), &[ff, d]),
            TensorSpec::new(format!("{ffn}.wi_1.weight"), &[ff, d]),
            TensorSpec::new(format!("{ffn}.wo.weight"), &[d, ff]),
            TensorSpec::new("layer.1.layer_norm.weight", &[d]),
        ]
    }

    /// The encoder's blocks as a streamed group.
    pub fn block_group(&self) -> BlockGroup {
        BlockGroup {
            name: "text_encoder".into(),
            prefix: BLOCK_PREFIX.into(),
            count: self.num_layers,
            block: self.block_specs(),
        }
    }

    /// Every tensor of the encoder with its full name (the embedding as `shared.weight`).
    pub fn all_specs(&self) -> Vec<TensorSpec> {
        crate::components::config_json::all_specs(self.resident_specs(), &self.block_group())
    }

    /// Checks a text encoder folder's tensors against this config: the block count, every
    /// name, shape and dtype, and nothing else; the embedding table under either of
    /// [`EMBEDDING_NAMES`] (or both).
    pub fn check(&self, c: &Component) -> Result<()> {
        let group = self.block_group();
        crate::components::config_checks::depth_matches(
            c,
            "num_layers",
            self.num_layers,
            |n| group.block_of(n),
            "blocks",
        )?;
        let table = embedding_table(c)?;
        let mut specs = self.all_specs();
        specs[0].name = table.into();
        if table == EMBEDDING_NAMES[0] && c.get(EMBEDDING_NAMES[1]).is_some() {
            specs.push(TensorSpec::new(EMBEDDING_NAMES[1], &specs[0].shape));
        }
        Ok(check_tensors(c, &specs, |_| None)?)
    }

    /// The JSON transformers writes for this config (so a synthetic folder loads there).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("config serialises");
        let m = v.as_object_mut().expect("object");
        let gated_gelu = self.feed_forward_proj.starts_with("gated-");
        let derived = [
            ("architectures", serde_json::json!(ENCODER_CLASSES)),
            ("num_decoder_layers", self.num_layers.into()),
            ("dense_act_fn", "gelu_new".into()),
            ("is_gated_act", gated_gelu.into()),
            ("tie_word_embeddings", true.into()),
            ("scale_decoder_outputs", true.into()),
            ("dtype", "float32".into()),
            ("transformers_version", "5.24.0".into()),
        ];
        for (k, val) in derived {
            m.entry(k).or_insert(val);
        }
        v
    }
}

/// The name a text encoder folder stores its embedding table under (`shared.weight` when
/// both are there: they are one table).
pub fn embedding_table(c: &Component) -> Result<&'static str> {
    EMBEDDING_NAMES
        .into_iter()
        .find(|n| c.get(n).is_some())
        .ok_or_else(|| {
            Error::tensor(
                &c.dir,
                EMBEDDING_NAMES[0],
                format!("missing (nor is it stored as {})", EMBEDDING_NAMES[1]),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxl_encoder_has_the_published_parameter_count() {
        // umt5-xxl's encoder: ~4.6 B in the blocks plus the 1.05 B embedding table.
        let cfg = Umt5Config::umt5_xxl();
        let n: usize = cfg.all_specs().iter().map(TensorSpec::numel).sum();
        assert!((5_600_000_000..5_800_000_000).contains(&n), "{n}");
        let embedding = cfg.resident_specs()[0].numel();
        assert_eq!(embedding, 256384 * 4096);
    }

    #[test]
    fn every_layer_has_its_own_position_bias() {
        let g = Umt5Config::tiny().block_group();
        assert_eq!((g.count, g.prefix.as_str()), (2, "encoder.block."));
        let bias = g
            .block
            .iter()
            .find(|s| s.name == "layer.0.SelfAttention.relative_attention_bias.weight")
            .expect("bias in the block");
        assert_eq!(bias.shape, vec![32, 4]);
        assert_eq!(
            g.block_of("encoder.block.1.layer.1.DenseReluDense.wo.weight"),
            Some(1)
        );
    }

    #[test]
    fn defaults_are_transformers_and_derived_fields_are_written() {
        let cfg = Umt5Config::transformers_defaults();
        assert_eq!(
            (cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_layers),
            (250112, 512, 6, 8)
        );
        assert_eq!(cfg.eos_token_id, Some(TokenIds::One(1)));
        let j = Umt5Config::tiny().to_json();
        assert_eq!(j["dense_act_fn"], "gelu_new");
        assert_eq!(j["is_gated_act"], true);
        assert_eq!(j["architectures"][0], "UMT5EncoderModel");
        assert_eq!(j["num_decoder_layers"], 2);
        let back: Umt5Config = serde_json::from_value(j).expect("round trip");
        assert_eq!(back.d_ff, 64);
        let list: Umt5Config = serde_json::from_str(r#"{"eos_token_id": [1, 2]}"#).expect("list");
        assert_eq!(list.eos_token_id, Some(TokenIds::Many(vec![1, 2])));
    }

    #[test]
    fn validate_names_the_field() {
        let p = Path::new("config.json");
        let err = |c: Umt5Config| c.validate(p).unwrap_err().to_string();
        let c = Umt5Config {
            feed_forward_proj: "relu".into(),
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("feed_forward_proj"));
        let c = Umt5Config {
            model_type: "t5".into(),
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("model_type"));
        let c = Umt5Config {
            architectures: Some(vec!["UMT5ForConditionalGeneration".into()]),
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("architectures"));
        let c = Umt5Config {
            relative_attention_num_buckets: 2,
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("relative_attention_num_buckets"));
        let c = Umt5Config {
            relative_attention_max_distance: 8,
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("relative_attention_max_distance"));
        let c = Umt5Config {
            scalable_attention: Some(false),
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("scalable_attention"));
        let c = Umt5Config {
            is_decoder: true,
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("is_decoder"));
        let c = Umt5Config {
            d_kv: 0,
            ..Umt5Config::tiny()
        };
        assert!(err(c).contains("d_kv"));
        Umt5Config::tiny().validate(p).expect("tiny is valid");
        Umt5Config::umt5_xxl().validate(p).expect("xxl is valid");
    }
}
