//! Qwen-Image over the HTTP API, in process over a real engine on the committed tiny
//! pipeline: images over `/v1/images/generations` from a body the `openai` client sends as
//! it is, the same bytes when asked again, the negative prompt and guidance reaching the
//! model; sizes the VAE and the patches cannot make a 422, and a clip refused by name.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine as _;
use serde_json::{json, Value};

use common::server::{assert_field, get_json, post, Setup};
use layerwise_engine::bounds::RequestBounds;
use layerwise_engine::engine::Model;
use layerwise_engine::server::api::Bounds;
use layerwise_engine::server::scheduler::Retention;

const NAME: &str = "qwen-image-tiny";

fn setup() -> Setup {
    Setup {
        dp: 2,
        max_queue: 8,
        hook: None,
        bounds: Bounds {
            request: RequestBounds {
                max_width: 96,
                max_height: 96,
                max_frames: 1,
                max_steps: 50,
                max_n: 2,
                guidance: true,
                max_prompt_tokens: 256,
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
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen-image-tiny");
    Arc::new(Model::open(&dir).unwrap())
}

fn pngs(v: &Value) -> Vec<Vec<u8>> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            base64::engine::general_purpose::STANDARD
                .decode(d["b64_json"].as_str().unwrap())
                .unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_from_prompts_as_the_openai_client_asks() {
    let (app, _) = common::server::start(model(), setup()).await;
    let models = get_json(&app, "/v1/models").await;
    assert_eq!(models["data"][0]["family"], "qwen-image", "{models}");

    // `client.images.generate(model=..., prompt=..., n=2, size="96x64",
    // response_format="b64_json")` sends exactly this body.
    let openai = json!({ "model": NAME, "prompt": "a red fox in the snow", "n": 2,
                         "size": "96x64", "response_format": "b64_json" });
    let (s, _, v) = post(&app, "/v1/images/generations", openai.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let images = pngs(&v);
    assert_eq!(images.len(), 2);
    let be = |png: &[u8], i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    for png in &images {
        assert_eq!(
            (&png[1..4], be(png, 16), be(png, 20)),
            (&b"PNG"[..], 96, 64)
        );
    }

    // Seeded, guided with a negative prompt: the same request gives the same bytes, and the
    // negative prompt and the scale each change them.
    let body = |negative: &str, guidance: f64| {
        json!({ "model": NAME, "prompt": "a red fox", "negative_prompt": negative,
                "guidance": guidance, "size": "32x48", "steps": 2, "seed": 3 })
    };
    let image = |b: Value| {
        let app = app.clone();
        async move {
            let (s, _, v) = post(&app, "/v1/images/generations", b).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            pngs(&v).remove(0)
        }
    };
    let first = image(body("blurry", 4.0)).await;
    assert_eq!(
        image(body("blurry", 4.0)).await,
        first,
        "the same request, the same image"
    );
    assert_ne!(
        image(body("static", 4.0)).await,
        first,
        "the negative prompt is read"
    );
    assert_ne!(image(body("blurry", 2.0)).await, first, "the scale is read");

    // QwenImagePipeline's rule: true CFG needs a negative prompt. Without one the default
    // scale runs unguided (the image of scale 1); an empty one given guides against it.
    let without = |guidance: f64| {
        json!({ "model": NAME, "prompt": "a red fox", "guidance": guidance,
                "size": "32x48", "steps": 2, "seed": 3 })
    };
    let unguided = image(without(1.0)).await;
    assert_eq!(
        image(without(4.0)).await,
        unguided,
        "no negative prompt: unguided at any scale"
    );
    assert_ne!(
        image(body("", 4.0)).await,
        unguided,
        "an empty negative prompt given: guided"
    );

    // A size off the 16-pixel grid is refused naming the field, before anything is queued;
    // so is a clip.
    let (s, _, v) = post(
        &app,
        "/v1/images/generations",
        json!({ "prompt": "a fox", "size": "40x32" }),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_field(&v, "size");
    let (s, _, v) = post(
        &app,
        "/v1/videos",
        json!({ "prompt": "a fox", "frames": 5 }),
    )
    .await;
    assert!(s.is_client_error(), "{s} {v}");
}
