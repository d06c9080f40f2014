//! One request per error class of the API (docs/serving.md's table), each answered with
//! its status and `error.type`: the 4xx for what the client sent, the 5xx for the server's
//! own failures with their cause in the message.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};

use common::server::{call, image_bounds, post, send, slow_copies, Setup};
use layerwise_engine::checkpoint::Header;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::pipeline::{Hook, Stage};
use layerwise_engine::server::scheduler::Retention;

fn setup(max_queue: usize, hook: Option<Hook>, retention: Retention, timeout: u64) -> Setup {
    Setup {
        dp: 1,
        max_queue,
        hook,
        bounds: image_bounds(),
        retention,
        name: "tiny",
        timeout: Duration::from_secs(timeout),
    }
}

/// The answer's status and `error.type`, checked together; returns the error body.
fn expect(answer: (StatusCode, Value), status: StatusCode, kind: &str) -> Value {
    let (s, v) = answer;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (status, Some(kind)),
        "{v}"
    );
    assert!(!v["error"]["message"].as_str().unwrap().is_empty(), "{v}");
    v
}

async fn get(app: &Router, uri: &str) -> (StatusCode, Value) {
    let (s, _, b) = call(app, "GET", uri, None).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

async fn submit(app: &Router, body: Value) -> String {
    let (s, _, v) = post(app, "/v1/jobs", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn wait_state(app: &Router, id: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (s, st) = get(app, &format!("/v1/jobs/{id}")).await;
        assert_eq!(s, StatusCode::OK, "{st}");
        if st["state"] == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} never reached {want}: {st}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every 4xx the API answers on its own, on one server: the client's mistakes, each named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_error_class_answers_with_its_status_and_type() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    // No bytes kept for finished outputs: a finished job's result is at once a 410.
    let retention = Retention {
        max_bytes: 0,
        ..Retention::default()
    };
    let (app, _sched) =
        common::server::start(model, setup(2, Some(slow_copies()), retention, 60)).await;

    // 400: a body that is not JSON.
    let (s, _, b) = call(&app, "POST", "/v1/jobs", Some(b"{not json".to_vec())).await;
    expect(
        (s, serde_json::from_slice(&b).unwrap()),
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    // 415: a body in a media type the API does not read.
    let body = json!({ "class_label": 1 }).to_string().into_bytes();
    let (s, _, b) = send(&app, "POST", "/v1/jobs", "text/plain", Some(body)).await;
    expect(
        (s, serde_json::from_slice(&b).unwrap()),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    // 413: a body over the limit.
    let big = json!({ "class_label": 1, "user": "x".repeat(image_bounds().body_limit) });
    let (s, _, v) = post(&app, "/v1/jobs", big).await;
    expect((s, v), StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    // 422: a field outside what the engine can do, named.
    let (s, _, v) = post(&app, "/v1/jobs", json!({ "class_label": 1, "steps": 0 })).await;
    let v = expect((s, v), StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    assert_eq!(v["error"]["field"], "steps", "{v}");
    // 404: a job the server does not know.
    expect(
        get(&app, "/v1/jobs/no-such-job").await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    // 410: a finished job whose output is no longer kept.
    let done = submit(&app, json!({ "class_label": 1, "steps": 2 })).await;
    wait_state(&app, &done, "succeeded").await;
    expect(
        get(&app, &format!("/v1/jobs/{done}/result")).await,
        StatusCode::GONE,
        "expired",
    );
    // 409: the result of a job still running.
    let long = submit(&app, json!({ "class_label": 1, "steps": 1000 })).await;
    wait_state(&app, &long, "running").await;
    expect(
        get(&app, &format!("/v1/jobs/{long}/result")).await,
        StatusCode::CONFLICT,
        "conflict",
    );
    // 429: the queue at capacity (the running job and two queued outputs hold it).
    submit(&app, json!({ "class_label": 2, "steps": 2, "n": 2 })).await;
    let (s, h, v) = post(&app, "/v1/jobs", json!({ "class_label": 2, "steps": 2 })).await;
    expect((s, v), StatusCode::TOO_MANY_REQUESTS, "queue_full");
    assert!(h.contains_key("retry-after"));
    let (s, _, _) = call(&app, "DELETE", &format!("/v1/jobs/{long}"), None).await;
    assert_eq!(s, StatusCode::OK);
}

/// Overwrites every value of tensor `name` in the tiny model's transformer with NaN.
fn poison_weight(model: &Path, name: &str) {
    let path = model.join("transformer/diffusion_pytorch_model.safetensors");
    let t = Header::read(&path)
        .unwrap()
        .tensors
        .into_iter()
        .find(|t| t.name == name)
        .unwrap();
    let nan: Vec<u8> = f32::NAN
        .to_le_bytes()
        .into_iter()
        .cycle()
        .take(t.len as usize)
        .collect();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&nan, t.offset).unwrap();
}

/// A 500: the request's own failure on the server (weights holding NaN), its cause in the
/// message; the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_of_the_servers_own_is_a_500_naming_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let m = common::tiny(dir.path(), 2);
    poison_weight(&m, "transformer_blocks.1.attn1.to_q.weight");
    let model = Arc::new(Model::open(&m).unwrap());
    let (app, _sched) =
        common::server::start(model, setup(4, None, Retention::default(), 60)).await;
    let body = json!({ "class_label": 1, "steps": 2, "response_format": "b64_json" });
    let (s, _, v) = post(&app, "/v1/images/generations", body).await;
    let v = expect((s, v), StatusCode::INTERNAL_SERVER_ERROR, "not_finite");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("NaN") && msg.contains("weights"), "{v}");
    assert_eq!(v["error"]["field"], Value::Null, "{v}");
    assert_eq!(get(&app, "/healthz").await.0, StatusCode::OK);
}

/// A 503: after a rank fails the server takes nothing more, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_engine_fails_requests_are_503_naming_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let copies = Arc::new(AtomicUsize::new(0));
    let stall: Hook = Arc::new(move |s: Stage| {
        if s == Stage::Copy && copies.fetch_add(1, Ordering::Relaxed) == 10 {
            std::thread::sleep(Duration::from_secs(4));
        }
    });
    let (app, _sched) =
        common::server::start(model, setup(4, Some(stall), Retention::default(), 1)).await;
    let id = submit(&app, json!({ "class_label": 1, "steps": 50 })).await;
    wait_state(&app, &id, "failed").await;
    let (s, _, v) = post(&app, "/v1/jobs", json!({ "class_label": 1, "steps": 2 })).await;
    let v = expect((s, v), StatusCode::SERVICE_UNAVAILABLE, "unavailable");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("engine failed") && msg.contains("rank"), "{v}");
}
