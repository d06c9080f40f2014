//! The prompt tokenizer in front of the UMT5 encoder, doing what diffusers'
//! `WanPipeline._get_t5_prompt_embeds` does: [`prompt_clean`], then the tokenizer with
//! `padding="max_length", max_length=M, truncation=True, add_special_tokens=True`, so at
//! most M − 1 pieces, then `</s>`, then `<pad>` up to M, with the attention mask.
//!
//! transformers ≥ 5 does not run a T5 `tokenizer.json` as written: `T5Tokenizer` rebuilds
//! the backend from the file's vocabulary and SentencePiece precompiled charsmap alone
//! (Unigram with unk id 2 and no byte fallback, whitespace split then `▁` before every
//! word, and `$A </s>`), dropping the file's other normalizers, pre-tokenizer and
//! post-processor. [`PromptTokenizer::load`] rebuilds it the same way, so both read one
//! file identically.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::prompt::prompt_clean;
use crate::{Error, Result};

/// A loaded prompt tokenizer with its sequence length.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    max_len: usize,
    eos: u32,
    pad: u32,
}

/// `tokenizer_config.json` may name its special tokens as strings or as AddedToken objects.
fn token_name(v: Option<&Value>, default: &str) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string(),
        _ => default.to_string(),
    }
}

/// The first SentencePiece precompiled normalizer of a `normalizer` entry, if any.
fn precompiled(normalizer: &Value) -> Option<Value> {
    match normalizer.get("type").and_then(Value::as_str) {
        Some("Precompiled") => Some(normalizer.clone()),
        Some("Sequence") => normalizer
            .get("normalizers")?
            .as_array()?
            .iter()
            .find_map(precompiled),
        _ => None,
    }
}

