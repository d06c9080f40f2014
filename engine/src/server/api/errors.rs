//! How errors answer: an [`ApiError`]'s status and JSON body (the one shape of every error,
//! unknown routes included), and what the OpenAPI document says of the errors many routes
//! share.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::server::error::ApiError;
use crate::server::responses::{ErrorBody, ErrorDetail};

// What the document says of the errors many routes share.
pub(super) const BAD_BODY: &str =
    "A body that is not a JSON object, nor multipart form data of UTF-8 text";
pub(super) const TIMEOUT: &str = "The body took longer than --body-timeout-seconds to arrive";
pub(super) const TOO_LARGE: &str = "Body over the server's limit (--body-limit)";
pub(super) const NOT_JSON: &str = "A body that is neither application/json nor multipart/form-data";
pub(super) const OTHER_MODEL: &str = "`model` names a model this server does not serve";
pub(super) const QUEUE_FULL: &str = "Queue full; see Retry-After";
pub(super) const NOT_READY: &str = "Not ready, shutting down, or the engine failed";
pub(super) const NO_JOB: &str =
    "No such job of the caller's (another credential's job is not found either), or it is another replica's and that replica is gone: 410";
pub(super) const BAD_CREDENTIAL: &str = "An Authorization header that is not `Bearer <token>`";
pub(super) const NOT_KEPT: &str =
    "Finished, but no longer kept (--result-ttl-seconds, --result-bytes)";

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
        if let Some(retry_after) = e.retry_after() {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(retry_after));
        }
        if let crate::Error::Unauthorized { .. } = e {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}
