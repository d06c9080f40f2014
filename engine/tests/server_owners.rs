//! Jobs belong to the credential that created them (the `Authorization: Bearer` token, kept
//! as a hash): a list holds only the caller's jobs, and another caller's job is not found,
//! to read, download, cancel or delete; without a credential the list is off unless the
//! operator turns it on, and the OpenAPI document says so. Then a client that sends its
//! request and half-closes its connection: the job is answered or cancelled, never run for
//! nobody.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request as HttpRequest, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

use common::server::{slow_copies, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::decode::DecodeSite;
use layerwise_engine::engine::Model;
use layerwise_engine::http::HttpLimits;
use layerwise_engine::server::api::{app, Bounds};
use layerwise_engine::server::ids::Owner;
use layerwise_engine::server::scheduler::{JobState, Retention, Scheduler};

fn setup(hook: bool) -> Setup {
    Setup {
        dp: 1,
        max_queue: 16,
        hook: hook.then(slow_copies),
        bounds: Bounds {
            request: RequestBounds {
                max_width: 64,
                max_height: 64,
                max_frames: 9,
                max_steps: 400,
                max_n: 2,
                guidance: true,
                max_prompt_tokens: 24,
            },
            body_limit: 8192,
            body_timeout: Duration::from_secs(30),
        },
        retention: Retention::default(),
        name: "wan-tiny",
        timeout: Duration::from_secs(60),
    }
}

async fn start(dir: &std::path::Path, anonymous_list: bool, hook: bool) -> (Router, Scheduler) {
    let model = Arc::new(Model::open(&common::wan_tiny(dir, 2, 2)).unwrap());
    let (mut state, sched) =
        common::server::start_state(model, setup(hook), DecodeSite::Host, 1).await;
    state.anonymous_list = anonymous_list;
    (app(state), sched)
}

/// One request as `token` (none: anonymous).
async fn send(
    app: &Router,
    token: Option<&str>,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, HeaderMap, Value) {
    let mut req = HttpRequest::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", t);
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = r.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, parts.headers, v)
}

const A: Option<&str> = Some("Bearer sk-alice");
const B: Option<&str> = Some("Bearer sk-bob");

