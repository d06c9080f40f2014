//! The step caches on Cosmos3 against diffusers' own hooks on the committed tiny pipeline
//! (`engine/parity/cosmos3_cache_reference.py`): SeaCache (`enable_cache(SeaCacheConfig)`,
//! at both residual orders), First-Block Cache and MagCache (diffusers' hooks with their
//! stream lookups read through the block registry's names, without which they fail on
//! Cosmos3), MagCache's calibration, and TaylorSeer in lite mode: the same skip decision at
//! every step and guidance row, final latents within Cosmos3's parity tolerance, guided and
//! unguided, for an image and a video; SeaCache under data and sequence parallelism; a step
//! SeaCache skips copies none of the generation pathway's blocks; bad settings are refused
//! naming the parameter.

mod common;

use common::cache::{bytes_per_step, check_case, decisions, run, Reference};
use common::{expect_err, opts, rel_err};

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::cache::StepCache;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::Strategy;

const STEM: &str = "cosmos3-tiny-cache-reference";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn request(r: &Reference, name: &str, cache: Option<StepCache>) -> Request {
    let case = &r.desc["cases"][name];
    let q = &case["request"];
    let n = |k: &str| q[k].as_u64().unwrap() as usize;
    Request {
        steps: r.desc["steps"].as_u64().unwrap() as usize,
        guidance: case["guidance"].as_f64().unwrap() as f32,
        frames: n("frames"),
        init_latents: Some(r.tensors[&format!("{name}.init")].clone()),
        cache,
        ..Request::image(
            Condition::Prompt {
                prompt: q["prompt"].as_str().unwrap().into(),
                negative: q["negative_prompt"].as_str().map(Into::into),
            },
            n("width"),
            n("height"),
        )
    }
}

fn model() -> Model {
    Model::open(&fixtures().join("cosmos3-tiny")).unwrap()
}

#[test]
fn each_cache_decides_and_ends_as_diffusers_hook_does() {
    let r = Reference::load(STEM);
    let model = model();
    let cases = r.desc["cases"].as_object().unwrap().clone();
    assert!(cases.len() >= 12, "the reference holds every case");
    let layers = 2u64;
    let mut skipped_somewhere = 0;
    for name in cases.keys() {
        let cache = r.cache(name);
        let first_block = matches!(cache, StepCache::FirstBlock { .. });
        let (out, stats) = run(
            &model,
            vec![request(&r, name, Some(cache))],
            Strategy::OffloadSharded,
            2,
        );
        let plain = || {
            let (plain, _) = run(&model, vec![request(&r, name, None)], Strategy::Offload, 1);
            plain[0].latents.clone()
        };
        let same = |t: &Tensor| t.clone();
        let skipped = check_case(
            name,
            first_block,
            &out[0],
            stats.blocks_saved,
            (layers, 1e-4),
            &r.tensors,
            same,
            plain,
        );
        skipped_somewhere += usize::from(skipped);
    }
    assert!(skipped_somewhere >= 11, "the cases exercise skipping");
}

#[test]
fn seacache_decides_the_same_under_data_and_sequence_parallelism() {
    let r = Reference::load(STEM);
    let model = model();
    let name = "video_guided";
    let want = decisions(&r.tensors[&format!("{name}.computed")]);
    let reference = &r.tensors[&format!("{name}.latents")];
    // Two requests on two ranks, one under SeaCache and one not; then the cached one's
    // sequence split over two ranks.
    let reqs = vec![
        request(&r, name, Some(r.cache(name))),
        request(&r, name, None),
    ];
    let (out, _) = run(&model, reqs, Strategy::OffloadSharded, 2);
    assert_eq!(out[0].cache.as_ref().unwrap().computed, want);
    assert!(out[1].cache.is_none());
    assert!(rel_err(&out[0].latents, reference) <= 1e-4);
    let mut o = opts(Strategy::OffloadSharded, 1, 2, false);
    o.sp = 2;
    let (split, _) = model
        .run(vec![request(&r, name, Some(r.cache(name)))], &o)
        .unwrap();
    assert_eq!(split[0].cache.as_ref().unwrap().computed, want);
    let e = rel_err(&split[0].latents, reference);
    assert!(e <= 1e-4, "sp 2: latents {e}");
}

