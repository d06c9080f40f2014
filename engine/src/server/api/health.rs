//! The server's own routes: liveness, readiness and the Prometheus metrics.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::state::AppState;
use crate::server::error::ApiError;
use crate::server::responses::ErrorBody;

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
pub(super) async fn healthz(State(s): State<AppState>) -> Response {
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
pub(super) async fn readyz(State(s): State<AppState>) -> Result<&'static str, ApiError> {
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
pub(super) async fn metrics(State(s): State<AppState>) -> Response {
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
