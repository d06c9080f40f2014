//! The HTTP API: routes, the handlers, and the checks of each request against the server's
//! bounds and the model. Everything a request can get wrong is found here, named by its
//! field, before it reaches the queue: its body's shape and types when serde reads it into
//! the request types ([`super::body`], [`super::requests`]), then what its values mean.
//!
//! Images follow OpenAI's image API (`POST /v1/images/generations`), videos its video API
//! (`POST /v1/videos`, then poll, download, delete), so the official clients work
//! unchanged; `/v1/jobs` is the engine's own asynchronous image API. Every route is
//! registered with its `#[utoipa::path]` attribute in one table ([`app`]), which makes the
//! router and the OpenAPI document served at `/openapi.json` ([`super::openapi`]) alike.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::body;
use super::error::ApiError;
use super::forward::{self, Forwarding};
use super::ids::Owner;
use super::kind::Kind;
use super::openapi;
use super::requests::{
    ContentQuery, Generation, ImageRequest, ListQuery, Order, ResponseFormat, ResultQuery, Variant,
    VideoRequest,
};
use super::responses::{
    Conditioning, Download, ErrorBody, ErrorDetail, ImageData, ImageResponse, Limits, ListTag,
    Modality, ModelCard, ModelList, ModelTag, OutputFormat, Video, VideoDeleted, VideoDeletedTag,
    VideoList,
};
use super::scheduler::{JobState, JobStatus, Scheduler};
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

/// The router; tests drive it in-process with `oneshot`. Every route is here once, as a
/// handler whose `#[utoipa::path]` names its path and method: `routes!` puts it on the
/// router and in the OpenAPI document at once, so the two cannot disagree.
pub fn app(state: AppState) -> Router {
    let limit = state.bounds.body_limit;
    // Every route that names a job: its owner answers, wherever the request landed.
    let jobs = OpenApiRouter::default()
        .routes(routes!(get_video, delete_video))
        .routes(routes!(video_content))
        .routes(routes!(job_status, cancel_job))
        .routes(routes!(job_result))
        .route_layer(middleware::from_fn_with_state(
            forward::JobRouting {
                shared: state.scheduler.shared.clone(),
                forwarding: state.forwarding,
            },
            forward::route_job,
        ));
    let (router, document) = OpenApiRouter::with_openapi(openapi::Head::openapi())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
        .routes(routes!(openapi::serve))
        .routes(routes!(list_models))
        .routes(routes!(get_model))
        .routes(routes!(generate))
        .routes(routes!(create_video, list_videos))
        .routes(routes!(submit_job))
        .merge(jobs)
        .split_for_parts();
    router
        .method_not_allowed_fallback(no_method)
        .layer(Extension(openapi::Served::new(&document)))
        .fallback(no_route)
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

/// A request's body as `T`, within the server's bounds on its size and its time.
async fn read_body<T: DeserializeOwned>(
    s: &AppState,
    req: axum::extract::Request,
) -> Result<T, Error> {
    body::read(req, s.bounds.body_limit, s.bounds.body_timeout).await
}

// What the document says of the errors many routes share.
const BAD_BODY: &str = "A body that is not a JSON object, nor multipart form data of UTF-8 text";
const TIMEOUT: &str = "The body took longer than --body-timeout-seconds to arrive";
const TOO_LARGE: &str = "Body over the server's limit (--body-limit)";
const NOT_JSON: &str = "A body that is neither application/json nor multipart/form-data";
const OTHER_MODEL: &str = "`model` names a model this server does not serve";
const QUEUE_FULL: &str = "Queue full; see Retry-After";
const NOT_READY: &str = "Not ready, shutting down, or the engine failed";
const NO_JOB: &str = "No such job (or it is another replica's, and that replica is gone: 410)";
const NOT_KEPT: &str = "Finished, but no longer kept (--result-ttl-seconds, --result-bytes)";

/// Liveness
///
/// `ok` while every rank runs; after a rank failed, 500 with the cause (the process then
/// exits, and Kubernetes restarts it).
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "server",
    responses(
        (status = 200, description = "Alive", body = String, content_type = "text/plain"),
        (status = 500, description = "The engine failed", body = String, content_type = "text/plain"),
    )
)]
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

