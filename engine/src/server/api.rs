//! The HTTP API: routes, request parsing and validation, responses. Everything a request
//! can get wrong is found here, named by its field, before it reaches the queue.
//!
//! Images follow OpenAI's image API (`POST /v1/images/generations`), videos its video API
//! (`POST /v1/videos`, then poll, download, delete), so the official clients work
//! unchanged; `/v1/jobs` is the engine's own asynchronous image API.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::multipart::MultipartError;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::forward::{self, Forwarding};
use super::ids::Owner;
use super::kind::Kind;
use super::scheduler::{JobState, JobStatus, Scheduler};
use super::ApiError;
use crate::bounds::RequestBounds;
use crate::engine::Model;
use crate::execution::work::{Condition, Request, DEFAULT_MAX_SEQUENCE_LENGTH};
use crate::Error;

/// What the server accepts, beyond what the model can do.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// Size, frames, steps, outputs and prompt tokens per request (what the operator
    /// passes).
    pub request: RequestBounds,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// How long a body may take to arrive after its headers.
    pub body_timeout: std::time::Duration,
}

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    pub scheduler: Scheduler,
    pub model: Arc<Model>,
    /// The served model's name (`model` in requests, `GET /v1/models`).
    pub model_name: String,
    pub bounds: Bounds,
    /// How requests for another replica's jobs reach it.
    pub forwarding: Forwarding,
}

