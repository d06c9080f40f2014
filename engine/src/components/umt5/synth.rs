//! A small, deterministic T5-style tokenizer for synthetic pipeline folders, written as the
//! `tokenizer.json` and `tokenizer_config.json` transformers' `T5Tokenizer` saves, so that
//! transformers' `AutoTokenizer` and the `tokenizers` crate both load it. Its vocabulary
//! size is [`SYNTH_VOCAB_SIZE`], the tiny encoder's (`Umt5Config::tiny()`).
//!
//! The pieces: `<pad>`=0, `</s>`=1, `<unk>`=2 (T5's ids), `▁`, every ASCII letter and digit
//! alone and after `▁`, common punctuation, a few English suffixes, and common prompt words.
//! Scores are log-probability-like (whole words beat spelling them out); the seed adds a
//! small deterministic jitter, so two seeds give two different (equally valid) tokenizers.

/// Pieces of the synthetic tokenizer, the three special tokens included.
pub const SYNTH_VOCAB_SIZE: usize = 256;

const SPECIAL: [&str; 3] = ["<pad>", "</s>", "<unk>"];
const PUNCTUATION: [&str; 11] = [".", ",", "!", "?", "'", "-", ":", ";", "(", ")", "\""];
const SUFFIXES: [&str; 24] = [
    "ing", "ed", "er", "ly", "es", "est", "tion", "ness", "th", "on", "an", "in", "re", "at", "en",
    "st", "ow", "ar", "ll", "ou", "ch", "sh", "ight", "le",
];
const WORDS: [&str; 93] = [
    "the",
    "and",
    "in",
    "of",
    "on",
    "at",
    "with",
    "an",
    "to",
    "is",
    "are",
    "by",
    "for",
    "from",
    "over",
    "under",
    "through",
    "into",
    "its",
    "her",
    "his",
    "their",
    "cat",
    "dog",
    "fox",
    "horse",
    "bird",
    "fish",
    "man",
    "woman",
    "girl",
    "boy",
    "child",
    "children",
    "city",
    "street",
    "forest",
    "snow",
    "rain",
    "sun",
    "moon",
    "sky",
    "sea",
    "river",
    "lake",
    "mountain",
    "tree",
    "flower",
    "field",
    "beach",
    "house",
    "car",
    "road",
    "night",
    "day",
    "light",
    "water",
    "fire",
    "red",
    "blue",
    "green",
    "white",
    "black",
    "yellow",
    "small",
    "big",
    "old",
    "young",
    "bright",
    "dark",
    "slow",
    "fast",
    "quiet",
    "walks",
    "runs",
    "flies",
    "sits",
    "plays",
    "looks",
    "camera",
    "video",
    "shot",
    "close",
    "up",
    "motion",
    "scene",
    "quality",
    "blurry",
    "low",
    "high",
    "static",
    "detailed",
    "cinematic",
];

/// splitmix64: a fixed, dependency-free stream for the score jitter.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The (piece, score) list, in id order.
fn vocab(seed: u64) -> Vec<(String, f64)> {
    let mut base: Vec<(String, f64)> = vec![("▁".into(), -3.0)];
    let letters = ('a'..='z').chain('A'..='Z').chain('0'..='9');
    base.extend(letters.clone().map(|c| (c.to_string(), -6.0)));
    base.extend(letters.map(|c| (format!("▁{c}"), -7.0)));
    base.extend(PUNCTUATION.iter().map(|p| (p.to_string(), -5.0)));
    base.extend(SUFFIXES.iter().map(|s| (s.to_string(), -7.5)));
    // Longer words a little less likely, as in a trained model.
    base.extend(
        WORDS
            .iter()
            .map(|w| (format!("▁{w}"), -8.0 - 0.1 * w.len() as f64)),
    );
    let mut v: Vec<(String, f64)> = SPECIAL.iter().map(|s| (s.to_string(), 0.0)).collect();
    v.extend(base.into_iter().enumerate().map(|(i, (piece, score))| {
        // Jitter in [0, 0.5), rounded to 4 decimals so the JSON stays short and exact.
        let jitter = (mix(seed ^ mix(i as u64)) >> 11) as f64 / (1u64 << 53) as f64 * 0.5;
        (piece, ((score - jitter) * 1e4).round() / 1e4)
    }));
    v
}

