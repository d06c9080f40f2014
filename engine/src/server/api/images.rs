//! OpenAI's synchronous image API (`POST /v1/images/generations`): the request waits for
//! its images, and a client that goes away cancels its job.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::Json;
use base64::Engine as _;

use super::errors::{
    BAD_BODY, BAD_CREDENTIAL, NOT_JSON, NOT_READY, OTHER_MODEL, QUEUE_FULL, TIMEOUT, TOO_LARGE,
};
use super::state::{read_openai_body, AppState};
use super::validate::parse_images;
use crate::server::error::ApiError;
use crate::server::kind::Kind;
use crate::server::openai_fields::{Api, Tolerated};
use crate::server::owner::Caller;
use crate::server::requests::{ImageRequest, ResponseFormat};
use crate::server::responses::{ErrorBody, ImageData, ImageResponse, OutputFormat};
use crate::server::scheduler::JobState;

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn result_url(id: &str, index: usize) -> String {
    format!("/v1/jobs/{id}/result?index={index}")
}

/// Generate images and wait for them
///
/// OpenAI's image API. The images come back in the answer (`b64_json`) or as the job's
/// result URLs (`url`, readable with the same bearer token as the request); a client that
/// goes away (a half-close included) cancels the job.
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
        (status = 401, description = BAD_CREDENTIAL, body = ErrorBody),
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
pub(super) async fn generate(
    State(s): State<AppState>,
    caller: Caller,
    req: axum::extract::Request,
) -> Result<(Tolerated, Json<ImageResponse>), ApiError> {
    s.scheduler.shared.ready()?;
    let (body, openai) = read_openai_body(&s, req, Api::Images).await?;
    let (requests, format) = parse_images(body, &s)?;
    let n = requests.len();
    let size = format!("{}x{}", requests[0].width, requests[0].height);
    let mut job = s
        .scheduler
        .submit_for(requests, Kind::Image, caller.0)
        .await?;
    openai.log(&s.scheduler.shared.ids.format(job.id()));
    s.scheduler.wait(job.id()).await;
    // Finished: nothing is left to cancel.
    let id = job.answered();
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
    Ok((
        openai,
        Json(ImageResponse {
            created: now_unix(),
            id: status.id.clone(),
            model: s.model_name.clone(),
            size,
            output_format: OutputFormat::Png,
            data,
            timings: status,
        }),
    ))
}