/// The name a model folder is served under by default: its last path component.
pub fn folder_name(path: &std::path::Path) -> String {
    path.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .or_else(|| path.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    B64Json,
    Url,
}

/// The router; tests drive it in-process with `oneshot`.
pub fn app(state: AppState) -> Router {
    let limit = state.bounds.body_limit;
    // Every route that names a job: its owner answers, wherever the request landed.
    let jobs = Router::new()
        .route("/v1/videos/{id}", get(get_video).delete(delete_video))
        .route("/v1/videos/{id}/content", get(video_content))
        .route("/v1/jobs/{id}", get(job_status).delete(cancel_job))
        .route("/v1/jobs/{id}/result", get(job_result))
        .route_layer(middleware::from_fn_with_state(
            forward::JobRouting {
                shared: state.scheduler.shared.clone(),
                forwarding: state.forwarding,
            },
            forward::route_job,
        ));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/v1/images/generations", post(generate))
        .route("/v1/videos", post(create_video).get(list_videos))
        .route("/v1/jobs", post(submit_job))
        .merge(jobs)
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Every answer is JSON in one shape, unknown routes and methods included.
async fn no_route(uri: axum::http::Uri) -> ApiError {
    Error::NotFound {
        what: format!("route `{}` (GET /openapi.json lists them)", uri.path()),
    }
    .into()
}

async fn no_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let e = ApiError::from(Error::BadRequest {
        msg: format!("{method} is not a method of `{}`", uri.path()),
    });
    let mut r = e.into_response();
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

/// A query string the route cannot read, as a JSON 400.
fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Error> {
    q.map(|Query(t)| t).map_err(|r| Error::BadRequest {
        msg: format!("query string: {}", r.body_text()),
    })
}

async fn healthz(State(s): State<AppState>) -> Response {
    match s
        .scheduler
        .shared
        .failed
        .lock()
        .expect("shared lock")
        .as_ref()
    {
        Some(f) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("engine failed: {f}\n"),
        )
            .into_response(),
        None => "ok\n".into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> Result<&'static str, ApiError> {
    s.scheduler.shared.ready()?;
    Ok("ready\n")
}

async fn metrics(State(s): State<AppState>) -> Response {
    let body = s.scheduler.shared.metrics.render();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("openapi.json"),
    )
        .into_response()
}

fn model_object(s: &AppState) -> Value {
    let m = &s.model;
    json!({
        "id": s.model_name,
        "object": "model",
        "created": s.scheduler.shared.started_unix,
        "owned_by": "layerwise",
        "family": m.family.name(),
        "modalities": if m.family.video().is_some() { json!(["image", "video"]) } else { json!(["image"]) },
        "conditioning": if m.family.classes().is_some() { "class" } else { "text" },
        "limits": limits(s),
    })
}

/// What this server admits (its bounds, each within what the model runs): a request beyond
/// any is a 422 naming the field, before it is queued.
fn limits(s: &AppState) -> Value {
    let (b, video) = (&s.bounds.request, s.model.family.video().is_some());
    json!({
        "max_width": b.max_width,
        "max_height": b.max_height,
        "max_frames": if video { b.max_frames } else { 1 },
        "max_steps": b.max_steps,
        "max_n": b.max_n,
        "max_prompt_tokens": if s.model.family.classes().is_some() { 0 } else { b.max_prompt_tokens },
        "guidance": b.guidance,
    })
}

async fn list_models(State(s): State<AppState>) -> Response {
    Json(json!({ "object": "list", "data": [model_object(&s)] })).into_response()
}

async fn get_model(
    State(s): State<AppState>,
    Path(model): Path<String>,
) -> Result<Response, ApiError> {
    check_model_name(&s, &model)?;
    Ok(Json(model_object(&s)).into_response())
}

fn check_model_name(s: &AppState, name: &str) -> Result<(), Error> {
    if name == s.model_name {
        return Ok(());
    }
    Err(Error::NotFound {
        what: format!(
            "model `{name}`: this server serves `{}` (GET /v1/models)",
            s.model_name
        ),
    })
}

/// A request body's fields: a JSON object, or multipart form data (whose values are all
/// strings; numbers are read from them). Files are refused by name.
async fn fields(s: &AppState, req: axum::extract::Request) -> Result<Map<String, Value>, Error> {
    let deadline = s.bounds.body_timeout;
    tokio::time::timeout(deadline, read_fields(s, req))
        .await
        .unwrap_or(Err(Error::RequestTimeout {
            seconds: deadline.as_secs(),
        }))
}

async fn read_fields(
    s: &AppState,
    req: axum::extract::Request,
) -> Result<Map<String, Value>, Error> {
    let limit = s.bounds.body_limit;
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let essence = content_type.split(';').next().unwrap_or("").trim();
    // Only types a browser cannot send across origins without asking first (no text/plain
    // or form-urlencoded bodies), and the multipart form OpenAI's clients send.
    let json = essence == "application/json" || essence.ends_with("+json");
    if !json && essence != "multipart/form-data" {
        return Err(Error::UnsupportedMediaType {
            content_type: if essence.is_empty() {
                "(none)".into()
            } else {
                essence.into()
            },
        });
    }
    if essence == "multipart/form-data" {
        let mut form = Multipart::from_request(req, &())
            .await
            .map_err(|r| Error::BadRequest { msg: r.body_text() })?;
        let mut o = Map::new();
        loop {
            let field = form
                .next_field()
                .await
                .map_err(|e| multipart_error(e, limit))?;
            let Some(field) = field else { break };
            let name = field.name().unwrap_or_default().to_string();
            if field.file_name().is_some() {
                return Err(Error::invalid(
                    name,
                    "files are not taken: this server generates from text (and class labels) only",
                ));
            }
            let bytes = field.bytes().await.map_err(|e| multipart_error(e, limit))?;
            let text = String::from_utf8(bytes.to_vec()).map_err(|e| Error::BadRequest {
                msg: format!(
                    "multipart field `{name}` is not valid UTF-8 (at byte {})",
                    e.utf8_error().valid_up_to()
                ),
            })?;
            if o.insert(name.clone(), form_value(&name, text)?).is_some() {
                return Err(Error::invalid(name, "given twice"));
            }
        }
        return Ok(o);
    }
    let bytes = Bytes::from_request(req, &()).await;
    let bytes = body(bytes, limit)?;
    // Named as a form's text is (serde_json's own message says only "invalid unicode").
    let text = std::str::from_utf8(&bytes).map_err(|e| Error::BadRequest {
        msg: format!("body is not valid UTF-8 (at byte {})", e.valid_up_to()),
    })?;
    let v: Value = serde_json::from_str(text).map_err(|e| Error::BadRequest {
        msg: format!("body is not JSON: {e}"),
    })?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(Error::BadRequest {
            msg: "body must be a JSON object".into(),
        }),
    }
}

