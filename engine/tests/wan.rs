//! The Wan family end to end: parity with diffusers' own WanPipeline on the committed tiny
//! pipelines (saved by diffusers and transformers themselves, with their outputs), the
//! strategy contracts with three streamed groups (text encoder, two experts), and the
//! bad inputs a user meets first.

mod common;

use common::{expect_err, max_abs, opts, read_safetensors, rel_err, wan_tiny};

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::tools::synth::{synth, SynthOptions};
use layerwise_engine::Strategy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The request the reference ran, from its JSON description.
fn reference_request(name: &str) -> (Request, std::collections::HashMap<String, Tensor>) {
    let desc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join(format!("{name}-reference.json"))).unwrap(),
    )
    .unwrap();
    let refs = read_safetensors(&fixtures().join(format!("{name}-reference.safetensors")));
    let n = |k: &str| desc[k].as_u64().unwrap() as usize;
    let r = Request {
        seed: 0,
        steps: n("steps"),
        guidance: desc["guidance"].as_f64().unwrap() as f32,
        guidance_2: desc["guidance_2"].as_f64().map(|g| g as f32),
        frames: n("frames"),
        max_sequence_length: n("max_sequence_length"),
        init_latents: Some(refs["init_latents"].clone()),
        ..Request::image(
            Condition::Prompt {
                prompt: desc["prompt"].as_str().unwrap().into(),
                negative: desc["negative_prompt"].as_str().map(Into::into),
            },
            n("width"),
            n("height"),
        )
    };
    (r, refs)
}

fn parity(name: &str) {
    let (mut req, refs) = reference_request(name);
    let model = Model::open(&fixtures().join(name)).unwrap();
    if model.checkpoint.groups().len() < 3 {
        req.guidance_2 = None;
    }
    let (out, _) = model
        .run(vec![req], &opts(Strategy::OffloadSharded, 2, 2, true))
        .unwrap();
    let o = &out[0];
    let text = o.text_embeddings.as_ref().unwrap();
    let e_prompt = rel_err(&text.narrow(0, 0, 1).unwrap(), &refs["prompt_embeds"]);
    let e_negative = rel_err(
        &text.narrow(0, 1, 1).unwrap(),
        &refs["negative_prompt_embeds"],
    );
    let e_latents = rel_err(&o.latents, &refs["latents"]);
    // Our frames are [F, 3, H, W] in [-1, 1]; the reference's [F, H, W, 3] in [0, 1].
    let frames = ((o.image.as_ref().unwrap().permute((0, 2, 3, 1)).unwrap() + 1.0).unwrap() / 2.0)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap();
    let px = max_abs(&(frames - &refs["frames"]).unwrap()) * 255.0;
    eprintln!(
        "{name}: prompt embeds {e_prompt:.2e}, negative {e_negative:.2e}, latents {e_latents:.2e} (max rel), frames {px:.3}/255"
    );
    assert!(e_prompt < 1e-3 && e_negative < 1e-3, "text embeddings");
    assert!(e_latents < 1e-3, "latents {e_latents}");
    assert!(px <= 2.0, "frames {px}/255");
}

#[test]
fn wan21_matches_diffusers() {
    parity("wan21-tiny");
}

#[test]
fn wan22_two_experts_match_diffusers() {
    parity("wan-tiny");
}

fn prompt_request(seed: u64, steps: usize, frames: usize, guidance: f32) -> Request {
    Request {
        seed,
        steps,
        guidance,
        guidance_2: Some(guidance / 2.0),
        frames,
        max_sequence_length: 16,
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

#[test]
fn every_strategy_dp_and_k_gives_identical_latents_across_experts() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan_tiny(dir.path(), 3, 2)).unwrap();
    // Different steps, frames and guidance: ranks switch experts at different passes, and
    // encode new prompts while their peers denoise.
    let requests = vec![
        prompt_request(1, 4, 5, 5.0),
        prompt_request(2, 2, 1, 1.0),
        prompt_request(3, 5, 9, 3.0),
        prompt_request(4, 1, 5, 0.0),
    ];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2, false))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for strategy in Strategy::ALL {
        for dp in 1..=3 {
            for k in 2..=3 {
                for slow in [false, true] {
                    let mut o = opts(strategy, dp, k, false);
                    if slow {
                        o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
                    }
                    let (out, stats) = model.run(requests.clone(), &o).unwrap();
                    let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
                    assert_eq!(got, reference, "{strategy} dp={dp} K={k} slowed={slow}");
                    assert!((0.0..=1.0).contains(&stats.stall_fraction));
                }
            }
        }
    }
}

