//! The Cosmos3 family end to end: parity with diffusers' own Cosmos3OmniPipeline on the
//! committed tiny pipeline (saved by diffusers and transformers themselves, with its outputs
//! for an image and a video under guidance), the strategy contracts with its two streamed
//! pathways, the bytes a step streams, and the bad inputs a user meets first.

mod common;

use common::{expect_err, max_abs, opts, read_safetensors, rel_err};

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::families::cosmos3::prompt::{Cosmos3Tokenizer, Target};
use layerwise_engine::Strategy;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model_dir() -> PathBuf {
    fixtures().join("cosmos3-tiny")
}

/// The fixture's request `name` (`image`, `video`) and the reference's tensors.
fn reference(name: &str) -> (Request, std::collections::HashMap<String, Tensor>) {
    let desc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("cosmos3-tiny-reference.json")).unwrap(),
    )
    .unwrap();
    let d = &desc["requests"][name];
    let refs =
        read_safetensors(&fixtures().join(format!("cosmos3-tiny-{name}-reference.safetensors")));
    let n = |k: &str| d[k].as_u64().unwrap() as usize;
    let r = Request {
        steps: n("steps"),
        guidance: d["guidance"].as_f64().unwrap() as f32,
        frames: n("frames"),
        init_latents: Some(refs["init_latents"].clone()),
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

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|i| i as u32)
        .collect()
}

fn parity(name: &str) {
    let (req, refs) = reference(name);
    // The prompt as the pipeline tokenizes it: templates, chat template, end tokens.
    let tok = Cosmos3Tokenizer::load(&model_dir().join("text_tokenizer"), true).unwrap();
    let Condition::Prompt { prompt, negative } = &req.condition else {
        unreachable!()
    };
    let target = Target {
        frames: req.frames,
        width: req.width,
        height: req.height,
        fps: 24.0,
    };
    let negative = negative.as_deref().unwrap_or("");
    let (cond, uncond) = tok.request(prompt, negative, &target).unwrap();
    assert_eq!(cond, ids(&refs["input_ids"]), "{name}: prompt ids");
    assert_eq!(
        uncond,
        ids(&refs["negative_input_ids"]),
        "{name}: negative ids"
    );

    let model = Model::open(&model_dir()).unwrap();
    let (out, _) = model
        .run(vec![req], &opts(Strategy::OffloadSharded, 2, 2, true))
        .unwrap();
    let o = &out[0];
    let e_latents = rel_err(&o.latents, &refs["latents"]);
    // Our frames are [F, 3, H, W] (an image: [3, H, W]) in [-1, 1]; the reference's
    // [F, H, W, 3] in [0, 1].
    let image = o.image.as_ref().unwrap();
    let image = if image.rank() == 3 {
        image.unsqueeze(0).unwrap()
    } else {
        image.clone()
    };
    let frames = ((image.permute((0, 2, 3, 1)).unwrap() + 1.0).unwrap() / 2.0)
        .unwrap()
        .clamp(0f32, 1f32)
        .unwrap();
    let e_frames = max_abs(&(frames - &refs["frames"]).unwrap());
    eprintln!("{name}: latents {e_latents:.2e} (max rel), frames {e_frames:.2e} (max abs, [0, 1])");
    assert!(e_latents <= 1e-4, "latents {e_latents}");
    assert!(e_frames <= 1e-3, "frames {e_frames}");
}

#[test]
fn text_to_image_matches_diffusers() {
    parity("image");
}

#[test]
fn text_to_video_matches_diffusers() {
    parity("video");
}

fn prompt_request(seed: u64, steps: usize, frames: usize, guidance: f32) -> Request {
    Request {
        seed,
        steps,
        guidance,
        frames,
        ..Request::image(
            Condition::Prompt {
                prompt: format!("a red fox {seed}"),
                negative: if seed.is_multiple_of(2) {
                    Some("blurry".into())
                } else {
                    None
                },
            },
            64,
            48,
        )
    }
}

