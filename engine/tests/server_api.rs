//! The HTTP API driven in-process (`oneshot` on the router) over a real engine on a tiny
//! model: every status code, cancellation of queued and running jobs, and mixed step
//! counts in flight at once giving the same PNGs as the same requests run alone.

mod common;

use std::collections::BTreeSet;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use base64::Engine as _;
use serde_json::{json, Value};

use common::server::{assert_field, call, image_bounds, post, send, slow_copies, Setup};
use layerwise_engine::engine::Model;
use layerwise_engine::execution::pipeline::Hook;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::{Condition, Request};
use layerwise_engine::media::image::encode_png;
use layerwise_engine::server::api::{app, AppState};
use layerwise_engine::server::forward::Forwarding;
use layerwise_engine::server::ids::JobIds;
use layerwise_engine::server::openai_fields::{OpenAiImageFields, OpenAiVideoFields};
use layerwise_engine::server::scheduler::{DecodeJob, Retention, Scheduler};
use layerwise_engine::server::ApiError;
use layerwise_engine::Strategy;

/// The API over a scheduler of `dp` ranks that never report ready (none is started), and
/// the decoder's end of its queue, to keep while the API is used.
fn unready(model: Arc<Model>, dp: usize) -> (Router, Receiver<DecodeJob>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let (sched, _source) =
        layerwise_engine::server::actor::start(dp, 4, Retention::default(), JobIds::local(), tx);
    let app = app(AppState {
        scheduler: sched,
        model,
        model_name: "tiny".into(),
        bounds: image_bounds(),
        forwarding: Forwarding::default(),
        sp: 1,
        anonymous_list: false,
        cache: None,
    });
    (app, rx)
}

async fn start(
    model: Arc<Model>,
    dp: usize,
    max_queue: usize,
    hook: Option<Hook>,
) -> (Router, Scheduler) {
    start_keeping(model, dp, max_queue, hook, Retention::default()).await
}

async fn start_keeping(
    model: Arc<Model>,
    dp: usize,
    max_queue: usize,
    hook: Option<Hook>,
    retention: Retention,
) -> (Router, Scheduler) {
    let setup = Setup {
        dp,
        max_queue,
        hook,
        bounds: image_bounds(),
        retention,
        name: "tiny",
        timeout: Duration::from_secs(60),
    };
    common::server::start(model, setup).await
}

