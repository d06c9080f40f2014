//! The router: every route once, registered with its `#[utoipa::path]` handler so the
//! router and the OpenAPI document served at `/openapi.json` cannot disagree; the routes that
//! name a job behind the middleware that sends them to the job's owner.

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router};
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::state::AppState;
use super::{health, images, jobs, models, videos};
use crate::server::error::ApiError;
use crate::server::{forward, openai_fields, openapi};
use crate::Error;

/// The router; tests drive it in-process with `oneshot`. Every route is here once, as a
/// handler whose `#[utoipa::path]` names its path and method: `routes!` puts it on the
/// router and in the OpenAPI document at once, so the two cannot disagree.
pub fn app(state: AppState) -> Router {
    let limit = state.bounds.body_limit;
    // Every route that names a job: its owner answers, wherever the request landed.
    let jobs = OpenApiRouter::default()
        .routes(routes!(videos::get_video, videos::delete_video))
        .routes(routes!(videos::video_content))
        .routes(routes!(jobs::job_status, jobs::cancel_job))
        .routes(routes!(jobs::job_result))
        .route_layer(middleware::from_fn_with_state(
            forward::JobRouting {
                shared: state.scheduler.shared.clone(),
                forwarding: state.forwarding,
            },
            forward::route_job,
        ));
    let (router, mut document) = OpenApiRouter::with_openapi(openapi::Head::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics))
        .routes(routes!(openapi::serve))
        .routes(routes!(models::list_models))
        .routes(routes!(models::get_model))
        .routes(routes!(images::generate))
        .routes(routes!(videos::create_video, videos::list_videos))
        .routes(routes!(jobs::submit_job))
        .merge(jobs)
        .split_for_parts();
    openai_fields::document(&mut document);
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