#[test]
fn a_step_seacache_skips_on_every_rank_is_neither_copied_nor_gathered() {
    let r = Reference::load(STEM);
    let model = model();
    // Two video requests whose caches skip on different steps (residual order 1 and 0).
    let names = ["video_guided", "video_order0_guided"];
    let steps = r.desc["steps"].as_u64().unwrap() as usize;
    let computed: Vec<Vec<Vec<bool>>> = names
        .iter()
        .map(|n| decisions(&r.tensors[&format!("{n}.computed")]))
        .collect();
    assert_ne!(
        computed[0], computed[1],
        "the requests skip on different steps"
    );
    let layers = 2u64;
    for strategy in Strategy::ALL {
        for dp in 1..=2 {
            let o = opts(strategy, dp, 2, false);
            let reqs = |cached: bool, s: usize| -> Vec<Request> {
                names[..dp]
                    .iter()
                    .map(|n| Request {
                        steps: s,
                        ..request(&r, n, cached.then(|| r.cache(n)))
                    })
                    .collect()
            };
            let (a, b) = (
                model.run(reqs(false, steps), &o).unwrap().1,
                model.run(reqs(false, steps + 1), &o).unwrap().1,
            );
            let (fixed, step) = bytes_per_step(&a, &b, steps);
            let (outs, stats) = model.run(reqs(true, steps), &o).unwrap();
            let union = (0..steps)
                .filter(|&j| computed[..dp].iter().any(|c| c[j].iter().any(|&x| x)))
                .count() as u64;
            let what = format!("{strategy} dp={dp}: {union} of {steps} steps computed");
            for (out, want) in outs.iter().zip(&computed) {
                assert_eq!(&out.cache.as_ref().unwrap().computed, want, "{what}");
            }
            assert!(union < steps as u64, "{what}: some step is skipped by all");
            // SeaCache decides a step from the latents the step before leaves, so the
            // prefetch during that step guesses that the next one computes: what it issued
            // for a step that then skips (at most the K = 2 slots' worth per rank) is dropped, and
            // was counted when it moved. Each generation block moves the same bytes.
            let skipped = steps as u64 - union;
            let dropped = stats.blocks_dropped;
            assert!(
                dropped <= 2 * dp as u64 * skipped,
                "{what}: {dropped} dropped"
            );
            // A block every rank dropped moved once over the pod (the step's bytes are the
            // pod's).
            assert_eq!(dropped % dp as u64, 0, "{what}: the ranks drop in step");
            let dropped = dropped / dp as u64;
            let block = (step.0 / layers, step.1 / layers);
            eprintln!("{what}: {dropped} blocks dropped, step {step:?}");
            assert_eq!(
                stats.bytes_copied,
                fixed.0 + union * step.0 + dropped * block.0,
                "copied, {what}"
            );
            assert_eq!(
                stats.bytes_gathered,
                fixed.1 + union * step.1 + dropped * block.1,
                "gathered, {what}"
            );
        }
    }
}

#[test]
fn bad_seacache_settings_are_refused_naming_the_parameter() {
    let r = Reference::load(STEM);
    let model = model();
    let name = "video_guided";
    let ask = |c: &str| {
        model.validate(&request(
            &r,
            name,
            Some(
                StepCache::parse("cache", c)
                    .map_err(|e| e.to_string())
                    .unwrap(),
            ),
        ))
    };
    for kind in ["sea", "first_block", "taylorseer"] {
        ask(kind).unwrap();
    }
    for bad in [
        r#"{"kind":"sea","residual_order":2}"#,
        r#"{"kind":"sea","power_exp":0}"#,
        r#"{"kind":"sea","threshold":-0.1}"#,
    ] {
        let field = bad.split('"').nth(5).unwrap();
        expect_err(StepCache::parse("cache", bad), &[&format!("cache.{field}")]);
    }
}