/// A copy that stalls mid-request (the 40th one sleeps past the engine's timeout): the rank
/// fails with the cause, every request in flight fails naming it, and the server turns
/// unhealthy (its process would exit 1) instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_stalls_mid_request_fails_what_is_in_flight_and_the_pod() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let copies = Arc::new(AtomicUsize::new(0));
    let stall: Hook = Arc::new(move |s: layerwise_engine::execution::pipeline::Stage| {
        if s == layerwise_engine::execution::pipeline::Stage::Copy
            && copies.fetch_add(1, Ordering::Relaxed) == 40
        {
            std::thread::sleep(Duration::from_secs(6));
        }
    });
    let setup = Setup {
        dp: 2,
        max_queue: 8,
        hook: Some(stall),
        bounds: image_bounds(),
        retention: Retention::default(),
        name: "tiny",
        timeout: Duration::from_secs(1),
    };
    let (app, sched) = common::server::start(model, setup).await;
    let mut ids = Vec::new();
    for seed in 0..3 {
        let (s, _, v) = post(
            &app,
            "/v1/jobs",
            json!({ "class_label": 1, "steps": 200, "seed": seed }),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    for id in &ids {
        let st = wait_state(&app, id, &["failed", "succeeded"]).await;
        assert_eq!(st["state"], "failed", "{st}");
        assert!(
            st["error"].as_str().unwrap().contains("engine failed"),
            "{st}"
        );
    }
    let why = sched
        .shared
        .failed
        .lock()
        .unwrap()
        .clone()
        .expect("the pod is marked failed");
    assert!(why.contains("rank"), "{why}");
    assert_eq!(
        call(&app, "GET", "/healthz", None).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        call(&app, "GET", "/readyz", None).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

/// `layerwise_running_requests` as the autoscaler and the watchdog read it.
fn running(sched: &Scheduler) -> i64 {
    sched.shared.metrics.running.get()
}

async fn wait_idle(sched: &Scheduler) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while running(sched) != 0 {
        assert!(
            Instant::now() < deadline,
            "the running count never returned to 0: {}",
            running(sched)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn status(app: &Router, id: &str) -> Value {
    let (s, _, b) = call(app, "GET", &format!("/v1/jobs/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    serde_json::from_slice(&b).unwrap()
}

async fn wait_state(app: &Router, id: &str, want: &[&str]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = status(app, id).await;
        if want.contains(&st["state"].as_str().unwrap()) {
            return st;
        }
        assert!(Instant::now() < deadline, "job {id} stuck in {st}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_is_503() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    // A scheduler whose ranks never report ready.
    let (app, _decoder) = unready(model, 2);
    let (s, _, _) = call(&app, "GET", "/readyz", None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let (s, _, v) = post(&app, "/v1/images/generations", json!({ "class_label": 1 })).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("0 of 2 ranks ready"),
        "{v}"
    );
    let (s, _, _) = call(&app, "GET", "/healthz", None).await;
    assert_eq!(s, StatusCode::OK, "alive while starting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_status_code_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let (app, _) = start(model.clone(), 1, 2, Some(slow_copies())).await;

    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            call(&app, "GET", path, None).await.0,
            StatusCode::OK,
            "{path}"
        );
    }
    let (s, _, b) = call(&app, "GET", "/openapi.json", None).await;
    assert_eq!(s, StatusCode::OK);
    let doc: Value = serde_json::from_slice(&b).unwrap();
    for p in [
        "/v1/models",
        "/v1/models/{model}",
        "/v1/images/generations",
        "/v1/videos",
        "/v1/videos/{id}",
        "/v1/videos/{id}/content",
        "/v1/jobs",
        "/v1/jobs/{id}",
        "/v1/jobs/{id}/result",
    ] {
        assert!(
            doc["paths"].get(p).is_some(),
            "{p} missing from the OpenAPI document"
        );
    }

    // 400: not JSON / not an object.
    let (s, _, b) = call(
        &app,
        "POST",
        "/v1/images/generations",
        Some(b"{nope".to_vec()),
    )
    .await;
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(
        post(&app, "/v1/jobs", json!([1, 2])).await.0,
        StatusCode::BAD_REQUEST
    );
    // 422, naming the field.
    for (body, field) in [
        (json!({ "class_label": 1, "prompt": "a cat" }), "prompt"),
        (json!({}), "class_label"),
        (json!({ "class_label": 5000 }), "class_label"),
        (json!({ "class_label": 1, "steps": 5000 }), "steps"),
        (json!({ "class_label": 1, "steps": "ten" }), "steps"),
        (json!({ "class_label": 1, "n": 4 }), "n"),
        (json!({ "class_label": 1, "size": "256x256" }), "size"),
        (json!({ "class_label": 1, "size": "60x64" }), "size"),
        (json!({ "class_label": 1, "size": "big" }), "size"),
        (json!({ "class_label": 1, "guidance": -1.0 }), "guidance"),
        (json!({ "class_label": 1, "guidance": 3.4e38 }), "guidance"),
        (
            json!({ "class_label": 1, "response_format": "gif" }),
            "response_format",
        ),
        (json!({ "class_label": 1, "colour": "red" }), "colour"),
        (
            json!({ "prompt": "goldfish", "class_label": 3 }),
            "class_label",
        ),
        (
            json!({ "prompt": "", "class_label": 1, "negative_prompt": "blur" }),
            "negative_prompt",
        ),
        (json!({ "class_label": 1, "guidance_2": 2.0 }), "guidance_2"),
        (
            json!({ "class_label": 1, "max_sequence_length": 8 }),
            "max_sequence_length",
        ),
    ] {
        let (s, _, v) = post(&app, "/v1/images/generations", body.clone()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body} -> {v}");
        assert_field(&v, field);
    }
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 1, "prompt": "x" }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("class-conditional"),
        "{v}"
    );
    // A DiT server makes no videos.
    let (s, _, v) = post(&app, "/v1/videos", json!({ "prompt": "goldfish" })).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "model");
    // The served model: listed, and any other name is a 404 as OpenAI answers.
    let (s, _, b) = call(&app, "GET", "/v1/models", None).await;
    assert_eq!(s, StatusCode::OK);
    let models: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    assert_eq!(models["data"][0]["family"], "dit", "{models}");
    assert_eq!(
        call(&app, "GET", "/v1/models/tiny", None).await.0,
        StatusCode::OK
    );
    assert_eq!(
        call(&app, "GET", "/v1/models/sora-2", None).await.0,
        StatusCode::NOT_FOUND
    );
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "model": "sora-2", "prompt": "goldfish" }),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("`tiny`"),
        "{v}"
    );
    // 415: only JSON (and OpenAI's multipart form) bodies, none a browser page could send
    // across origins unasked.
    for ct in ["text/plain", "application/x-www-form-urlencoded", ""] {
        let body = json!({ "class_label": 1, "steps": 1 })
            .to_string()
            .into_bytes();
        let (s, _, b) = send(&app, "POST", "/v1/jobs", ct, Some(body)).await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("content-type"),
            "{v}"
        );
    }
    // Unknown routes and methods and unreadable query strings answer JSON errors too (the
    // last on a job that exists: ids cannot be made up).
    let (s, _, job) = post(&app, "/v1/jobs", json!({ "class_label": 1, "steps": 1 })).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{job}");
    let bad_index = format!("/v1/jobs/{}/result?index=x", job["id"].as_str().unwrap());
    for (method, uri, code) in [
        ("GET", "/v2/nothing", StatusCode::NOT_FOUND),
        ("PUT", "/v1/jobs", StatusCode::METHOD_NOT_ALLOWED),
        ("GET", bad_index.as_str(), StatusCode::BAD_REQUEST),
    ] {
        let (s, _, b) = call(&app, method, uri, None).await;
        let v: Value = serde_json::from_slice(&b).unwrap_or_else(|_| {
            panic!("{method} {uri}: not JSON: {}", String::from_utf8_lossy(&b))
        });
        assert_eq!(s, code, "{method} {uri}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    // 413.
    let big = json!({ "class_label": 1, "pad": "x".repeat(5000) });
    assert_eq!(
        post(&app, "/v1/jobs", big).await.0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // 404.
    assert_eq!(
        call(&app, "GET", "/v1/jobs/ffff", None).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&app, "GET", "/v1/jobs/not-an-id/result", None).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&app, "DELETE", "/v1/jobs/ffff", None).await.0,
        StatusCode::NOT_FOUND
    );

    // 200, both formats; the url points at the job's PNG.
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 3, "steps": 2, "n": 2, "seed": 9 }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let png = base64::engine::general_purpose::STANDARD
        .decode(v["data"][1]["b64_json"].as_str().unwrap())
        .unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 3, "steps": 2, "n": 2, "seed": 9, "response_format": "url" }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, h, body) = call(&app, "GET", v["data"][1]["url"].as_str().unwrap(), None).await;
    assert_eq!(
        (s, h["content-type"].to_str().unwrap()),
        (StatusCode::OK, "image/png")
    );
    assert_eq!(body, png, "same request and seed, same PNG");
    // What OpenAI's client sends for a class-conditional model: `model` and a prompt naming
    // the class (ImageNet's names, from the folder's id2label), or an empty prompt beside
    // `class_label` in the extra body. Both draw class 1, as `class_label` 1 does.
    let by_label = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 1, "steps": 2, "seed": 4 }),
    )
    .await
    .2;
    for body in [
        json!({ "model": "tiny", "prompt": "Goldfish", "steps": 2, "seed": 4 }),
        json!({ "model": "tiny", "prompt": "", "class_label": 1, "steps": 2, "seed": 4 }),
        json!({ "prompt": "goldfish", "class_label": 1, "steps": 2, "seed": 4 }),
    ] {
        let (s, _, v) = post(&app, "/v1/images/generations", body.clone()).await;
        assert_eq!(s, StatusCode::OK, "{body} -> {v}");
        assert_eq!(
            v["data"][0]["b64_json"], by_label["data"][0]["b64_json"],
            "{body}"
        );
        assert_eq!(v["model"], "tiny");
    }

    // 202 + queue: a long job runs, the queue (2 images) fills, the next is 429.
    let (s, h, long) = post(&app, "/v1/jobs", json!({ "class_label": 1, "steps": 1000 })).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{long}");
    let long_id = long["id"].as_str().unwrap().to_string();
    assert_eq!(
        h["location"].to_str().unwrap(),
        format!("/v1/jobs/{long_id}")
    );
    let running = wait_state(&app, &long_id, &["running"]).await;
    assert!(running["steps_total"] == 1000, "{running}");
    let (s, _, queued) = post(
        &app,
        "/v1/jobs",
        json!({ "class_label": 2, "steps": 2, "n": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let queued_id = queued["id"].as_str().unwrap().to_string();
    assert_eq!(status(&app, &queued_id).await["queue_position"], 0);
    let (s, h, v) = post(&app, "/v1/jobs", json!({ "class_label": 2, "steps": 2 })).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(h["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    // 409: no result yet.
    assert_eq!(
        call(&app, "GET", &format!("/v1/jobs/{queued_id}/result"), None)
            .await
            .0,
        StatusCode::CONFLICT
    );
    // Cancel the queued job, then the running one.
    let (s, _, b) = call(&app, "DELETE", &format!("/v1/jobs/{queued_id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (v["state"].as_str(), &v["queue_position"]),
        (Some("cancelled"), &Value::Null)
    );
    let before = status(&app, &long_id).await["steps_done"].as_u64().unwrap();
    let (s, _, _) = call(&app, "DELETE", &format!("/v1/jobs/{long_id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        wait_state(&app, &long_id, &["cancelled"]).await["state"],
        "cancelled"
    );
    assert!(before < 1000);
    assert_eq!(
        call(&app, "GET", &format!("/v1/jobs/{long_id}/result"), None)
            .await
            .0,
        StatusCode::CONFLICT
    );
    // The rank is free again at its next step boundary: a new request completes.
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 4, "steps": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");

    let (_, _, m) = call(&app, "GET", "/metrics", None).await;
    let m = String::from_utf8(m).unwrap();
    for name in [
        "layerwise_queue_depth 0",
        "layerwise_running_requests 0",
        "layerwise_requests_finished_total{outcome=\"cancelled\"} 2",
        "layerwise_requests_rejected_total{reason=\"queue_full\"} 1",
        "layerwise_request_duration_seconds_bucket",
        "layerwise_step_duration_seconds_count",
        "layerwise_stall_seconds_total{rank=\"0\"}",
        "layerwise_copied_bytes_total{rank=\"0\"}",
        "layerwise_gathered_bytes_total{rank=\"0\"}",
        "layerwise_device_bytes{rank=\"0\"}",
        "layerwise_rank_busy_ratio{rank=\"0\"}",
        "layerwise_outputs_requested_total{modality=\"image\"}",
        "layerwise_frames_generated_total",
        "layerwise_queue_wait_seconds_bucket{le=\"3600.0\"}",
        "layerwise_engine_build_info{version=",
    ] {
        assert!(m.contains(name), "{name} missing from\n{m}");
    }
    // The page as served passes Prometheus' exposition and naming rules.
    assert_eq!(
        layerwise_engine::exposition::lint(&m),
        Vec::<String>::new(),
        "{m}"
    );
}

fn expected_png(model: &Model, r: &Request) -> Vec<u8> {
    let opts = EngineOptions {
        strategy: Strategy::Resident,
        dp: 1,
        decode: true,
        ..EngineOptions::default()
    };
    let (out, _) = model.run(vec![r.clone()], &opts).unwrap();
    encode_png(out[0].image.as_ref().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_steps_in_flight_match_each_request_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 3)).unwrap());
    let (app, sched) = start(model.clone(), 2, 16, None).await;
    // Different step counts, guidance and sizes, all submitted at once: ranks pick up the
    // next job as soon as theirs finishes, mid-way through the other rank's job.
    let specs = [
        (1u64, 7usize, 4.0f32, 64usize, 64usize),
        (2, 2, 1.0, 96, 64),
        (3, 5, 1.5, 64, 96),
        (4, 1, 0.0, 64, 64),
        (5, 3, 4.0, 64, 64),
    ];
    let mut ids = Vec::new();
    for (seed, steps, guidance, w, h) in specs {
        let body = json!({ "class_label": seed, "seed": seed, "steps": steps, "guidance": guidance, "size": format!("{w}x{h}") });
        let (s, _, v) = post(&app, "/v1/jobs", body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    for (id, (seed, steps, guidance, w, h)) in ids.iter().zip(specs) {
        let st = wait_state(&app, id, &["succeeded", "failed"]).await;
        assert_eq!(st["state"], "succeeded", "{st}");
        assert_eq!(st["steps_done"], steps);
        let (s, _, png) = call(&app, "GET", &format!("/v1/jobs/{id}/result"), None).await;
        assert_eq!(s, StatusCode::OK);
        let r = Request {
            seed,
            steps,
            guidance,
            ..Request::image(Condition::Class(seed as u32), w, h)
        };
        assert!(
            png == expected_png(&model, &r),
            "job {id} (seed {seed}, {steps} steps) differs from the same request run alone"
        );
    }
    let m = sched.shared.metrics.render();
    for r in 0..2 {
        let line = m
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "layerwise_rank_busy_seconds_total{{rank=\"{r}\"}}"
                ))
            })
            .unwrap();
        let busy: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(busy > 0.0, "rank {r} never computed: {line}");
    }
    assert_eq!(
        sched
            .shared
            .stale
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

/// Running jobs cancelled, then more jobs than the server keeps submitted and cancelled, so
/// the first ones are evicted while their images still run on the ranks: the ranks' late
/// reports must still take them out of the running count (it leaked, the watchdog then
/// failed the pod and the autoscaler saw phantom load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_evicted_while_running_leave_no_phantom_running_count() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let keep = Retention {
        keep_finished: 4,
        ..Retention::default()
    };
    let (app, sched) = start_keeping(model, 2, 16, Some(slow_copies()), keep).await;
    let mut long = Vec::new();
    for seed in 0..2 {
        let (s, _, v) = post(
            &app,
            "/v1/jobs",
            json!({ "class_label": 1, "steps": 1000, "seed": seed }),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        long.push(v["id"].as_str().unwrap().to_string());
    }
    for id in &long {
        wait_state(&app, id, &["running"]).await;
        assert_eq!(
            call(&app, "DELETE", &format!("/v1/jobs/{id}"), None)
                .await
                .0,
            StatusCode::OK
        );
    }
    // Enough finished jobs to evict the two cancelled ones before their ranks report.
    for _ in 0..10 {
        let (s, _, v) = post(&app, "/v1/jobs", json!({ "class_label": 2, "steps": 1000 })).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        let id = v["id"].as_str().unwrap();
        assert_eq!(
            call(&app, "DELETE", &format!("/v1/jobs/{id}"), None)
                .await
                .0,
            StatusCode::OK
        );
    }
    assert_eq!(
        call(&app, "GET", &format!("/v1/jobs/{}", long[0]), None)
            .await
            .0,
        StatusCode::NOT_FOUND,
        "the first cancelled job was evicted"
    );
    wait_idle(&sched).await;
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 3, "steps": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    wait_idle(&sched).await;
}

/// A burst of small jobs at a small queue: every job the server accepts succeeds (the
/// decoder's backlog counts against admission, so it can never overflow and fail accepted
/// work), and the rest are 429s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_accepted_job_of_a_burst_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let (app, sched) = start(model, 2, 3, None).await;
    let (mut accepted, mut refused) = (Vec::new(), 0);
    for seed in 0..60u64 {
        let (s, _, v) = post(
            &app,
            "/v1/jobs",
            json!({ "class_label": 1, "steps": 1, "seed": seed }),
        )
        .await;
        match s {
            StatusCode::ACCEPTED => accepted.push(v["id"].as_str().unwrap().to_string()),
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("{other}: {v}"),
        }
    }
    for id in &accepted {
        let st = wait_state(&app, id, &["succeeded", "failed"]).await;
        assert_eq!(st["state"], "succeeded", "an accepted job failed: {st}");
    }
    assert!(
        accepted.len() >= 3 && refused > 0,
        "{} accepted, {refused} refused",
        accepted.len()
    );
    wait_idle(&sched).await;
}

/// A deployment sized for unguided requests (`workload.guidance: false`): a scale above 1
/// is refused naming the field, and a request that names none runs unguided, as the plan
/// reserved activations for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unguided_deployments_refuse_guidance_and_run_unguided() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let mut b = image_bounds();
    b.request.guidance = false;
    let setup = Setup {
        dp: 1,
        max_queue: 4,
        hook: None,
        bounds: b,
        retention: Retention::default(),
        name: "tiny",
        timeout: Duration::from_secs(60),
    };
    let (app, _) = common::server::start(model.clone(), setup).await;
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 2, "guidance": 4.0, "size": "64x64" }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "guidance");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("unguided"),
        "{v}"
    );
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "class_label": 2, "steps": 2, "seed": 3, "size": "64x64" }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let png = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    let unguided = Request {
        seed: 3,
        steps: 2,
        guidance: 1.0,
        ..Request::image(Condition::Class(2), 64, 64)
    };
    assert!(
        png == expected_png(&model, &unguided),
        "not the unguided image"
    );
}

