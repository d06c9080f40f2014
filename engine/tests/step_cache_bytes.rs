//! Skipped work moves no bytes: under every strategy and dp 1–3, with requests whose step
//! caches skip on different steps, every pass that some rank computes moves what an
//! uncached pass moves, a pass none computes moves nothing, and each request's output is
//! bit-identical to the same request run alone (cached requests beside uncached ones
//! included). First-Block Cache, which decides after block 0, votes across the ranks.

mod common;

use common::cache::bytes_per_step;
use common::{bits, opts, wan_tiny};

use layerwise_engine::cache::StepCache;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::Strategy;

fn req(seed: u64, steps: usize, guidance: f32, cache: Option<StepCache>) -> Request {
    Request {
        seed,
        steps,
        guidance,
        frames: 5,
        max_sequence_length: 16,
        cache,
        ..Request::image(
            Condition::Prompt {
                prompt: format!("a red fox {seed}"),
                negative: Some("blurry".into()),
            },
            32,
            32,
        )
    }
}

/// TaylorSeer computing in its first `before` steps, then every third.
fn taylor(before: usize) -> Option<StepCache> {
    Some(StepCache::Taylorseer {
        cache_interval: 3,
        disable_cache_before_step: before,
        disable_cache_after_step: None,
        max_order: 1,
    })
}

#[test]
fn a_step_no_rank_computes_is_neither_copied_nor_gathered() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan_tiny(dir.path(), 3, 2)).unwrap();
    let steps = 7;
    for strategy in Strategy::ALL {
        for dp in 1..=3 {
            let o = opts(strategy, dp, 2, false);
            // The unit: one uncached request per rank, at `steps` and one step more.
            let unit = |s: usize| {
                let reqs = (0..dp).map(|r| req(r as u64, s, 4.0, None)).collect();
                model.run(reqs, &o).unwrap().1
            };
            let (fixed, step) = bytes_per_step(&unit(steps), &unit(steps + 1), steps);
            // Rank r's request warms up r + 1 steps: the ranks skip on different steps.
            let reqs: Vec<Request> = (0..dp)
                .map(|r| req(r as u64, steps, 4.0, taylor(r + 1)))
                .collect();
            let (outs, stats) = model.run(reqs.clone(), &o).unwrap();
            let computed = |j: usize| {
                outs.iter()
                    .any(|o| o.cache.as_ref().unwrap().computed[j].iter().any(|&c| c))
            };
            let union = (0..steps).filter(|&j| computed(j)).count() as u64;
            let what = format!("{strategy} dp={dp}: {union} of {steps} steps computed");
            assert_eq!(
                stats.bytes_copied,
                fixed.0 + union * step.0,
                "copied, {what}"
            );
            assert_eq!(
                stats.bytes_gathered,
                fixed.1 + union * step.1,
                "gathered, {what}"
            );
            assert_eq!(stats.blocks_dropped, 0, "{what}");
            if dp == 1 {
                assert!(union < steps as u64, "{what}: the schedule skips");
            }
            let skipped: u64 = outs
                .iter()
                .map(|o| {
                    let c = &o.cache.as_ref().unwrap().computed;
                    c.iter().filter(|row| row.iter().all(|&x| !x)).count() as u64
                })
                .sum();
            assert_eq!(stats.blocks_saved, skipped * 3, "blocks saved, {what}");
            for (r, out) in reqs.into_iter().zip(&outs) {
                let alone = model
                    .run(vec![r], &opts(Strategy::Offload, 1, 2, false))
                    .unwrap()
                    .0;
                assert_eq!(bits(&out.latents), bits(&alone[0].latents), "{what}");
            }
        }
    }
}

#[test]
fn cached_and_uncached_requests_share_a_pod_and_each_ends_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan_tiny(dir.path(), 3, 2)).unwrap();
    let fbc = |t: f64| Some(StepCache::FirstBlock { threshold: t });
    let mag = Some(StepCache::Mag {
        threshold: 0.06,
        max_skip_steps: 3,
        retention_ratio: 0.2,
        ratios: Some(vec![1.0, 1.01, 1.0, 0.99, 1.0, 1.0]),
        calibrate: false,
    });
    // Different steps and guidance, so the ranks also switch experts at different passes.
    let reqs = vec![
        req(1, 6, 4.0, fbc(0.2)),
        req(2, 5, 1.0, None),
        req(3, 6, 3.0, mag),
        req(4, 4, 4.0, fbc(0.5)),
        req(5, 6, 4.0, taylor(2)),
    ];
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let out = model
                .run(vec![r.clone()], &opts(Strategy::Offload, 1, 2, false))
                .unwrap()
                .0;
            bits(&out[0].latents)
        })
        .collect();
    for strategy in [
        Strategy::OffloadSharded,
        Strategy::Sharded,
        Strategy::Offload,
    ] {
        for dp in 1..=3 {
            for k in [2, 3] {
                let (outs, stats) = model
                    .run(reqs.clone(), &opts(strategy, dp, k, false))
                    .unwrap();
                let got: Vec<Vec<u32>> = outs.iter().map(|o| bits(&o.latents)).collect();
                assert_eq!(got, alone, "{strategy} dp={dp} K={k}");
                assert!(
                    stats.blocks_saved > 0,
                    "{strategy} dp={dp} K={k}: nothing saved"
                );
            }
        }
    }
}
