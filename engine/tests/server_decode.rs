//! Where `serve` decodes, in process: on the CPU backend it decodes on the host and keeps
//! nothing for the decoder in the device budget, as it always has; decoding "on the device"
//! (each rank's, which on the CPU backend is the CPU) serves the same bytes, images and
//! clips, from a decoder per rank at dp 2, with the decoder's weights and its largest
//! decode counted for each rank.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::json;

use common::server::{call, get_json, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::decode::{
    device_decode, DecodeChoice, DecodeSite, DecoderBytes, DEFAULT_DECODE_BUDGET,
};
use layerwise_engine::engine::Model;
use layerwise_engine::execution::cuda::DeviceChoice;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::Request;
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::kind::Kind;
use layerwise_engine::server::scheduler::Retention;
use layerwise_engine::server::{decode_placement, make_media};
use layerwise_engine::Strategy;

fn bounds() -> Bounds {
    Bounds {
        request: RequestBounds {
            max_width: 64,
            max_height: 48,
            max_frames: 9,
            max_steps: 10,
            max_n: 1,
            guidance: true,
            max_prompt_tokens: 24,
        },
        body_limit: 8192,
        body_timeout: Duration::from_secs(30),
    }
}

#[test]
fn the_cpu_backend_decodes_on_the_host_and_reserves_nothing_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&common::wan_tiny(dir.path(), 2, 2)).unwrap();
    let b = bounds().request;
    // `auto` on the CPU backend, asked for or fallen back to (this build has no CUDA).
    for device in [DeviceChoice::Cpu, DeviceChoice::Auto] {
        let (site, bytes) = decode_placement(
            &model,
            DecodeChoice::Auto,
            device,
            2,
            &b,
            DEFAULT_DECODE_BUDGET,
        )
        .unwrap();
        assert_eq!(site, DecodeSite::Host, "{device:?}");
        assert_eq!(bytes, DecoderBytes::default());
    }
    // On the device (as the operator asks of pods on GPU nodes): the checkpoint's decoder
    // weights and the decode of the largest output at the split the budget allows, by the
    // profile's own figures (the planner's function).
    let (site, bytes) = decode_placement(
        &model,
        DecodeChoice::Fixed(DecodeSite::Device),
        DeviceChoice::Cpu,
        2,
        &b,
        DEFAULT_DECODE_BUDGET,
    )
    .unwrap();
    assert_eq!(site, DecodeSite::Device);
    let profile = model.checkpoint.profile().unwrap();
    assert!(profile.decoder_bytes > 0);
    assert_eq!(bytes.weights, profile.decoder_bytes);
    let decode = profile
        .decode
        .as_ref()
        .expect("the Wan VAE describes its peak");
    let (_, peak) = device_decode(decode, &b, DEFAULT_DECODE_BUDGET).unwrap();
    assert_eq!(bytes.peak, peak);
    assert!(bytes.peak > 0 && bytes.peak <= DEFAULT_DECODE_BUDGET);
    // A budget below the smallest split is refused at start, by name.
    let err = decode_placement(
        &model,
        DecodeChoice::Fixed(DecodeSite::Device),
        DeviceChoice::Cpu,
        2,
        &b,
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("decode budget"), "{err}");
}

fn request(prompt: &str, w: usize, h: usize, frames: usize, seed: u64) -> Request {
    let tokens = bounds().request.max_prompt_tokens as usize;
    common::server::prompt_request(prompt, (w, h, frames), 2, (4.0, 2.0), seed, tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoding_on_each_ranks_device_serves_the_bytes_the_host_decoder_makes() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::wan_tiny(dir.path(), 2, 2)).unwrap());
    let setup = Setup {
        dp: 2,
        max_queue: 8,
        hook: None,
        bounds: bounds(),
        retention: Retention::default(),
        name: "wan-tiny",
        timeout: Duration::from_secs(60),
    };
    let (app, _) = common::server::start_decoding(model.clone(), setup, DecodeSite::Device).await;
    let jobs = [
        ("video", request("a fox in snow", 48, 32, 9, 1)),
        ("image", request("a red kite", 32, 32, 1, 2)),
        ("video", request("waves at dusk", 32, 48, 5, 3)),
    ];
    let ids = common::server::submit(&app, &jobs).await;
    let opts = EngineOptions {
        strategy: Strategy::Resident,
        dp: 1,
        decode: false,
        ..EngineOptions::default()
    };
    let host = model.decoder(&candle_core::Device::Cpu).unwrap();
    for (id, (kind, r)) in ids.iter().zip(&jobs) {
        let (status, uri) = if *kind == "video" {
            (
                format!("/v1/videos/{id}"),
                format!("/v1/videos/{id}/content"),
            )
        } else {
            (format!("/v1/jobs/{id}"), format!("/v1/jobs/{id}/result"))
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let v = get_json(&app, &status).await;
            let state = v.get("state").or(v.get("status")).unwrap().clone();
            if state == "succeeded" || state == "completed" {
                if *kind == "video" {
                    assert_eq!(v["frames_decoded"], json!(r.frames), "{v}");
                }
                break;
            }
            assert!(state != "failed", "{kind} {id}: {v}");
            assert!(Instant::now() < deadline, "{kind} {id} never finished: {v}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (s, _, served) = call(&app, "GET", &uri, None).await;
        assert_eq!(s, StatusCode::OK);
        let (out, _) = model.run(vec![r.clone()], &opts).unwrap();
        let k = if *kind == "video" {
            Kind::Video { fps: 16.0 }
        } else {
            Kind::Image
        };
        let alone = make_media(host.as_ref(), &out[0].latents, k, |_| {}).unwrap();
        assert!(
            served == alone.bytes,
            "{kind} {id}: the device decoders' bytes differ from the host decoder's"
        );
    }
}
