//! Parity of the Wan VAE decoder with diffusers' `AutoencoderKLWan`, and the checkpoint
//! checks, on folders written by `engine/parity/wan_vae_reference.py` (diffusers' own
//! `save_pretrained`, plus latents and the video WanPipeline's decode path made of them):
//! the committed tiny fixtures always (Wan 2.1's and Wan 2.2's residual, patchified VAE),
//! and a folder named by `LAYERWISE_WAN_VAE_REFERENCE` (e.g. full-size shapes) when set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::decoder::WanVaeDecoder;
use super::WanVaeConfig;
use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{Component, Mapped};
use crate::decode::{DecodeSetting, Tile};
use crate::execution::weights;
use crate::testing::max_abs_diff;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture() -> PathBuf {
    fixtures().join("wan-vae-tiny")
}

fn fixture22() -> PathBuf {
    fixtures().join("wan22-vae-tiny")
}

/// The decoder as the engine loads it: headers, mapping, the decoder's tensors as f32.
fn load(dir: &Path) -> (WanVaeConfig, WanVaeDecoder) {
    let cfg = WanVaeConfig::load(&dir.join("config.json")).unwrap();
    let component = Component::open(dir).unwrap();
    check_tensors(&component, &cfg.tensor_specs(), |_| None).unwrap();
    let mapped = Mapped::map(component).unwrap();
    let names = cfg.decoder_specs().into_iter().map(|s| s.name);
    let w = weights::load(&mapped, names, &Device::Cpu, candle_core::DType::F32).unwrap();
    let vae = WanVaeDecoder::load_from(&cfg, &w, dir).unwrap();
    (cfg, vae)
}

fn reference(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap()
}

/// One clip of a reference folder against our decoder.
struct Case {
    t: usize,
    /// max |ours - diffusers| decoding the clip whole, and chunk by chunk.
    whole: f32,
    chunked: f32,
    /// max |diffusers|.
    scale: f32,
}

impl Case {
    fn print(&self, label: &str) {
        let Case {
            t,
            whole,
            chunked,
            scale,
        } = *self;
        println!(
            "{label} T={t}: max |ours - diffusers| = {whole:.3e} whole, {chunked:.3e} chunked \
             (max |video| = {scale:.3}, relative {:.3e})",
            whole.max(chunked) / scale
        );
    }

    fn worst(&self) -> f32 {
        self.whole.max(self.chunked)
    }
}

/// Decodes every `latents_T` of the folder, whole and through `decode_chunks`.
fn compare(dir: &Path) -> Vec<Case> {
    let (_, vae) = load(dir);
    let refs = reference(dir);
    let mut lengths: Vec<usize> = refs
        .keys()
        .filter_map(|k| k.strip_prefix("latents_")?.parse().ok())
        .collect();
    lengths.sort_unstable();
    assert!(!lengths.is_empty(), "no latents_T in {}", dir.display());
    lengths
        .into_iter()
        .map(|t| {
            let latents = &refs[&format!("latents_{t}")];
            // diffusers' [1, C, T, H, W] as the decoder's [T, C, H, W].
            let theirs = refs[&format!("video_{t}")]
                .squeeze(0)
                .unwrap()
                .permute((1, 0, 2, 3))
                .unwrap();
            let ours = vae.decode(latents).unwrap();
            assert_eq!(ours.dims(), theirs.dims(), "T={t}");
            assert_eq!(ours.dim(0).unwrap(), vae.output_frames(t));
            // The streamed chunks: one frame, then temporal_upscale per latent frame.
            let mut chunks = Vec::new();
            vae.decode_chunks(latents, |c| {
                chunks.push(c);
                Ok(())
            })
            .unwrap();
            let frames: Vec<usize> = chunks.iter().map(|c| c.dim(0).unwrap()).collect();
            let mut expected = vec![vae.temporal_upscale(); t];
            expected[0] = 1;
            assert_eq!(frames, expected, "T={t}");
            let chunked = Tensor::cat(&chunks, 0).unwrap();
            let scale = max_abs_diff(&theirs, &theirs.zeros_like().unwrap());
            Case {
                t,
                whole: max_abs_diff(&ours, &theirs),
                chunked: max_abs_diff(&chunked, &theirs),
                scale,
            }
        })
        .collect()
}

/// The exact check: the folder's config is `preset`, written as `to_json` writes it, and
/// its checkpoint holds every name and shape of `tensor_specs`, nothing else.
fn check_fixture(dir: &Path, preset: WanVaeConfig) {
    let cfg = WanVaeConfig::load(&dir.join("config.json")).unwrap();
    assert_eq!(
        cfg,
        preset,
        "{}: wan_vae_reference.py's preset drifted from WanVaeConfig's",
        dir.display()
    );
    let component = Component::open(dir).unwrap();
    check_tensors(&component, &cfg.tensor_specs(), |_| None).unwrap();
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let theirs: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(cfg.to_json(), theirs);
}