/// Readiness: every rank can serve
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "server",
    responses(
        (status = 200, description = "Ready", body = String, content_type = "text/plain"),
        (status = 503, description = "Not ready", body = ErrorBody),
    )
)]
async fn readyz(State(s): State<AppState>) -> Result<&'static str, ApiError> {
    s.scheduler.shared.ready()?;
    Ok("ready\n")
}

/// Prometheus metrics (OpenMetrics text)
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "server",
    responses((
        status = 200,
        description = "The metrics",
        body = String,
        content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"
    ))
)]
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

fn model_card(s: &AppState) -> ModelCard {
    let m = &s.model;
    ModelCard {
        id: s.model_name.clone(),
        object: ModelTag::Model,
        created: s.scheduler.shared.started_unix,
        owned_by: "layerwise",
        family: m.family.name(),
        modalities: if m.family.video().is_some() {
            vec![Modality::Image, Modality::Video]
        } else {
            vec![Modality::Image]
        },
        conditioning: if m.family.classes().is_some() {
            Conditioning::Class
        } else {
            Conditioning::Text
        },
        limits: limits(s),
    }
}

/// What this server admits (its bounds, each within what the model runs): a request beyond
/// any is a 422 naming the field, before it is queued.
fn limits(s: &AppState) -> Limits {
    let (b, video) = (&s.bounds.request, s.model.family.video().is_some());
    Limits {
        max_width: b.max_width,
        max_height: b.max_height,
        max_frames: if video { b.max_frames } else { 1 },
        max_steps: b.max_steps,
        max_n: b.max_n,
        max_prompt_tokens: if s.model.family.classes().is_some() {
            0
        } else {
            b.max_prompt_tokens
        },
        guidance: b.guidance,
    }
}

/// The served model (OpenAI's model list)
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "models",
    responses((status = 200, description = "A list of one model", body = ModelList))
)]
async fn list_models(State(s): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: ListTag::List,
        data: vec![model_card(&s)],
    })
}

/// The served model by name
#[utoipa::path(
    get,
    path = "/v1/models/{model}",
    tag = "models",
    params(("model" = String, Path, description = "The served model's name")),
    responses(
        (status = 200, description = "The model", body = ModelCard),
        (status = 404, description = "Not the served model", body = ErrorBody),
    )
)]
async fn get_model(
    State(s): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    check_model_name(&s, &model)?;
    Ok(Json(model_card(&s)))
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

/// What every output of a request shares, checked against the server's
/// bounds; the model checks the rest when [`Model::validate`] sees the requests.
fn request(body: &Generation, s: &AppState, native: (usize, usize)) -> Result<Request, Error> {
    let b = &s.bounds;
    let family = &s.model.family;
    if let Some(m) = &body.model {
        check_model_name(s, m)?;
    }
    let condition = condition(body, s)?;
    let text = matches!(condition, Condition::Prompt { .. });
    let given = body.size.is_some();
    let (width, height) = body.size.map_or(native, |s| (s.width, s.height));
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
    let steps = body
        .steps
        .unwrap_or(default_steps.min(r.max_steps as usize) as u64);
    if steps == 0 || steps > r.max_steps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: this server allows 1..={} steps", r.max_steps),
        ));
    }
    // A deployment sized for unguided requests runs them unguided unless asked otherwise.
    let default_guidance = if r.guidance { default_guidance } else { 1.0 };
    let guidance = body.guidance.map_or(default_guidance, |x| x as f32);
    let guidance_2 = body.guidance_2.map(|x| x as f32);
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
    let max_sequence_length = match body.max_sequence_length {
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
        seed: body.seed.unwrap_or(0),
        steps: steps as usize,
        guidance,
        guidance_2,
        max_sequence_length,
        ..Request::image(condition, width, height)
    })
}

