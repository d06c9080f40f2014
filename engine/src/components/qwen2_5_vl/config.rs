//! `text_encoder/config.json` of a Qwen2.5-VL model (transformers'
//! `Qwen2_5_VLForConditionalGeneration`), of which only the language model runs, and the
//! tensors it implies: the embedding table (rows read from the host mapping per prompt),
//! `num_hidden_layers` decoder layers that stream, and the final RMS norm that stays
//! resident. The vision tower and `lm_head.weight` may sit in the folder; they are never
//! loaded.
//!
//! Two layouts of the config are read, as transformers 5.24 reads them: the one it writes
//! (the language model's fields in a nested `text_config`), and the flat one of the
//! published Qwen-Image folder (transformers 4.5x: the fields at the top level beside a
//! nested `vision_config`, rotary in `rope_scaling` and `rope_theta`). When `text_config`
//! is there it is the language model's config and the top-level fields are not read.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::checkpoint::check::check_tensors;
use crate::checkpoint::Component;
use crate::{Error, Result};
use layerwise_core::family::{BlockGroup, TensorSpec};

/// The classes whose folder holds a Qwen2.5-VL language model this encoder runs.
const CLASSES: [&str; 2] = ["Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"];

/// Where a checkpoint keeps the language model's tensors. transformers 5.24 (like the
/// published Qwen-Image folder, written by 4.5x) saves them as `model.…`, with the vision
/// tower as `visual.…`; checkpoints written from the module paths have them as
/// `model.language_model.…` (and `model.visual.…`). transformers reads both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorPrefix {
    /// `model.`: what `save_pretrained` writes and the published checkpoint holds.
    Model,
    /// `model.language_model.`: the module path.
    LanguageModel,
}

impl TensorPrefix {
    /// Both spellings, the saved one first.
    pub const ALL: [TensorPrefix; 2] = [TensorPrefix::Model, TensorPrefix::LanguageModel];

    /// The prefix itself, with its trailing dot.
    pub fn as_str(self) -> &'static str {
        match self {
            TensorPrefix::Model => "model.",
            TensorPrefix::LanguageModel => "model.language_model.",
        }
    }

    /// The token embedding table, `[vocab_size, hidden_size]`.
    pub fn embedding(self) -> String {
        format!("{}embed_tokens.weight", self.as_str())
    }

    /// The final RMS norm's weight, `[hidden_size]`.
    pub fn final_norm(self) -> String {
        format!("{}norm.weight", self.as_str())
    }

    /// Where layer `i`'s tensors live: `{prefix}layers.{i}.…`.
    pub fn layers(self) -> String {
        format!("{}layers.", self.as_str())
    }

    /// The spelling `c` uses, found by its embedding table; an error naming the table when
    /// neither (or, ambiguously, both) is there.
    pub fn detect(c: &Component) -> Result<TensorPrefix> {
        let found: Vec<TensorPrefix> = Self::ALL
            .into_iter()
            .filter(|p| c.get(&p.embedding()).is_some())
            .collect();
        match found.as_slice() {
            [one] => Ok(*one),
            [] => Err(Error::tensor(
                c.path_of(&TensorPrefix::Model.embedding()),
                TensorPrefix::Model.embedding(),
                format!(
                    "missing (nor is it stored as {}): the folder holds no Qwen2.5-VL language model",
                    TensorPrefix::LanguageModel.embedding()
                ),
            )),
            _ => Err(Error::tensor(
                c.path_of(&TensorPrefix::LanguageModel.embedding()),
                TensorPrefix::LanguageModel.embedding(),
                format!(
                    "stored beside {}: one language model under two prefixes",
                    TensorPrefix::Model.embedding()
                ),
            )),
        }
    }
}

/// Whether a tensor of the folder belongs to what the text encoder never loads: the vision
/// tower (under either spelling) and the language-model head.
pub fn is_unused(name: &str) -> bool {
    name == "lm_head.weight" || name.starts_with("visual.") || name.starts_with("model.visual.")
}

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