/// The `tokenizer.json` of the synthetic tokenizer for `seed`.
pub fn synth_tokenizer_json(seed: u64) -> String {
    use serde_json::json;
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let metaspace =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
    let seq = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
    let eos = json!({"SpecialToken": {"id": "</s>", "type_id": 0}});
    let vocab: Vec<serde_json::Value> = vocab(seed)
        .into_iter()
        .map(|(piece, score)| json!([piece, score]))
        .collect();
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": SPECIAL.iter().enumerate().map(|(i, s)| special(i, s)).collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [seq("A"), eos],
            "pair": [seq("A"), eos, seq("B"), eos],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}},
        },
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": 2, "vocab": vocab, "byte_fallback": false},
    });
    serde_json::to_string_pretty(&doc).expect("tokenizer JSON serialises")
}

/// The `tokenizer_config.json` that goes beside it (what transformers writes for a
/// `T5Tokenizer` without sentinel tokens).
pub fn synth_tokenizer_config() -> String {
    let doc = serde_json::json!({
        "backend": "tokenizers",
        "eos_token": "</s>",
        "extra_ids": 0,
        "extra_special_tokens": [],
        "model_max_length": 512,
        "pad_token": "<pad>",
        "tokenizer_class": "T5Tokenizer",
        "unk_token": "<unk>",
    });
    serde_json::to_string_pretty(&doc).expect("tokenizer config serialises")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn vocabulary_is_the_tiny_encoders_with_t5_special_ids() {
        let v = vocab(0);
        assert_eq!(v.len(), SYNTH_VOCAB_SIZE);
        assert_eq!(
            super::super::Umt5Config::tiny().vocab_size,
            SYNTH_VOCAB_SIZE
        );
        let names: Vec<&str> = v.iter().take(3).map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, SPECIAL);
        let unique: BTreeSet<&str> = v.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(unique.len(), v.len(), "duplicate pieces");
        assert!(v[3..].iter().all(|(_, s)| *s < 0.0 && *s > -20.0));
    }

    #[test]
    fn deterministic_per_seed() {
        assert_eq!(synth_tokenizer_json(7), synth_tokenizer_json(7));
        assert_ne!(synth_tokenizer_json(7), synth_tokenizer_json(8));
        let doc: serde_json::Value =
            serde_json::from_str(&synth_tokenizer_json(0)).expect("valid JSON");
        assert_eq!(doc["model"]["vocab"][1][0], "</s>");
        let cfg: serde_json::Value =
            serde_json::from_str(&synth_tokenizer_config()).expect("valid JSON");
        assert_eq!(cfg["tokenizer_class"], "T5Tokenizer");
    }

    /// The committed copy of seed 0's files, which `engine/parity/umt5_reference.py` loads
    /// with transformers (the parity test checks its ids). `LAYERWISE_BLESS=1` rewrites it.
    #[test]
    fn matches_the_committed_synth_tokenizer() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/umt5-tiny/synth-tokenizer");
        let files = [
            ("tokenizer.json", synth_tokenizer_json(0) + "\n"),
            ("tokenizer_config.json", synth_tokenizer_config() + "\n"),
        ];
        if std::env::var_os("LAYERWISE_BLESS").is_some() {
            std::fs::create_dir_all(&dir).expect("fixture folder");
            for (name, text) in &files {
                std::fs::write(dir.join(name), text).expect("write fixture");
            }
        }
        for (name, text) in &files {
            let committed = std::fs::read_to_string(dir.join(name))
                .unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()));
            assert!(
                committed == *text,
                "{name} drifted from synth_tokenizer_*(); rerun with LAYERWISE_BLESS=1 and \
                 regenerate the references with engine/parity/umt5_reference.py"
            );
        }
    }

    #[cfg(feature = "runtime")]
    #[test]
    fn round_trips_through_the_tokenizers_crate() {
        use std::str::FromStr;
        let tok = tokenizers::Tokenizer::from_str(&synth_tokenizer_json(3)).expect("loads");
        assert_eq!(tok.get_vocab_size(true), SYNTH_VOCAB_SIZE);
        let text = "A red fox walks through the snow, slowly.";
        let enc = tok.encode(text, true).expect("encodes");
        let ids = enc.get_ids();
        assert_eq!(ids.last(), Some(&1), "</s> appended");
        assert!(
            !ids.contains(&2),
            "no <unk> in plain ASCII: {:?}",
            enc.get_tokens()
        );
        assert!(enc.get_tokens().contains(&"▁fox".to_string()));
        let back = tok.decode(ids, true).expect("decodes");
        assert_eq!(back, text);
    }
}