/// The conditioning: a prompt for text families; for class-conditional ones a class
/// label, or a prompt naming one of the model's classes (what OpenAI clients send).
fn condition(body: &Generation, s: &AppState) -> Result<Condition, Error> {
    let family = &s.model.family;
    let (prompt, negative) = (body.prompt.clone(), body.negative_prompt.clone());
    let Some(classes) = family.classes() else {
        if body.class_label.is_some() {
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
    let label = match body.class_label {
        None => None,
        Some(v) => Some(u32::try_from(v).map_err(|_| {
            Error::invalid(
                "class_label",
                format!("{v}: expected a non-negative integer"),
            )
        })?),
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

/// Checks an image request (`/v1/images/generations`, `/v1/jobs`), its fields as serde
/// read them, against the server's bounds, then against the model. One `Request` per
/// image.
pub fn parse_images(
    body: ImageRequest,
    s: &AppState,
) -> Result<(Vec<Request>, ResponseFormat), Error> {
    let (g, n, format) = body.split();
    let base = request(&g, s, s.model.family.native_size())?;
    let n = n.unwrap_or(1);
    let max_n = s.bounds.request.max_n;
    if n == 0 || n > max_n {
        return Err(Error::invalid(
            "n",
            format!("{n}: this server generates 1..={max_n} images per request"),
        ));
    }
    let format = format.unwrap_or(ResponseFormat::B64Json);
    let requests = (0..n)
        .map(|i| Request {
            seed: base.seed.wrapping_add(i),
            ..base.clone()
        })
        .collect();
    Ok((validated(&s.model, requests)?, format))
}

/// Checks a video request (`POST /v1/videos`) as [`parse_images`] does an image one: its
/// frames from `frames`, or from `seconds` × `fps` rounded up to a length the model makes.
pub fn parse_video(body: VideoRequest, s: &AppState) -> Result<(Request, f64), Error> {
    let (g, length) = body.split();
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
    let mut r = request(&g, s, family.native_size())?;
    let fps = length.fps.unwrap_or(spec.default_fps);
    if !(fps > 0.0 && fps <= MAX_FPS) {
        return Err(Error::invalid(
            "fps",
            format!("{fps}: expected a frame rate in (0, {MAX_FPS}]"),
        ));
    }
    let max = s.bounds.request.max_frames as usize;
    r.frames = match (length.frames, length.seconds) {
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

/// Generate images and wait for them
///
/// OpenAI's image API. The images come back in the answer (`b64_json`) or as the job's
/// result URLs (`url`); a client that goes away cancels the job.
#[utoipa::path(
    post,
    path = "/v1/images/generations",
    tag = "images",
    request_body(content(
        (ImageRequest = "application/json"),
        (ImageRequest = "multipart/form-data"),
    )),
    responses(
        (status = 200, description = "The images", body = ImageResponse),
        (status = 400, description = BAD_BODY, body = ErrorBody),
        (status = 404, description = OTHER_MODEL, body = ErrorBody),
        (status = 408, description = TIMEOUT, body = ErrorBody),
        (status = 413, description = TOO_LARGE, body = ErrorBody),
        (status = 415, description = NOT_JSON, body = ErrorBody),
        (status = 422, description = "A field is invalid, beyond the server's bounds, or one the model's family cannot use (error.field names it)", body = ErrorBody),
        (status = 429, description = QUEUE_FULL, body = ErrorBody,
            headers(("retry-after" = u64, description = "Seconds to wait before trying again"))),
        (status = 500, description = "The request failed", body = ErrorBody),
        (status = 503, description = NOT_READY, body = ErrorBody),
    )
)]
async fn generate(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Json<ImageResponse>, ApiError> {
    s.scheduler.shared.ready()?;
    let (requests, format) = parse_images(read_body(&s, req).await?, &s)?;
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
        data.push(match format {
            ResponseFormat::Url => {
                if status.state != JobState::Succeeded {
                    s.scheduler.result(id, i).await?;
                }
                ImageData {
                    b64_json: None,
                    url: Some(result_url(&status.id, i)),
                }
            }
            ResponseFormat::B64Json => {
                let m = s.scheduler.result(id, i).await?;
                ImageData {
                    b64_json: Some(base64::engine::general_purpose::STANDARD.encode(&m.bytes)),
                    url: None,
                }
            }
        });
    }
    Ok(Json(ImageResponse {
        created: now_unix(),
        id: status.id.clone(),
        model: s.model_name.clone(),
        size,
        output_format: OutputFormat::Png,
        data,
        timings: status,
    }))
}

/// Queue a generation job
///
/// The image request of `POST /v1/images/generations`, answered at once; poll
/// `GET /v1/jobs/{id}`, then download `GET /v1/jobs/{id}/result`.
#[utoipa::path(
    post,
    path = "/v1/jobs",
    tag = "jobs",
    request_body(content(
        (ImageRequest = "application/json"),
        (ImageRequest = "multipart/form-data"),
    )),
    responses(
        (status = 202, description = "Queued; Location names the job", body = JobStatus,
            headers(("location" = String, description = "The job: /v1/jobs/{id}"))),
        (status = 400, description = BAD_BODY, body = ErrorBody),
        (status = 404, description = OTHER_MODEL, body = ErrorBody),
        (status = 408, description = TIMEOUT, body = ErrorBody),
        (status = 413, description = TOO_LARGE, body = ErrorBody),
        (status = 415, description = NOT_JSON, body = ErrorBody),
        (status = 422, description = "A field is invalid, beyond the server's bounds, or one the model's family cannot use (error.field names it)", body = ErrorBody),
        (status = 429, description = QUEUE_FULL, body = ErrorBody,
            headers(("retry-after" = u64, description = "Seconds to wait before trying again"))),
        (status = 503, description = NOT_READY, body = ErrorBody),
    )
)]
async fn submit_job(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let (requests, _) = parse_images(read_body(&s, req).await?, &s)?;
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

/// A job's state, queue position, progress and timings
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job's id")),
    responses(
        (status = 200, description = "Status", body = JobStatus),
        (status = 404, description = NO_JOB, body = ErrorBody),
    )
)]
async fn job_status(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    Ok(Json(s.scheduler.status(here(&s, &id)?).await?))
}

/// Cancel a queued or running job
///
/// A running job's rank is free at its next step boundary.
#[utoipa::path(
    delete,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job's id")),
    responses(
        (status = 200, description = "Status after cancelling", body = JobStatus),
        (status = 404, description = NO_JOB, body = ErrorBody),
    )
)]
async fn cancel_job(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    Ok(Json(s.scheduler.cancel(here(&s, &id)?).await?))
}