/// Reads the language model's fields of one JSON object, naming `{prefix}{field}` in
/// errors; absent (or `null`) fields take transformers 5.24's defaults
/// (`Qwen2_5_VLTextConfig`).
struct Fields<'a> {
    obj: &'a serde_json::Map<String, Value>,
    path: &'a Path,
    prefix: String,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn error(&self, name: &str, msg: impl Into<String>) -> Error {
        Error::config(self.path, format!("{}{name}", self.prefix), msg)
    }

    fn usize(&self, name: &str, default: usize) -> Result<usize> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.error(name, format!("{v}: want a count"))),
        }
    }

    fn f64(&self, name: &str) -> Result<Option<f64>> {
        self.get(name)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.error(name, format!("{v}: want a number")))
            })
            .transpose()
    }

    fn string(&self, name: &str) -> Result<Option<&str>> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.error(name, format!("{v}: want a string")))
            })
            .transpose()
    }

    fn object(&self, name: &str) -> Result<Option<Fields<'_>>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                obj,
                path: self.path,
                prefix: format!("{}{name}.", self.prefix),
            })),
            Some(v) => Err(self.error(name, format!("{v}: want an object"))),
        }
    }
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
        crate::components::config_checks::at_least_one(
            path,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
            ],
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

    /// Width of one attention head: `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Query heads per key/value head.
    pub fn groups_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Bytes per prompt token live at the peak of one decoder layer in f32 (the profile's
    /// `encoder_bytes_per_token`): the hidden states, their norm and the residual sum, the
    /// queries with their rotated copy and the attention output before and after its
    /// merge, the keys and values with the rotated keys, the keys and values repeated to
    /// every query head, and the MLP's two projections with their product. The causal
    /// attention's scores run in query chunks within
    /// [`crate::components::attention::ATTENTION_CHUNK_BYTES`], a fixed cost beside this.
    pub fn encoder_bytes_per_token(&self) -> u64 {
        let d = self.hidden_size as u64;
        let qw = (self.num_attention_heads * self.head_dim()) as u64;
        let kvw = (self.num_key_value_heads * self.head_dim()) as u64;
        let repeated = if self.groups_per_kv() > 1 { 2 * qw } else { 0 };
        let ff = self.intermediate_size as u64;
        4 * (3 * d + 4 * qw + 3 * kvw + repeated + 3 * ff)
    }

    /// The embedding table: read row by row from the host mapping, never loaded whole.
    pub fn embedding_spec(&self, prefix: TensorPrefix) -> TensorSpec {
        TensorSpec::new(prefix.embedding(), &[self.vocab_size, self.hidden_size])
    }

    /// Tensors that stay resident on the device: the final norm.
    pub fn resident_specs(&self, prefix: TensorPrefix) -> Vec<TensorSpec> {
        vec![TensorSpec::new(prefix.final_norm(), &[self.hidden_size])]
    }

    /// One decoder layer's tensors, named relative to its prefix `{prefix}layers.{i}.`:
    /// q/k/v projections with biases, the output projection without, the SiLU-gated MLP
    /// and the two RMS norms.
    pub fn block_specs(&self) -> Vec<TensorSpec> {
        let d = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_key_value_heads * self.head_dim();
        let ff = self.intermediate_size;
        vec![
            TensorSpec::new("input_layernorm.weight", &[d]),
            TensorSpec::new("self_attn.q_proj.weight", &[q, d]),
            TensorSpec::new("self_attn.q_proj.bias", &[q]),
            TensorSpec::new("self_attn.k_proj.weight", &[kv, d]),
            TensorSpec::new("self_attn.k_proj.bias", &[kv]),
            TensorSpec::new("self_attn.v_proj.weight", &[kv, d]),
            TensorSpec::new("self_attn.v_proj.bias", &[kv]),
            TensorSpec::new("self_attn.o_proj.weight", &[d, q]),
            TensorSpec::new("post_attention_layernorm.weight", &[d]),
            TensorSpec::new("mlp.gate_proj.weight", &[ff, d]),
            TensorSpec::new("mlp.up_proj.weight", &[ff, d]),
            TensorSpec::new("mlp.down_proj.weight", &[d, ff]),
        ]
    }

    /// The decoder layers as one streamed group, one block per layer.
    pub fn block_group(&self, prefix: TensorPrefix) -> BlockGroup {
        BlockGroup {
            name: "text_encoder".into(),
            prefix: prefix.layers(),
            count: self.num_hidden_layers,
            block: self.block_specs(),
        }
    }

    /// Every tensor of the language model with its full name: the embedding table, the
    /// final norm, the layers.
    pub fn all_specs(&self, prefix: TensorPrefix) -> Vec<TensorSpec> {
        let mut v = vec![self.embedding_spec(prefix)];
        v.extend(self.resident_specs(prefix));
        v.extend(self.block_group(prefix).tensor_specs());
        v
    }

    /// Checks a text encoder folder's tensors against this config and returns the prefix
    /// they use: the layer count, then every language-model tensor's name, shape and
    /// dtype, and nothing else beside them but what [`is_unused`] names.
    pub fn check(&self, c: &Component) -> Result<TensorPrefix> {
        let prefix = TensorPrefix::detect(c)?;
        let group = self.block_group(prefix);
        let found = c
            .index
            .keys()
            .filter_map(|n| group.block_of(n))
            .max()
            .map_or(0, |m| m + 1);
        if found != self.num_hidden_layers {
            return Err(Error::config(
                c.dir.join("config.json"),
                "num_hidden_layers",
                format!(
                    "says {} but the weights hold {found} layers",
                    self.num_hidden_layers
                ),
            ));
        }
        let mut lm = c.clone();
        lm.index.retain(|name, _| !is_unused(name));
        check_tensors(&lm, &self.all_specs(prefix), |_| None)?;
        Ok(prefix)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The published Qwen-Image `text_encoder/config.json`'s language-model fields, flat.
    const PUBLISHED: &str = r#"{
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "image_token_id": 151655,
        "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 128000, "max_window_layers": 28, "model_type": "qwen2_5_vl",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "transformers_version": "4.53.1", "use_cache": true,
        "use_sliding_window": false, "video_token_id": 151656,
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
            "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584,
            "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
            "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2, "temporal_patch_size": 2, "model_type": "qwen2_5_vl"},
        "vision_end_token_id": 151653, "vision_start_token_id": 151652,
        "vision_token_id": 151654, "vocab_size": 152064
    }"#;

    fn parse(text: &str) -> Result<Qwen25VlConfig> {
        let doc: Value = serde_json::from_str(text).expect("JSON");
        Qwen25VlConfig::from_json(&doc, Path::new("config.json"))
    }

    #[test]
    fn published_flat_layout_is_the_7b_preset() {
        let cfg = parse(PUBLISHED).expect("published config");
        assert_eq!(cfg, Qwen25VlConfig::qwen2_5_vl_7b());
        assert_eq!((cfg.head_dim(), cfg.groups_per_kv()), (128, 7));
    }

    #[test]
    fn nested_layout_round_trips_and_wins_over_flat_fields() {
        let tiny = Qwen25VlConfig::tiny();
        assert_eq!(parse(&tiny.to_json().to_string()).expect("nested"), tiny);
        // transformers reads `text_config` alone when it is there.
        let mut doc = tiny.to_json();
        doc["hidden_size"] = 3584.into();
        doc["num_hidden_layers"] = 28.into();
        assert_eq!(parse(&doc.to_string()).expect("nested"), tiny);
    }

    #[test]
    fn seven_b_language_model_has_the_published_parameter_count() {
        let cfg = Qwen25VlConfig::qwen2_5_vl_7b();
        let n: usize = cfg
            .all_specs(TensorPrefix::Model)
            .iter()
            .map(TensorSpec::numel)
            .sum();
        // 7.07 B: the 7.6 B model less its 545 M lm_head and 0.67 B vision tower.
        assert!((7_000_000_000..7_100_000_000).contains(&n), "{n}");
        let g = cfg.block_group(TensorPrefix::LanguageModel);
        assert_eq!(g.prefix, "model.language_model.layers.");
        assert_eq!(
            g.block_of("model.language_model.layers.27.self_attn.k_proj.bias"),
            Some(27)
        );
        // About 0.3 MB a token: a 1058-token prompt holds about 0.3 GB at a layer's peak.
        assert_eq!(
            cfg.encoder_bytes_per_token(),
            4 * (3 * 3584 + 6 * 3584 + 3 * 512 + 3 * 18944)
        );
        let k = g.block.iter().find(|s| s.name == "self_attn.k_proj.weight");
        assert_eq!(k.map(|s| s.shape.clone()), Some(vec![512, 3584]));
    }

    #[test]
    fn validate_names_the_field() {
        let err = |text: String| parse(&text).unwrap_err().to_string();
        let nested = |f: &dyn Fn(&mut Value)| {
            let mut doc = Qwen25VlConfig::tiny().to_json();
            f(&mut doc["text_config"]);
            doc.to_string()
        };
        assert!(
            err(nested(&|t| t["hidden_act"] = "gelu".into())).contains("text_config.hidden_act")
        );
        assert!(err(nested(&|t| t["num_key_value_heads"] = 3.into()))
            .contains("text_config.num_key_value_heads"));
        assert!(err(nested(
            &|t| t["rope_parameters"]["mrope_section"] = serde_json::json!([2, 2, 2])
        ))
        .contains("text_config.rope_parameters.mrope_section"));
        assert!(err(nested(
            &|t| t["rope_parameters"]["rope_type"] = "yarn".into()
        ))
        .contains("rope_type"));
        assert!(
            err(nested(&|t| t["use_sliding_window"] = true.into())).contains("use_sliding_window")
        );
        assert!(
            err(nested(&|t| t["hidden_size"] = "wide".into())).contains("text_config.hidden_size")
        );
        let flat = PUBLISHED.replace("\"num_attention_heads\": 28", "\"num_attention_heads\": 0");
        let e = err(flat);
        assert!(
            e.contains("num_attention_heads") && !e.contains("text_config."),
            "{e}"
        );
        assert!(err(PUBLISHED.replace("\"qwen2_5_vl\"", "\"qwen2_vl\"")).contains("model_type"));
        assert!(
            err(PUBLISHED.replace("Qwen2_5_VLForConditionalGeneration", "Qwen2VL"))
                .contains("architectures")
        );
    }

    #[test]
    fn unused_tensors_are_the_vision_tower_and_the_head() {
        assert!(is_unused("lm_head.weight"));
        assert!(is_unused("visual.blocks.0.attn.qkv.weight"));
        assert!(is_unused("model.visual.merger.mlp.0.bias"));
        assert!(!is_unused("model.norm.weight"));
        assert!(!is_unused(
            "model.language_model.layers.0.mlp.up_proj.weight"
        ));
    }
}