async fn create(app: &Router, token: Option<&str>, uri: &str) -> String {
    let body = json!({ "prompt": "a fox", "size": "32x32", "steps": 1 });
    let body = if uri == "/v1/videos" {
        json!({ "prompt": "a fox", "size": "32x32", "frames": 1, "steps": 1 })
    } else {
        body
    };
    let (s, _, v) = send(app, token, "POST", uri, Some(body)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn finish(app: &Router, token: Option<&str>, uri: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (s, _, v) = send(app, token, "GET", uri, None).await;
        assert_eq!(s, StatusCode::OK, "{uri}: {v}");
        let status = v["status"].as_str().or(v["state"].as_str()).unwrap();
        if ["completed", "succeeded"].contains(&status) {
            return;
        }
        assert!(!["failed", "cancelled"].contains(&status), "{v}");
        assert!(Instant::now() < deadline, "{uri} stuck: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn ids(list: &Value) -> Vec<&str> {
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_belong_to_the_credential_that_created_them() {
    let dir = tempfile::tempdir().unwrap();
    let (app, _) = start(dir.path(), false, false).await;
    let va = create(&app, A, "/v1/videos").await;
    let vb = create(&app, B, "/v1/videos").await;
    let vn = create(&app, None, "/v1/videos").await;
    let ja = create(&app, A, "/v1/jobs").await;
    for (token, v) in [(A, &va), (B, &vb), (None, &vn)] {
        finish(&app, token, &format!("/v1/videos/{v}")).await;
    }
    finish(&app, A, &format!("/v1/jobs/{ja}")).await;

    // Each credential lists its own; anonymous listing is off, saying how to list.
    let (s, _, list) = send(&app, A, "GET", "/v1/videos", None).await;
    assert_eq!((s, ids(&list)), (StatusCode::OK, vec![va.as_str()]));
    let (s, _, list) = send(&app, B, "GET", "/v1/videos", None).await;
    assert_eq!((s, ids(&list)), (StatusCode::OK, vec![vb.as_str()]));
    let (s, h, v) = send(&app, None, "GET", "/v1/videos", None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    assert_eq!(h["www-authenticate"], "Bearer");
    assert_eq!(v["error"]["type"], "unauthorized", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--anonymous-list"));

    // Another caller's job is not found, whatever it asks of it; its owner's is untouched.
    for (token, uri) in [
        (B, format!("/v1/videos/{va}")),
        (B, format!("/v1/videos/{va}/content")),
        (None, format!("/v1/videos/{va}")),
        (A, format!("/v1/videos/{vn}")),
        (B, format!("/v1/jobs/{ja}")),
        (B, format!("/v1/jobs/{ja}/result")),
        (None, format!("/v1/jobs/{ja}/result")),
    ] {
        let (s, _, v) = send(&app, token, "GET", &uri, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{token:?} GET {uri}: {v}");
    }
    for (token, uri) in [
        (B, format!("/v1/videos/{va}")),
        (B, format!("/v1/jobs/{ja}")),
    ] {
        let (s, _, v) = send(&app, token, "DELETE", &uri, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{token:?} DELETE {uri}: {v}");
    }
    for (token, uri) in [
        (A, format!("/v1/videos/{va}/content")),
        (A, format!("/v1/jobs/{ja}/result")),
        (None, format!("/v1/videos/{vn}/content")),
    ] {
        let (s, _, _) = send(&app, token, "GET", &uri, None).await;
        assert_eq!(s, StatusCode::OK, "{token:?} GET {uri}");
    }
    let (s, _, v) = send(&app, A, "DELETE", &format!("/v1/videos/{va}"), None).await;
    assert_eq!((s, &v["deleted"]), (StatusCode::OK, &json!(true)), "{v}");

    // A credential that is not a bearer token is refused, not taken as anonymous.
    for bad in ["Basic YWxpY2U6cHc=", "Bearer ", "sk-alice"] {
        let (s, _, v) = send(&app, Some(bad), "GET", &format!("/v1/videos/{vn}"), None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{bad}: {v}");
    }

    // The document says so.
    let (_, _, doc) = send(&app, None, "GET", "/openapi.json", None).await;
    let list = &doc["paths"]["/v1/videos"]["get"];
    assert!(list["responses"]["401"].is_object(), "{list}");
    assert!(list["description"]
        .as_str()
        .unwrap()
        .contains("--anonymous-list"));
    for (path, method) in [
        ("/v1/videos", "post"),
        ("/v1/jobs", "post"),
        ("/v1/images/generations", "post"),
    ] {
        let op = &doc["paths"][path][method];
        assert!(op["responses"]["401"].is_object(), "{path}: {op}");
    }
    assert!(doc["components"]["schemas"]["JobStatus"]["properties"]["owner"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_anonymous_listing_on_anonymous_callers_list_the_anonymous_jobs_only() {
    let dir = tempfile::tempdir().unwrap();
    let (app, _) = start(dir.path(), true, false).await;
    let _va = create(&app, A, "/v1/videos").await;
    let vn = create(&app, None, "/v1/videos").await;
    let (s, _, list) = send(&app, None, "GET", "/v1/videos", None).await;
    assert_eq!((s, ids(&list)), (StatusCode::OK, vec![vn.as_str()]));
}

/// Posts `body` to `uri` over TCP and half-closes once `sched` holds one more job of `kind`
/// than `before` (or at once when `early`), then reads what comes back until the server
/// closes.
async fn post_and_half_close(
    addr: std::net::SocketAddr,
    uri: &str,
    body: &Value,
    sched: &Scheduler,
    kind: &'static str,
    early: bool,
) -> Vec<u8> {
    let before = sched.list(kind).await.len();
    let body = body.to_string();
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {uri} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).await.unwrap();
    c.write_all(body.as_bytes()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !early && sched.list(kind).await.len() == before {
        assert!(Instant::now() < deadline, "{uri}: no job was made");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    c.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), c.read_to_end(&mut got))
        .await
        .expect("the server neither answered nor closed")
        .ok();
    got
}

/// How long an answer takes between its handler and the connection in the test below: the
/// client's half-close lands in that time, as it may on a loaded server between a job's
/// submission and its answer's first byte.
const SLOW_ANSWER: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_half_closes_is_answered_or_its_job_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let (app, sched) = start(dir.path(), false, true).await;
    let app = app.layer(axum::middleware::map_response(
        |r: axum::response::Response| async move {
            tokio::time::sleep(SLOW_ANSWER).await;
            r
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(10),
        max_connections: 16,
        drain: Duration::from_secs(1),
    };
    tokio::spawn(layerwise_engine::http::serve(
        listener,
        app,
        limits,
        std::future::pending(),
    ));
    let image = json!({ "prompt": "a fox", "size": "32x32", "steps": 200 });
    let video = json!({ "prompt": "a fox", "size": "32x32", "frames": 5, "steps": 200 });
    for (uri, kind, body, early) in [
        ("/v1/jobs", "image", &image, false),
        ("/v1/videos", "video", &video, false),
        ("/v1/images/generations", "image", &image, false),
        ("/v1/jobs", "image", &image, true),
        ("/v1/videos", "video", &video, true),
    ] {
        let before = sched.list(kind).await.len();
        let answer = post_and_half_close(addr, uri, body, &sched, kind, early).await;
        let text = String::from_utf8_lossy(&answer);
        let jobs = sched.list(kind).await;
        let first = text.lines().next().unwrap_or("nothing");
        eprintln!(
            "{uri} (half-closed early: {early}): {first}, {} job(s)",
            jobs.len() - before
        );
        if answer.is_empty() {
            // No answer: whatever job the request made must not run to its end.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let jobs = sched.list(kind).await;
                let live: Vec<_> = jobs.iter().filter(|j| !j.state.terminal()).collect();
                if live.is_empty() {
                    for j in &jobs[..jobs.len() - before] {
                        assert_eq!(j.state, JobState::Cancelled, "{uri}: {j:?}");
                        assert!(j.steps_done < j.steps_total, "{uri}: ran to its end: {j:?}");
                    }
                    break;
                }
                assert!(Instant::now() < deadline, "{uri}: still running: {live:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        } else {
            // Answered on the half-closed connection: the client has its job.
            assert!(text.starts_with("HTTP/1.1 20"), "{uri}: {text}");
            assert_eq!(jobs.len(), before + 1, "{uri}");
            // It need not run on for this test.
            if let Ok(Owner::Here(n)) = sched.shared.ids.parse(&jobs[0].id) {
                sched.cancel(n).await.unwrap();
            }
        }
    }
}
