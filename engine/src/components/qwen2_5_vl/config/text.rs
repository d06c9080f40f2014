//! The language model's config: the presets, the reading of either layout of
//! `text_encoder/config.json`, the checks that refuse what the encoder cannot compute, and
//! the JSON transformers 5.24 writes for it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::fields::Fields;
use super::prefix::CLASSES;
use crate::components::config_checks;
use crate::{Error, Result};

/// The language model's config: what the encoder computes with. Read by [`Self::load`]
/// from either layout; serialised as transformers 5.24's `text_config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen25VlConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Key/value heads, each shared by `num_attention_heads / num_key_value_heads` query
    /// heads (GQA).
    pub num_key_value_heads: usize,
    pub hidden_act: String,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// How the rotary frequencies split over (time, height, width). For text alone the
    /// three positions are equal, so the split does not change the result: the rotary is
    /// ordinary RoPE over `0..T`. Checked (it must cover `head_dim / 2` frequencies, or
    /// transformers fails) and otherwise unused.
    pub mrope_section: Vec<usize>,
}

/// transformers' default for a rope dict without `rope_theta` and no top-level one.
const DEFAULT_THETA: f64 = 1_000_000.0;
/// transformers' default for `mrope_section`.
const DEFAULT_MROPE: [usize; 3] = [16, 24, 24];

impl Qwen25VlConfig {
    /// A language model small enough for unit tests and synthetic folders: its vocabulary
    /// is the synthesized Qwen tokenizer's (`qwen2_5_vl::synth::SYNTH_VOCAB`, the 256 byte
    /// symbols and Qwen's five special tokens).
    pub fn tiny() -> Self {
        Qwen25VlConfig {
            vocab_size: 256 + 5,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            mrope_section: vec![1, 1, 2],
            ..Self::qwen2_5_vl_7b()
        }
    }

    /// Qwen2.5-VL-7B's language model, as the Qwen-Image pipelines ship it.
    pub fn qwen2_5_vl_7b() -> Self {
        Qwen25VlConfig {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            hidden_act: "silu".into(),
            rms_norm_eps: 1e-6,
            rope_theta: DEFAULT_THETA,
            mrope_section: DEFAULT_MROPE.to_vec(),
        }
    }

    /// Reads and checks `text_encoder/config.json` in either layout.
    pub fn load(path: &Path) -> Result<Self> {
        let doc: Value = crate::checkpoint::read_json(path)?;
        Self::from_json(&doc, path)
    }