impl PromptTokenizer {
    /// Loads `tokenizer.json` (its folder's `tokenizer_config.json`, when there, names the
    /// end and padding tokens) for sequences of `max_len` tokens.
    pub fn load(path: &Path, max_len: usize) -> Result<Self> {
        let bytes = crate::checkpoint::read_small(path)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| Error::checkpoint(path, "not UTF-8 text: not a tokenizer.json"))?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config: Value = if config_path.is_file() {
            crate::checkpoint::read_json(&config_path)?
        } else {
            Value::Null
        };
        let eos = token_name(config.get("eos_token"), "</s>");
        let pad = token_name(config.get("pad_token"), "<pad>");
        Self::from_json(&text, path, max_len, &eos, &pad)
    }

    /// As [`Self::load`] from the JSON text itself; `path` names it in errors.
    pub fn from_json(
        text: &str,
        path: &Path,
        max_len: usize,
        eos_token: &str,
        pad_token: &str,
    ) -> Result<Self> {
        if max_len == 0 {
            return Err(Error::invalid(
                "max_sequence_length",
                "must be at least 1 (room for </s>)",
            ));
        }
        let bad = |field: &str, msg: String| Error::config(path, field, msg);
        let mut doc: Value = serde_json::from_str(text)
            .map_err(|e| Error::checkpoint(path, format!("not a tokenizer.json: {e}")))?;
        if doc["model"]["type"] != "Unigram" {
            return Err(bad(
                "model.type",
                format!(
                    "{}: a T5 tokenizer is a SentencePiece Unigram model",
                    doc["model"]["type"]
                ),
            ));
        }
        doc["model"]["unk_id"] = json!(2);
        doc["model"]["byte_fallback"] = json!(false);
        doc["normalizer"] = precompiled(&doc["normalizer"]).unwrap_or(Value::Null);
        let metaspace = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
        doc["pre_tokenizer"] =
            json!({"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]});
        doc["decoder"] = metaspace;
        // Truncation and padding are applied by `encode`, the post-processor's `</s>` too.
        doc["post_processor"] = Value::Null;
        doc["truncation"] = Value::Null;
        doc["padding"] = Value::Null;
        let tokenizer: tokenizers::Tokenizer = serde_json::from_value(doc)
            .map_err(|e| Error::checkpoint(path, format!("tokenizer does not load: {e}")))?;
        let id = |field: &str, token: &str| {
            tokenizer
                .token_to_id(token)
                .ok_or_else(|| bad(field, format!("`{token}` is not in the vocabulary")))
        };
        let (eos, pad) = (id("eos_token", eos_token)?, id("pad_token", pad_token)?);
        Ok(PromptTokenizer {
            tokenizer,
            path: path.to_path_buf(),
            max_len,
            eos,
            pad,
        })
    }

    /// The sequence length every prompt is truncated or padded to.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// The pieces of a cleaned prompt, without `</s>`.
    fn pieces(&self, prompt: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(prompt_clean(prompt).as_str(), false)
            .map_err(|e| {
                Error::invalid(
                    "prompt",
                    format!("{} cannot tokenize it: {e}", self.path.display()),
                )
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids and attention masks of `prompts`, each exactly [`Self::max_len`] long:
    /// the pieces (cut after M − 1, as transformers truncates), `</s>`, padding.
    #[allow(clippy::type_complexity)]
    pub fn encode(&self, prompts: &[&str]) -> Result<(Vec<Vec<u32>>, Vec<Vec<u32>>)> {
        self.encode_to(prompts, self.max_len)
    }

    /// [`Self::encode`] to another length (a request's own `max_sequence_length`).
    #[allow(clippy::type_complexity)]
    pub fn encode_to(
        &self,
        prompts: &[&str],
        max_len: usize,
    ) -> Result<(Vec<Vec<u32>>, Vec<Vec<u32>>)> {
        if max_len == 0 {
            return Err(Error::invalid("max_sequence_length", "must be at least 1"));
        }
        let mut ids = Vec::with_capacity(prompts.len());
        let mut masks = Vec::with_capacity(prompts.len());
        for p in prompts {
            let mut row = self.pieces(p)?;
            row.truncate(max_len - 1);
            row.push(self.eos);
            let mut mask = vec![1; row.len()];
            row.resize(max_len, self.pad);
            mask.resize(max_len, 0);
            ids.push(row);
            masks.push(mask);
        }
        Ok((ids, masks))
    }

    /// Tokens of a prompt before truncation, its `</s>` included: the pipeline silently
    /// cuts a prompt at more than [`Self::max_len`].
    pub fn token_count(&self, prompt: &str) -> Result<usize> {
        Ok(self.pieces(prompt)?.len() + 1)
    }

    /// Whether the pipeline would cut `prompt`.
    pub fn truncates(&self, prompt: &str) -> Result<bool> {
        Ok(self.token_count(prompt)? > self.max_len)
    }

    /// Refuses prompts the pipeline would cut, naming the limit (for callers that would
    /// rather fail than condition on part of a prompt).
    pub fn check_fits(&self, prompts: &[&str]) -> Result<()> {
        for (i, p) in prompts.iter().enumerate() {
            let n = self.token_count(p)?;
            if n > self.max_len {
                return Err(Error::invalid(
                    "prompt",
                    format!(
                        "prompt {i} is {n} tokens (with its </s>), over the limit of {} \
                         (max_sequence_length); shorten it or raise the limit",
                        self.max_len
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::components::umt5::synth::synth_tokenizer_json;
    use std::str::FromStr;

    fn synth(max_len: usize) -> PromptTokenizer {
        PromptTokenizer::from_json(
            &synth_tokenizer_json(1),
            Path::new("synth/tokenizer.json"),
            max_len,
            "</s>",
            "<pad>",
        )
        .expect("synth tokenizer loads")
    }

    #[test]
    fn pads_truncates_and_appends_eos_like_the_crates_own_truncation() {
        let tok = synth(6);
        let prompts = [
            "a red fox",
            "the old man walks through the quiet forest",
            "",
        ];
        let (ids, masks) = tok.encode(&prompts).expect("encodes");
        assert_eq!(ids[2], vec![1, 0, 0, 0, 0, 0]);
        assert_eq!(masks[2], vec![1, 0, 0, 0, 0, 0]);
        assert!(!tok.truncates(prompts[0]).unwrap());
        assert!(tok.truncates(prompts[1]).unwrap());
        assert_eq!(ids[1][5], 1, "a cut prompt still ends in </s>");
        assert_eq!(masks[1], vec![1; 6]);
        let e = tok.check_fits(&prompts).unwrap_err().to_string();
        assert!(e.contains("prompt 1") && e.contains("limit of 6"), "{e}");

        // The crate's own truncation and padding (what transformers drives) agree.
        let mut reference =
            tokenizers::Tokenizer::from_str(&synth_tokenizer_json(1)).expect("loads");
        reference
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: 6,
                ..Default::default()
            }))
            .expect("truncation");
        reference.with_padding(Some(tokenizers::PaddingParams {
            strategy: tokenizers::PaddingStrategy::Fixed(6),
            pad_id: 0,
            pad_token: "<pad>".into(),
            ..Default::default()
        }));
        for (i, p) in prompts.iter().enumerate() {
            let enc = reference.encode(prompt_clean(p).as_str(), true).unwrap();
            assert_eq!(enc.get_ids(), ids[i].as_slice(), "{p}");
            assert_eq!(enc.get_attention_mask(), masks[i].as_slice(), "{p}");
        }
    }

    #[test]
    fn reads_an_older_layout_as_transformers_5_rebuilds_it() {
        // What older converters wrote for T5: Metaspace alone, Strip and Replace
        // normalizers, and no post-processor; transformers 5 keeps only the vocabulary.
        let mut doc: Value = serde_json::from_str(&synth_tokenizer_json(1)).unwrap();
        doc["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁",
                                      "prepend_scheme": "always", "split": true});
        doc["normalizer"] = json!({"type": "Sequence", "normalizers": [
            {"type": "Strip", "strip_left": false, "strip_right": true},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "▁"}]});
        doc["post_processor"] = Value::Null;
        doc["model"]["unk_id"] = json!(0);
        let old = PromptTokenizer::from_json(
            &doc.to_string(),
            Path::new("old/tokenizer.json"),
            12,
            "</s>",
            "<pad>",
        )
        .expect("older layout loads");
        let prompts = ["A red fox, in the snow!", "  spaced\tout  ", "qzx \u{e9}"];
        let (ids, masks) = old.encode(&prompts).unwrap();
        assert_eq!(synth(12).encode(&prompts).unwrap(), (ids.clone(), masks));
        assert!(
            ids[2].contains(&2),
            "unknown characters map to <unk> (id 2)"
        );
        assert!(
            ids.iter().all(|r| r.contains(&1)),
            "</s> without a post-processor"
        );
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let p = Path::new("tokenizer.json");
        let e = PromptTokenizer::from_json(&synth_tokenizer_json(0), p, 0, "</s>", "<pad>");
        assert!(e.is_err());
        let e = PromptTokenizer::from_json(&synth_tokenizer_json(0), p, 8, "</s>", "[PAD]")
            .err()
            .expect("unknown pad token")
            .to_string();
        assert!(e.contains("pad_token"), "{e}");
        let bpe = synth_tokenizer_json(0).replace("\"Unigram\"", "\"BPE\"");
        let e = PromptTokenizer::from_json(&bpe, p, 8, "</s>", "<pad>")
            .err()
            .expect("not unigram")
            .to_string();
        assert!(e.contains("model.type"), "{e}");
    }
}
