//! The Qwen-Image prompt, as diffusers' `QwenImagePipeline._get_qwen_prompt_embeds` forms
//! it: the prompt in the pipeline's fixed chat template (a system message asking for a
//! detailed description, the user's text, the assistant's opening), tokenized by the
//! folder's Qwen2 tokenizer with truncation at 1024 + 34 tokens, encoded, and the first 34
//! rows of the hidden states dropped (the system message, as Qwen's own tokenizer counts
//! it). `encode_prompt` then keeps at most `max_sequence_length` rows.
//!
//! transformers 5.24 does not run a Qwen2 `tokenizer.json` as written: `Qwen2Tokenizer`
//! takes the file's vocabulary, merges and added tokens and rebuilds the rest itself (NFC,
//! Qwen's pre-tokenizer split, byte-level without a prefix space, no unknown token). The
//! published Qwen-Image folder has no `tokenizer.json` at all (vocab.json, merges.txt and
//! its added tokens in tokenizer_config.json / added_tokens.json), from which transformers
//! builds the same. [`QwenTokenizer::load`] does that from either.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde_json::{json, Value};

use crate::{Error, Result};

/// `QwenImagePipeline.prompt_template_encode`; `{}` is where the prompt goes.
pub const PROMPT_TEMPLATE: &str = "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n";
/// `prompt_template_encode_start_idx`: hidden-state rows dropped from the front.
pub const TEMPLATE_DROP: usize = 34;
/// `tokenizer_max_length`: rows the pipeline keeps after the drop, at most.
pub const TOKENIZER_MAX_LENGTH: usize = 1024;
/// Tokens the tokenizer keeps (its `max_length`): the rest of a longer prompt, and the
/// template's tail after it, is cut.
pub const MAX_TOKENS: usize = TOKENIZER_MAX_LENGTH + TEMPLATE_DROP;

/// Qwen2's pre-tokenizer split (`PRETOKENIZE_REGEX` of transformers' `Qwen2Tokenizer`).
const PRETOKENIZE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The prompt in the pipeline's template.
pub fn templated(prompt: &str) -> String {
    PROMPT_TEMPLATE.replacen("{}", prompt, 1)
}

/// A Qwen2 tokenizer as transformers 5.24 builds it from a folder.
pub struct QwenTokenizer {
    tokenizer: tokenizers::Tokenizer,
    dir: PathBuf,
    /// The file the vocabulary came from (`tokenizer.json` or `vocab.json`): what a
    /// tokenizer fault names.
    source: PathBuf,
}

/// A token name as `tokenizer_config.json` writes it: a string or an AddedToken object.
pub fn token_name(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(crate::checkpoint::read_small(path)?)
        .map_err(|_| Error::checkpoint(path, "not UTF-8 text"))
}

/// An added token entry of `tokenizer.json` for `content` at `id`, its flags from `flags`
/// (an `added_tokens_decoder` entry) where given: special, not normalized, by default.
fn added_token(id: u64, content: &str, flags: Option<&Value>) -> Value {
    let flag = |k: &str, default: bool| {
        flags
            .and_then(|f| f.get(k))
            .and_then(Value::as_bool)
            .unwrap_or(default)
    };
    json!({"id": id, "content": content, "single_word": flag("single_word", false),
        "lstrip": flag("lstrip", false), "rstrip": flag("rstrip", false),
        "normalized": flag("normalized", false), "special": flag("special", true)})
}

