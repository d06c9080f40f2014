//! OpenAI's video API (`/v1/videos`): queue a clip, list, poll, download and delete video
//! jobs. An image job's id is not a video's.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::delivery::deliver;
use super::errors::{
    BAD_BODY, BAD_CREDENTIAL, NOT_JSON, NOT_KEPT, NOT_READY, OTHER_MODEL, QUEUE_FULL, TIMEOUT,
    TOO_LARGE,
};
use super::state::{caller_job, here, query, read_openai_body, AppState};
use super::validate::parse_video;
use crate::server::error::ApiError;
use crate::server::kind::Kind;
use crate::server::openai_fields::Api;
use crate::server::owner::Caller;
use crate::server::requests::{ContentQuery, ListQuery, Order, Variant, VideoRequest};
use crate::server::responses::{
    Download, ErrorBody, ListTag, Video, VideoDeleted, VideoDeletedTag, VideoList,
};
use crate::server::scheduler::JobStatus;
use crate::Error;

/// The poll interval a running video's status suggests to clients.
const POLL_AFTER_MS: &str = "250";

/// Queue a text-to-video job (OpenAI's video API)
///
/// Poll `GET /v1/videos/{id}`, then download `GET /v1/videos/{id}/content`. The job
/// belongs to the request's bearer token (`Authorization: Bearer <token>`; none: anonymous),
/// and only that token sees, lists, downloads or deletes it. A client whose connection
/// closes (or half-closes) before the answer has its job cancelled.
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
        (status = 401, description = BAD_CREDENTIAL, body = ErrorBody),
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
pub(super) async fn create_video(
    State(s): State<AppState>,
    caller: Caller,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    s.scheduler.shared.ready()?;
    let (body, openai) = read_openai_body(&s, req, Api::Videos).await?;
    let (request, fps) = parse_video(body, &s)?;
    let job = s
        .scheduler
        .submit_for(vec![request], Kind::Video { fps }, caller.0)
        .await?;
    let status = s.scheduler.status(job.id()).await?;
    openai.log(&status.id);
    let answer = (
        StatusCode::ACCEPTED,
        [(header::LOCATION, format!("/v1/videos/{}", status.id))],
        Json(Video::new(&status, &s.model_name)),
    );
    Ok(deliver(answer.into_response(), job))
}

/// The most videos one list page holds.
pub(super) const MAX_LIST: usize = 100;

/// The caller's video jobs the server still holds, newest first
///
/// Only the jobs of the request's bearer token (`Authorization: Bearer <token>`). Without
/// one the list is a 401, unless the server runs with `--anonymous-list`: then it holds the
/// jobs every anonymous caller made.
#[utoipa::path(
    get,
    path = "/v1/videos",
    tag = "videos",
    params(ListQuery),
    responses(
        (status = 200, description = "The list", body = VideoList),
        (status = 400, description = "A query string the route cannot read", body = ErrorBody),
        (status = 401, description = "No credential (and the server lists anonymous jobs only with --anonymous-list), or an Authorization header that is not `Bearer <token>`", body = ErrorBody),
        (status = 404, description = "`after` names no video the server holds", body = ErrorBody),
        (status = 422, description = "`limit` or `order` out of range (error.field names it)", body = ErrorBody),
    )
)]
pub(super) async fn list_videos(
    State(s): State<AppState>,
    caller: Caller,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<VideoList>, ApiError> {
    let q = query(q)?;
    if caller.0.is_none() && !s.anonymous_list {
        return Err(Error::Unauthorized {
            msg: "listing videos needs a credential (`Authorization: Bearer <token>`): the list holds the jobs its token created; this server lists anonymous jobs only with --anonymous-list".into(),
        }
        .into());
    }
    let limit = q.limit.unwrap_or(20);
    if limit == 0 || limit > MAX_LIST {
        return Err(Error::invalid("limit", format!("{limit}: expected 1..={MAX_LIST}")).into());
    }
    let mut all = s.scheduler.list(Kind::VIDEO).await;
    all.retain(|st| caller.owns(st.owner));
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

/// The caller's video job by id (an image job's id is not a video's).
async fn video_status(s: &AppState, caller: Caller, id: &str) -> Result<JobStatus, ApiError> {
    let st = caller_job(s, caller, id).await?;
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
        (status = 404, description = "No such video job of the caller's (another credential's is not found either; nor is an image job's id)", body = ErrorBody),
    )
)]
pub(super) async fn get_video(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let st = video_status(&s, caller, &id).await?;
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
        (status = 404, description = "No such video job of the caller's (another credential's is not found either)", body = ErrorBody),
    )
)]
pub(super) async fn delete_video(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VideoDeleted>, ApiError> {
    video_status(&s, caller, &id).await?;
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
        (status = 404, description = "No such video job of the caller's (another credential's is not found either)", body = ErrorBody),
        (status = 409, description = "Not finished (yet), or cancelled", body = ErrorBody),
        (status = 410, description = NOT_KEPT, body = ErrorBody),
        (status = 422, description = "An unknown variant", body = ErrorBody),
        (status = 500, description = "The job failed", body = ErrorBody),
    )
)]
pub(super) async fn video_content(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, QueryRejection>,
) -> Result<Download, ApiError> {
    let q = query(q)?;
    video_status(&s, caller, &id).await?;
    let m = s.scheduler.result(here(&s, &id)?, 0).await?;
    Ok(match Variant::of(q.variant.as_deref())? {
        Variant::Video => Download(m.content_type, m.bytes.clone()),
        Variant::Thumbnail => Download("image/png", m.thumbnail.clone().unwrap_or_default()),
    })
}
