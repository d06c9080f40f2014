//! Parity of the Qwen-Image transformer with diffusers' `QwenImageTransformer2DModel`. The
//! fixture `tests/fixtures/qwen-image-transformer-tiny/` is written by
//! `engine/parity/qwen_image_transformer_reference.py` (diffusers' own `save_pretrained`,
//! with every parameter perturbed, plus per case packed latents, timestep, prompt
//! embeddings and diffusers' output; `reference.json` names each case's grid); a folder
//! named by `LAYERWISE_QWEN_IMAGE_TRANSFORMER_REFERENCE` that the script wrote (another
//! seed) is compared too when set.
#![cfg(feature = "runtime")]

mod common;

use common::{max_abs, read_safetensors};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use layerwise_engine::checkpoint::check::check_tensors;
use layerwise_engine::checkpoint::{Component, Mapped};
use layerwise_engine::execution::weights;
use layerwise_engine::families::qwen_image::transformer::model::QwenImageTransformer;
use layerwise_engine::families::qwen_image::transformer::QwenImageTransformerConfig;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen-image-transformer-tiny")
}

/// One forward the script ran, as `reference.json` lists it.
#[derive(serde::Deserialize)]
struct Case {
    name: String,
    grid: [usize; 3],
    text_tokens: usize,
}

#[derive(serde::Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

/// Runs every case of the folder through prologue, every block (each with its own
/// weights, prefix stripped, as a streamed slot hands them over) and epilogue, and returns
/// per case (name, max |ours - diffusers|, max |diffusers|).
fn compare(dir: &Path) -> Vec<(String, f32, f32)> {
    let cfg = QwenImageTransformerConfig::load(&dir.join("config.json")).unwrap();
    let component = Component::open(dir).unwrap();
    check_tensors(&component, &cfg.all_specs(), |_| None).unwrap();
    let mapped = Mapped::map(component).unwrap();
    let resident_names = cfg.resident_specs().into_iter().map(|s| s.name);
    let resident = weights::load(&mapped, resident_names, &Device::Cpu, DType::F32).unwrap();
    let group = cfg.block_group();
    let blocks: Vec<HashMap<String, Tensor>> = (0..group.count)
        .map(|i| {
            let prefix = group.block_prefix(i);
            let full = group.block.iter().map(|s| format!("{prefix}{}", s.name));
            weights::load(&mapped, full, &Device::Cpu, DType::F32)
                .unwrap()
                .into_iter()
                .map(|(name, t)| (name[prefix.len()..].to_string(), t))
                .collect()
        })
        .collect();

    let listing: Reference =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    assert!(!listing.cases.is_empty());
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let model = QwenImageTransformer::new(cfg, Box::new(resident));
    listing
        .cases
        .iter()
        .map(|case| {
            let get = |what: &str| &reference[&format!("{}.{what}", case.name)];
            let t: Vec<f32> = get("timestep").to_vec1().unwrap();
            let text = get("text");
            assert_eq!(text.dim(1).unwrap(), case.text_tokens);
            let [f, h, w] = case.grid;
            let mut st = model
                .prologue(get("latents"), t[0], text, (f, h, w))
                .unwrap();
            for (i, w) in blocks.iter().enumerate() {
                model.block(i, w, &mut st).unwrap();
            }
            let ours = model.epilogue(st).unwrap();
            let theirs = get("sample");
            assert_eq!(ours.dims(), theirs.dims(), "{}", case.name);
            let diff = max_abs(&(&ours - theirs).unwrap());
            (case.name.clone(), diff, max_abs(theirs))
        })
        .collect()
}

fn assert_close(dir: &Path) {
    for (name, diff, scale) in compare(dir) {
        println!(
            "{} {name}: max |ours - diffusers| = {diff:.3e}, max |ref| = {scale:.3}, relative {:.3e}",
            dir.display(),
            diff / scale
        );
        assert!(
            diff / scale <= 1e-4,
            "{name}: relative max abs diff {}",
            diff / scale
        );
    }
}

#[test]
fn fixture_is_the_tiny_preset() {
    let cfg = QwenImageTransformerConfig::load(&fixture().join("config.json")).unwrap();
    assert_eq!(
        cfg,
        QwenImageTransformerConfig::tiny(),
        "qwen_image_transformer_reference.py's tiny config drifted from QwenImageTransformerConfig::tiny()"
    );
    // And the config this crate writes for it is the one diffusers wrote.
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg.to_json(), written);
}

#[test]
fn specs_are_the_saved_tensors_exactly() {
    let cfg = QwenImageTransformerConfig::tiny();
    let component = Component::open(&fixture()).unwrap();
    check_tensors(&component, &cfg.all_specs(), |_| None).unwrap();
    // Names and shapes, one by one, both ways.
    let stored: HashMap<String, Vec<usize>> = component
        .files
        .iter()
        .flat_map(|h| &h.tensors)
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let specs: HashMap<String, Vec<usize>> = cfg
        .all_specs()
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect();
    assert_eq!(stored, specs);
}

#[test]
fn specs_refuse_the_fixture_under_another_config() {
    let component = Component::open(&fixture()).unwrap();
    let tiny = QwenImageTransformerConfig::tiny();
    // A wider text encoder than stored: txt_norm and txt_in are misshapen.
    let wide = QwenImageTransformerConfig {
        joint_attention_dim: 32,
        ..tiny.clone()
    };
    let e = check_tensors(&component, &wide.all_specs(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("txt_"), "{e}");
    // A third block the checkpoint does not have.
    let deeper = QwenImageTransformerConfig {
        num_layers: 3,
        ..tiny
    };
    let e = check_tensors(&component, &deeper.all_specs(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("transformer_blocks.2."), "{e}");
}

#[test]
fn transformer_matches_diffusers_on_the_tiny_fixture() {
    assert_close(&fixture());
}

#[test]
fn transformer_matches_diffusers_on_a_given_reference() {
    let Ok(dir) = std::env::var("LAYERWISE_QWEN_IMAGE_TRANSFORMER_REFERENCE") else {
        println!("skipped: set LAYERWISE_QWEN_IMAGE_TRANSFORMER_REFERENCE to a folder written by engine/parity/qwen_image_transformer_reference.py");
        return;
    };
    assert_close(Path::new(&dir));
}
