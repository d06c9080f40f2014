//! Shared fixtures: tiny checkpoints made by the project's own `synth`.

#![allow(dead_code)]

pub mod cache;
pub mod process;
pub mod server;

use std::path::{Path, PathBuf};

use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::tools::synth::{synth, SynthOptions};

/// A tiny DiT pipeline folder with `layers` blocks, written under `dir`.
pub fn tiny(dir: &Path, layers: usize) -> PathBuf {
    tiny_with(dir, layers, |_| {})
}

pub fn tiny_with(dir: &Path, layers: usize, edit: impl FnOnce(&mut SynthOptions)) -> PathBuf {
    let out = dir.join(format!("tiny-{layers}"));
    let mut o = SynthOptions::preset("tiny").unwrap();
    o.set_layers(layers);
    o.seed = 7;
    edit(&mut o);
    synth(&out, &o).unwrap();
    out
}

/// A tiny two-expert Wan 2.2 pipeline folder with `layers` blocks per expert and
/// `text_layers` text-encoder blocks, written under `dir`.
pub fn wan_tiny(dir: &Path, layers: usize, text_layers: usize) -> PathBuf {
    let out = dir.join(format!("wan-{layers}-{text_layers}"));
    let mut o = SynthOptions::preset("wan-tiny").unwrap();
    o.set_layers(layers);
    if let Some(w) = o.model_mut::<layerwise_engine::families::wan::synth::WanSynth>() {
        w.text_encoder.num_layers = text_layers;
    }
    o.seed = 11;
    synth(&out, &o).unwrap();
    out
}

/// A tiny Cosmos3 pipeline folder with `layers` layers (each two streamed blocks, one per
/// pathway), written under `dir`.
#[allow(dead_code)]
pub fn cosmos3_tiny(dir: &Path, layers: usize) -> PathBuf {
    let out = dir.join(format!("cosmos3-{layers}"));
    let mut o = SynthOptions::preset("cosmos3-tiny").unwrap();
    o.set_layers(layers);
    o.seed = 13;
    synth(&out, &o).unwrap();
    out
}

/// A tiny Qwen-Image pipeline folder with `layers` transformer blocks, written under `dir`.
#[allow(dead_code)]
pub fn qwen_image_tiny(dir: &Path, layers: usize) -> PathBuf {
    let out = dir.join(format!("qwen-image-{layers}"));
    let mut o = SynthOptions::preset("qwen-image-tiny").unwrap();
    o.set_layers(layers);
    o.seed = 17;
    synth(&out, &o).unwrap();
    out
}

/// A request for the tiny model (64 × 64 px).
pub fn request(seed: u64, steps: usize, guidance: f32) -> Request {
    Request {
        seed,
        steps,
        guidance,
        ..Request::image(Condition::Class((seed % 1000) as u32), 64, 64)
    }
}

pub fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|f| f.to_bits())
        .collect()
}

/// A seeded random delay on copies and gathers, so the streams interleave differently.
pub fn jitter(seed: u64) -> layerwise_engine::execution::pipeline::Hook {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use layerwise_engine::execution::pipeline::Stage;
    let state = std::sync::Arc::new(AtomicU64::new(seed));
    std::sync::Arc::new(move |stage: Stage| {
        let x = state.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let max_us = if stage == Stage::Copy { 1500 } else { 800 };
        std::thread::sleep(Duration::from_micros((x >> 33) % max_us));
    })
}

/// Every tensor of a safetensors fixture (F32, or I64 ids) as an f32 CPU tensor.
pub fn read_safetensors(path: &Path) -> std::collections::HashMap<String, candle_core::Tensor> {
    use candle_core::{DType, Device, Tensor};
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let dtype = match v.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::I64 => DType::I64,
                other => panic!("{name} in {}: {other:?}", path.display()),
            };
            let t = Tensor::from_raw_buffer(v.data(), dtype, v.shape(), &Device::Cpu).unwrap();
            (name, t.to_dtype(DType::F32).unwrap())
        })
        .collect()
}

/// The largest magnitude in a tensor.
pub fn max_abs(t: &candle_core::Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// `codec,width,height,frames` of the first video stream of the MP4 at `path`, as `ffprobe`
/// (Debian's ffmpeg; scripts/test installs it) reads and counts them.
pub fn ffprobe(path: &Path) -> String {
    let out = std::process::Command::new("ffprobe")
        .args(["-v", "error", "-select_streams", "v:0", "-count_frames"])
        .args([
            "-show_entries",
            "stream=codec_name,width,height,nb_read_frames",
        ])
        .args(["-of", "csv=p=0"])
        .arg(path)
        .output()
        .expect("ffprobe runs (scripts/test installs ffmpeg when it is missing)");
    assert!(
        out.status.success(),
        "ffprobe {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Max |ours − theirs| / max |theirs|, `ours` reshaped to `theirs`'s shape (the families'
/// parity tests).
#[allow(dead_code)]
pub fn rel_err(ours: &candle_core::Tensor, theirs: &candle_core::Tensor) -> f32 {
    let ours = ours.reshape(theirs.dims()).unwrap();
    max_abs(&(ours - theirs).unwrap()) / max_abs(theirs).max(1e-12)
}

/// Engine options for `strategy` at dp and K slots, decoding or not, with a 120 s stall limit.
#[allow(dead_code)]
pub fn opts(
    strategy: layerwise_engine::Strategy,
    dp: usize,
    slots: usize,
    decode: bool,
) -> layerwise_engine::execution::rank::EngineOptions {
    layerwise_engine::execution::rank::EngineOptions {
        strategy,
        dp,
        slots: layerwise_engine::contract::SlotsChoice::Fixed(slots),
        decode,
        timeout: std::time::Duration::from_secs(120),
        ..layerwise_engine::execution::rank::EngineOptions::default()
    }
}

/// Panics unless `r` failed with an error naming every one of `parts`.
#[allow(dead_code)]
pub fn expect_err(r: Result<impl Sized, layerwise_engine::Error>, parts: &[&str]) {
    let e = match r {
        Ok(_) => panic!("accepted; expected an error naming {parts:?}"),
        Err(e) => e.to_string(),
    };
    for p in parts {
        assert!(e.contains(p), "`{e}` does not name {p}");
    }
}