impl QwenTokenizer {
    /// Loads the tokenizer folder `dir`: the vocabulary, merges and added tokens of its
    /// `tokenizer.json`, else of `vocab.json`, `merges.txt` and the added tokens that
    /// `tokenizer_config.json` (`added_tokens_decoder`) and `added_tokens.json` list; the
    /// config's `eos_token`, `pad_token`, `bos_token` and `unk_token` are added tokens too.
    pub fn load(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = if config_path.is_file() {
            crate::checkpoint::read_json(&config_path)?
        } else {
            json!({})
        };
        let file = dir.join("tokenizer.json");
        // id → entry, so each id is added once whichever file names it.
        let mut added: BTreeMap<u64, Value> = BTreeMap::new();
        let (vocab, merges, post_processor, source) = if file.is_file() {
            let doc: Value = serde_json::from_str(&read_text(&file)?)
                .map_err(|e| Error::checkpoint(&file, format!("not JSON: {e}")))?;
            let model = &doc["model"];
            if model["type"].as_str().is_some_and(|t| t != "BPE") {
                return Err(Error::checkpoint(
                    &file,
                    format!("model type {}: a Qwen2 tokenizer is BPE", model["type"]),
                ));
            }
            for t in doc["added_tokens"].as_array().into_iter().flatten() {
                if let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) {
                    added.insert(id, added_token(id, content, Some(t)));
                }
            }
            (
                model["vocab"].clone(),
                model["merges"].clone(),
                doc["post_processor"].clone(),
                file.clone(),
            )
        } else {
            let vocab_path = dir.join("vocab.json");
            let vocab: Value = serde_json::from_str(&read_text(&vocab_path)?)
                .map_err(|e| Error::checkpoint(&vocab_path, format!("not JSON: {e}")))?;
            let merges: Vec<Value> = read_text(&dir.join("merges.txt"))?
                .lines()
                .filter(|l| !l.is_empty() && !l.starts_with("#version"))
                .map(|l| Value::String(l.to_string()))
                .collect();
            let listed = dir.join("added_tokens.json");
            if listed.is_file() {
                let map: BTreeMap<String, u64> = crate::checkpoint::read_json(&listed)?;
                for (content, id) in map {
                    added.insert(id, added_token(id, &content, None));
                }
            }
            (vocab, Value::Array(merges), Value::Null, vocab_path)
        };
        let Some(vocab_map) = vocab.as_object() else {
            return Err(Error::checkpoint(
                &source,
                "the vocabulary is not a token → id map",
            ));
        };
        if let Some(decoder) = config["added_tokens_decoder"].as_object() {
            for (id, t) in decoder {
                let (Ok(id), Some(content)) = (id.parse::<u64>(), t["content"].as_str()) else {
                    return Err(Error::config(
                        &config_path,
                        format!("added_tokens_decoder.{id}"),
                        "not an id with a token's `content`",
                    ));
                };
                added.insert(id, added_token(id, content, Some(t)));
            }
        }
        for key in ["eos_token", "pad_token", "bos_token", "unk_token"] {
            let Some(name) = token_name(config.get(key)) else {
                continue;
            };
            let known = added.values().any(|t| t["content"] == name.as_str());
            if let (false, Some(id)) = (known, vocab_map.get(&name).and_then(Value::as_u64)) {
                added.insert(id, added_token(id, &name, None));
            }
        }
        let add_prefix_space = config["add_prefix_space"].as_bool().unwrap_or(false);
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added.into_values().collect::<Vec<_>>(),
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE}, "behavior": "Isolated",
                    "invert": false},
                {"type": "ByteLevel", "add_prefix_space": add_prefix_space,
                    "trim_offsets": true, "use_regex": false},
            ]},
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges},
        });
        let tokenizer = tokenizers::Tokenizer::from_bytes(doc.to_string().as_bytes())
            .map_err(|e| Error::checkpoint(&source, format!("not a Qwen2 tokenizer: {e}")))?;
        for special in ["<|im_start|>", "<|im_end|>"] {
            if tokenizer.token_to_id(special).is_none() {
                return Err(Error::checkpoint(
                    &source,
                    format!("`{special}` is not a token: the Qwen-Image template needs it"),
                ));
            }
        }
        Ok(QwenTokenizer {
            tokenizer,
            dir: dir.to_path_buf(),
            source,
        })
    }

    /// The folder this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file the vocabulary came from, which a tokenizer fault names.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The id of a token (a special token such as `<|im_end|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Every id `text` tokenizes to, untruncated. A byte-level vocabulary encodes any text,
    /// so a failure is the tokenizer file's fault (a 5xx naming it), not the `field`'s.
    fn tokenize(&self, text: &str, field: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| {
            Error::checkpoint(
                &self.source,
                format!("the tokenizer failed on the {field}: {e}"),
            )
        })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Tokens of `prompt` in the template, before truncation.
    pub fn token_count(&self, prompt: &str) -> Result<usize> {
        Ok(self.tokenize(&templated(prompt), "prompt")?.len())
    }

    /// The ids the text encoder reads for `prompt` (`field` names it in errors: `prompt`
    /// or `negative_prompt`), as the pipeline tokenizes them: the template, cut at
    /// [`MAX_TOKENS`] (as diffusers does, silently, tail of the template included). An
    /// error naming the tokenizer file when no row would be left after the drop of
    /// [`TEMPLATE_DROP`]: the template alone is longer than that with Qwen's vocabulary.
    pub fn ids(&self, prompt: &str, field: &str) -> Result<Vec<u32>> {
        let mut ids = self.tokenize(&templated(prompt), field)?;
        ids.truncate(MAX_TOKENS);
        if ids.len() <= TEMPLATE_DROP {
            return Err(Error::checkpoint(
                &self.source,
                format!(
                    "the {field} in the pipeline's template tokenizes to {} tokens, none left after the pipeline drops its first {TEMPLATE_DROP}: this is not Qwen-Image's tokenizer",
                    ids.len(),
                ),
            ));
        }
        Ok(ids)
    }

    /// The rows `prompt` conditions on (after the drop, at most `max_sequence_length`),
    /// or an error naming `field` when the pipeline would cut it: past [`MAX_TOKENS`]
    /// with the template (the tokenizer's truncation), past `max_sequence_length` rows
    /// after the drop (`encode_prompt`'s), or nothing left after the drop.
    pub fn check(&self, prompt: &str, field: &str, max_sequence_length: usize) -> Result<usize> {
        let n = self.tokenize(&templated(prompt), field)?.len();
        let rows = n.saturating_sub(TEMPLATE_DROP);
        if n > MAX_TOKENS || rows > max_sequence_length {
            return Err(Error::invalid(
                field,
                format!(
                    "too long: {rows} tokens after the template's system message (its tail included), \
                     at most {} are read ({})",
                    max_sequence_length.min(TOKENIZER_MAX_LENGTH),
                    if max_sequence_length < TOKENIZER_MAX_LENGTH {
                        "max_sequence_length"
                    } else {
                        "the tokenizer's limit"
                    }
                ),
            ));
        }
        if rows == 0 {
            self.ids(prompt, field)?;
        }
        Ok(rows)
    }
}