/// Two servers (two replicas behind one Service, or one pod before and after a restart)
/// never hand out the same job id, so a client that reaches the wrong one gets a 404, never
/// another client's job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_ids_are_unique_across_servers() {
    use layerwise_engine::server::kind::Kind;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        let (tx, _rx) = std::sync::mpsc::sync_channel(8);
        let (sched, _source) =
            layerwise_engine::server::actor::start(1, 8, Retention::default(), JobIds::local(), tx);
        for seed in 0..3 {
            let id = sched
                .submit(vec![common::request(seed, 1, 4.0)], Kind::Image)
                .await
                .unwrap();
            assert!(seen.insert(id), "id {id:016x} handed out twice");
        }
    }
}

#[test]
fn errors_map_to_one_status_each() {
    use layerwise_engine::Error;
    let cases: Vec<(Error, u16)> = vec![
        (Error::BadRequest { msg: "x".into() }, 400),
        (Error::NotFound { what: "job".into() }, 404),
        (Error::Conflict { what: "x".into() }, 409),
        (Error::Gone { what: "x".into() }, 410),
        (
            Error::ReplicaGone {
                job: "j".into(),
                owner: "10.0.0.1:8080".into(),
            },
            410,
        ),
        (
            Error::ReplicaUnreachable {
                job: "j".into(),
                owner: "10.0.0.1:8080".into(),
                msg: "x".into(),
            },
            502,
        ),
        (Error::PayloadTooLarge { limit: 1 }, 413),
        (
            Error::UnsupportedMediaType {
                content_type: "text/plain".into(),
            },
            415,
        ),
        (Error::invalid("steps", "too many"), 422),
        (
            Error::QueueFull {
                queued: 1,
                decoding: 0,
                capacity: 1,
                need: 1,
                retry_after: 2,
            },
            429,
        ),
        (Error::unavailable("starting"), 503),
        (
            Error::Rank {
                rank: 1,
                msg: "boom".into(),
            },
            500,
        ),
    ];
    for (e, code) in cases {
        assert_eq!(e.http_status(), code, "{e}");
        let r = axum::response::IntoResponse::into_response(ApiError::from(e));
        assert_eq!(r.status().as_u16(), code);
    }
}