fn multipart_error(e: MultipartError, limit: usize) -> Error {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        Error::PayloadTooLarge { limit }
    } else {
        Error::BadRequest {
            msg: format!("multipart body: {}", e.body_text()),
        }
    }
}

fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, Error> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::PayloadTooLarge { limit }
        } else {
            Error::BadRequest { msg: r.body_text() }
        }
    })
}

fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

/// Request fields whose values are integers, and those that are numbers, as the OpenAPI
/// document types them. In JSON they must be JSON numbers (`"5"` is a string, refused); a
/// multipart form's values are all text, so there these are read from their text once, as
/// the form is read ([`form_value`]).
const INTEGER_FIELDS: [&str; 6] = [
    "n",
    "steps",
    "seed",
    "class_label",
    "max_sequence_length",
    "frames",
];
const NUMBER_FIELDS: [&str; 3] = ["guidance", "guidance_2", "fps"];

/// A multipart form field's text as the JSON value its field is typed as.
fn form_value(name: &str, text: String) -> Result<Value, Error> {
    let t = text.trim();
    if INTEGER_FIELDS.contains(&name) {
        return t.parse::<u64>().map(Value::from).map_err(|_| {
            Error::invalid(name, format!("`{text}`: expected a non-negative integer"))
        });
    }
    if NUMBER_FIELDS.contains(&name) {
        return t
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| Error::invalid(name, format!("`{text}`: expected a finite number")));
    }
    Ok(Value::String(text))
}

/// What a value of the wrong JSON type is told beside the type it should have had.
fn not_text(v: &Value) -> &'static str {
    if v.is_string() {
        " (a JSON number, not a string)"
    } else {
        ""
    }
}

fn uint(o: &Map<String, Value>, name: &str) -> Result<Option<u64>, Error> {
    let Some(v) = field(o, name) else {
        return Ok(None);
    };
    v.as_u64().map(Some).ok_or_else(|| {
        Error::invalid(
            name,
            format!("{v}: expected a non-negative integer{}", not_text(v)),
        )
    })
}

fn float(o: &Map<String, Value>, name: &str) -> Result<Option<f64>, Error> {
    let Some(v) = field(o, name) else {
        return Ok(None);
    };
    v.as_f64()
        .filter(|x| x.is_finite())
        .map(Some)
        .ok_or_else(|| {
            Error::invalid(
                name,
                format!("{v}: expected a finite number{}", not_text(v)),
            )
        })
}

/// A field the document types as a string or a number (OpenAI's video `seconds` is a
/// string, `"4"`): either, read as a finite number.
fn number_or_text(o: &Map<String, Value>, name: &str) -> Result<Option<f64>, Error> {
    let Some(v) = field(o, name) else {
        return Ok(None);
    };
    let n = match v {
        Value::String(s) => s.trim().parse::<f64>().ok(),
        v => v.as_f64(),
    };
    n.filter(|x| x.is_finite())
        .map(Some)
        .ok_or_else(|| Error::invalid(name, format!("{v}: expected a finite number")))
}

fn string(o: &Map<String, Value>, name: &str) -> Result<Option<String>, Error> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(Error::invalid(name, format!("{v}: expected a string"))),
    }
}

/// Fields every generation request may carry.
const COMMON: [&str; 10] = [
    "model",
    "prompt",
    "negative_prompt",
    "size",
    "steps",
    "guidance",
    "guidance_2",
    "seed",
    "max_sequence_length",
    "class_label",
];

fn known(o: &Map<String, Value>, extra: &[&str]) -> Result<(), Error> {
    let all: Vec<&str> = COMMON.iter().chain(extra).copied().collect();
    match o.keys().find(|k| !all.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) if k == "input_reference" => Err(Error::invalid(
            "input_reference",
            "reference images are not taken: this server generates video from text",
        )),
        Some(k) => Err(Error::invalid(
            k.as_str(),
            format!("unknown field; expected one of {}", all.join(", ")),
        )),
    }
}

