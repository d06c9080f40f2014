//! The Qwen-Image family end to end: parity with diffusers' own QwenImagePipeline on the
//! committed tiny pipeline (saved by diffusers and transformers themselves, with its outputs
//! for a guided and an unguided image, and one at the default scale with no negative prompt,
//! which the pipeline runs unguided), the strategy contracts with its two streamed groups
//! (the text encoder once per request, the transformer every step), and the bad inputs a
//! user meets first.

mod common;

use common::{expect_err, max_abs, opts, read_safetensors, rel_err};

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::contract::ResidentBlocks;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::families::qwen_image::runtime::{pack, unpack};
use layerwise_engine::Strategy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model_dir() -> PathBuf {
    fixtures().join("qwen-image-tiny")
}

/// The fixture's request `name` (`guided`, `unguided`) and the reference's tensors.
fn reference(name: &str) -> (Request, std::collections::HashMap<String, Tensor>) {
    let desc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("qwen-image-tiny-reference.json")).unwrap(),
    )
    .unwrap();
    let d = &desc["requests"][name];
    let refs =
        read_safetensors(&fixtures().join(format!("qwen-image-tiny-{name}-reference.safetensors")));
    let n = |k: &str| d[k].as_u64().unwrap() as usize;
    let (h, w) = (n("height") / 8, n("width") / 8);
    // The pipeline's latents are packed 2×2 patches; requests give them as the VAE reads them.
    let init = unpack(&refs["init_latents"], h, w).unwrap();
    let r = Request {
        steps: n("steps"),
        guidance: d["guidance"].as_f64().unwrap() as f32,
        init_latents: Some(init),
        ..Request::image(
            Condition::Prompt {
                prompt: d["prompt"].as_str().unwrap().into(),
                negative: d["negative_prompt"].as_str().map(Into::into),
            },
            n("width"),
            n("height"),
        )
    };
    (r, refs)
}

fn parity(name: &str) {
    let (req, refs) = reference(name);
    let model = Model::open(&model_dir()).unwrap();
    let (out, _) = model
        .run(vec![req], &opts(Strategy::OffloadSharded, 2, 2, true))
        .unwrap();
    let o = &out[0];
    assert_eq!(o.latents.dims().len(), 5, "latents as the VAE reads them");
    let e_latents = rel_err(&pack(&o.latents).unwrap(), &refs["latents"]);
    // Our image is [3, H, W] in [-1, 1]; the reference's [H, W, 3] in [0, 1].
    let image = o.image.as_ref().unwrap();
    let image = ((image.permute((1, 2, 0)).unwrap() + 1.0).unwrap() / 2.0)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap();
    let e_image = max_abs(&(image - &refs["image"]).unwrap());
    eprintln!("{name}: latents {e_latents:.2e} (max rel), image {e_image:.2e} (max abs, [0, 1])");
    assert!(e_latents <= 1e-4, "latents {e_latents}");
    assert!(e_image <= 1e-3, "image {e_image}");
}

#[test]
fn a_guided_image_matches_diffusers() {
    parity("guided");
}

#[test]
fn an_unguided_image_matches_diffusers() {
    parity("unguided");
}

/// `QwenImagePipeline(prompt=P)` at its default scale of 4 with no negative prompt runs
/// unguided (true CFG needs one): so does the engine.
#[test]
fn the_default_scale_without_a_negative_prompt_matches_diffusers() {
    let (req, _) = reference("no_negative");
    let Condition::Prompt { negative, .. } = &req.condition else {
        unreachable!()
    };
    assert!(
        negative.is_none() && req.guidance > 1.0,
        "the case under test"
    );
    parity("no_negative");
}

fn prompt_request(seed: u64, steps: usize, guidance: f32, (w, h): (usize, usize)) -> Request {
    Request {
        seed,
        steps,
        guidance,
        ..Request::image(
            Condition::Prompt {
                prompt: format!("a red fox {seed}"),
                negative: if seed.is_multiple_of(2) {
                    Some("blurry".into())
                } else {
                    None
                },
            },
            w,
            h,
        )
    }
}

#[test]
fn every_strategy_dp_k_and_kept_blocks_give_identical_latents() {
    let model = Model::open(&model_dir()).unwrap();
    // Guided and not, of different sizes and step counts: ranks start new text-encoder
    // passes while their peers denoise.
    let requests = vec![
        prompt_request(1, 3, 4.0, (64, 48)),
        prompt_request(2, 2, 1.0, (32, 32)),
        prompt_request(3, 4, 2.5, (48, 64)),
        prompt_request(4, 2, 0.0, (32, 16)),
    ];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2, false))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for strategy in Strategy::ALL {
        for dp in 1..=3 {
            for k in 2..=3 {
                for kept in [0, 1] {
                    if kept > 0 && !strategy.streams() {
                        continue;
                    }
                    let mut o = opts(strategy, dp, k, false);
                    o.resident_blocks = ResidentBlocks::Fixed(kept);
                    o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
                    let (out, _) = model.run(requests.clone(), &o).unwrap();
                    let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
                    assert_eq!(got, reference, "{strategy} dp={dp} K={k} kept={kept}");
                }
            }
        }
    }
}

#[test]
fn the_text_encoder_streams_once_per_request_and_the_transformer_every_step() {
    let model = Model::open(&model_dir()).unwrap();
    let profile = model.checkpoint.profile().unwrap();
    let (te, tr) = (profile.groups[0].bytes(), profile.groups[1].bytes());
    assert!(te > 0 && tr > 0);
    for steps in [2, 3] {
        let (_, stats) = model
            .run(
                vec![prompt_request(1, steps, 4.0, (32, 32))],
                &opts(Strategy::Offload, 1, 2, false),
            )
            .unwrap();
        assert_eq!(
            stats.bytes_copied,
            te + steps as u64 * tr,
            "{steps} steps: {te} + {steps} × {tr}"
        );
    }
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let model = Model::open(&model_dir()).unwrap();
    let o = opts(Strategy::Offload, 1, 2, false);
    let run = |r: Request| model.run(vec![r], &o);
    let ok = prompt_request(1, 2, 4.0, (32, 32));
    expect_err(
        run(Request {
            width: 40,
            ..ok.clone()
        }),
        &["width", "16"],
    );
    expect_err(
        run(Request {
            frames: 5,
            ..ok.clone()
        }),
        &["frames", "images"],
    );
    expect_err(
        run(Request {
            guidance_2: Some(2.0),
            ..ok.clone()
        }),
        &["guidance_2"],
    );
    expect_err(
        run(Request {
            condition: Condition::Class(3),
            ..ok.clone()
        }),
        &["class_label"],
    );
    expect_err(
        run(Request {
            max_sequence_length: 2,
            ..ok.clone()
        }),
        &["prompt", "max_sequence_length"],
    );
    expect_err(
        run(Request {
            max_sequence_length: 2048,
            ..ok.clone()
        }),
        &["max_sequence_length", "1024"],
    );
    expect_err(
        run(Request {
            init_latents: Some(
                Tensor::zeros(
                    (1, 16, 1, 2, 2),
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap(),
            ),
            ..ok.clone()
        }),
        &["init_latents", "[1, 16, 1, 4, 4]"],
    );
    // Valid work is still taken afterwards.
    run(ok).unwrap();
}
