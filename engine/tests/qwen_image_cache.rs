//! The step caches on Qwen-Image against diffusers' own hooks (`apply_first_block_cache`,
//! `apply_mag_cache`, `apply_taylorseer_cache` in lite mode) on the committed tiny pipeline
//! (`engine/parity/qwen_image_cache_reference.py`): the same skip decision at every step and
//! guidance row, final latents within Qwen-Image's parity tolerance, guided (true CFG with a
//! negative prompt) and unguided; MagCache's calibration records the same ratios; a step no
//! row computes saves its blocks under data parallelism too; SeaCache, which diffusers applies
//! to Cosmos3 only, is refused by name.

mod common;

use common::cache::{check_case, Reference};
use common::{expect_err, opts};

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::cache::StepCache;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::families::qwen_image::runtime::{pack, unpack};
use layerwise_engine::Strategy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn request(r: &Reference, name: &str, cache: Option<StepCache>) -> Request {
    let d = &r.desc;
    let n = |k: &str| d[k].as_u64().unwrap() as usize;
    // The pipeline's latents are packed 2×2 patches; requests give them as the VAE reads them.
    let init = unpack(
        &r.tensors[&format!("{name}.init")],
        n("height") / 8,
        n("width") / 8,
    )
    .unwrap();
    Request {
        steps: n("steps"),
        guidance: d["cases"][name]["guidance"].as_f64().unwrap() as f32,
        init_latents: Some(init),
        cache,
        ..Request::image(
            Condition::Prompt {
                prompt: d["prompt"].as_str().unwrap().into(),
                negative: d["negative_prompt"].as_str().map(Into::into),
            },
            n("width"),
            n("height"),
        )
    }
}

#[test]
fn each_cache_decides_and_ends_as_diffusers_hook_does() {
    let r = Reference::load("qwen-image-tiny-cache-reference");
    let model = Model::open(&fixtures().join("qwen-image-tiny")).unwrap();
    let cases = r.desc["cases"].as_object().unwrap().clone();
    assert!(cases.len() >= 7, "the reference holds every case");
    let mut skipped_somewhere = 0;
    for (i, name) in cases.keys().enumerate() {
        let cache = r.cache(name);
        let first_block = matches!(cache, StepCache::FirstBlock { .. });
        // Alternately one rank and two (each request on its own rank).
        let dp = 1 + i % 2;
        let (out, stats) = model
            .run(
                vec![request(&r, name, Some(cache))],
                &opts(Strategy::OffloadSharded, dp, 2, false),
            )
            .unwrap();
        let plain = || {
            let o = opts(Strategy::Offload, 1, 2, false);
            model.run(vec![request(&r, name, None)], &o).unwrap().0[0]
                .latents
                .clone()
        };
        let packed = |t: &Tensor| pack(t).unwrap();
        let skipped = check_case(
            name,
            first_block,
            &out[0],
            stats.blocks_saved,
            (2, 1e-4),
            &r.tensors,
            packed,
            plain,
        );
        skipped_somewhere += usize::from(skipped);
    }
    assert!(skipped_somewhere >= 6, "the cases exercise skipping");
}

#[test]
fn seacache_is_refused_by_name() {
    let r = Reference::load("qwen-image-tiny-cache-reference");
    let model = Model::open(&fixtures().join("qwen-image-tiny")).unwrap();
    let sea = StepCache::parse("cache", "sea").unwrap();
    let name = "mag_guided";
    expect_err(
        model.validate(&request(&r, name, Some(sea))),
        &["cache", "sea", "qwen-image"],
    );
    model
        .validate(&request(&r, name, Some(r.cache(name))))
        .unwrap();
}
