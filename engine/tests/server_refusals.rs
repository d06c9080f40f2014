//! What a careless or hostile client or operator gets refused up front, before anything is
//! queued or served, naming what is wrong: a frame rate outside the one range the document,
//! the request check and the engine share (`fps`); a size the published pattern refuses
//! (`size`); a request with fewer latent tokens than the ranks its sequence is split over
//! (`size`, with the minimum in `/v1/models`); and `serve` flags outside their ranges,
//! each named with its range at start.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use clap::Parser;
use serde_json::{json, Value};

use common::server::{assert_field, get_json, post, Setup};
use layerwise_engine::bounds::{RequestBounds, MAX_FPS, MIN_FPS};
use layerwise_engine::decode::DecodeSite;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::scheduler::{Retention, Scheduler};
use layerwise_engine::server::ServeArgs;

/// `layerwise serve`'s flags, as the binary parses them.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn setup(dp: usize) -> Setup {
    Setup {
        dp,
        max_queue: 16,
        hook: None,
        bounds: Bounds {
            request: RequestBounds {
                max_width: 64,
                max_height: 64,
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
        name: "tiny",
        timeout: Duration::from_secs(60),
    }
}

async fn serve(model: &Path, dp: usize, sp: usize) -> (Router, Scheduler) {
    let model = Arc::new(Model::open(model).unwrap());
    common::server::start_split(model, setup(dp), DecodeSite::Host, sp).await
}

/// A 422 naming `field`, and nothing queued for it.
async fn refused(app: &Router, sched: &Scheduler, uri: &str, body: Value, field: &str) {
    let before = sched.list("video").await.len() + sched.list("image").await.len();
    let (s, _, v) = post(app, uri, body.clone()).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body} -> {v}");
    assert_field(&v, field);
    let after = sched.list("video").await.len() + sched.list("image").await.len();
    assert_eq!(before, after, "{body} queued a job");
}