/// What every output of a request shares, parsed and checked against the server's
/// bounds; the model checks the rest when [`Model::validate`] sees the requests.
fn request(o: &Map<String, Value>, s: &AppState, native: (usize, usize)) -> Result<Request, Error> {
    let b = &s.bounds;
    let family = &s.model.family;
    if let Some(m) = string(o, "model")? {
        check_model_name(s, &m)?;
    }
    let condition = condition(o, s)?;
    let text = matches!(condition, Condition::Prompt { .. });
    let given = field(o, "size").is_some();
    let (width, height) = match field(o, "size") {
        None => native,
        Some(Value::String(v)) => parse_size(v)?,
        Some(v) => {
            return Err(Error::invalid(
                "size",
                format!("{v}: expected a string \"WxH\""),
            ))
        }
    };
    let r = &b.request;
    if width as u64 > r.max_width || height as u64 > r.max_height {
        return Err(Error::invalid(
            "size",
            format!(
                "{width}x{height}{}: this server allows at most {}x{}",
                if given {
                    ""
                } else {
                    " (the model's native size, taken when `size` is not given)"
                },
                r.max_width,
                r.max_height
            ),
        ));
    }
    let (default_steps, default_guidance) = family.defaults();
    let steps = uint(o, "steps")?.unwrap_or(default_steps.min(r.max_steps as usize) as u64);
    if steps == 0 || steps > r.max_steps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: this server allows 1..={} steps", r.max_steps),
        ));
    }
    // A deployment sized for unguided requests runs them unguided unless asked otherwise.
    let default_guidance = if r.guidance { default_guidance } else { 1.0 };
    let guidance = float(o, "guidance")?.map_or(default_guidance, |g| g as f32);
    let guidance_2 = float(o, "guidance_2")?.map(|g| g as f32);
    for (field, g) in [("guidance", Some(guidance)), ("guidance_2", guidance_2)] {
        if let Some(g) = g.filter(|g| !(0.0..=MAX_GUIDANCE).contains(g)) {
            return Err(Error::invalid(
                field,
                format!("{g}: expected a scale in [0, {MAX_GUIDANCE}] (≤ 1 disables guidance)"),
            ));
        }
        if let Some(g) = g.filter(|g| *g > 1.0 && !r.guidance) {
            return Err(Error::invalid(
                field,
                format!("{g}: this deployment serves unguided requests only (workload.guidance: false); give a scale ≤ 1"),
            ));
        }
    }
    let max_sequence_length = match uint(o, "max_sequence_length")? {
        Some(_) if !text => {
            return Err(Error::invalid(
                "max_sequence_length",
                "this model is class-conditional and reads no prompt tokens",
            ))
        }
        Some(n) if n == 0 || n > b.request.max_prompt_tokens => {
            return Err(Error::invalid(
                "max_sequence_length",
                format!(
                    "{n}: this server allows 1..={} prompt tokens",
                    b.request.max_prompt_tokens
                ),
            ))
        }
        Some(n) => n as usize,
        None => DEFAULT_MAX_SEQUENCE_LENGTH.min(b.request.max_prompt_tokens as usize),
    };
    if guidance_2.is_some() && !text {
        return Err(Error::invalid(
            "guidance_2",
            "this model has one transformer; a second guidance scale needs two experts",
        ));
    }
    Ok(Request {
        seed: uint(o, "seed")?.unwrap_or(0),
        steps: steps as usize,
        guidance,
        guidance_2,
        max_sequence_length,
        ..Request::image(condition, width, height)
    })
}