/// One output of a finished job
///
/// An image job's PNG, or a video job's MP4.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/result",
    tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ResultQuery),
    responses(
        (status = 200, description = "The output", content(
            (Download = "image/png"),
            (Download = "video/mp4"),
        )),
        (status = 400, description = "A query string that is not `index=N`", body = ErrorBody),
        (status = 404, description = NO_JOB, body = ErrorBody),
        (status = 409, description = "Queued, running or cancelled", body = ErrorBody),
        (status = 410, description = NOT_KEPT, body = ErrorBody),
        (status = 422, description = "index out of range", body = ErrorBody),
        (status = 500, description = "The job failed", body = ErrorBody),
        (status = 503, description = "The job failed because the server shut down", body = ErrorBody),
    )
)]
async fn job_result(
    State(s): State<AppState>,
    Path(id): Path<String>,
    q: Result<Query<ResultQuery>, QueryRejection>,
) -> Result<Download, ApiError> {
    let q = query(q)?;
    let m = s
        .scheduler
        .result(here(&s, &id)?, q.index.unwrap_or(0))
        .await?;
    Ok(Download(m.content_type, m.bytes.clone()))
}

/// Queue a text-to-video job (OpenAI's video API)
///
/// Poll `GET /v1/videos/{id}`, then download `GET /v1/videos/{id}/content`.
#[utoipa::path(
    post,
    path = "/v1/videos",
    tag = "videos",
    request_body(content(
        (VideoRequest = "application/json"),
        (VideoRequest = "multipart/form-data"),
    )),
    responses(
        (status = 202, description = "Queued; Location names the job", body = Video,
            headers(("location" = String, description = "The video: /v1/videos/{id}"))),
        (status = 400, description = BAD_BODY, body = ErrorBody),
        (status = 404, description = OTHER_MODEL, body = ErrorBody),
        (status = 408, description = TIMEOUT, body = ErrorBody),
        (status = 413, description = TOO_LARGE, body = ErrorBody),
        (status = 415, description = NOT_JSON, body = ErrorBody),
        (status = 422, description = "A field is invalid, beyond the server's bounds (size, frames, seconds × fps, steps, prompt tokens), or one the model's family cannot use (error.field names it); a model that makes images only names `model`", body = ErrorBody),
        (status = 429, description = QUEUE_FULL, body = ErrorBody,
            headers(("retry-after" = u64, description = "Seconds to wait before trying again"))),
        (status = 503, description = NOT_READY, body = ErrorBody),
    )
)]
async fn create_video(
    State(s): State<AppState>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let (request, fps) = parse_video(read_body(&s, req).await?, &s)?;
    let id = s
        .scheduler
        .submit(vec![request], Kind::Video { fps })
        .await?;
    let status = s.scheduler.status(id).await?;
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/videos/{}", status.id))],
        Json(Video::new(&status, &s.model_name)),
    )
        .into_response())
}