/// A clip request for the engine itself (what `generate --fps` and the server's ranks
/// check).
fn clip(fps: f64) -> Request {
    Request {
        steps: 2,
        frames: 5,
        fps: Some(fps),
        max_sequence_length: 16,
        ..Request::image(
            Condition::Prompt {
                prompt: "a fox".into(),
                negative: None,
            },
            48,
            32,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_rate_outside_the_shared_range_is_a_422_naming_fps_on_every_video_family() {
    let dir = tempfile::tempdir().unwrap();
    for path in [
        common::wan_tiny(dir.path(), 2, 2),
        common::cosmos3_tiny(dir.path(), 2),
    ] {
        let (app, sched) = serve(&path, 1, 1).await;
        let name = path.display();
        for fps in [0.05, 1e-300, MIN_FPS / 2.0, MAX_FPS + 1.0, 0.0] {
            let body = json!({ "prompt": "a fox", "size": "48x32", "frames": 5, "fps": fps });
            refused(&app, &sched, "/v1/videos", body, "fps").await;
        }
        // The ends of the range are taken.
        for fps in [MIN_FPS, MAX_FPS] {
            let body =
                json!({ "prompt": "a fox", "size": "48x32", "frames": 5, "fps": fps, "steps": 1 });
            let (s, _, v) = post(&app, "/v1/videos", body).await;
            assert_eq!(s, StatusCode::ACCEPTED, "{name}: fps {fps}: {v}");
        }
        // The engine refuses what the API refuses, as `fps`, and takes what it takes.
        let model = Model::open(&path).unwrap();
        for fps in [0.05, 1e-300, MAX_FPS + 1.0, f64::NAN] {
            let e = model.validate(&clip(fps)).unwrap_err();
            assert_eq!(e.field(), Some("fps"), "{name}: {fps}: {e}");
        }
        model.validate(&clip(MIN_FPS)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_the_published_pattern_refuses_are_a_422_naming_size() {
    let dir = tempfile::tempdir().unwrap();
    let (app, sched) = serve(&common::wan_tiny(dir.path(), 2, 2), 1, 1).await;
    for size in [" 48x32", "48x32 ", "48X32", "+48x32", "48x+32", "48 x 32"] {
        let body = json!({ "prompt": "a fox", "size": size, "frames": 1 });
        refused(&app, &sched, "/v1/videos", body.clone(), "size").await;
        refused(
            &app,
            &sched,
            "/v1/jobs",
            json!({ "prompt": "a fox", "size": size }),
            "size",
        )
        .await;
    }
    let body = json!({ "prompt": "a fox", "size": "48x32", "frames": 1, "steps": 1 });
    assert_eq!(post(&app, "/v1/videos", body).await.0, StatusCode::ACCEPTED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_latent_tokens_for_the_sp_group_are_refused_at_submit_and_the_minimum_is_advertised(
) {
    let dir = tempfile::tempdir().unwrap();
    // Cosmos3's tiny VAE and patch make 32 × 32 pixels one token: 32x32 at one frame is one
    // token, 48x32 two, and five frames of 32x32 two (latent frames: the first, then 4 each).
    let path = common::cosmos3_tiny(dir.path(), 2);
    let (app, sched) = serve(&path, 1, 2).await;
    let limits = &get_json(&app, "/v1/models").await["data"][0]["limits"];
    assert_eq!(limits["min_latent_tokens"], 2, "{limits}");
    assert_eq!(limits["pixels_per_latent_token"], 32 * 32, "{limits}");
    assert_eq!(limits["frames_per_latent_frame"], 4, "{limits}");
    for (uri, body) in [
        (
            "/v1/videos",
            json!({ "prompt": "a fox", "size": "32x32", "frames": 1 }),
        ),
        ("/v1/jobs", json!({ "prompt": "a fox", "size": "32x32" })),
        (
            "/v1/images/generations",
            json!({ "prompt": "a fox", "size": "32x32" }),
        ),
    ] {
        refused(&app, &sched, uri, body, "size").await;
    }
    for body in [
        json!({ "prompt": "a fox", "size": "48x32", "frames": 1, "steps": 1 }),
        json!({ "prompt": "a fox", "size": "32x32", "frames": 5, "steps": 1 }),
    ] {
        let (s, _, v) = post(&app, "/v1/videos", body.clone()).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{body}: {v}");
        let id = v["id"].as_str().unwrap();
        // Taken means it runs: it completes on the group of two.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let v = get_json(&app, &format!("/v1/videos/{id}")).await;
            match v["status"].as_str().unwrap() {
                "completed" => break,
                "failed" => panic!("{body}: {v}"),
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
            assert!(std::time::Instant::now() < deadline, "{body}: stuck: {v}");
        }
    }

    // Without a split one token is enough: the same request is taken.
    let (app, _) = serve(&path, 1, 1).await;
    let limits = &get_json(&app, "/v1/models").await["data"][0]["limits"];
    assert_eq!(limits["min_latent_tokens"], 1, "{limits}");
    let body = json!({ "prompt": "a fox", "size": "32x32", "frames": 1, "steps": 1 });
    assert_eq!(post(&app, "/v1/videos", body).await.0, StatusCode::ACCEPTED);
}

/// `layerwise serve` with `flags` on `model`, on a port of its own: the error it stops
/// with, or a panic when it is still running after a while (it took the flags).
fn refused_at_start(model: &Path, flags: &[&str]) -> layerwise_engine::Error {
    let mut argv = vec![
        "layerwise",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--device",
        "cpu",
    ];
    argv.extend_from_slice(flags);
    let args = Cli::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("{flags:?}: {e}"))
        .serve;
    let (tx, rx) = std::sync::mpsc::channel();
    // A server that takes the flags runs until the test process ends.
    std::thread::spawn(move || {
        let _ = tx.send(layerwise_engine::server::serve(args));
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(Err(e)) => e,
        Ok(Ok(code)) => panic!("{flags:?}: served and ended with {code:?}"),
        Err(_) => panic!("{flags:?}: taken; the server is running"),
    }
}

#[test]
fn serve_flags_outside_their_ranges_are_refused_at_start_naming_flag_and_range() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 2);
    for (flags, field, range) in [
        (
            &["--timeout-seconds", "0"][..],
            "timeout-seconds",
            "1..=86400",
        ),
        (&["--max-connections", "0"], "max-connections", "2..=65536"),
        (&["--max-connections", "1"], "max-connections", "2..=65536"),
        (&["--keep-finished", "0"], "keep-finished", "1..=1000000"),
        (&["--max-queue", "10000000000"], "max-queue", "1..=65536"),
        (&["--max-queue", "0"], "max-queue", "1..=65536"),
        (
            &["--header-timeout-seconds", "0"],
            "header-timeout-seconds",
            "1..=3600",
        ),
        (
            &["--body-timeout-seconds", "0"],
            "body-timeout-seconds",
            "1..=3600",
        ),
        (&["--body-limit", "0"], "body-limit", "256..="),
        (&["--result-bytes", "0"], "result-bytes", "1048576..="),
        (&["--result-ttl-seconds", "0"], "result-ttl-seconds", "1..="),
        (
            &["--forward-timeout-seconds", "0"],
            "forward-timeout-seconds",
            "1..=",
        ),
        (&["--max-width", "0"], "max-width", "8..=16384"),
        (&["--max-height", "0"], "max-height", "8..=16384"),
        (&["--max-frames", "0"], "max-frames", "1..=1024"),
        (&["--max-steps", "0"], "max-steps", "1..=1000"),
        (&["--max-n", "0"], "max-n", "1..=64"),
        (
            &["--max-prompt-tokens", "0"],
            "max-prompt-tokens",
            "1..=4096",
        ),
    ] {
        let e = refused_at_start(&model, flags);
        assert_eq!(e.field(), Some(field), "{flags:?}: {e}");
        assert!(e.to_string().contains(range), "{flags:?}: {e}");
    }
}