/// The pipeline's drop of the template's system rows: hidden states [1, T, D] from the
/// encoder's epilogue to [1, T − 34, D].
pub fn drop_template(hidden: &Tensor) -> Result<Tensor> {
    let (b, t, _) = hidden.dims3()?;
    if b != 1 || t <= TEMPLATE_DROP {
        return Err(Error::bug(format!(
            "prompt hidden states {:?}: want [1, more than {TEMPLATE_DROP}, D]",
            hidden.dims()
        )));
    }
    Ok(hidden.narrow(1, TEMPLATE_DROP, t - TEMPLATE_DROP)?)
}

/// `encode_prompt`'s `prompt_embeds` for one prompt: [`drop_template`], then at most
/// `max_sequence_length` rows.
pub fn prompt_embeds(hidden: &Tensor, max_sequence_length: usize) -> Result<Tensor> {
    let rows = drop_template(hidden)?;
    let keep = rows.dim(1)?.min(max_sequence_length);
    Ok(rows.narrow(1, 0, keep)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth_folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in crate::components::qwen2_5_vl::synth::synth_tokenizer_files() {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    #[test]
    fn tiny_config_has_the_synthesized_tokenizers_vocabulary() {
        let vocab = crate::components::qwen2_5_vl::Qwen25VlConfig::tiny().vocab_size;
        assert_eq!(vocab, crate::components::qwen2_5_vl::synth::SYNTH_VOCAB);
    }

    #[test]
    fn template_is_the_pipelines() {
        let t = templated("a fox");
        assert!(t.starts_with("<|im_start|>system\nDescribe the image by detailing"));
        assert!(t.ends_with("<|im_start|>user\na fox<|im_end|>\n<|im_start|>assistant\n"));
        assert_eq!(templated("{}"), PROMPT_TEMPLATE);
    }

    #[test]
    fn synthesized_tokenizer_reads_one_token_a_byte() {
        let dir = synth_folder();
        let tok = QwenTokenizer::load(dir.path()).unwrap();
        let (start, end) = (tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"));
        assert_eq!((start, end), (Some(257), Some(258)));
        let ids = tok.ids("ab", "prompt").unwrap();
        // Special tokens are one id each; every other byte of the template is one too.
        let bytes = templated("ab").len();
        let specials = 3 * ("<|im_start|>".len() - 1) + 2 * ("<|im_end|>".len() - 1);
        assert_eq!(ids.len(), bytes - specials, "{ids:?}");
        assert_eq!(ids[0], 257);
        assert_eq!(tok.token_count("ab").unwrap(), ids.len());
        // Past MAX_TOKENS the ids are cut; the check refuses and names the field.
        let long = "x".repeat(2000);
        assert_eq!(tok.ids(&long, "prompt").unwrap().len(), MAX_TOKENS);
        let err = tok
            .check(&long, "negative_prompt", 512)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("negative_prompt") && err.contains("too long"),
            "{err}"
        );
        let rows = tok.check("ab", "prompt", 512).unwrap();
        assert_eq!(rows, ids.len() - TEMPLATE_DROP);
        assert!(tok.check("ab", "prompt", rows - 1).is_err());
    }

    #[test]
    fn drop_and_cap_rows() {
        let h = Tensor::arange(0f32, 40.0, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((1, 40, 1))
            .unwrap();
        let d = drop_template(&h).unwrap();
        assert_eq!(d.dims(), [1, 6, 1]);
        let first: Vec<f32> = d.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(first[0], 34.0);
        assert_eq!(prompt_embeds(&h, 4).unwrap().dims(), [1, 4, 1]);
        assert!(drop_template(&h.narrow(1, 0, 34).unwrap()).is_err());
    }
}