/// The served OpenAPI document is the router's. Every operation it lists reaches that
/// route's handler (the router matched its path; no fallback answered), every other method
/// of the path is a 405, a path it does not list is the fallback's 404, and each request
/// schema holds exactly the fields its request type takes (the query parameters too), so a
/// field added to a type shows in the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_is_the_routers_and_the_request_types() {
    use axum::extract::{MatchedPath, Request};
    use axum::middleware::{self, Next};
    use layerwise_engine::server::requests::{
        ContentQuery, ImageRequest, ListQuery, ResultQuery, VideoRequest,
    };

    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    // No rank ever gets ready: every handler answers at once, without generating.
    let (app, _decoder) = unready(model, 1);
    let (s, h, b) = call(&app, "GET", "/openapi.json", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "application/json");
    let doc: Value = serde_json::from_slice(&b).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");

    // Which route the router matched for each request, if any (the fallback matches none).
    let app = app.layer(middleware::from_fn(|req: Request, next: Next| async move {
        let matched = req.extensions().get::<MatchedPath>().cloned();
        let mut r = next.run(req).await;
        if let Some(m) = matched {
            r.headers_mut()
                .insert("x-matched-path", m.as_str().parse().unwrap());
        }
        r
    }));
    let paths = doc["paths"].as_object().unwrap();
    let mut operations = 0;
    for (path, item) in paths {
        let uri = path
            .replace("{id}", "0123456789abcdef")
            .replace("{model}", "tiny");
        for method in ["get", "post", "put", "delete", "patch"] {
            let verb = method.to_uppercase();
            let body = (method == "post").then(|| b"{}".to_vec());
            let (s, h, b) = call(&app, &verb, &uri, body).await;
            let seen = format!("{verb} {uri}: {s} {}", String::from_utf8_lossy(&b));
            assert_eq!(
                h.get("x-matched-path").map(|v| v.to_str().unwrap()),
                Some(path.as_str()),
                "{seen}"
            );
            if item.get(method).is_some() {
                operations += 1;
                assert_ne!(s, StatusCode::METHOD_NOT_ALLOWED, "{seen}");
            } else {
                assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "{seen}");
            }
        }
    }
    // healthz, readyz, metrics, openapi.json and the twelve of the API (docs/serving.md).
    assert!(operations >= 16, "{}", doc["paths"]);
    for uri in ["/", "/v1", "/v1/images", "/v1/jobs/x/y", "/openapi.yaml"] {
        let (s, h, b) = call(&app, "GET", uri, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{uri}");
        assert!(h.get("x-matched-path").is_none(), "{uri}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("route `"),
            "{v}"
        );
    }

    // Every schema the document refers to is in it.
    let schemas = &doc["components"]["schemas"];
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let name = r.strip_prefix("#/components/schemas/").unwrap_or(&r);
        assert!(schemas.get(name).is_some(), "{r} refers to nothing");
    }

    // Request bodies: both content types, the schema of the request type, and its fields
    // with OpenAI's other fields the endpoint tolerates.
    let image_fields: BTreeSet<&str> = field_names::<ImageRequest>()
        .union(&field_names::<OpenAiImageFields>())
        .copied()
        .collect();
    let video_fields: BTreeSet<&str> = field_names::<VideoRequest>()
        .union(&field_names::<OpenAiVideoFields>())
        .copied()
        .collect();
    for (path, schema, fields) in [
        (
            "/v1/images/generations",
            "ImageRequest",
            image_fields.clone(),
        ),
        ("/v1/jobs", "ImageRequest", image_fields),
        ("/v1/videos", "VideoRequest", video_fields),
    ] {
        let content = &doc["paths"][path]["post"]["requestBody"]["content"];
        for ct in ["application/json", "multipart/form-data"] {
            assert_eq!(
                content[ct]["schema"]["$ref"],
                format!("#/components/schemas/{schema}"),
                "{path} {ct}"
            );
        }
        let documented: BTreeSet<&str> = schemas[schema]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(documented, fields, "{schema}");
        assert_eq!(
            schemas[schema]["additionalProperties"],
            json!(false),
            "{schema}"
        );
    }
    // Query strings: the path's parameters and the query type's fields.
    for (path, method, mut fields) in [
        ("/v1/videos", "get", field_names::<ListQuery>()),
        ("/v1/jobs/{id}/result", "get", field_names::<ResultQuery>()),
        (
            "/v1/videos/{id}/content",
            "get",
            field_names::<ContentQuery>(),
        ),
    ] {
        if path.contains("{id}") {
            fields.insert("id");
        }
        let documented: BTreeSet<&str> = doc["paths"][path][method]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(documented, fields, "{method} {path}");
    }
}

/// Every `$ref` under `v`.
fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get("$ref") {
                out.push(r.clone());
            }
            o.values().for_each(|x| collect_refs(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| collect_refs(x, out)),
        _ => {}
    }
}

/// The names serde reads a struct's fields by: what its derived `Deserialize` hands the
/// deserializer.
fn field_names<T: serde::de::DeserializeOwned>() -> BTreeSet<&'static str> {
    use serde::de::{self, Visitor};
    use std::cell::Cell;

    struct Names(Cell<&'static [&'static str]>);
    impl<'de> de::Deserializer<'de> for &Names {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0.set(fields);
            Err(de::Error::custom("names taken"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let names = Names(Cell::new(&[]));
    assert!(T::deserialize(&names).is_err());
    assert!(
        !names.0.get().is_empty(),
        "{} has no fields",
        std::any::type_name::<T>()
    );
    names.0.get().iter().copied().collect()
}
