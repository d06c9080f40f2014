//! Parity of the UMT5 text encoder and the prompt tokenizer with transformers, as diffusers'
//! `WanPipeline` calls them. The fixture `tests/fixtures/umt5-tiny` is written by
//! `engine/parity/umt5_reference.py` (transformers' own `save_pretrained` of a trained
//! tokenizer and a tiny random `UMT5EncoderModel`, once as one f32 file and once in bf16
//! shards, with the ids, masks and hidden states transformers computes).
#![cfg(feature = "runtime")]

mod common;

use common::max_abs;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use layerwise_engine::checkpoint::{Component, Mapped};
use layerwise_engine::components::umt5::model::{relative_position_bucket, zero_padding};
use layerwise_engine::components::umt5::{
    embedding_table, prompt_clean, PromptTokenizer, Umt5Config, Umt5Encoder, FINAL_NORM,
};
use layerwise_engine::execution::weights;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/umt5-tiny")
}

fn reference_json() -> Value {
    let path = fixture().join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference.json")
}

fn prompts(r: &Value) -> Vec<String> {
    r["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p.as_str().expect("prompt").to_string())
        .collect()
}

/// The reference tensors: int64 ids/masks as rows of u32, hidden states as f32 tensors.
struct Reference {
    rows: HashMap<String, Vec<Vec<u32>>>,
    tensors: HashMap<String, Tensor>,
}

fn reference() -> Reference {
    let path = fixture().join("reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("reference.safetensors");
    let mut r = Reference {
        rows: HashMap::new(),
        tensors: HashMap::new(),
    };
    for (name, view) in st.tensors() {
        match view.dtype() {
            Dtype::I64 => {
                let cols = view.shape()[1];
                let v: Vec<u32> = view
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
                    .collect();
                r.rows
                    .insert(name, v.chunks(cols).map(<[u32]>::to_vec).collect());
            }
            Dtype::F32 => {
                let v: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                let t = Tensor::from_vec(v, view.shape(), &Device::Cpu).expect("tensor");
                r.tensors.insert(name, t);
            }
            other => panic!("{name}: unexpected {other:?}"),
        }
    }
    r
}

/// (max |ours − theirs|, that over max |theirs|).
fn error(ours: &Tensor, theirs: &Tensor) -> (f32, f32) {
    assert_eq!(ours.dims(), theirs.dims());
    let d = max_abs(&(ours - theirs).expect("diff"));
    (d, d / max_abs(theirs))
}

/// Runs a text encoder folder on `ids`/`mask` the way the pipeline streams it.
fn encode(dir: &Path, ids: &[Vec<u32>], mask: &[Vec<u32>]) -> Tensor {
    let cfg = Umt5Config::load(&dir.join("config.json")).expect("config");
    let component = Component::open(dir).expect("component");
    cfg.check(&component).expect("tensors match the config");
    let table = embedding_table(&component).expect("embedding table");
    let mapped = Mapped::map(component).expect("map");
    let dev = Device::Cpu;
    let resident = weights::load(
        &mapped,
        [FINAL_NORM.to_string()].into_iter(),
        &dev,
        candle_core::DType::F32,
    )
    .expect("resident");
    let encoder = Umt5Encoder::new(cfg.clone(), &resident).expect("encoder");
    let embeddings = Umt5Encoder::embed(&mapped, table, ids, &dev).expect("embed");
    let mut st = encoder.prologue(embeddings, mask).expect("prologue");
    let group = cfg.block_group();
    for i in 0..group.count {
        let prefix = group.block_prefix(i);
        let names = group.block.iter().map(|s| format!("{prefix}{}", s.name));
        let block: HashMap<String, Tensor> =
            weights::load(&mapped, names, &dev, candle_core::DType::F32)
                .expect("block weights")
                .into_iter()
                .map(|(n, t)| (n[prefix.len()..].to_string(), t))
                .collect();
        encoder.block(i, &block, &mut st).expect("block");
    }
    encoder.epilogue(st).expect("epilogue")
}

#[test]
fn tokenizer_matches_transformers() {
    let r = reference_json();
    let max_len = r["max_length"].as_u64().expect("max_length") as usize;
    let tok = PromptTokenizer::load(&fixture().join("tokenizer/tokenizer.json"), max_len)
        .expect("tokenizer");
    let prompts = prompts(&r);
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let (ids, mask) = tok.encode(&refs).expect("encode");
    let reference = reference();
    assert_eq!(ids, reference.rows["input_ids"]);
    assert_eq!(mask, reference.rows["attention_mask"]);
    for (p, n) in refs
        .iter()
        .zip(r["untruncated_lengths"].as_array().expect("lengths"))
    {
        let n = n.as_u64().expect("length") as usize;
        assert_eq!(tok.token_count(p).expect("count"), n, "{p:?}");
        assert_eq!(tok.truncates(p).expect("truncates"), n > max_len, "{p:?}");
    }
    assert!(
        refs.iter().any(|p| tok.truncates(p).unwrap()),
        "a prompt exercises truncation"
    );
    let e = tok.check_fits(&refs).unwrap_err().to_string();
    assert!(e.contains(&format!("limit of {max_len}")), "{e}");
}

#[test]
fn synthetic_tokenizer_reads_as_transformers_reads_it() {
    let r = reference_json();
    let synth = &r["synth_tokenizer"];
    assert_eq!(synth["class"], "T5Tokenizer");
    let max_len = r["max_length"].as_u64().expect("max_length") as usize;
    let tok = PromptTokenizer::load(&fixture().join("synth-tokenizer/tokenizer.json"), max_len)
        .expect("synth tokenizer");
    let prompts = prompts(&r);
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let (ids, _) = tok.encode(&refs).expect("encode");
    let theirs: Vec<Vec<u32>> =
        serde_json::from_value(synth["input_ids"].clone()).expect("synth ids");
    assert_eq!(ids, theirs);
    let counts: Vec<usize> = refs.iter().map(|p| tok.token_count(p).unwrap()).collect();
    let theirs: Vec<usize> =
        serde_json::from_value(synth["untruncated_lengths"].clone()).expect("lengths");
    assert_eq!(counts, theirs);
}

#[test]
fn prompt_clean_matches_diffusers() {
    let r = reference_json();
    for case in r["clean"].as_array().expect("clean cases") {
        let (raw, clean) = (case[0].as_str().unwrap(), case[1].as_str().unwrap());
        assert_eq!(prompt_clean(raw), clean, "prompt_clean({raw:?})");
    }
}

#[test]
fn position_buckets_match_transformers() {
    let r = reference_json();
    let b = &r["buckets"];
    let from = b["from"].as_i64().expect("from");
    let cfg = Umt5Config::tiny();
    for (i, want) in b["bucket"].as_array().expect("buckets").iter().enumerate() {
        let rel = from + i as i64;
        let want = want.as_u64().expect("bucket") as usize;
        assert_eq!(relative_position_bucket(&cfg, rel), want, "offset {rel}");
    }
}

#[test]
fn fixture_config_is_the_tiny_preset_and_to_json_writes_its_fields() {
    let path = fixture().join("text_encoder/config.json");
    let cfg = Umt5Config::load(&path).expect("config");
    let tiny = Umt5Config::tiny();
    let shape = |c: &Umt5Config| {
        (
            c.vocab_size,
            c.d_model,
            c.d_kv,
            c.d_ff,
            c.num_layers,
            c.num_heads,
            c.relative_attention_num_buckets,
            c.relative_attention_max_distance,
            c.feed_forward_proj.clone(),
        )
    };
    assert_eq!(
        shape(&cfg),
        shape(&tiny),
        "umt5_reference.py drifted from tiny()"
    );
    assert_eq!(cfg.layer_norm_epsilon, tiny.layer_norm_epsilon);
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ours = tiny.to_json();
    for key in written.as_object().expect("object").keys() {
        assert!(ours.get(key).is_some(), "to_json() lacks `{key}`");
    }
}

#[test]
fn encoder_matches_transformers() {
    let r = reference();
    let (ids, mask) = (&r.rows["input_ids"], &r.rows["attention_mask"]);
    let ours = encode(&fixture().join("text_encoder"), ids, mask);
    let (abs, rel) = error(&ours, &r.tensors["last_hidden_state"]);
    println!("f32 encoder: max |diff| {abs:.3e}, relative {rel:.3e}");
    assert!(rel < 1e-4, "max |diff| {abs}, relative {rel}");
    let (abs, rel) = error(
        &zero_padding(&ours, mask).unwrap(),
        &r.tensors["prompt_embeds"],
    );
    println!("prompt_embeds (pipeline masking): max |diff| {abs:.3e}, relative {rel:.3e}");
    assert!(rel < 1e-4, "max |diff| {abs}, relative {rel}");
}

#[test]
fn sharded_bf16_encoder_matches_transformers() {
    let dir = fixture().join("text_encoder_sharded_bf16");
    let component = Component::open(&dir).expect("sharded component");
    assert!(component.files.len() > 1, "the fixture is sharded");
    let r = reference();
    let ours = encode(&dir, &r.rows["input_ids"], &r.rows["attention_mask"]);
    let (abs, rel) = error(&ours, &r.tensors["last_hidden_state_bf16"]);
    println!("bf16 sharded encoder: max |diff| {abs:.3e}, relative {rel:.3e}");
    assert!(rel < 1e-4, "max |diff| {abs}, relative {rel}");
}

#[test]
fn check_refuses_a_config_the_weights_disagree_with() {
    let dir = fixture().join("text_encoder");
    let component = Component::open(&dir).expect("component");
    let cfg = Umt5Config::load(&dir.join("config.json")).expect("config");
    let e = Umt5Config {
        d_ff: 48,
        ..cfg.clone()
    }
    .check(&component)
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("DenseReluDense.wi_0.weight") && e.contains("[64, 32]"),
        "{e}"
    );
    let e = Umt5Config {
        num_layers: 3,
        ..cfg.clone()
    }
    .check(&component)
    .unwrap_err()
    .to_string();
    assert!(e.contains("num_layers"), "{e}");
    let e = Umt5Encoder::embed(
        &Mapped::map(component).unwrap(),
        "shared.weight",
        &[vec![cfg.vocab_size as u32]],
        &Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("input_ids"), "{e}");
}