#[test]
fn every_strategy_dp_and_k_gives_identical_latents() {
    let model = Model::open(&model_dir()).unwrap();
    // Images and clips, guided and not (guidance 1 runs the prompt alone): ranks start new
    // understanding passes while their peers denoise.
    let requests = vec![
        prompt_request(1, 3, 5, 5.0),
        prompt_request(2, 2, 1, 1.0),
        prompt_request(3, 4, 9, 3.0),
        prompt_request(4, 1, 1, 0.0),
    ];
    let (reference, _) = model
        .run(requests.clone(), &opts(Strategy::Resident, 1, 2, false))
        .unwrap();
    let reference: Vec<Vec<u32>> = reference.iter().map(|o| common::bits(&o.latents)).collect();
    for strategy in Strategy::ALL {
        for dp in 1..=3 {
            for k in 2..=3 {
                let mut o = opts(strategy, dp, k, false);
                o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
                let (out, _) = model.run(requests.clone(), &o).unwrap();
                let got: Vec<Vec<u32>> = out.iter().map(|o| common::bits(&o.latents)).collect();
                assert_eq!(got, reference, "{strategy} dp={dp} K={k}");
            }
        }
    }
}

#[test]
fn a_step_streams_the_generation_pathway_alone() {
    let model = Model::open(&model_dir()).unwrap();
    let profile = model.checkpoint.profile().unwrap();
    let (und, gen) = (profile.groups[0].bytes(), profile.groups[1].bytes());
    assert!(und > 0 && gen > 0);
    for steps in [1, 4] {
        let (_, stats) = model
            .run(
                vec![prompt_request(1, steps, 5, 5.0)],
                &opts(Strategy::Offload, 1, 2, false),
            )
            .unwrap();
        // One understanding pass for the request (both prompts), one generation pass a step.
        assert_eq!(
            stats.bytes_copied,
            und + steps as u64 * gen,
            "{steps} steps: {und} + {steps} × {gen}"
        );
    }
}

/// A clip's frame rate reaches the model: its prompt's duration sentence and its rotary time
/// axis (rescaled against `base_fps`) change with it; the pipeline's 24 is the default.
#[test]
fn the_frame_rate_conditions_a_clip() {
    let model = Model::open(&model_dir()).unwrap();
    let at = |fps: Option<f64>| {
        let r = Request {
            fps,
            ..prompt_request(5, 2, 9, 4.0)
        };
        let (out, _) = model
            .run(vec![r], &opts(Strategy::Offload, 1, 2, false))
            .unwrap();
        common::bits(&out[0].latents)
    };
    let default = at(None);
    assert_eq!(at(Some(24.0)), default);
    assert_ne!(at(Some(12.0)), default);
    // An image has no duration, and one latent frame no time axis to rescale.
    let image = |fps| {
        let r = Request {
            fps,
            ..prompt_request(5, 2, 1, 4.0)
        };
        let (out, _) = model
            .run(vec![r], &opts(Strategy::Offload, 1, 2, false))
            .unwrap();
        common::bits(&out[0].latents)
    };
    assert_eq!(image(Some(12.0)), image(None));
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let model = Model::open(&model_dir()).unwrap();
    let o = opts(Strategy::Offload, 1, 2, false);
    let run = |r: Request| model.run(vec![r], &o);
    let ok = prompt_request(1, 2, 1, 5.0);
    expect_err(
        run(Request {
            width: 40,
            ..ok.clone()
        }),
        &["width", "16"],
    );
    expect_err(
        run(Request {
            frames: 4,
            ..ok.clone()
        }),
        &["frames", "4k + 1"],
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
            guidance: f32::NAN,
            ..ok.clone()
        }),
        &["guidance"],
    );
    expect_err(
        run(Request {
            fps: Some(0.0),
            ..ok.clone()
        }),
        &["fps"],
    );
    expect_err(
        run(Request {
            max_sequence_length: 2,
            ..ok.clone()
        }),
        &["prompt", "max_sequence_length"],
    );
    // Valid work is still taken afterwards.
    run(ok).unwrap();
}