/// The conditioning: a prompt for text families; for class-conditional ones a class
/// label, or a prompt naming one of the model's classes (what OpenAI clients send).
fn condition(o: &Map<String, Value>, s: &AppState) -> Result<Condition, Error> {
    let family = &s.model.family;
    let prompt = string(o, "prompt")?;
    let negative = string(o, "negative_prompt")?;
    let Some(classes) = family.classes() else {
        if field(o, "class_label").is_some() {
            return Err(Error::invalid(
                "class_label",
                format!(
                    "the {} family is text-conditioned and takes no class label; send `prompt`",
                    family.name()
                ),
            ));
        }
        let prompt = prompt
            .ok_or_else(|| Error::invalid("prompt", "required: the text to generate from"))?;
        return Ok(Condition::Prompt {
            prompt,
            negative: negative.unwrap_or_default(),
        });
    };
    if negative.as_deref().is_some_and(|n| !n.trim().is_empty()) {
        return Err(Error::invalid(
            "negative_prompt",
            format!(
                "the {} family is class-conditional and takes no negative prompt",
                family.name()
            ),
        ));
    }
    let named = match prompt.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
        None => None,
        Some(p) => Some(family.class_named(p).ok_or_else(|| {
            Error::invalid(
                "prompt",
                format!(
                    "`{p}` names no class of this model: it is class-conditional, so the prompt must be one of its class names (as its model_index.json id2label lists them), or empty beside `class_label` (0..{})",
                    classes - 1
                ),
            )
        })?),
    };
    let label = match field(o, "class_label") {
        None => None,
        Some(v) => Some(
            uint(o, "class_label")?
                .filter(|&c| c <= u32::MAX as u64)
                .ok_or_else(|| {
                    Error::invalid(
                        "class_label",
                        format!("{v}: expected a non-negative integer"),
                    )
                })? as u32,
        ),
    };
    match (named, label) {
        (Some(n), Some(l)) if n != l => Err(Error::invalid(
            "class_label",
            format!("{l} disagrees with the prompt, which names class {n}; send one of them"),
        )),
        (Some(c), _) | (None, Some(c)) => Ok(Condition::Class(c)),
        (None, None) => Err(Error::invalid(
            "class_label",
            format!(
                "required: the class to draw (0..{}), or its name as `prompt`",
                classes - 1
            ),
        )),
    }
}

fn validated(model: &Model, requests: Vec<Request>) -> Result<Vec<Request>, Error> {
    for r in &requests {
        model.validate(r).map_err(|e| match e {
            Error::Core(layerwise_core::Error::Invalid { field, msg })
                if field == "width" || field == "height" =>
            {
                Error::invalid("size", format!("{field} {msg}"))
            }
            other => other,
        })?;
    }
    Ok(requests)
}

/// Parses and checks an image request (`/v1/images/generations`, `/v1/jobs`): field by
/// field, then against the server's bounds, then against the model. One `Request` per
/// image.
pub fn parse_images(
    o: &Map<String, Value>,
    s: &AppState,
) -> Result<(Vec<Request>, ResponseFormat), Error> {
    known(o, &["n", "response_format"])?;
    let base = request(o, s, s.model.family.native_size())?;
    let n = uint(o, "n")?.unwrap_or(1);
    let max_n = s.bounds.request.max_n;
    if n == 0 || n > max_n {
        return Err(Error::invalid(
            "n",
            format!("{n}: this server generates 1..={max_n} images per request"),
        ));
    }
    let format = match field(o, "response_format") {
        None => ResponseFormat::B64Json,
        Some(Value::String(v)) if v == "b64_json" => ResponseFormat::B64Json,
        Some(Value::String(v)) if v == "url" => ResponseFormat::Url,
        Some(v) => {
            return Err(Error::invalid(
                "response_format",
                format!("{v}: expected \"b64_json\" or \"url\""),
            ))
        }
    };
    let requests = (0..n)
        .map(|i| Request {
            seed: base.seed.wrapping_add(i),
            ..base.clone()
        })
        .collect();
    Ok((validated(&s.model, requests)?, format))
}

