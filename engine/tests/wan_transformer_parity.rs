//! Parity of the Wan transformer with diffusers' `WanTransformer3DModel`. The fixture
//! `tests/fixtures/wan-transformer-tiny/` is written by
//! `engine/parity/wan_transformer_reference.py` (diffusers' own `save_pretrained`, with
//! every parameter perturbed, plus latents, timestep, text embeddings and diffusers'
//! output); a folder named by `LAYERWISE_WAN_TRANSFORMER_REFERENCE` that the script wrote
//! (other sizes, other seeds) is compared too when set.
#![cfg(feature = "runtime")]

mod common;

use common::{max_abs, read_safetensors};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use layerwise_engine::checkpoint::check::check_tensors;
use layerwise_engine::checkpoint::{Component, Mapped};
use layerwise_engine::execution::seq::Split;
use layerwise_engine::execution::weights;
use layerwise_engine::families::wan::transformer::model::WanTransformer;
use layerwise_engine::families::wan::transformer::WanTransformerConfig;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan-transformer-tiny")
}

/// Runs the folder's reference inputs through prologue, every block (each with its
/// own weights, prefix stripped, as a streamed slot hands them over) and epilogue, and
/// returns (max |ours - diffusers|, max |diffusers|).
fn compare(dir: &Path) -> (f32, f32) {
    let cfg = WanTransformerConfig::load(&dir.join("config.json")).unwrap();
    let component = Component::open(dir).unwrap();
    check_tensors(&component, &cfg.all_specs(), |_| None).unwrap();
    let mapped = Mapped::map(component).unwrap();
    let resident_names = cfg.resident_specs().into_iter().map(|s| s.name);
    let resident = weights::load(
        &mapped,
        resident_names,
        &Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    let group = cfg.block_group();
    let blocks: Vec<HashMap<String, Tensor>> = (0..group.count)
        .map(|i| {
            let prefix = group.block_prefix(i);
            let full = group.block.iter().map(|s| format!("{prefix}{}", s.name));
            weights::load(&mapped, full, &Device::Cpu, candle_core::DType::F32)
                .unwrap()
                .into_iter()
                .map(|(name, t)| (name[prefix.len()..].to_string(), t))
                .collect()
        })
        .collect();

    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let t: Vec<f32> = reference["timestep"].to_vec1().unwrap();

    let model = WanTransformer::new(cfg, Box::new(resident));
    let whole = &mut Split::whole();
    let mut st = model
        .prologue(&reference["latents"], t[0], &reference["text"], whole)
        .unwrap();
    for (i, w) in blocks.iter().enumerate() {
        model.block(i, w, &mut st, whole).unwrap();
    }
    let ours = model.epilogue(st, whole).unwrap();
    let theirs = &reference["sample"];
    assert_eq!(ours.dims(), theirs.dims());
    (max_abs(&(&ours - theirs).unwrap()), max_abs(theirs))
}

#[test]
fn fixture_is_the_tiny_preset() {
    let cfg = WanTransformerConfig::load(&fixture().join("config.json")).unwrap();
    assert_eq!(
        cfg,
        WanTransformerConfig::tiny(),
        "wan_transformer_reference.py's tiny config drifted from WanTransformerConfig::tiny()"
    );
    // And the config this crate writes for it is the one diffusers wrote.
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg.to_json(), written);
}

#[test]
fn transformer_matches_diffusers_on_the_tiny_fixture() {
    let (diff, scale) = compare(&fixture());
    println!(
        "wan-transformer-tiny parity: max |ours - diffusers| = {diff:.3e}, max |ref| = {scale:.3}, relative {:.3e}",
        diff / scale
    );
    assert!(
        diff / scale < 1e-4,
        "relative max abs diff {}",
        diff / scale
    );
}

#[test]
fn transformer_matches_diffusers_on_a_given_reference() {
    let Ok(dir) = std::env::var("LAYERWISE_WAN_TRANSFORMER_REFERENCE") else {
        println!("skipped: set LAYERWISE_WAN_TRANSFORMER_REFERENCE to a folder written by engine/parity/wan_transformer_reference.py");
        return;
    };
    let (diff, scale) = compare(Path::new(&dir));
    println!(
        "{dir} parity: max |ours - diffusers| = {diff:.3e}, relative {:.3e}",
        diff / scale
    );
    assert!(
        diff / scale < 1e-4,
        "relative max abs diff {}",
        diff / scale
    );
}

#[test]
fn specs_refuse_the_fixture_under_another_config() {
    let component = Component::open(&fixture()).unwrap();
    let tiny = WanTransformerConfig::tiny();
    // Without the cross-attention norm, the stored norm2 tensors are extra.
    let plain = WanTransformerConfig {
        cross_attn_norm: false,
        ..tiny.clone()
    };
    let e = check_tensors(&component, &plain.all_specs(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("norm2"), "{e}");
    // A wider FFN than stored: the first block's FFN weight is misshapen.
    let wide = WanTransformerConfig {
        ffn_dim: 48,
        ..tiny.clone()
    };
    let e = check_tensors(&component, &wide.all_specs(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ffn.net.0.proj"), "{e}");
    // A third block the checkpoint does not have.
    let deeper = WanTransformerConfig {
        num_layers: 3,
        ..tiny
    };
    let e = check_tensors(&component, &deeper.all_specs(), |_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("blocks.2."), "{e}");
}