    /// [`Self::load`] of an already parsed document; `path` is what errors name.
    pub fn from_json(doc: &Value, path: &Path) -> Result<Self> {
        let bad = |field: &str, msg: String| Error::config(path, field, msg);
        let Some(top) = doc.as_object() else {
            return Err(bad("(document)", "not a JSON object".into()));
        };
        match top.get("model_type").and_then(Value::as_str) {
            Some("qwen2_5_vl") | None => {}
            Some(other) => {
                return Err(bad(
                    "model_type",
                    format!(
                        "`{other}`: the text encoder must be a Qwen2.5-VL model (`qwen2_5_vl`)"
                    ),
                ))
            }
        }
        if let Some(archs) = top.get("architectures").and_then(Value::as_array) {
            if let Some(other) = archs
                .iter()
                .find(|a| !a.as_str().is_some_and(|a| CLASSES.contains(&a)))
            {
                return Err(bad(
                    "architectures",
                    format!(
                        "{other}: the text encoder must be one of {}",
                        CLASSES.join(", ")
                    ),
                ));
            }
        }
        let (text, field_prefix) = match top.get("text_config") {
            Some(Value::Object(_)) => (&top["text_config"], "text_config."),
            None | Some(Value::Null) => (doc, ""),
            Some(_) => return Err(bad("text_config", "not an object".into())),
        };
        let Some(obj) = text.as_object() else {
            return Err(bad("(document)", "not a JSON object".into()));
        };
        let f = Fields {
            obj,
            path,
            prefix: field_prefix.to_string(),
        };
        let field = |name: &str| format!("{field_prefix}{name}");
        // transformers: `rope_scaling or rope_parameters`, its theta else the top-level one.
        let rope = match f.object("rope_scaling")? {
            Some(r) => Some(r),
            None => f.object("rope_parameters")?,
        };
        let (mut kind, mut rope_theta, mut mrope_section) = (None, None, None);
        if let Some(r) = &rope {
            kind = match r.string("rope_type")? {
                Some(k) => Some(k),
                None => r.string("type")?,
            };
            rope_theta = r.f64("rope_theta")?;
            if let Some(v) = r.get("mrope_section") {
                let section = serde_json::from_value::<Vec<usize>>(v.clone())
                    .map_err(|_| r.error("mrope_section", format!("{v}: want a list of counts")))?;
                mrope_section = Some(section);
            }
        }
        let rope_field = match &rope {
            Some(r) => r.prefix.trim_end_matches('.').to_string(),
            None => field("rope_parameters"),
        };
        if !matches!(kind, None | Some("default") | Some("mrope")) {
            return Err(Error::config(
                path,
                format!("{rope_field}.rope_type"),
                format!(
                    "`{}`: only the default (multimodal) rotary is implemented, without scaling",
                    kind.unwrap_or_default()
                ),
            ));
        }
        let sliding_layers = f
            .get("layer_types")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .any(|t| t != "full_attention");
        let sliding = if f.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            Some("use_sliding_window")
        } else if sliding_layers {
            Some("layer_types")
        } else {
            None
        };
        if let Some(name) = sliding {
            return Err(bad(
                &field(name),
                "sliding-window attention is not implemented (every layer attends to the whole prompt)".into(),
            ));
        }
        let heads = f.usize("num_attention_heads", 64)?;
        let cfg = Qwen25VlConfig {
            vocab_size: f.usize("vocab_size", 152064)?,
            hidden_size: f.usize("hidden_size", 8192)?,
            intermediate_size: f.usize("intermediate_size", 29568)?,
            num_hidden_layers: f.usize("num_hidden_layers", 80)?,
            num_attention_heads: heads,
            // transformers: `null` means one per query head.
            num_key_value_heads: match f.obj.get("num_key_value_heads") {
                Some(Value::Null) => heads,
                _ => f.usize("num_key_value_heads", 8)?,
            },
            hidden_act: f.string("hidden_act")?.unwrap_or("silu").to_string(),
            rms_norm_eps: f.f64("rms_norm_eps")?.unwrap_or(1e-5),
            rope_theta: match rope_theta {
                Some(t) => t,
                None => f.f64("rope_theta")?.unwrap_or(DEFAULT_THETA),
            },
            mrope_section: mrope_section.unwrap_or_else(|| DEFAULT_MROPE.to_vec()),
        };
        cfg.validate(path, field_prefix, &rope_field)?;
        Ok(cfg)
    }

    /// Rejects configurations this implementation does not compute; `prefix` is prepended
    /// to the field names errors give (`text_config.` for the nested layout), `rope` is
    /// the rotary dict's field.
    fn validate(&self, path: &Path, prefix: &str, rope: &str) -> Result<()> {
        let bad =
            |field: &str, msg: String| Err(Error::config(path, format!("{prefix}{field}"), msg));
        config_checks::at_least_one_under(
            path,
            prefix,
            &config_checks::named!(self: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads),
        )?;
        let layers = format!("{prefix}num_hidden_layers");
        crate::checkpoint::at_most(
            path,
            &[(
                layers.as_str(),
                self.num_hidden_layers,
                crate::checkpoint::MAX_CONFIG_LAYERS,
            )],
        )?;
        if self.hidden_act != "silu" {
            return bad(
                "hidden_act",
                format!(
                    "`{}`: only the SiLU-gated MLP is implemented",
                    self.hidden_act
                ),
            );
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
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
        if !self.head_dim().is_multiple_of(2) {
            return bad(
                "num_attention_heads",
                format!("head dim {} is odd: rotary needs pairs", self.head_dim()),
            );
        }
        if self.mrope_section.iter().sum::<usize>() != self.head_dim() / 2 {
            return Err(Error::config(
                path,
                format!("{rope}.mrope_section"),
                format!(
                    "{:?} covers {} frequencies; the head dim {} has {}",
                    self.mrope_section,
                    self.mrope_section.iter().sum::<usize>(),
                    self.head_dim(),
                    self.head_dim() / 2
                ),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad("rms_norm_eps", "must be positive".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::config(
                path,
                format!("{rope}.rope_theta"),
                "must be positive",
            ));
        }
        Ok(())
    }

    /// The `config.json` transformers 5.24 writes for a model with this language model
    /// (its default vision tower), so a synthetic folder loads there.
    pub fn to_json(&self) -> Value {
        let mut text = serde_json::to_value(self).expect("config serialises");
        let t = text.as_object_mut().expect("object");
        let mrope = t.remove("mrope_section").expect("field");
        let theta = t.remove("rope_theta").expect("field");
        t.insert("model_type".into(), "qwen2_5_vl_text".into());
        t.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "type": "mrope",
                "rope_theta": theta, "mrope_section": mrope}),
        );
        t.insert("use_sliding_window".into(), false.into());
        serde_json::json!({
            "architectures": [CLASSES[0]],
            "model_type": "qwen2_5_vl",
            "dtype": "float32",
            "tie_word_embeddings": false,
            "text_config": text,
            "transformers_version": "5.24.0",
        })
    }
}
