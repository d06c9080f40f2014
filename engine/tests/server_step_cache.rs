//! The step cache through the HTTP API, in process over a real engine on a tiny two-expert
//! Wan 2.2 pipeline: a server set to TaylorSeer runs each request with its setting unless
//! the request turns it off or asks for less skipping; cached and uncached requests in
//! flight at once on two ranks give the bytes each gives run alone; a `cache` value beyond
//! the server's setting, of another kind, out of range or of the wrong type is a 422
//! naming the field, on the image and the video endpoints; and the OpenAPI document lists
//! the field.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};

use common::server::{assert_field, call, get_json, post, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::cache::StepCache;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::Request;
use layerwise_engine::server::api::{app, Bounds};
use layerwise_engine::server::kind::Kind;
use layerwise_engine::server::make_media;
use layerwise_engine::server::scheduler::Retention;
use layerwise_engine::Strategy;

const STEPS: usize = 7;

fn setup() -> Setup {
    Setup {
        dp: 2,
        max_queue: 16,
        hook: None,
        bounds: Bounds {
            request: RequestBounds {
                max_width: 64,
                max_height: 64,
                max_frames: 9,
                max_steps: 50,
                max_n: 1,
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

/// The server's setting: TaylorSeer refreshing every third step after the first.
fn server_cache() -> StepCache {
    StepCache::Taylorseer {
        cache_interval: 3,
        disable_cache_before_step: 1,
        disable_cache_after_step: None,
        max_order: 1,
    }
}

async fn serve(model: Arc<Model>, cache: Option<StepCache>) -> Router {
    let (mut state, _) = common::server::start_state(
        model,
        setup(),
        layerwise_engine::decode::DecodeSite::Host,
        1,
    )
    .await;
    state.cache = cache;
    app(state)
}

/// The request the API builds from `prompt` and `seed` at 32x32, and its body.
fn image(prompt: &str, seed: u64) -> (Request, Value) {
    let r = common::server::prompt_request(prompt, (32, 32, 1), STEPS, (4.0, 2.0), seed, 24);
    let body = json!({
        "prompt": prompt, "size": "32x32", "steps": STEPS, "guidance": 4.0,
        "guidance_2": 2.0, "seed": seed,
    });
    (r, body)
}

async fn result(app: &Router, id: &str) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let st = get_json(app, &format!("/v1/jobs/{id}")).await;
        match st["state"].as_str().unwrap() {
            "succeeded" => break,
            "failed" => panic!("job {id} failed: {st}"),
            _ => {}
        }
        assert!(Instant::now() < deadline, "job {id} never finished");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, _, b) = call(app, "GET", &format!("/v1/jobs/{id}/result"), None).await;
    assert_eq!(s, StatusCode::OK);
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_and_uncached_requests_at_once_match_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::wan_tiny(dir.path(), 2, 2)).unwrap());
    let app = serve(model.clone(), Some(server_cache())).await;
    let fewer_skips = StepCache::Taylorseer {
        cache_interval: 2,
        disable_cache_before_step: 1,
        disable_cache_after_step: None,
        max_order: 1,
    };
    // The same prompt and seed cached and not, a request asking for less skipping, and
    // others: all in flight at once over the two ranks.
    let cases: Vec<(Value, Option<StepCache>, &str, u64)> = vec![
        (Value::Null, Some(server_cache()), "a fox in snow", 1),
        (json!("off"), None, "a fox in snow", 1),
        (
            json!({"kind": "taylorseer", "cache_interval": 2}),
            Some(fewer_skips),
            "a red kite",
            2,
        ),
        (json!("taylorseer"), Some(server_cache()), "a lighthouse", 3),
        (json!({"kind": "off"}), None, "waves at dusk", 4),
    ];
    let mut ids = Vec::new();
    for (field, _, prompt, seed) in &cases {
        let (_, mut body) = image(prompt, *seed);
        if !field.is_null() {
            body["cache"] = field.clone();
        }
        let (s, _, v) = post(&app, "/v1/jobs", body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    let opts = EngineOptions {
        strategy: Strategy::Resident,
        dp: 1,
        decode: false,
        ..EngineOptions::default()
    };
    let vae = model.decoder(&candle_core::Device::Cpu).unwrap();
    let mut served = Vec::new();
    for (id, (field, cache, prompt, seed)) in ids.iter().zip(&cases) {
        let bytes = result(&app, id).await;
        let (r, _) = image(prompt, *seed);
        let r = Request {
            cache: cache.clone(),
            ..r
        };
        let (out, _) = model.run(vec![r], &opts).unwrap();
        let alone = make_media(vae.as_ref(), &out[0].latents, Kind::Image, |_| {}).unwrap();
        assert!(
            bytes == alone.bytes,
            "`cache`: {field} (seed {seed}) differs from the same request run alone"
        );
        // The cache really ran: it skipped some of the steps.
        if let Some(report) = out[0].cache.as_ref() {
            let skipped = report.computed.iter().filter(|s| !s[0]).count();
            assert!(skipped > 0, "{field}: {report:?}");
        }
        served.push(bytes);
    }
    // The server's setting changed the output: the cached request is not the uncached one.
    assert_ne!(served[0], served[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_beyond_the_servers_is_a_422_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::wan_tiny(dir.path(), 2, 2)).unwrap());
    let app = serve(model.clone(), Some(server_cache())).await;
    let bad = [
        (json!(3), "cache"),
        (json!(["taylorseer"]), "cache"),
        (json!("fastest"), "cache"),
        (json!("first_block"), "cache.kind"),
        (json!({"kind": "mag", "ratios": [1.0]}), "cache.kind"),
        (
            json!({"kind": "taylorseer", "cache_interval": 4}),
            "cache.cache_interval",
        ),
        (
            json!({"kind": "taylorseer", "max_order": 2}),
            "cache.max_order",
        ),
        (
            json!({"kind": "taylorseer", "max_order": 9}),
            "cache.max_order",
        ),
        (
            json!({"kind": "taylorseer", "disable_cache_before_step": 0}),
            "cache.disable_cache_before_step",
        ),
        (json!({"kind": "taylorseer", "intervall": 2}), "cache"),
    ];
    for (value, field) in &bad {
        for uri in ["/v1/jobs", "/v1/images/generations", "/v1/videos"] {
            let (_, mut body) = image("a fox", 1);
            body["cache"] = value.clone();
            let (s, _, v) = post(&app, uri, body).await;
            assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{uri} {value}: {v}");
            assert_field(&v, field);
        }
    }
    // A server with no cache: a request may not ask for one, and "off" is taken.
    let plain = serve(model, None).await;
    let (_, mut body) = image("a fox", 1);
    body["cache"] = json!("taylorseer");
    let (s, _, v) = post(&plain, "/v1/jobs", body.clone()).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "cache");
    body["cache"] = json!("off");
    let (s, _, v) = post(&plain, "/v1/jobs", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");

    // The document lists the field on both requests, its kinds and its ranges.
    let doc = get_json(&app, "/openapi.json").await;
    for schema in ["ImageRequest", "VideoRequest"] {
        let cache = &doc["components"]["schemas"][schema]["properties"]["cache"];
        let names = &cache["oneOf"][0]["enum"];
        assert!(
            names.as_array().unwrap().contains(&json!("off"))
                && names.as_array().unwrap().contains(&json!("taylorseer")),
            "{schema}: {cache}"
        );
        let order = &cache["oneOf"][1]["properties"]["max_order"];
        assert_eq!(order["maximum"].as_f64(), Some(4.0), "{schema}: {cache}");
    }
}
