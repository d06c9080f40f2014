//! Parity of the Qwen2.5-VL text encoder and the Qwen-Image prompt with diffusers'
//! `QwenImagePipeline._get_qwen_prompt_embeds`. The fixture `tests/fixtures/qwen2_5_vl-tiny`
//! is written by `engine/parity/qwen2_5_vl_reference.py`: a trained byte-level BPE tokenizer
//! (as transformers saves it, and as the published folder holds one: vocab.json +
//! merges.txt), a tiny random `Qwen2_5_VLForConditionalGeneration` (as transformers 5.24
//! saves it, f32, `model.` names and a nested `text_config`; and in bf16 with the flat
//! config and `model.language_model.` names), and the pipeline's ids and prompt embeddings.
#![cfg(feature = "runtime")]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{read_safetensors, rel_err};
use layerwise_engine::checkpoint::{Component, Mapped};
use layerwise_engine::components::qwen2_5_vl::prompt::{drop_template, MAX_TOKENS, TEMPLATE_DROP};
use layerwise_engine::components::qwen2_5_vl::{
    Qwen25VlConfig, Qwen25VlEncoder, QwenTokenizer, TensorPrefix,
};
use layerwise_engine::execution::weights;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen2_5_vl-tiny")
}

fn reference_json() -> Value {
    let path = fixture().join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference.json")
}

fn prompts() -> Vec<String> {
    reference_json()["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p.as_str().expect("prompt").to_string())
        .collect()
}

fn reference() -> HashMap<String, Tensor> {
    read_safetensors(&fixture().join("reference.safetensors"))
}

/// The reference ids of prompt `i` (stored int64, read back as f32: exact at this vocab).
fn reference_ids(r: &HashMap<String, Tensor>, i: usize) -> Vec<u32> {
    let v: Vec<f32> = r[&format!("input_ids_{i}")]
        .flatten_all()
        .expect("flat")
        .to_vec1()
        .expect("ids");
    v.into_iter().map(|x| x as u32).collect()
}

/// A text encoder folder, checked and mapped, ready to run prompts the way the pipeline
/// streams them.
struct Folder {
    cfg: Qwen25VlConfig,
    prefix: TensorPrefix,
    mapped: Mapped,
    encoder: Qwen25VlEncoder,
}

impl Folder {
    fn open(dir: &Path) -> Folder {
        let cfg = Qwen25VlConfig::load(&dir.join("config.json")).expect("config");
        let component = Component::open(dir).expect("component");
        let prefix = cfg.check(&component).expect("tensors match the config");
        let mapped = Mapped::map(component).expect("map");
        let names = cfg.resident_specs(prefix).into_iter().map(|s| s.name);
        let resident = weights::load(&mapped, names, &Device::Cpu, DType::F32).expect("resident");
        let encoder = Qwen25VlEncoder::new(cfg.clone(), prefix, &resident).expect("encoder");
        Folder {
            cfg,
            prefix,
            mapped,
            encoder,
        }
    }

    /// The encoder's output [1, T, D] for `ids`.
    fn encode(&self, ids: &[u32]) -> Tensor {
        let dev = Device::Cpu;
        let embeddings =
            Qwen25VlEncoder::embed(&self.mapped, self.prefix, ids, &dev).expect("embed");
        let mut st = self.encoder.prologue(embeddings).expect("prologue");
        let group = self.cfg.block_group(self.prefix);
        for i in 0..group.count {
            let prefix = group.block_prefix(i);
            let names = group.block.iter().map(|s| format!("{prefix}{}", s.name));
            let block: HashMap<String, Tensor> =
                weights::load(&self.mapped, names, &dev, DType::F32)
                    .expect("block weights")
                    .into_iter()
                    .map(|(n, t)| (n[prefix.len()..].to_string(), t))
                    .collect();
            self.encoder.block(i, &block, &mut st).expect("block");
        }
        self.encoder.epilogue(st).expect("epilogue")
    }
}

#[test]
fn tokenizer_matches_transformers_from_either_folder_layout() {
    let r = reference();
    let meta = reference_json();
    assert_eq!(meta["drop"], TEMPLATE_DROP);
    assert_eq!(meta["max_length"], MAX_TOKENS);
    let lengths = meta["untruncated_lengths"].as_array().expect("lengths");
    for dir in ["tokenizer", "tokenizer_legacy"] {
        let tok = QwenTokenizer::load(&fixture().join(dir)).expect("tokenizer");
        for (i, prompt) in prompts().iter().enumerate() {
            let ids = tok.ids(prompt, "prompt").expect("ids");
            assert_eq!(ids, reference_ids(&r, i), "{dir}: prompt {i}");
            let n = tok.token_count(prompt).expect("count");
            assert_eq!(Some(n as u64), lengths[i].as_u64(), "{dir}: prompt {i}");
        }
        assert_eq!(tok.token_id("<|im_end|>"), Some(2));
        assert_eq!(tok.token_id("<|endoftext|>"), Some(0));
    }
}

#[test]
fn encoder_matches_transformers() {
    let r = reference();
    let folder = Folder::open(&fixture().join("text_encoder"));
    assert_eq!(folder.prefix, TensorPrefix::Model);
    let mut worst = 0f32;
    for i in 0..prompts().len() {
        let hidden = folder.encode(&reference_ids(&r, i));
        let ours = drop_template(&hidden).expect("drop");
        let theirs = &r[&format!("prompt_embeds_{i}")];
        assert_eq!(ours.dims(), theirs.dims(), "prompt {i}");
        let e = rel_err(&ours, theirs);
        println!(
            "f32 prompt {i} ({} rows): max |diff| / max |ref| {e:.3e}",
            ours.dim(1).unwrap()
        );
        worst = worst.max(e);
    }
    assert!(worst <= 1e-4, "relative error {worst:.3e}");
}

#[test]
fn bf16_published_layout_matches_transformers() {
    let r = reference();
    let folder = Folder::open(&fixture().join("text_encoder_bf16"));
    assert_eq!(folder.prefix, TensorPrefix::LanguageModel);
    let f32_cfg = Qwen25VlConfig::load(&fixture().join("text_encoder/config.json")).expect("cfg");
    assert_eq!(
        folder.cfg, f32_cfg,
        "the flat and nested layouts read alike"
    );
    let mut worst = 0f32;
    for i in 0..prompts().len() {
        let hidden = folder.encode(&reference_ids(&r, i));
        let ours = drop_template(&hidden).expect("drop");
        let e = rel_err(&ours, &r[&format!("prompt_embeds_bf16_{i}")]);
        println!("bf16 prompt {i}: max |diff| / max |ref| {e:.3e}");
        worst = worst.max(e);
    }
    assert!(worst <= 1e-4, "relative error {worst:.3e}");
}

#[test]
fn check_refuses_a_config_the_weights_disagree_with() {
    let dir = fixture().join("text_encoder");
    let component = Component::open(&dir).expect("component");
    let cfg = Qwen25VlConfig::load(&dir.join("config.json")).expect("config");
    let deeper = Qwen25VlConfig {
        num_hidden_layers: 3,
        ..cfg.clone()
    };
    let e = deeper.check(&component).unwrap_err().to_string();
    assert!(e.contains("num_hidden_layers"), "{e}");
    let wider = Qwen25VlConfig {
        intermediate_size: 48,
        ..cfg
    };
    let e = wider.check(&component).unwrap_err().to_string();
    assert!(e.contains("mlp.gate_proj.weight"), "{e}");
}
