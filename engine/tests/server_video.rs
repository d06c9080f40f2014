//! Video over the HTTP API, in process over a real engine on a tiny two-expert Wan 2.2
//! pipeline: a job posted with a prompt, polled through its progress to an MP4 that
//! `ffprobe` reads with the frames and size asked for; DELETE mid-run freeing the rank at
//! its next step boundary; every bound a 422 naming its field; OpenAI's multipart form;
//! outputs let go by time and by byte budget; and images and videos of different sizes,
//! frame counts, step counts and experts in flight at once at dp 2 giving the same bytes as
//! each alone.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};

use common::server::{assert_field, call, get_json, post, send, slow_copies, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::Request;
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::kind::Kind;
use layerwise_engine::server::make_media;
use layerwise_engine::server::scheduler::Retention;
use layerwise_engine::Strategy;

const NAME: &str = "wan-tiny";

fn bounds() -> Bounds {
    Bounds {
        request: RequestBounds {
            max_width: 64,
            max_height: 64,
            max_frames: 17,
            max_steps: 400,
            max_n: 2,
            guidance: true,
            max_prompt_tokens: 24,
        },
        body_limit: 8192,
        body_timeout: Duration::from_secs(30),
    }
}

fn setup(dp: usize, hook: bool, retention: Retention) -> Setup {
    Setup {
        dp,
        max_queue: 16,
        hook: hook.then(slow_copies),
        bounds: bounds(),
        retention,
        name: NAME,
        timeout: Duration::from_secs(60),
    }
}

async fn video(app: &Router, id: &str) -> Value {
    get_json(app, &format!("/v1/videos/{id}")).await
}

/// Polls a video until it ends; returns its last object and every progress seen.
async fn poll(app: &Router, id: &str) -> (Value, Vec<(u64, u64, u64)>) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    loop {
        let v = video(app, id).await;
        let p = (
            v["progress"].as_u64().unwrap(),
            v["steps_done"].as_u64().unwrap(),
            v["frames_decoded"].as_u64().unwrap(),
        );
        if seen.last() != Some(&p) {
            seen.push(p);
        }
        if ["completed", "failed"].contains(&v["status"].as_str().unwrap()) {
            return (v, seen);
        }
        assert!(Instant::now() < deadline, "video {id} stuck: {v}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `codec,width,height,frames` of MP4 bytes, as ffprobe counts them.
fn ffprobe(mp4: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.mp4");
    std::fs::write(&path, mp4).unwrap();
    common::ffprobe(&path)
}

/// Width and height from a PNG's header.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[1..4], b"PNG");
    let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

fn model(dir: &Path) -> Arc<Model> {
    Arc::new(Model::open(&common::wan_tiny(dir, 2, 2)).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_job_polls_to_an_mp4_and_a_cancel_frees_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (app, sched) =
        common::server::start(model(dir.path()), setup(1, true, Retention::default())).await;

    let body = json!({
        "model": NAME, "prompt": "a red fox running through fresh snow",
        "negative_prompt": "blurry", "size": "48x32", "frames": 9, "fps": 8,
        "steps": 3, "guidance": 5.0, "guidance_2": 3.0, "seed": 3,
    });
    let (s, h, v) = post(&app, "/v1/videos", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(h["location"].to_str().unwrap(), format!("/v1/videos/{id}"));
    assert_eq!(
        (
            v["object"].as_str(),
            v["model"].as_str(),
            v["size"].as_str()
        ),
        (Some("video"), Some(NAME), Some("48x32"))
    );
    assert!(
        ["queued", "in_progress"].contains(&v["status"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v["seconds"], "1.12", "9 frames at 8 fps");

    let (done, seen) = poll(&app, &id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        (
            &done["progress"],
            &done["steps_done"],
            &done["frames_decoded"]
        ),
        (&json!(100), &json!(3), &json!(9)),
        "{done}"
    );
    assert!(
        done["expires_at"].as_u64() > done["completed_at"].as_u64(),
        "{done}"
    );
    // Progress only grows, and it was seen mid-way (steps before frames).
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert!(
        seen.iter().any(|&(p, s, _)| p > 0 && p < 100 && s > 0),
        "no progress seen between start and end: {seen:?}"
    );

    let (s, h, mp4) = call(&app, "GET", &format!("/v1/videos/{id}/content"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "video/mp4");
    assert_eq!(ffprobe(&mp4), "h264,48,32,9");
    let (s, h, png) = call(
        &app,
        "GET",
        &format!("/v1/videos/{id}/content?variant=thumbnail"),
        None,
    )
    .await;
    assert_eq!(
        (s, h["content-type"].to_str().unwrap()),
        (StatusCode::OK, "image/png")
    );
    assert_eq!(png_size(&png), (48, 32));
    let (s, _, v) = call(
        &app,
        "GET",
        &format!("/v1/videos/{id}/content?variant=spritesheet"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_field(&serde_json::from_slice(&v).unwrap(), "variant");
    let list = get_json(&app, "/v1/videos").await;
    assert_eq!(list["data"][0]["id"], id.as_str(), "{list}");

    // DELETE mid-run: the job stops at its rank's next step boundary, and the rank takes
    // the next job.
    let (s, _, long) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a long one", "size": "32x32", "frames": 5, "steps": 400 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{long}");
    let long = long["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    while video(&app, &long).await["steps_done"].as_u64().unwrap() < 1 {
        assert!(Instant::now() < deadline, "the long video never stepped");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, _, b) = call(&app, "DELETE", &format!("/v1/videos/{long}"), None).await;
    assert_eq!(s, StatusCode::OK);
    let del: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (&del["object"], &del["deleted"]),
        (&json!("video.deleted"), &json!(true))
    );
    let gone = video(&app, &long).await;
    assert_eq!(
        (gone["status"].as_str(), gone["error"]["code"].as_str()),
        (Some("failed"), Some("cancelled")),
        "{gone}"
    );
    let (s, _, next) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "after the cancel", "size": "32x32", "frames": 1, "steps": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (next, _) = poll(&app, next["id"].as_str().unwrap()).await;
    assert_eq!(next["status"], "completed", "the rank was freed: {next}");
    let stopped = video(&app, &long).await["steps_done"].as_u64().unwrap();
    assert!(stopped < 400, "the cancelled job ran on: {stopped} steps");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(video(&app, &long).await["steps_done"], stopped);

    // OpenAI's client posts multipart form data, every value a string; `seconds` × `fps`
    // rounds up to the next length the model makes (1 + 4k frames).
    let boundary = "XyZ";
    let form: String = [
        ("model", NAME),
        ("prompt", "a kite over a beach"),
        ("seconds", "1"),
        ("size", "32x32"),
        ("fps", "6"),
        ("steps", "2"),
    ]
    .iter()
    .map(|(k, v)| {
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
    })
    .chain([format!("--{boundary}--\r\n")])
    .collect();
    let (s, _, b) = send(
        &app,
        "POST",
        "/v1/videos",
        &format!("multipart/form-data; boundary={boundary}"),
        Some(form.into_bytes()),
    )
    .await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!((&v["frames"], &v["fps"]), (&json!(9), &json!(6.0)), "{v}");
    let (v, _) = poll(&app, v["id"].as_str().unwrap()).await;
    assert_eq!(v["status"], "completed", "{v}");

    // Every bound and every field the family cannot use: a 422 naming it.
    let long_prompt = "fox ".repeat(40);
    for (body, field) in [
        (json!({ "prompt": "x", "size": "80x32" }), "size"),
        (json!({ "prompt": "x", "size": "40x32" }), "size"),
        (json!({ "prompt": "x", "frames": 21 }), "frames"),
        (json!({ "prompt": "x", "frames": 10 }), "frames"),
        (
            json!({ "prompt": "x", "seconds": "3", "fps": 16 }),
            "seconds",
        ),
        (
            json!({ "prompt": "x", "seconds": "1", "frames": 5 }),
            "seconds",
        ),
        (json!({ "prompt": "x", "seconds": "-1" }), "seconds"),
        (json!({ "prompt": "x", "fps": 0 }), "fps"),
        (json!({ "prompt": "x", "steps": 401 }), "steps"),
        (json!({ "prompt": long_prompt }), "prompt"),
        (
            json!({ "prompt": "x", "max_sequence_length": 25 }),
            "max_sequence_length",
        ),
        (json!({ "prompt": "x", "class_label": 1 }), "class_label"),
        (
            json!({ "prompt": "x", "input_reference": "img" }),
            "input_reference",
        ),
        (json!({ "prompt": "x", "n": 2 }), "n"),
        (json!({ "size": "32x32" }), "prompt"),
        (json!({ "prompt": "x", "guidance": -1 }), "guidance"),
    ] {
        // Within bounds but for the field under test (the default size, 832x480, is not).
        let mut body = body;
        body.as_object_mut()
            .unwrap()
            .entry("size")
            .or_insert(json!("32x32"));
        let (s, _, v) = post(&app, "/v1/videos", body.clone()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body} -> {v}");
        assert_field(&v, field);
    }
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "model": "sora-2", "prompt": "x", "size": "32x32" }),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    // An image job's id is not a video.
    let (s, _, img) = post(
        &app,
        "/v1/jobs",
        json!({ "prompt": "x", "size": "32x32", "steps": 1 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{img}");
    assert_eq!(
        call(
            &app,
            "GET",
            &format!("/v1/videos/{}", img["id"].as_str().unwrap()),
            None
        )
        .await
        .0,
        StatusCode::NOT_FOUND
    );

    let m = sched.shared.metrics.render();
    for line in [
        "layerwise_outputs_requested_total{modality=\"video\"} 4",
        "layerwise_outputs_requested_total{modality=\"image\"} 1",
        "layerwise_requests_finished_total{outcome=\"cancelled\"} 1",
    ] {
        assert!(m.contains(line), "{line} missing from\n{m}");
    }
    let metric = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from\n{m}"))
            .parse()
            .unwrap()
    };
    // 9 + 1 + 9 frames of video (the image job may still run).
    assert!(metric("layerwise_frames_generated_total") >= 19.0);
    let secs = metric("layerwise_generated_video_seconds_total");
    assert!(
        (secs - (9.0 / 8.0 + 1.0 / 16.0 + 9.0 / 6.0)).abs() < 1e-9,
        "{secs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_are_let_go_by_time_and_by_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let body = json!({ "prompt": "a fox", "size": "32x32", "frames": 5, "steps": 1 });
    for (retention, after) in [
        // A budget smaller than one clip: it goes as soon as it is finished.
        (
            Retention {
                max_bytes: 1,
                ..Retention::default()
            },
            Duration::ZERO,
        ),
        // Kept for a second, then gone.
        (
            Retention {
                ttl: Duration::from_secs(1),
                ..Retention::default()
            },
            Duration::from_millis(1200),
        ),
    ] {
        let (app, _) = common::server::start(model.clone(), setup(1, false, retention)).await;
        let (s, _, v) = post(&app, "/v1/videos", body.clone()).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        let id = v["id"].as_str().unwrap().to_string();
        let (v, _) = poll(&app, &id).await;
        assert_eq!(v["status"], "completed", "{v}");
        let content = format!("/v1/videos/{id}/content");
        if !after.is_zero() {
            assert_eq!(call(&app, "GET", &content, None).await.0, StatusCode::OK);
            tokio::time::sleep(after).await;
        }
        let (s, _, b) = call(&app, "GET", &content, None).await;
        let e: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(s, StatusCode::GONE, "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("no longer kept"),
            "{e}"
        );
        assert_eq!(video(&app, &id).await["expired"], true);
    }
}

/// The request the API builds from a body with these fields (prompt families).
fn request(
    prompt: &str,
    w: usize,
    h: usize,
    frames: usize,
    steps: usize,
    g: (f32, f32),
    seed: u64,
) -> Request {
    let tokens = bounds().request.max_prompt_tokens as usize;
    common::server::prompt_request(prompt, (w, h, frames), steps, g, seed, tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_images_and_videos_at_dp2_match_each_alone() {
    mixed_match_each_alone(1).await;
}

/// The same with each of the two groups splitting its requests over two ranks
/// (sequence parallelism): the server still sees two ranks, and every output is the one
/// the request makes alone on one rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_images_and_videos_on_two_groups_of_two_ranks_match_each_alone() {
    mixed_match_each_alone(2).await;
}

async fn mixed_match_each_alone(sp: usize) {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let (app, sched) = common::server::start_split(
        model.clone(),
        setup(2, false, Retention::default()),
        layerwise_engine::decode::DecodeSite::Host,
        sp,
    )
    .await;
    // Images (one frame) and clips of different sizes, lengths and step counts, with
    // different guidance per expert, all in flight at once: the ranks run different
    // requests in lockstep, each pass over the group (text encoder, expert) its own needs.
    let jobs: Vec<(&str, Request)> = vec![
        (
            "video",
            request("a fox in snow", 48, 32, 9, 4, (5.0, 3.0), 1),
        ),
        ("image", request("a red kite", 32, 32, 1, 3, (4.0, 2.0), 2)),
        (
            "video",
            request("waves at dusk", 32, 48, 5, 2, (1.0, 1.0), 3),
        ),
        (
            "image",
            request("a lighthouse", 48, 48, 1, 5, (6.0, 6.0), 4),
        ),
        (
            "video",
            request("rain on a window", 32, 32, 13, 3, (3.0, 0.0), 5),
        ),
    ];
    let ids = common::server::submit(&app, &jobs).await;
    let opts = EngineOptions {
        strategy: Strategy::Resident,
        dp: 1,
        decode: false,
        ..EngineOptions::default()
    };
    let vae = model.decoder(&candle_core::Device::Cpu).unwrap();
    for (id, (kind, r)) in ids.iter().zip(&jobs) {
        let uri = if *kind == "video" {
            let (v, _) = poll(&app, id).await;
            assert_eq!(v["status"], "completed", "{v}");
            format!("/v1/videos/{id}/content")
        } else {
            let deadline = Instant::now() + Duration::from_secs(120);
            while get_json(&app, &format!("/v1/jobs/{id}")).await["state"] != "succeeded" {
                assert!(Instant::now() < deadline, "image job {id} never finished");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            format!("/v1/jobs/{id}/result")
        };
        let (s, _, served) = call(&app, "GET", &uri, None).await;
        assert_eq!(s, StatusCode::OK);
        let (out, _) = model.run(vec![r.clone()], &opts).unwrap();
        let k = if *kind == "video" {
            Kind::Video { fps: 16.0 }
        } else {
            Kind::Image
        };
        let alone = make_media(vae.as_ref(), &out[0].latents, k, |_| {}).unwrap();
        assert!(
            served == alone.bytes,
            "{kind} {id} (seed {}) differs from the same request run alone",
            r.seed
        );
        if *kind == "video" {
            assert_eq!(
                ffprobe(&served),
                format!("h264,{},{},{}", r.width, r.height, r.frames)
            );
        }
    }
    assert_eq!(
        sched
            .shared
            .stale
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