/// The committed fixture's clips 1 and 3 within float rounding of diffusers'.
fn check_parity(dir: &Path, label: &str) {
    let results = compare(dir);
    assert_eq!(results.iter().map(|r| r.t).collect::<Vec<_>>(), vec![1, 3]);
    for case in results {
        case.print(label);
        let t = case.t;
        assert!(case.scale > 0.1, "a flat reference proves nothing (T={t})");
        assert!(case.worst() < 1e-4, "T={t}: max abs diff {}", case.worst());
    }
}

#[test]
fn fixture_is_the_tiny_preset_and_holds_exactly_its_tensors() {
    check_fixture(&fixture(), WanVaeConfig::tiny());
}

#[test]
fn wan22_fixture_is_the_tiny22_preset_and_holds_exactly_its_tensors() {
    check_fixture(&fixture22(), WanVaeConfig::tiny22());
}

#[test]
fn decoder_matches_diffusers_on_the_tiny_fixture() {
    check_parity(&fixture(), "wan-vae-tiny");
}

#[test]
fn residual_decoder_matches_diffusers_on_the_wan22_tiny_fixture() {
    check_parity(&fixture22(), "wan22-vae-tiny");
}

/// diffusers' tiled decode (`enable_tiling` at the tile and stride the file names) of the
/// folder's `tiled-reference.safetensors` against ours at the same tile, one latent frame a
/// chunk and two: the max abs diff of the worse.
fn tiled_parity(dir: &Path, label: &str) -> f32 {
    let (_, vae) = load(dir);
    let refs: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("tiled-reference.safetensors"), &Device::Cpu)
            .unwrap();
    let tile: Vec<f32> = refs["tile"].to_vec1().unwrap();
    let tile = Tile {
        size: tile[0] as u64,
        stride: tile[1] as u64,
    };
    let theirs = refs["video"]
        .squeeze(0)
        .unwrap()
        .permute((1, 0, 2, 3))
        .unwrap();
    let (_, _, h, w) = theirs.dims4().unwrap();
    assert!(
        h > tile.size as usize || w > tile.size as usize,
        "{label}: the frame must span several tiles"
    );
    let untiled = vae.decode(&refs["latents"]).unwrap();
    let seams = max_abs_diff(&untiled, &theirs);
    assert!(
        seams > 1e-2,
        "{label}: tiling changed nothing ({seams}), so proves nothing"
    );
    let mut worst = 0f32;
    for chunk in [1, 2] {
        let setting = DecodeSetting {
            chunk,
            tile: Some(tile),
        };
        let mut parts = Vec::new();
        vae.decode_chunks_with(&refs["latents"], &setting, |c| {
            parts.push(c);
            Ok(())
        })
        .unwrap();
        let ours = Tensor::cat(&parts, 0).unwrap();
        assert_eq!(ours.dims(), theirs.dims(), "{label}");
        let diff = max_abs_diff(&ours, &theirs);
        println!(
            "{label} tiled {}/{} chunk {chunk}: max |ours - diffusers| = {diff:.3e} \
             (untiled differs by {seams:.3})",
            tile.size, tile.stride
        );
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn tiled_decode_matches_diffusers_enable_tiling_on_the_tiny_fixtures() {
    for (dir, label) in [(fixture(), "wan-vae-tiny"), (fixture22(), "wan22-vae-tiny")] {
        let diff = tiled_parity(&dir, label);
        assert!(diff < 1e-4, "{label}: max abs diff {diff}");
    }
}

#[test]
fn chunks_of_several_latent_frames_decode_what_diffusers_decodes_frame_by_frame() {
    for dir in [fixture(), fixture22()] {
        let (_, vae) = load(&dir);
        let refs = reference(&dir);
        let theirs = refs["video_3"]
            .squeeze(0)
            .unwrap()
            .permute((1, 0, 2, 3))
            .unwrap();
        for chunk in [2, 5] {
            let mut sizes = Vec::new();
            let mut parts = Vec::new();
            let setting = DecodeSetting { chunk, tile: None };
            vae.decode_chunks_with(&refs["latents_3"], &setting, |c| {
                sizes.push(c.dim(0)?);
                parts.push(c);
                Ok(())
            })
            .unwrap();
            // The first latent frame alone, then the other two together.
            assert_eq!(sizes, vec![1, 8], "{}", dir.display());
            let diff = max_abs_diff(&Tensor::cat(&parts, 0).unwrap(), &theirs);
            assert!(diff < 1e-4, "{} chunk {chunk}: {diff}", dir.display());
        }
    }
}

#[test]
fn decoder_matches_diffusers_on_a_given_reference() {
    let Ok(dir) = std::env::var("LAYERWISE_WAN_VAE_REFERENCE") else {
        println!(
            "skipped: set LAYERWISE_WAN_VAE_REFERENCE to a folder written by \
             engine/parity/wan_vae_reference.py"
        );
        return;
    };
    for case in compare(Path::new(&dir)) {
        case.print(&dir);
        // The product's tolerance on [-1, 1] frames: 2/255.
        let diff = case.worst();
        assert!(diff < 2.0 / 255.0, "T={}: max abs diff {diff}", case.t);
    }
}

/// The tiny fixture's weights with `edit` applied, written as a component folder in a
/// tempdir.
fn edited_checkpoint(edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> tempfile::TempDir {
    edited(&fixture(), edit)
}

/// `fixture`'s weights with `edit` applied, written as a component folder in a tempdir.
fn edited(fixture: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> tempfile::TempDir {
    let mut tensors = candle_core::safetensors::load(
        fixture.join("diffusion_pytorch_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture.join("config.json"), dir.path().join("config.json")).unwrap();
    candle_core::safetensors::save(
        &tensors,
        dir.path().join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    dir
}

fn check_error(dir: &Path) -> String {
    let cfg = WanVaeConfig::load(&dir.join("config.json")).unwrap();
    let component = Component::open(dir).unwrap();
    check_tensors(&component, &cfg.tensor_specs(), |_| None)
        .expect_err("the spec check must refuse this checkpoint")
        .to_string()
}

#[test]
fn a_checkpoint_missing_a_decoder_tensor_is_refused_by_name() {
    let name = "decoder.up_blocks.0.upsamplers.0.time_conv.weight";
    let dir = edited_checkpoint(|t| {
        t.remove(name).unwrap();
    });
    let err = check_error(dir.path());
    assert!(err.contains(name) && err.contains("missing"), "{err}");
}

#[test]
fn a_misshapen_decoder_tensor_is_refused_by_name() {
    let name = "decoder.mid_block.attentions.0.norm.gamma";
    let dir = edited_checkpoint(|t| {
        // Right element count, wrong rank: the video norm's shape, not the image norm's.
        t.insert(
            name.into(),
            Tensor::ones((3, 1, 1, 1), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let err = check_error(dir.path());
    assert!(err.contains(name) && err.contains("[3, 1, 1]"), "{err}");
}

#[test]
fn an_extra_tensor_is_refused_by_name() {
    let dir = edited_checkpoint(|t| {
        let extra = t["decoder.conv_out.bias"].clone();
        t.insert("decoder.conv_out2.bias".into(), extra);
    });
    let err = check_error(dir.path());
    assert!(err.contains("decoder.conv_out2.bias"), "{err}");
}

#[test]
fn the_residual_checkpoint_is_checked_by_name_and_shape() {
    // The residual decoder's resampler is `upsampler`, not Wan 2.1's `upsamplers.0`.
    let name = "decoder.up_blocks.0.upsampler.time_conv.weight";
    let dir = edited(&fixture22(), |t| {
        t.remove(name).unwrap();
    });
    let err = check_error(dir.path());
    assert!(err.contains(name) && err.contains("missing"), "{err}");
    // A Wan 2.1-style resampler that halves the width, and a head of 3 channels where it
    // makes 2×2 patches of RGB (12): each refused with the shape it implies.
    for (name, shape, want) in [
        (
            "decoder.up_blocks.1.upsampler.resample.1.weight",
            &[1usize, 3, 3, 3][..],
            "[3, 3, 3, 3]",
        ),
        (
            "decoder.conv_out.weight",
            &[3, 3, 3, 3, 3],
            "[12, 3, 3, 3, 3]",
        ),
    ] {
        let dir = edited(&fixture22(), |t| {
            t.insert(
                name.into(),
                Tensor::ones(shape, candle_core::DType::F32, &Device::Cpu).unwrap(),
            );
        });
        let err = check_error(dir.path());
        assert!(err.contains(name) && err.contains(want), "{err}");
    }
}

/// The end of the committed WanPipeline reference (`wan_reference.py fixture`): its final
/// latents, decoded by the pipeline's own VAE and post-processed to [F, H, W, 3] in [0, 1].
#[test]
fn decodes_the_wan21_pipeline_fixtures_final_latents_to_its_frames() {
    let fixtures = fixtures();
    let (_, vae) = load(&fixtures.join("wan21-tiny/vae"));
    let refs = candle_core::safetensors::load(
        fixtures.join("wan21-tiny-reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let video = vae.decode(&refs["latents"]).unwrap();
    // VideoProcessor.postprocess_video: (x / 2 + 0.5).clamp(0, 1), channels last.
    let frames = video
        .affine(0.5, 0.5)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap()
        .permute((0, 2, 3, 1))
        .unwrap();
    let theirs = &refs["frames"];
    assert_eq!(frames.dims(), theirs.dims());
    let diff = max_abs_diff(&frames, theirs);
    println!(
        "wan21-tiny frames: max |ours - diffusers| = {diff:.3e} ({:.4}/255)",
        diff * 255.0
    );
    assert!(diff < 1e-4, "max abs diff {diff}");
}
