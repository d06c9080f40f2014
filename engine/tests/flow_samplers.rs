//! Parity of the flow-matching samplers with diffusers' UniPCMultistepScheduler and
//! FlowMatchEulerDiscreteScheduler. `engine/parity/flow_samplers_reference.py` wrote, per
//! case, the scheduler's `scheduler_config.json` (diffusers' `save_config`) and what diffusers
//! produced stepping seeded random model outputs over whole schedules: the timesteps, sigmas
//! and every step's sample. Timesteps and sigmas must match exactly, samples to 1e-5 of their
//! largest magnitude (measured: Euler bit for bit; UniPC within a few 1e-7, where torch's
//! float32 log (MKL) and expm1 (SLEEF on AVX machines) round an ulp away from libm's).
#![cfg(feature = "runtime")]

mod common;

use common::{max_abs, read_safetensors};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::samplers::flow::{FlowMatchEulerConfig, FlowScheduler, UniPcConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flow-samplers")
}

/// Replays one case; returns the worst (max |diff|, max |diff| / max |ref|) over its steps.
fn replay(case: &str, inputs: &HashMap<String, Tensor>) -> (f32, f32) {
    let dir = fixtures().join(case);
    let config = dir.join("scheduler_config.json");
    let scheduler = FlowScheduler::load(&config).unwrap();
    // What the engine writes for a synthetic folder is what diffusers wrote.
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    assert_eq!(scheduler.to_json(), saved, "{case}: to_json");

    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let mut step_counts: Vec<usize> = reference
        .keys()
        .filter_map(|k| {
            k.strip_prefix("steps")?
                .strip_suffix(".timesteps")?
                .parse()
                .ok()
        })
        .collect();
    step_counts.sort();
    assert!(!step_counts.is_empty(), "{case}: no references");
    let (mut worst_abs, mut worst_rel) = (0f32, 0f32);
    for steps in step_counts {
        let key = |what: &str| format!("steps{steps}.{what}");
        let mut sampler = scheduler.sampler(steps).unwrap();
        let want_t: Vec<f32> = reference[&key("timesteps")].to_vec1().unwrap();
        assert_eq!(
            sampler.timesteps(),
            &want_t[..],
            "{case} {steps}: timesteps"
        );
        let want_s: Vec<f32> = reference[&key("sigmas")].to_vec1().unwrap();
        assert_eq!(sampler.sigmas(), &want_s[..], "{case} {steps}: sigmas");

        let mut sample = inputs[&key("sample")].clone();
        let outputs = &inputs[&key("model_outputs")];
        let samples = &reference[&key("samples")];
        for i in 0..steps {
            let out = outputs.get(i).unwrap();
            sample = sampler.step(&out, &sample).unwrap();
            let want = samples.get(i).unwrap();
            let diff = max_abs(&(&sample - &want).unwrap());
            let rel = diff / max_abs(&want);
            assert!(
                rel < 1e-5,
                "{case}, {steps} steps, step {i}: max |diff| {diff:e}, relative {rel:e}"
            );
            worst_abs = worst_abs.max(diff);
            worst_rel = worst_rel.max(rel);
        }
        assert!(sampler.step(&outputs.get(0).unwrap(), &sample).is_err());
    }
    (worst_abs, worst_rel)
}

#[test]
fn samplers_match_diffusers() {
    let inputs = read_safetensors(&fixtures().join("inputs.safetensors"));
    for case in [
        "unipc-shift3",
        "unipc-shift5",
        "euler-shift3",
        "unipc-order3",
        "euler-terminal-inverted",
    ] {
        let (abs, rel) = replay(case, &inputs);
        eprintln!("{case}: max |diff| {abs:e}, max |diff| / max |ref| {rel:e}");
    }
}

#[test]
fn presets_are_what_diffusers_saves() {
    let load = |case: &str| {
        FlowScheduler::load(&fixtures().join(case).join("scheduler_config.json")).unwrap()
    };
    assert_eq!(
        load("unipc-shift3"),
        FlowScheduler::UniPc(UniPcConfig::wan(3.0))
    );
    assert_eq!(
        load("unipc-shift5"),
        FlowScheduler::UniPc(UniPcConfig::wan(5.0))
    );
    assert_eq!(
        load("euler-shift3"),
        FlowScheduler::Euler(FlowMatchEulerConfig::with_shift(3.0))
    );
}
