//! The HTTP API in process: a real engine behind the router, driven with `oneshot`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request as HttpRequest, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::decode::DecodeSite;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::pipeline::{Hook, Stage};
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::server;
use layerwise_engine::server::api::{app, AppState, Bounds};
use layerwise_engine::server::forward::Forwarding;
use layerwise_engine::server::ids::JobIds;
use layerwise_engine::server::scheduler::{Retention, Scheduler};
use layerwise_engine::Strategy;

/// Slows every copy a little so long jobs stay running long enough to be cancelled.
pub fn slow_copies() -> Hook {
    Arc::new(|s: Stage| {
        if s == Stage::Copy {
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

/// The bounds of an image server on the tiny DiT: up to 128 px, 2000 steps, 3 images, a
/// 4096-byte body.
#[allow(dead_code)] // Not every test binary that includes this module serves images.
pub fn image_bounds() -> Bounds {
    Bounds {
        request: layerwise_engine::bounds::RequestBounds {
            max_width: 128,
            max_height: 128,
            max_frames: 1,
            max_steps: 2000,
            max_n: 3,
            guidance: true,
            max_prompt_tokens: 512,
        },
        body_limit: 4096,
        body_timeout: Duration::from_secs(30),
    }
}

/// What a test server runs with.
pub struct Setup {
    pub dp: usize,
    pub max_queue: usize,
    pub hook: Option<Hook>,
    pub bounds: Bounds,
    pub retention: Retention,
    pub name: &'static str,
    /// How long a transfer or a peer may stall before the rank fails.
    pub timeout: Duration,
}

/// Starts the engine (offload-sharded, two slots) and waits until every rank is ready.
pub async fn start(model: Arc<Model>, s: Setup) -> (Router, Scheduler) {
    start_decoding(model, s, DecodeSite::Host).await
}

/// As [`start`], decoding at `decode`.
pub async fn start_decoding(
    model: Arc<Model>,
    s: Setup,
    decode: DecodeSite,
) -> (Router, Scheduler) {
    start_split(model, s, decode, 1).await
}

/// As [`start_decoding`], each of the `s.dp` groups of `sp` ranks splitting its requests'
/// sequences.
pub async fn start_split(
    model: Arc<Model>,
    s: Setup,
    decode: DecodeSite,
    sp: usize,
) -> (Router, Scheduler) {
    let (state, scheduler) = start_state(model, s, decode, sp).await;
    (app(state), scheduler)
}

/// As [`start_split`], the router's state not yet made a router (for a test that changes
/// it). Its callers may list jobs without a credential (`--anonymous-list`), as the tests
/// that do not test ownership send none.
pub async fn start_state(
    model: Arc<Model>,
    s: Setup,
    decode: DecodeSite,
    sp: usize,
) -> (AppState, Scheduler) {
    let opts = EngineOptions {
        strategy: Strategy::OffloadSharded,
        dp: s.dp,
        sp,
        slots: SlotsChoice::Fixed(2),
        decode: false,
        timeout: s.timeout,
        hook: s.hook,
        ..EngineOptions::default()
    };
    let e = server::start(
        model.clone(),
        opts,
        decode,
        s.max_queue,
        s.retention,
        JobIds::local(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while e.scheduler.shared.ready().is_err() {
        assert!(Instant::now() < deadline, "engine never became ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let state = AppState {
        scheduler: e.scheduler.clone(),
        model,
        model_name: s.name.into(),
        bounds: s.bounds,
        forwarding: Forwarding::default(),
        sp,
        anonymous_list: true,
        cache: None,
    };
    (state, e.scheduler)
}

/// One request with a body of `content_type`.
pub async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    content_type: &str,
    body: Option<Vec<u8>>,
) -> (StatusCode, HeaderMap, Vec<u8>) {
    let req = HttpRequest::builder()
        .method(method)
        .uri(uri)
        .header("content-type", content_type)
        .body(body.map(Body::from).unwrap_or_else(Body::empty))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = r.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

pub async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    body: Option<Vec<u8>>,
) -> (StatusCode, HeaderMap, Vec<u8>) {
    send(app, method, uri, "application/json", body).await
}

pub async fn post(app: &Router, uri: &str, v: Value) -> (StatusCode, HeaderMap, Value) {
    let (s, h, b) = call(app, "POST", uri, Some(v.to_string().into_bytes())).await;
    (s, h, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// A prompt request of `size` (width, height, frames) and `steps`, guided by `g` (the
/// first expert's scale, the second's), its prompt cut to the server's token bound.
#[allow(dead_code)] // Not every test binary that includes this module builds requests.
pub fn prompt_request(
    prompt: &str,
    size: (usize, usize, usize),
    steps: usize,
    g: (f32, f32),
    seed: u64,
    max_prompt_tokens: usize,
) -> layerwise_engine::execution::work::Request {
    use layerwise_engine::execution::work::{Condition, Request, DEFAULT_MAX_SEQUENCE_LENGTH};
    let (w, h, frames) = size;
    Request {
        seed,
        steps,
        guidance: g.0,
        guidance_2: Some(g.1),
        frames,
        max_sequence_length: DEFAULT_MAX_SEQUENCE_LENGTH.min(max_prompt_tokens),
        ..Request::image(
            Condition::Prompt {
                prompt: prompt.into(),
                negative: None,
            },
            w,
            h,
        )
    }
}

/// Submits each prompt request as the API's clients do, to `/v1/videos` where its kind is
/// "video" (with its frames, at 16 fps) and to `/v1/jobs` otherwise; returns the job ids.
#[allow(dead_code)] // Not every test binary that includes this module submits jobs.
pub async fn submit(
    app: &Router,
    jobs: &[(&str, layerwise_engine::execution::work::Request)],
) -> Vec<String> {
    use layerwise_engine::execution::work::Condition;
    let mut ids = Vec::new();
    for (kind, r) in jobs {
        let Condition::Prompt { prompt, .. } = &r.condition else {
            panic!("submit takes prompt requests");
        };
        let mut body = serde_json::json!({
            "prompt": prompt, "size": format!("{}x{}", r.width, r.height), "steps": r.steps,
            "guidance": r.guidance, "guidance_2": r.guidance_2, "seed": r.seed,
        });
        let uri = if *kind == "video" {
            body["frames"] = serde_json::json!(r.frames);
            body["fps"] = serde_json::json!(16);
            "/v1/videos"
        } else {
            "/v1/jobs"
        };
        let (s, _, v) = post(app, uri, body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    ids
}

pub async fn get_json(app: &Router, uri: &str) -> Value {
    let (s, _, b) = call(app, "GET", uri, None).await;
    assert_eq!(s, StatusCode::OK, "{uri}: {}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).unwrap()
}

/// A 422 (or other error) body names `field`, in `error.field` and in its message.
pub fn assert_field(v: &Value, field: &str) {
    assert_eq!(v["error"]["field"], field, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(field),
        "{v}"
    );
}