/// The most videos one list page holds.
const MAX_LIST: usize = 100;

/// The video jobs the server still holds, newest first
#[utoipa::path(
    get,
    path = "/v1/videos",
    tag = "videos",
    params(ListQuery),
    responses(
        (status = 200, description = "The list", body = VideoList),
        (status = 400, description = "A query string the route cannot read", body = ErrorBody),
        (status = 404, description = "`after` names no video the server holds", body = ErrorBody),
        (status = 422, description = "`limit` or `order` out of range (error.field names it)", body = ErrorBody),
    )
)]
async fn list_videos(
    State(s): State<AppState>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<VideoList>, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(20);
    if limit == 0 || limit > MAX_LIST {
        return Err(Error::invalid("limit", format!("{limit}: expected 1..={MAX_LIST}")).into());
    }
    let mut all = s.scheduler.list(Kind::VIDEO).await;
    if Order::of(q.order.as_deref())? == Order::Asc {
        all.reverse();
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
    let data: Vec<Video> = page
        .iter()
        .take(limit)
        .map(|st| Video::new(st, &s.model_name))
        .collect();
    Ok(Json(VideoList {
        object: ListTag::List,
        first_id: data.first().map(|v| v.id.clone()),
        last_id: data.last().map(|v| v.id.clone()),
        has_more: page.len() > limit,
        data,
    }))
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

/// A video job's state and progress (steps done, frames decoded)
#[utoipa::path(
    get,
    path = "/v1/videos/{id}",
    tag = "videos",
    params(("id" = String, Path, description = "The video's id")),
    responses(
        (status = 200, description = "The video job", body = Video,
            headers(("openai-poll-after-ms" = String, description = "While it runs: how often to poll, in milliseconds"))),
        (status = 404, description = "No such video job (or an image job's id)", body = ErrorBody),
    )
)]
async fn get_video(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let st = video_status(&s, &id).await?;
    let mut r = Json(Video::new(&st, &s.model_name)).into_response();
    if !st.state.terminal() {
        // How often OpenAI's client polls (`videos.poll`) while the job runs.
        r.headers_mut().insert(
            "openai-poll-after-ms",
            header::HeaderValue::from_static(POLL_AFTER_MS),
        );
    }
    Ok(r)
}