/// Parses and checks a video request (`POST /v1/videos`): its frames from `frames`, or
/// from `seconds` × `fps` rounded up to a length the model makes.
pub fn parse_video(o: &Map<String, Value>, s: &AppState) -> Result<(Request, f64), Error> {
    known(o, &["seconds", "frames", "fps"])?;
    let family = &s.model.family;
    let spec = family.video().ok_or_else(|| {
        Error::invalid(
            "model",
            format!(
                "the {} family makes images only; POST /v1/images/generations",
                family.name()
            ),
        )
    })?;
    let mut r = request(o, s, family.native_size())?;
    let fps = float(o, "fps")?.unwrap_or(spec.default_fps);
    if !(fps > 0.0 && fps <= MAX_FPS) {
        return Err(Error::invalid(
            "fps",
            format!("{fps}: expected a frame rate in (0, {MAX_FPS}]"),
        ));
    }
    let max = s.bounds.request.max_frames as usize;
    r.frames = match (uint(o, "frames")?, number_or_text(o, "seconds")?) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                "seconds",
                "give `seconds` or `frames`, not both",
            ))
        }
        (Some(f), None) => {
            if f as usize > max {
                return Err(Error::invalid(
                    "frames",
                    format!("{f}: this server makes at most {max} frames per clip"),
                ));
            }
            f as usize
        }
        (None, Some(secs)) => {
            if secs <= 0.0 {
                return Err(Error::invalid(
                    "seconds",
                    format!("{secs}: must be positive"),
                ));
            }
            let want = (secs * fps).ceil();
            let frames = if want > max as f64 {
                usize::MAX
            } else {
                spec.round_up(want as usize)
            };
            if frames > max {
                return Err(Error::invalid(
                    "seconds",
                    format!(
                        "{secs} s at {fps} fps needs {want} frames; this server makes at most {max} frames per clip ({:.2} s at {fps} fps)",
                        max as f64 / fps
                    ),
                ));
            }
            frames
        }
        (None, None) => {
            let unit = spec.frames_per_latent.max(1);
            spec.default_frames.min((max.max(1) - 1) / unit * unit + 1)
        }
    };
    r.fps = Some(fps);
    let mut v = validated(&s.model, vec![r])?;
    Ok((v.remove(0), fps))
}

/// The largest guidance scale taken: far past any model's useful range (diffusers' defaults
/// are 4–5), where outputs saturate to nothing.
const MAX_GUIDANCE: f32 = 100.0;

/// The poll interval a running video's status suggests to clients.
const POLL_AFTER_MS: &str = "250";

/// The fastest frame rate a clip may be written at.
const MAX_FPS: f64 = 240.0;

fn parse_size(s: &str) -> Result<(usize, usize), Error> {
    let bad = || Error::invalid("size", format!("`{s}`: expected \"WxH\", e.g. \"256x256\""));
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    Ok((
        w.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    ))
}

/// Cancels a synchronous request's job when its client goes away before it finishes.
struct CancelOnDrop {
    scheduler: Scheduler,
    id: Option<u64>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.scheduler.cancel_detached(id);
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn result_url(id: &str, index: usize) -> String {
    format!("/v1/jobs/{id}/result?index={index}")
}

/// This replica's number for the job `id` names (the middleware in [`forward`] sends the
/// requests for other replicas' jobs on before a handler runs).
fn here(s: &AppState, id: &str) -> Result<u64, Error> {
    match s.scheduler.shared.ids.parse(id)? {
        Owner::Here(n) => Ok(n),
        Owner::Peer(_) => Err(Error::NotFound {
            what: format!("job `{id}` on this replica"),
        }),
    }
}

async fn generate(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let o = fields(&s, req).await?;
    let (requests, format) = parse_images(&o, &s)?;
    let n = requests.len();
    let size = format!("{}x{}", requests[0].width, requests[0].height);
    let id = s.scheduler.submit(requests, Kind::Image).await?;
    let mut guard = CancelOnDrop {
        scheduler: s.scheduler.clone(),
        id: Some(id),
    };
    s.scheduler.wait(id).await;
    guard.id = None;
    let status = s.scheduler.status(id).await?;
    let mut data = Vec::with_capacity(n);
    for i in 0..n {
        match format {
            ResponseFormat::Url => {
                if status.state != JobState::Succeeded {
                    s.scheduler.result(id, i).await?;
                }
                data.push(json!({ "url": result_url(&status.id, i) }));
            }
            ResponseFormat::B64Json => {
                let m = s.scheduler.result(id, i).await?;
                data.push(json!({ "b64_json": base64::engine::general_purpose::STANDARD.encode(&m.bytes) }));
            }
        }
    }
    Ok(Json(json!({
        "created": now_unix(),
        "id": status.id,
        "model": s.model_name,
        "size": size,
        "output_format": "png",
        "data": data,
        "timings": status,
    }))
    .into_response())
}

async fn submit_job(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let o = fields(&s, req).await?;
    let (requests, _) = parse_images(&o, &s)?;
    let id = s.scheduler.submit(requests, Kind::Image).await?;
    let status = s.scheduler.status(id).await?;
    let location = format!("/v1/jobs/{}", status.id);
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(status),
    )
        .into_response())
}

