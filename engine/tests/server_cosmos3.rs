//! Cosmos3 over the HTTP API, in process over a real engine on the committed tiny pipeline:
//! an image over `/v1/images/generations` and a clip over `/v1/videos`, both from prompts,
//! the clip the same bytes when asked again; sizes the VAE cannot make a 422.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use base64::Engine as _;
use serde_json::{json, Value};

use common::server::{assert_field, call, get_json, post, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::engine::Model;
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::scheduler::Retention;

const NAME: &str = "cosmos3-tiny";

fn setup() -> Setup {
    Setup {
        dp: 2,
        max_queue: 8,
        hook: None,
        bounds: Bounds {
            request: RequestBounds {
                max_width: 96,
                max_height: 96,
                max_frames: 9,
                max_steps: 50,
                max_n: 2,
                guidance: true,
                max_prompt_tokens: 64,
            },
            body_limit: 8192,
            body_timeout: Duration::from_secs(30),
        },
        retention: Retention::default(),
        name: NAME,
        timeout: Duration::from_secs(60),
    }
}

fn model() -> Arc<Model> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cosmos3-tiny");
    Arc::new(Model::open(&dir).unwrap())
}

/// Polls a video until it ends and returns its MP4 bytes.
async fn clip(app: &Router, body: Value) -> Vec<u8> {
    let (s, _, v) = post(app, "/v1/videos", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = get_json(app, &format!("/v1/videos/{id}")).await;
        match v["status"].as_str().unwrap() {
            "completed" => break,
            "failed" => panic!("{v}"),
            _ => {}
        }
        assert!(Instant::now() < deadline, "video {id} stuck: {v}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, h, mp4) = call(app, "GET", &format!("/v1/videos/{id}/content"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "video/mp4");
    mp4
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_and_videos_from_prompts() {
    let (app, _) = common::server::start(model(), setup()).await;
    let models = get_json(&app, "/v1/models").await;
    assert_eq!(models["data"][0]["family"], "cosmos3", "{models}");

    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "model": NAME, "prompt": "a red fox in the snow", "size": "96x64",
                "steps": 2, "seed": 5, "n": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let png = base64::engine::general_purpose::STANDARD
        .decode(v["data"][1]["b64_json"].as_str().unwrap())
        .unwrap();
    let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    assert_eq!((&png[1..4], be(16), be(20)), (&b"PNG"[..], 96, 64));

    let body = |fps: f64| {
        json!({ "model": NAME, "prompt": "a red fox runs", "negative_prompt": "static",
                "size": "96x64", "frames": 9, "fps": fps, "steps": 2, "seed": 3 })
    };
    let at24 = clip(&app, body(24.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.mp4");
    std::fs::write(&path, &at24).unwrap();
    assert_eq!(common::ffprobe(&path), "h264,96,64,9");
    assert_eq!(
        clip(&app, body(24.0)).await,
        at24,
        "the same request, the same clip"
    );

    // Sizes the VAE cannot make are refused naming the field, before anything is queued.
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a fox", "size": "88x64", "frames": 9 }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "size");
}
