//! The step caches against diffusers' own hooks (`apply_first_block_cache`,
//! `apply_mag_cache`, `apply_taylorseer_cache`) on the committed tiny Wan 2.1 pipeline:
//! the same skip decision for every step and guidance row, final latents within Wan's
//! parity tolerance, guided and unguided; MagCache's calibration records the same ratios;
//! and the kinds a family cannot honour are refused by name.

mod common;

use common::cache::{check_case, run};
use common::{expect_err, read_safetensors};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::cache::StepCache;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::Strategy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Reference {
    desc: serde_json::Value,
    tensors: HashMap<String, Tensor>,
    init: Tensor,
}

fn reference() -> Reference {
    let desc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("wan21-tiny-cache-reference.json")).unwrap(),
    )
    .unwrap();
    let tensors = read_safetensors(&fixtures().join("wan21-tiny-cache-reference.safetensors"));
    let init = read_safetensors(&fixtures().join("wan21-tiny-reference.safetensors"))
        ["init_latents"]
        .clone();
    Reference {
        desc,
        tensors,
        init,
    }
}

fn request(r: &Reference, cache: Option<StepCache>, guidance: f32) -> Request {
    let d = &r.desc;
    let n = |k: &str| d[k].as_u64().unwrap() as usize;
    Request {
        steps: n("steps"),
        guidance,
        frames: n("frames"),
        max_sequence_length: n("max_sequence_length"),
        init_latents: Some(r.init.clone()),
        cache,
        ..Request::image(
            Condition::Prompt {
                prompt: d["prompt"].as_str().unwrap().into(),
                negative: Some(d["negative_prompt"].as_str().unwrap().into()),
            },
            n("width"),
            n("height"),
        )
    }
}

#[test]
fn each_cache_decides_and_ends_as_diffusers_hook_does() {
    let r = reference();
    let model = Model::open(&fixtures().join("wan21-tiny")).unwrap();
    let cases = r.desc["cases"].as_object().unwrap().clone();
    assert!(cases.len() >= 7, "the reference holds every case");
    let uncached = |g: f32| run(&model, vec![request(&r, None, g)], Strategy::Offload, 1).0;
    let plain = [uncached(5.0), uncached(1.0)];
    let mut skipped_somewhere = 0;
    for (name, case) in cases {
        let cache: StepCache = serde_json::from_value(case["cache"].clone()).unwrap();
        let guidance = case["guidance"].as_f64().unwrap() as f32;
        let (out, stats) = run(
            &model,
            vec![request(&r, Some(cache), guidance)],
            Strategy::OffloadSharded,
            2,
        );
        let plain = || plain[(guidance <= 1.0) as usize][0].latents.clone();
        let skipped = check_case(
            &name,
            name.starts_with("first_block"),
            &out[0],
            stats.blocks_saved,
            (2, 1e-3),
            &r.tensors,
            |t| t.clone(),
            plain,
        );
        skipped_somewhere += usize::from(skipped);
    }
    assert!(skipped_somewhere >= 5, "the cases exercise skipping");
}

#[test]
fn a_kind_the_family_cannot_honour_is_refused_by_name() {
    let r = reference();
    let model = Model::open(&fixtures().join("wan21-tiny")).unwrap();
    let sea = StepCache::parse("cache", "sea").unwrap();
    expect_err(
        model.validate(&request(&r, Some(sea), 5.0)),
        &["cache", "sea"],
    );
    let bad = StepCache::Mag {
        threshold: 0.06,
        max_skip_steps: 3,
        retention_ratio: 0.2,
        ratios: None,
        calibrate: false,
    };
    expect_err(
        model.validate(&request(&r, Some(bad), 5.0)),
        &["cache.ratios"],
    );
    let dir = tempfile::tempdir().unwrap();
    let dit = Model::open(&common::tiny(dir.path(), 2)).unwrap();
    let mut req = common::request(0, 2, 1.0);
    req.cache = Some(StepCache::parse("cache", "first_block").unwrap());
    expect_err(dit.validate(&req), &["cache", "first_block", "dit"]);
}