async fn job_status(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(s.scheduler.status(here(&s, &id)?).await?).into_response())
}

async fn cancel_job(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(s.scheduler.cancel(here(&s, &id)?).await?).into_response())
}

#[derive(Deserialize)]
struct ResultQuery {
    index: Option<usize>,
}

async fn job_result(
    State(s): State<AppState>,
    Path(id): Path<String>,
    q: Result<Query<ResultQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let m = s
        .scheduler
        .result(here(&s, &id)?, q.index.unwrap_or(0))
        .await?;
    Ok(media_response(m.content_type, &m.bytes))
}

fn media_response(content_type: &'static str, bytes: &[u8]) -> Response {
    (
        [(header::CONTENT_TYPE, content_type)],
        Body::from(bytes.to_vec()),
    )
        .into_response()
}

/// A video job as OpenAI's video API shows one (`status`, `progress`, `size`, `seconds`
/// ...), with the engine's own detail beside it (steps and frames done, the job state).
pub fn video_object(st: &JobStatus, model: &str) -> Value {
    let status = match st.state {
        JobState::Queued => "queued",
        JobState::Running => "in_progress",
        JobState::Succeeded => "completed",
        JobState::Failed | JobState::Cancelled => "failed",
    };
    let fps = st.fps.unwrap_or(1.0);
    let error = match (st.state, &st.error) {
        (JobState::Cancelled, _) => {
            Some(json!({ "code": "cancelled", "message": "cancelled (DELETE /v1/videos/{id})" }))
        }
        (_, Some(m)) => Some(json!({ "code": st.error_type, "message": m })),
        _ => None,
    };
    json!({
        "id": st.id,
        "object": "video",
        "model": model,
        "status": status,
        "progress": st.progress(),
        "created_at": st.created_at,
        "completed_at": st.finished_at,
        "expires_at": st.expires_at,
        "error": error,
        "prompt": st.prompt,
        "size": format!("{}x{}", st.width, st.height),
        "seconds": seconds_text(st.frames as f64 / fps),
        "remixed_from_video_id": null,
        "state": st.state,
        "frames": st.frames,
        "fps": fps,
        "steps": st.steps,
        "seed": st.seed,
        "steps_done": st.steps_done,
        "steps_total": st.steps_total,
        "frames_decoded": st.frames_decoded,
        "queue_position": st.queue_position,
        "expired": st.expired,
    })
}

/// Seconds as a short decimal string ("5.0625" → "5.06", "4" → "4").
fn seconds_text(secs: f64) -> String {
    let t = format!("{secs:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

async fn create_video(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let o = fields(&s, req).await?;
    let (request, fps) = parse_video(&o, &s)?;
    let id = s
        .scheduler
        .submit(vec![request], Kind::Video { fps })
        .await?;
    let status = s.scheduler.status(id).await?;
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/videos/{}", status.id))],
        Json(video_object(&status, &s.model_name)),
    )
        .into_response())
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
}

/// The most videos one list page holds.
const MAX_LIST: usize = 100;

async fn list_videos(
    State(s): State<AppState>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(20);
    if limit == 0 || limit > MAX_LIST {
        return Err(Error::invalid("limit", format!("{limit}: expected 1..={MAX_LIST}")).into());
    }
    let mut all = s.scheduler.list(Kind::VIDEO).await;
    match q.order.as_deref().unwrap_or("desc") {
        "desc" => {}
        "asc" => all.reverse(),
        other => {
            return Err(
                Error::invalid("order", format!("`{other}`: expected `asc` or `desc`")).into(),
            )
        }
    }
    let start = match &q.after {
        None => 0,
        Some(after) => {
            all.iter()
                .position(|st| &st.id == after)
                .ok_or_else(|| Error::NotFound {
                    what: format!("video `{after}` (the `after` cursor)"),
                })?
                + 1
        }
    };
    let page = &all[start.min(all.len())..];
    let data: Vec<Value> = page
        .iter()
        .take(limit)
        .map(|st| video_object(st, &s.model_name))
        .collect();
    let (first, last) = (
        data.first().map(|v| v["id"].clone()),
        data.last().map(|v| v["id"].clone()),
    );
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "first_id": first,
        "last_id": last,
        "has_more": page.len() > limit,
    }))
    .into_response())
}

