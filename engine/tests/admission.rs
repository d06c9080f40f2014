//! What a server admits, found by an outside test of the video path and fixed here: bounds
//! the model cannot run (checked at start against the checkpoint, and a 422 before the
//! queue), numbers sent as strings, text that is not UTF-8 (JSON and multipart alike), and
//! job ids a client could guess from its own. Each class is sent to every generation
//! endpoint and to both families.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use clap::Parser;
use serde_json::{json, Value};

use common::server::{assert_field, call, get_json, post, send, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::engine::Model;
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::scheduler::Retention;
use layerwise_engine::server::ServeArgs;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn serve_args(model: &std::path::Path, flags: &[&str]) -> ServeArgs {
    let mut argv = vec!["layerwise", "--model", model.to_str().unwrap()];
    argv.extend_from_slice(flags);
    Cli::try_parse_from(argv).unwrap().serve
}

fn bounds(request: RequestBounds) -> Bounds {
    Bounds {
        request,
        body_limit: 8192,
        body_timeout: Duration::from_secs(30),
    }
}

/// Bounds the tiny models run well within.
fn small() -> RequestBounds {
    RequestBounds {
        max_width: 64,
        max_height: 64,
        max_frames: 17,
        max_steps: 50,
        max_n: 2,
        guidance: true,
        max_prompt_tokens: 24,
    }
}

async fn start(
    model: Arc<Model>,
    name: &'static str,
    request: RequestBounds,
    max_queue: usize,
) -> Router {
    let setup = Setup {
        dp: 1,
        max_queue,
        hook: None,
        bounds: bounds(request),
        retention: Retention::default(),
        name,
        timeout: Duration::from_secs(60),
    };
    common::server::start(model, setup).await.0
}

/// A multipart form of `fields`, each value the raw bytes given.
fn form(fields: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "AdMiSsIoN";
    let mut body = Vec::new();
    for (k, v) in fields {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(v);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// E1: the tiny Wan's rotary tables hold 32 positions per axis, so it runs at most 512 px
/// (32 patches of 16 px) and 125 frames (32 latent frames). `serve`'s defaults (1280 px, 81
/// frames) are lowered to that; bounds given beyond it are refused at start, naming the
/// flag. The planner reads the same limits from the profile (operator/tests/wan_plan.rs).
#[test]
fn serve_bounds_are_checked_against_the_model_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let wan = common::wan_tiny(dir.path(), 1, 1);
    let model = Model::open(&wan).unwrap();
    let limits = model.checkpoint.limits();
    assert_eq!(
        (limits.max_width, limits.max_height, limits.max_frames),
        (Some(512), Some(512), Some(125)),
        "{limits:?}"
    );
    let b = serve_args(&wan, &[]).request_bounds(&limits).unwrap();
    assert_eq!((b.max_width, b.max_height, b.max_frames), (512, 512, 81));
    let b = serve_args(&wan, &["--max-width", "256", "--max-frames", "125"])
        .request_bounds(&limits)
        .unwrap();
    assert_eq!((b.max_width, b.max_height, b.max_frames), (256, 512, 125));
    for (flag, value, max) in [
        ("--max-width", "1280", "512"),
        ("--max-height", "528", "512"),
        ("--max-frames", "129", "125"),
    ] {
        let e = serve_args(&wan, &[flag, value])
            .request_bounds(&limits)
            .unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.field(), Some(&flag[2..]), "{msg}");
        assert!(
            msg.contains(value) && msg.contains(max) && msg.contains("rope_max_seq_len"),
            "{msg}"
        );
    }
    // DiT computes its positions for any grid: nothing but memory bounds it.
    let dit = common::tiny(dir.path(), 2);
    let limits = Model::open(&dit).unwrap().checkpoint.limits();
    assert_eq!(limits, Default::default());
    let b = serve_args(&dit, &["--max-width", "4096"])
        .request_bounds(&limits)
        .unwrap();
    assert_eq!((b.max_width, b.max_height), (4096, 1280));
}

/// E1 as the outside test saw it: a server whose bounds were wider than its model (as
/// main's defaults were) took a 1280×1280, 81-frame video with 202, and the job failed on its
/// rank while holding the queue. Now the model's own check refuses it with a 422 naming the
/// size before it is queued, every endpoint alike, and valid work still gets in; the server
/// advertises the bounds it admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_models_tables_are_refused_before_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let wan = common::wan_tiny(dir.path(), 1, 1);
    let model = Arc::new(Model::open(&wan).unwrap());
    let wide = RequestBounds {
        max_width: 1280,
        max_height: 1280,
        max_frames: 81,
        max_steps: 50,
        max_n: 1,
        guidance: true,
        max_prompt_tokens: 24,
    };
    let app = start(model.clone(), "wan-tiny", wide, 2).await;
    // Three times the queue's capacity: none of them may take a place in it.
    for _ in 0..3 {
        for (uri, extra) in [
            ("/v1/videos", json!({ "frames": 81 })),
            ("/v1/jobs", json!({})),
            ("/v1/images/generations", json!({})),
        ] {
            let mut body = json!({ "prompt": "a fox", "size": "1280x1280", "steps": 2 });
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (s, _, v) = post(&app, uri, body).await;
            assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{uri}: {v}");
            assert_field(&v, "size");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains("512") && msg.contains("rotary"), "{msg}");
        }
    }
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a fox", "size": "32x32", "frames": 129, "steps": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a fox", "size": "32x32", "frames": 5, "steps": 2 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "valid work is still taken: {v}");

    // What `serve` would have started with: the bounds lowered to the model's, advertised.
    let served = serve_args(&wan, &[])
        .request_bounds(&model.checkpoint.limits())
        .unwrap();
    let app = start(model, "wan-tiny", served, 2).await;
    let m = get_json(&app, "/v1/models/wan-tiny").await;
    assert_eq!(
        (&m["limits"]["max_width"], &m["limits"]["max_frames"]),
        (&json!(512), &json!(81)),
        "{m}"
    );
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a fox", "size": "1280x1280", "frames": 81 }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "size");
}

