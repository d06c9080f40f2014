//! A synthesized Qwen2 tokenizer folder (byte-level, no merges, Qwen's special tokens and
//! its ChatML template) for fixtures and `synth`: what Qwen-Image's and Cosmos3's tiny
//! pipelines tokenize with, so tests never download a vocabulary.

use serde_json::Value;

/// The token after which generation tokens follow (Cosmos3 ends its prompt with it).
pub const VISION_START: &str = "<|vision_start|>";

/// Qwen's special tokens, in the order a synthesized tokenizer numbers them after the bytes.
const SYNTH_SPECIAL: [&str; 5] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    VISION_START,
    "<|vision_end|>",
];

/// Qwen's ChatML for text-only messages (a system message first when there is one, each
/// message, the assistant's opening), as synthesized folders carry it.
pub const SYNTH_CHAT_TEMPLATE: &str = "{%- if messages[0].role == 'system' -%}{%- if messages[0].content is string -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}{%- endif -%}{%- endif -%}{%- for message in messages -%}{%- if message.role != 'system' or not loop.first -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// Tokens of a synthesized tokenizer: the 256 byte-level symbols and Qwen's special tokens.
pub const SYNTH_VOCAB: usize = 256 + SYNTH_SPECIAL.len();

/// A byte-level BPE tokenizer with no merges (every byte one token) and Qwen's special
/// tokens: `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.
pub fn synth_tokenizer_files() -> [(&'static str, String); 3] {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let mut symbols: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    symbols.sort_unstable();
    let vocab: serde_json::Map<String, Value> = symbols
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), Value::from(i)))
        .collect();
    let added: Vec<Value> = SYNTH_SPECIAL
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    let doc = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []},
    });
    let config = serde_json::json!({
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": null,
        "unk_token": null,
    });
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON serialises") + "\n";
    [
        ("tokenizer.json", pretty(&doc)),
        ("tokenizer_config.json", pretty(&config)),
        ("chat_template.jinja", SYNTH_CHAT_TEMPLATE.to_string()),
    ]
}