/// A video job by id (an image job's id is not a video's).
async fn video_status(s: &AppState, id: &str) -> Result<JobStatus, ApiError> {
    let st = s.scheduler.status(here(s, id)?).await?;
    if st.kind != Kind::VIDEO {
        return Err(Error::NotFound {
            what: format!("video `{id}` (it is an image job: GET /v1/jobs/{id})"),
        }
        .into());
    }
    Ok(st)
}

async fn get_video(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let st = video_status(&s, &id).await?;
    let mut r = Json(video_object(&st, &s.model_name)).into_response();
    if !st.state.terminal() {
        // How often OpenAI's client polls (`videos.poll`) while the job runs.
        r.headers_mut().insert(
            "openai-poll-after-ms",
            header::HeaderValue::from_static(POLL_AFTER_MS),
        );
    }
    Ok(r)
}

async fn delete_video(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    video_status(&s, &id).await?;
    let st = s.scheduler.delete(here(&s, &id)?).await?;
    Ok(
        Json(json!({ "id": st.id, "object": "video.deleted", "deleted": true, "state": st.state }))
            .into_response(),
    )
}

#[derive(Deserialize)]
struct ContentQuery {
    variant: Option<String>,
}

async fn video_content(
    State(s): State<AppState>,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    video_status(&s, &id).await?;
    let m = s.scheduler.result(here(&s, &id)?, 0).await?;
    match q.variant.as_deref().unwrap_or("video") {
        "video" => Ok(media_response(m.content_type, &m.bytes)),
        "thumbnail" => Ok(media_response(
            "image/png",
            m.thumbnail.as_deref().unwrap_or_default(),
        )),
        other => Err(Error::invalid(
            "variant",
            format!(
                "`{other}`: this server has `video` (MP4) and `thumbnail` (PNG of the first frame)"
            ),
        )
        .into()),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let e = &*self.0;
        let status =
            StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = Json(
            json!({ "error": { "type": e.label(), "message": e.to_string(), "field": e.field() } }),
        );
        let mut r = (status, body).into_response();
        if let Error::QueueFull { retry_after, .. } = e {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(*retry_after));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields the parser reads as integers and as numbers are exactly those the served
    /// OpenAPI document types so, in every request schema (`seconds` alone may be either).
    #[test]
    fn numeric_fields_are_the_ones_the_document_types_as_numbers() {
        let doc: Value = serde_json::from_str(include_str!("openapi.json")).unwrap();
        let mut integers = std::collections::BTreeSet::new();
        let mut numbers = std::collections::BTreeSet::new();
        for schema in ["GenerationRequest", "VideoRequest"] {
            let props = doc["components"]["schemas"][schema]["properties"]
                .as_object()
                .unwrap();
            for (name, p) in props {
                match &p["type"] {
                    Value::String(t) if t == "integer" => integers.insert(name.as_str()),
                    Value::String(t) if t == "number" => numbers.insert(name.as_str()),
                    Value::String(t) if t == "string" => continue,
                    t if name == "seconds" => {
                        assert_eq!(t, &json!(["string", "number"]));
                        continue;
                    }
                    t => panic!("{schema}.{name}: type {t}"),
                };
            }
        }
        assert_eq!(
            integers,
            INTEGER_FIELDS.into_iter().collect(),
            "integer fields"
        );
        assert_eq!(
            numbers,
            NUMBER_FIELDS.into_iter().collect(),
            "number fields"
        );
    }

    #[test]
    fn form_text_becomes_the_fields_type_or_names_it() {
        assert_eq!(form_value("steps", " 5 ".into()).unwrap(), json!(5));
        assert_eq!(form_value("guidance", "4.5".into()).unwrap(), json!(4.5));
        assert_eq!(form_value("seconds", "4".into()).unwrap(), json!("4"));
        assert_eq!(form_value("prompt", "5".into()).unwrap(), json!("5"));
        for (f, t) in [("steps", "-1"), ("n", "2.0"), ("fps", "inf"), ("seed", "")] {
            let e = form_value(f, t.into()).unwrap_err();
            assert_eq!(e.field(), Some(f), "{e}");
        }
    }
}