/// Cancel a video job and let its MP4 go
///
/// Its rank is free at its next step boundary; the job then reads `failed` with
/// `error.code` `cancelled`.
#[utoipa::path(
    delete,
    path = "/v1/videos/{id}",
    tag = "videos",
    params(("id" = String, Path, description = "The video's id")),
    responses(
        (status = 200, description = "Deleted", body = VideoDeleted),
        (status = 404, description = "No such video job", body = ErrorBody),
    )
)]
async fn delete_video(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<VideoDeleted>, ApiError> {
    video_status(&s, &id).await?;
    let st = s.scheduler.delete(here(&s, &id)?).await?;
    Ok(Json(VideoDeleted {
        id: st.id,
        object: VideoDeletedTag::VideoDeleted,
        deleted: true,
        state: st.state,
    }))
}

/// The finished clip: H.264 in MP4, or `variant=thumbnail` its first frame as PNG
#[utoipa::path(
    get,
    path = "/v1/videos/{id}/content",
    tag = "videos",
    params(("id" = String, Path, description = "The video's id"), ContentQuery),
    responses(
        (status = 200, description = "The clip or its thumbnail", content(
            (Download = "video/mp4"),
            (Download = "image/png"),
        )),
        (status = 400, description = "A query string the route cannot read", body = ErrorBody),
        (status = 404, description = "No such video job", body = ErrorBody),
        (status = 409, description = "Not finished (yet), or cancelled", body = ErrorBody),
        (status = 410, description = NOT_KEPT, body = ErrorBody),
        (status = 422, description = "An unknown variant", body = ErrorBody),
        (status = 500, description = "The job failed", body = ErrorBody),
    )
)]
async fn video_content(
    State(s): State<AppState>,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Download, ApiError> {
    let q = query(q)?;
    video_status(&s, &id).await?;
    let m = s.scheduler.result(here(&s, &id)?, 0).await?;
    Ok(match Variant::of(q.variant.as_deref())? {
        Variant::Video => Download(m.content_type, m.bytes.clone()),
        Variant::Thumbnail => Download("image/png", m.thumbnail.clone().unwrap_or_default()),
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let e = &*self.0;
        let status =
            StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = Json(ErrorBody {
            error: ErrorDetail {
                kind: e.label(),
                message: e.to_string(),
                field: e.field().map(str::to_string),
            },
        });
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
    use serde_json::Value;
    use utoipa::{IntoParams, PartialSchema};

    use super::*;

    fn maximum(schema: impl serde::Serialize, field: &str) -> Option<f64> {
        let v = serde_json::to_value(schema).unwrap();
        v["properties"][field]["maximum"].as_f64()
    }

    /// The bounds the document states are the ones the handlers check.
    #[test]
    fn the_documented_bounds_are_the_checked_ones() {
        assert_eq!(maximum(VideoRequest::schema(), "fps"), Some(MAX_FPS));
        for field in ["guidance", "guidance_2"] {
            for schema in [ImageRequest::schema(), VideoRequest::schema()] {
                assert_eq!(maximum(schema, field), Some(MAX_GUIDANCE as f64), "{field}");
            }
        }
        let limit = ListQuery::into_params(|| None)
            .into_iter()
            .find(|p| p.name == "limit")
            .unwrap();
        let limit: Value = serde_json::to_value(limit).unwrap();
        assert_eq!(limit["schema"]["maximum"].as_f64(), Some(MAX_LIST as f64));
    }
}