/// E5 (and E4) on both families: in JSON a number sent as a string is a 422 naming the
/// field, as the OpenAPI document types it; the same values as multipart form text (where
/// every value is text) are read as numbers. A prompt that is not UTF-8 is a 400 saying so,
/// as JSON and as multipart alike, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_as_strings_and_text_that_is_not_utf8_are_refused_alike() {
    let dir = tempfile::tempdir().unwrap();
    let wan = Arc::new(Model::open(&common::wan_tiny(dir.path(), 1, 1)).unwrap());
    let dit = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let b = small();
    let wan = start(wan, "wan-tiny", b, 16).await;
    let dit = start(dit, "tiny", b, 16).await;
    let cases: [(&Router, &str, Value, &[&str]); 3] = [
        (
            &wan,
            "/v1/videos",
            json!({ "prompt": "a fox", "size": "32x32", "frames": 5, "steps": 2, "fps": 8, "seed": 1, "guidance": 2, "max_sequence_length": 16 }),
            &[
                "frames",
                "steps",
                "fps",
                "seed",
                "guidance",
                "max_sequence_length",
            ],
        ),
        (
            &wan,
            "/v1/jobs",
            json!({ "prompt": "a fox", "size": "32x32", "steps": 2, "n": 1, "guidance_2": 2 }),
            &["steps", "n", "guidance_2"],
        ),
        (
            &dit,
            "/v1/images/generations",
            json!({ "class_label": 3, "size": "64x64", "steps": 2, "n": 1, "response_format": "b64_json" }),
            &["class_label", "steps", "n"],
        ),
    ];
    for (app, uri, body, numeric) in cases {
        for field in numeric {
            let mut b = body.clone();
            b[field] = Value::String(b[field].to_string());
            let (s, _, v) = post(app, uri, b.clone()).await;
            assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{uri} {b} -> {v}");
            assert_field(&v, field);
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("not a string"),
                "{v}"
            );
        }
        // The same request as form text is taken, its numbers read from the text.
        let text: Vec<(String, Vec<u8>)> = body
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let t = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                (k.clone(), t.into_bytes())
            })
            .collect();
        let fields: Vec<(&str, &[u8])> = text
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let (ct, f) = form(&fields);
        let (s, _, v) = send(app, "POST", uri, &ct, Some(f)).await;
        assert!(
            s.is_success(),
            "{uri} as a form: {s} {}",
            String::from_utf8_lossy(&v)
        );
        // A form field that is not the number its field is typed as names it.
        let (ct, f) = form(&[(fields[0].0, fields[0].1), ("steps", b"two")]);
        let (s, _, v) = send(app, "POST", uri, &ct, Some(f)).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{uri}");
        assert_field(&serde_json::from_slice(&v).unwrap(), "steps");

        // E4: not UTF-8, as JSON and as a form.
        let bad: &[u8] = b"a fox \xff\xfe in snow";
        let mut json_bytes = br#"{"prompt": ""#.to_vec();
        json_bytes.extend_from_slice(bad);
        json_bytes.extend_from_slice(br#""}"#);
        let (s, _, v) = call(app, "POST", uri, Some(json_bytes)).await;
        let v: Value = serde_json::from_slice(&v).unwrap();
        assert_eq!(s, StatusCode::BAD_REQUEST, "{uri} JSON: {v}");
        let json_msg = v["error"]["message"].as_str().unwrap().to_string();
        let (ct, f) = form(&[("prompt", bad)]);
        let (s, _, v) = send(app, "POST", uri, &ct, Some(f)).await;
        let v: Value = serde_json::from_slice(&v).unwrap();
        assert_eq!(s, StatusCode::BAD_REQUEST, "{uri} form: {v}");
        let form_msg = v["error"]["message"].as_str().unwrap().to_string();
        assert_eq!(v["error"]["type"], "bad_request", "{v}");
        for m in [&json_msg, &form_msg] {
            assert!(m.contains("not valid UTF-8"), "{uri}: {m}");
        }
        assert!(form_msg.contains("`prompt`"), "{form_msg}");
    }
    // Nothing above took a place or broke a server: both still serve.
    let (s, _, v) = post(
        &wan,
        "/v1/videos",
        json!({ "prompt": "after it all", "size": "32x32", "frames": 1, "steps": 1 }),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let (s, _, v) = post(
        &dit,
        "/v1/images/generations",
        json!({ "class_label": 1, "steps": 1 }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// E3: without a job key, an id one less (or more) than one's own names no job: its status,
/// content and DELETE are all 404, and the neighbour's job runs on untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_neighbours_job_cannot_be_reached_from_ones_own_id() {
    let dir = tempfile::tempdir().unwrap();
    let wan = Arc::new(Model::open(&common::wan_tiny(dir.path(), 1, 1)).unwrap());
    let b = small();
    let app = start(wan, "wan-tiny", b, 4).await;
    let mut ids = Vec::new();
    for prompt in ["the other client's secret", "mine"] {
        let (s, _, v) = post(
            &app,
            "/v1/videos",
            json!({ "prompt": prompt, "size": "32x32", "frames": 1, "steps": 2 }),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    let (theirs, mine) = (&ids[0], &ids[1]);
    let number = u64::from_str_radix(&mine[..16], 16).unwrap();
    let guesses = [
        format!("{:016x}", number - 1),
        format!("{:016x}{}", number - 1, &mine[16..]),
        format!("{:016x}{}", number + 1, &mine[16..]),
    ];
    for g in &guesses {
        assert_ne!(g, theirs);
        for (method, uri) in [
            ("GET", format!("/v1/videos/{g}")),
            ("GET", format!("/v1/videos/{g}/content")),
            ("DELETE", format!("/v1/videos/{g}")),
            ("GET", format!("/v1/jobs/{g}")),
            ("DELETE", format!("/v1/jobs/{g}")),
        ] {
            let (s, _, body) = call(&app, method, &uri, None).await;
            let text = String::from_utf8_lossy(&body);
            assert_eq!(s, StatusCode::NOT_FOUND, "{method} {uri}: {text}");
            assert!(!text.contains("secret"), "{method} {uri}: {text}");
        }
    }
    let v = get_json(&app, &format!("/v1/videos/{theirs}")).await;
    assert_eq!(v["prompt"], "the other client's secret", "{v}");
    assert_ne!(v["status"], "failed", "{v}");
}
