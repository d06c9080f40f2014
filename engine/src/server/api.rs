//! The HTTP API: routes, request parsing and validation, responses. Everything a request
//! can get wrong is found here, named by its field, before it reaches the queue.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::scheduler::{format_id, parse_id, JobState, Scheduler};
use super::ApiError;
use crate::engine::Model;
use crate::execution::work::{Condition, Request};
use crate::Error;

/// What the server accepts, beyond what the model can do.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// Largest width or height in pixels.
    pub max_size: usize,
    pub max_steps: usize,
    pub max_n: usize,
    /// Largest request body in bytes.
    pub body_limit: usize,
}

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    pub scheduler: Scheduler,
    pub model: Arc<Model>,
    pub bounds: Bounds,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    B64Json,
    Url,
}

/// The router; tests drive it in-process with `oneshot`.
pub fn app(state: AppState) -> Router {
    let limit = state.bounds.body_limit;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/images/generations", post(generate))
        .route("/v1/jobs", post(submit_job))
        .route("/v1/jobs/{id}", get(job_status).delete(cancel_job))
        .route("/v1/jobs/{id}/result", get(job_result))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
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

fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::PayloadTooLarge { limit }.into()
        } else {
            Error::BadRequest { msg: r.body_text() }.into()
        }
    })
}

fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

fn uint(o: &Map<String, Value>, name: &str, default: u64) -> Result<u64, Error> {
    match field(o, name) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| Error::invalid(name, format!("{v}: expected a non-negative integer"))),
    }
}

/// Parses and checks a generation request: field by field, then against the server's
/// bounds, then against the model. Returns one `Request` per image.
pub fn parse(
    bytes: &[u8],
    model: &Model,
    b: &Bounds,
) -> Result<(Vec<Request>, ResponseFormat), Error> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| Error::BadRequest {
        msg: format!("body is not JSON: {e}"),
    })?;
    let Value::Object(o) = v else {
        return Err(Error::BadRequest {
            msg: "body must be a JSON object".into(),
        });
    };
    const KNOWN: [&str; 8] = [
        "class_label",
        "prompt",
        "n",
        "size",
        "steps",
        "guidance",
        "seed",
        "response_format",
    ];
    if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(Error::invalid(
            k.as_str(),
            format!("unknown field; expected one of {}", KNOWN.join(", ")),
        ));
    }
    let classes = model.family.classes().ok_or_else(|| {
        Error::invalid(
            "model",
            format!(
                "the {} family is text-conditioned; this API serves class-conditional families",
                model.family.name()
            ),
        )
    })?;
    if field(&o, "prompt").is_some() {
        return Err(Error::invalid(
            "prompt",
            format!("this model family (DiT) is class-conditional and takes no prompt; send `class_label` (0..{}) instead", classes - 1),
        ));
    }
    let class_label = match field(&o, "class_label") {
        None => {
            return Err(Error::invalid(
                "class_label",
                format!("required: the class to draw (0..{})", classes - 1),
            ))
        }
        Some(v) => v
            .as_u64()
            .filter(|&c| c <= u32::MAX as u64)
            .ok_or_else(|| {
                Error::invalid(
                    "class_label",
                    format!("{v}: expected a non-negative integer"),
                )
            })? as u32,
    };
    let n = uint(&o, "n", 1)? as usize;
    if n == 0 || n > b.max_n {
        return Err(Error::invalid(
            "n",
            format!(
                "{n}: this server generates 1..={} images per request",
                b.max_n
            ),
        ));
    }
    let (width, height) = match field(&o, "size") {
        None => model.family.native_size(),
        Some(Value::String(s)) => parse_size(s)?,
        Some(v) => {
            return Err(Error::invalid(
                "size",
                format!("{v}: expected a string \"WxH\""),
            ))
        }
    };
    if width > b.max_size || height > b.max_size {
        return Err(Error::invalid(
            "size",
            format!(
                "{width}x{height}: this server allows at most {0}x{0}",
                b.max_size
            ),
        ));
    }
    let steps = uint(&o, "steps", 25.min(b.max_steps) as u64)? as usize;
    if steps == 0 || steps > b.max_steps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: this server allows 1..={} steps", b.max_steps),
        ));
    }
    let guidance = match field(&o, "guidance") {
        None => 4.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| Error::invalid("guidance", format!("{v}: expected a number")))?
            as f32,
    };
    let seed = uint(&o, "seed", 0)?;
    let format = match field(&o, "response_format") {
        None => ResponseFormat::B64Json,
        Some(Value::String(s)) if s == "b64_json" => ResponseFormat::B64Json,
        Some(Value::String(s)) if s == "url" => ResponseFormat::Url,
        Some(v) => {
            return Err(Error::invalid(
                "response_format",
                format!("{v}: expected \"b64_json\" or \"url\""),
            ))
        }
    };
    let requests: Vec<Request> = (0..n)
        .map(|i| Request {
            seed: seed.wrapping_add(i as u64),
            steps,
            guidance,
            ..Request::image(Condition::Class(class_label), width, height)
        })
        .collect();
    for r in &requests {
        model.validate(r).map_err(|e| match e {
            Error::Invalid { field, msg } if field == "width" || field == "height" => {
                Error::invalid("size", format!("{field} {msg}"))
            }
            other => other,
        })?;
    }
    Ok((requests, format))
}

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

fn result_url(id: u64, index: usize) -> String {
    format!("/v1/jobs/{}/result?index={index}", format_id(id))
}

async fn generate(
    State(s): State<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let bytes = body(b, s.bounds.body_limit)?;
    let (requests, format) = parse(&bytes, &s.model, &s.bounds)?;
    let n = requests.len();
    let id = s.scheduler.submit(requests).await?;
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
                data.push(json!({ "url": result_url(id, i) }));
            }
            ResponseFormat::B64Json => {
                let png = s.scheduler.result(id, i).await?;
                data.push(json!({ "b64_json": base64::engine::general_purpose::STANDARD.encode(png.as_slice()) }));
            }
        }
    }
    Ok(
        Json(
            json!({ "created": now_unix(), "id": format_id(id), "data": data, "timings": status }),
        )
        .into_response(),
    )
}

async fn submit_job(
    State(s): State<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let bytes = body(b, s.bounds.body_limit)?;
    let (requests, _) = parse(&bytes, &s.model, &s.bounds)?;
    let id = s.scheduler.submit(requests).await?;
    let status = s.scheduler.status(id).await?;
    let location = format!("/v1/jobs/{}", format_id(id));
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
    Ok(Json(s.scheduler.status(parse_id(&id)?).await?).into_response())
}

async fn cancel_job(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(s.scheduler.cancel(parse_id(&id)?).await?).into_response())
}

#[derive(Deserialize)]
struct ResultQuery {
    index: Option<usize>,
}

async fn job_result(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ResultQuery>,
) -> Result<Response, ApiError> {
    let png = s
        .scheduler
        .result(parse_id(&id)?, q.index.unwrap_or(0))
        .await?;
    Ok((
        [(header::CONTENT_TYPE, "image/png")],
        Body::from(png.as_slice().to_vec()),
    )
        .into_response())
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