#[test]
fn components_kept_resident_give_identical_latents_and_copy_nothing_again() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan_tiny(dir.path(), 3, 2)).unwrap();
    let requests = vec![
        prompt_request(1, 4, 5, 5.0),
        prompt_request(2, 2, 1, 1.0),
        prompt_request(3, 3, 5, 3.0),
    ];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2, false))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for strategy in [
        Strategy::Sharded,
        Strategy::Offload,
        Strategy::OffloadSharded,
    ] {
        let dp = if strategy == Strategy::Offload { 1 } else { 2 };
        let mut copied = Vec::new();
        for resident in [
            &[][..],
            &["text_encoder"][..],
            &["transformer_2"][..],
            &["text_encoder", "transformer"][..],
        ] {
            let mut o = opts(strategy, dp, 2, false);
            o.resident_components = names(resident);
            o.hook = Some(common::jitter(7));
            let (out, stats) = model.run(requests.clone(), &o).unwrap();
            let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
            assert_eq!(got, reference, "{strategy} dp={dp} resident {resident:?}");
            let kept = stats
                .peak_device_bytes_by_kind
                .get("resident_blocks")
                .copied()
                .unwrap_or(0);
            assert_eq!(kept > 0, !resident.is_empty(), "{resident:?}");
            copied.push(stats.bytes_copied + stats.bytes_gathered);
        }
        // Every component kept whole moves fewer bytes per run.
        assert!(
            copied[1] < copied[0] && copied[2] < copied[0],
            "{strategy}: {copied:?}"
        );
        assert!(copied[3] < copied[1], "{strategy}: {copied:?}");
    }
    // Names that are not streamed components, and keeping everything, are refused.
    let mut o = opts(Strategy::Offload, 1, 2, false);
    o.resident_components = names(&["vae"]);
    expect_err(
        model.run(requests.clone(), &o),
        &["vae", "text_encoder, transformer, transformer_2"],
    );
    o.resident_components = names(&["text_encoder", "transformer", "transformer_2"]);
    expect_err(model.run(requests, &o), &["--strategy resident"]);
}

#[test]
fn device_weights_stay_flat_in_the_depth_of_every_streamed_component() {
    let dir = tempfile::tempdir().unwrap();
    let mut peaks = Vec::new();
    // Deeper experts, then a deeper text encoder: the slots and the device peak stay put.
    for (layers, text_layers) in [(2, 2), (8, 2), (2, 8)] {
        let model = Model::open(&wan_tiny(dir.path(), layers, text_layers)).unwrap();
        for (strategy, dp, k) in [(Strategy::OffloadSharded, 2, 2), (Strategy::Offload, 1, 3)] {
            let (_, s) = model
                .run(
                    vec![prompt_request(5, 3, 5, 4.0)],
                    &opts(strategy, dp, k, false),
                )
                .unwrap();
            let outside = s.peak_device_bytes_by_kind["resident_outside_blocks"];
            let slots = s.peak_device_bytes_by_kind["slots"];
            assert!(slots <= k as u64 * s.largest_padded_block_bytes * 2);
            assert!(s.peak_device_bytes <= slots + outside);
            peaks.push((strategy, dp, k, s.peak_device_bytes));
        }
    }
    assert_eq!(peaks[0..2], peaks[2..4], "deeper experts");
    assert_eq!(peaks[0..2], peaks[4..6], "deeper text encoder");
}

#[test]
fn bad_input_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let root = wan_tiny(dir.path(), 2, 2);
    let model = Model::open(&root).unwrap();
    let mut r = prompt_request(1, 2, 6, 4.0);
    expect_err(model.validate(&r), &["frames", "4k + 1"]);
    r.frames = 5;
    r.condition = Condition::Prompt {
        prompt: "fox ".repeat(40),
        negative: None,
    };
    expect_err(model.validate(&r), &["prompt", "over the limit of 16"]);
    r.condition = Condition::Class(3);
    expect_err(model.validate(&r), &["class_label", "prompt"]);

    // A second expert whose shapes differ from the first's.
    let cfg = root.join("transformer_2/config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["ffn_dim"] = serde_json::json!(v["ffn_dim"].as_u64().unwrap() * 2);
    std::fs::write(&cfg, v.to_string()).unwrap();
    expect_err(Model::open(&root), &["transformer_2", "ffn_dim"]);
    std::fs::write(&cfg, text).unwrap();

    // No tokenizer.
    std::fs::rename(root.join("tokenizer"), root.join("tok")).unwrap();
    expect_err(Model::open(&root), &["tokenizer"]);
}

#[test]
fn published_shapes_load_and_profile_from_headers() {
    let dir = tempfile::tempdir().unwrap();
    // (preset, text encoder parameters, parameters per expert, experts): bf16 throughout
    // but for what diffusers keeps in f32, so bytes ≈ 2 × parameters.
    for (preset, te, expert, experts) in [
        ("wan2.1-1.3b", 5.68e9, 1.42e9, 1),
        ("wan2.1-14b", 5.68e9, 14.29e9, 1),
        ("wan2.2-a14b", 5.68e9, 14.29e9, 2),
    ] {
        let out = dir.path().join(preset);
        let mut o = SynthOptions::preset(preset).unwrap();
        o.sparse = true;
        o.max_shard_bytes = Some(5 << 30);
        synth(&out, &o).unwrap();
        let t = std::time::Instant::now();
        let p = layerwise_engine::families::profile(&out).unwrap();
        eprintln!(
            "{preset}: profiled {} GB in {:?}",
            p.total_bytes / 1_000_000_000,
            t.elapsed()
        );
        let near = |bytes: u64, params: f64| (bytes as f64 / (2.0 * params) - 1.0).abs() < 0.02;
        let comp = |n: &str| p.components.iter().find(|c| c.name == n).unwrap();
        assert!(
            near(comp("text_encoder").bytes, te),
            "{preset} text encoder"
        );
        assert!(
            near(comp("transformer").bytes, expert),
            "{preset} transformer"
        );
        assert_eq!(
            p.components
                .iter()
                .filter(|c| c.name.starts_with("transformer"))
                .count(),
            experts
        );
        assert_eq!(comp("text_encoder").blocks, 24);
        assert!(p.bytes_by_dtype.contains_key("BF16") && p.bytes_by_dtype.contains_key("F32"));
        // The configs a published folder holds open as a model (mapped, nothing read).
        let m = Model::open(&out).unwrap();
        assert_eq!(m.layouts(2).unwrap().len(), 1 + experts);
    }
}
