//! The engine's own asynchronous image API (`/v1/jobs`): queue a request, poll its job,
//! download or cancel it.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::delivery::deliver;
use super::errors::{
    BAD_BODY, BAD_CREDENTIAL, NOT_JSON, NOT_KEPT, NOT_READY, NO_JOB, OTHER_MODEL, QUEUE_FULL,
    TIMEOUT, TOO_LARGE,
};
use super::state::{caller_job, here, query, read_openai_body, AppState};
use super::validate::parse_images;
use crate::server::error::ApiError;
use crate::server::kind::Kind;
use crate::server::openai_fields::Api;
use crate::server::owner::Caller;
use crate::server::requests::{ImageRequest, ResultQuery};
use crate::server::responses::{Download, ErrorBody};
use crate::server::scheduler::JobStatus;

/// Queue a generation job
///
/// The image request of `POST /v1/images/generations`, answered at once; poll
/// `GET /v1/jobs/{id}`, then download `GET /v1/jobs/{id}/result`. The job belongs to the
/// request's bearer token (none: anonymous), and only that token sees, downloads or
/// cancels it. A client whose connection closes (or half-closes) before the answer has its
/// job cancelled.
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
        (status = 401, description = BAD_CREDENTIAL, body = ErrorBody),
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
pub(super) async fn submit_job(
    State(s): State<AppState>,
    caller: Caller,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let (body, openai) = read_openai_body(&s, req, Api::Images).await?;
    let (requests, _) = parse_images(body, &s)?;
    let job = s
        .scheduler
        .submit_for(requests, Kind::Image, caller.0)
        .await?;
    let status = s.scheduler.status(job.id()).await?;
    openai.log(&status.id);
    let location = format!("/v1/jobs/{}", status.id);
    let answer = (
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        openai,
        Json(status),
    );
    Ok(deliver(answer.into_response(), job))
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
pub(super) async fn job_status(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    Ok(Json(caller_job(&s, caller, &id).await?))
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
pub(super) async fn cancel_job(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<JobStatus>, ApiError> {
    caller_job(&s, caller, &id).await?;
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
pub(super) async fn job_result(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    q: Result<Query<ResultQuery>, QueryRejection>,
) -> Result<Download, ApiError> {
    let q = query(q)?;
    caller_job(&s, caller, &id).await?;
    let m = s
        .scheduler
        .result(here(&s, &id)?, q.index.unwrap_or(0))
        .await?;
    Ok(Download(m.content_type, m.bytes.clone()))
}
