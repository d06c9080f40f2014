//! Parity of the VAE decoder with diffusers' AutoencoderKL. The folders compared against
//! are written by `engine/parity/vae_reference.py` (diffusers' own `save_pretrained`, plus
//! latents and diffusers' decoded output): the committed tiny fixture always, and a
//! folder named by `LAYERWISE_VAE_REFERENCE` (e.g. the full-size sd VAE) when set.
#![cfg(feature = "runtime")]

mod common;

use common::{max_abs, read_safetensors};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use layerwise_engine::components::autoencoder_kl::decoder::VaeDecoder;
use layerwise_engine::components::autoencoder_kl::VaeConfig;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vae-tiny")
}

/// Decodes the folder's latents with the Rust decoder and returns (max |diff|, max |sample|).
fn compare(dir: &Path) -> (f32, f32) {
    let cfg = VaeConfig::load(&dir.join("config.json")).unwrap();
    let weights = read_safetensors(&dir.join("diffusion_pytorch_model.safetensors"));
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let vae = VaeDecoder::load_from(&cfg, &weights, dir).unwrap();
    let ours = vae.decode(&reference["latents"]).unwrap();
    let theirs = &reference["sample"];
    assert_eq!(ours.dims(), theirs.dims());
    (max_abs(&(&ours - theirs).unwrap()), max_abs(theirs))
}

#[test]
fn fixture_is_the_tiny_preset_with_diffusers_names_and_shapes() {
    let cfg = VaeConfig::load(&fixture().join("config.json")).unwrap();
    assert_eq!(
        cfg,
        VaeConfig::tiny(),
        "vae_reference.py's tiny preset drifted from VaeConfig::tiny()"
    );
    let stored: BTreeMap<String, Vec<usize>> =
        read_safetensors(&fixture().join("diffusion_pytorch_model.safetensors"))
            .into_iter()
            .map(|(name, t)| (name, t.dims().to_vec()))
            .collect();
    let expected: BTreeMap<String, Vec<usize>> = cfg
        .tensor_specs()
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect();
    assert_eq!(stored, expected);
}

#[test]
fn decoder_matches_diffusers_on_the_tiny_fixture() {
    let (diff, scale) = compare(&fixture());
    println!("vae-tiny parity: max |ours - diffusers| = {diff:.3e} (max |sample| = {scale:.3})");
    assert!(diff < 1e-4, "max abs diff {diff}");
}

#[test]
fn decoder_matches_diffusers_on_a_given_reference() {
    let Ok(dir) = std::env::var("LAYERWISE_VAE_REFERENCE") else {
        println!("skipped: set LAYERWISE_VAE_REFERENCE to a folder written by engine/parity/vae_reference.py");
        return;
    };
    let (diff, scale) = compare(Path::new(&dir));
    println!("{dir} parity: max |ours - diffusers| = {diff:.3e} (max |sample| = {scale:.3})");
    // Deep f32 convolution stacks drift with size; hold the error to float noise relative
    // to the output's scale.
    assert!(diff <= 1e-4 * scale.max(1.0), "max abs diff {diff}");
}
