//! The OpenAPI document, served at `GET /openapi.json`. Nothing in it is written by hand
//! but its head: its paths come from the handlers' `#[utoipa::path]` attributes as the
//! router registers them (one table, in [`super::api::app`]), its schemas from the request
//! and response types ([`super::requests`], [`super::responses`]).

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use utoipa::OpenApi;

/// The document's head, which the router adds its paths and their schemas to.
#[derive(OpenApi)]
#[openapi(info(
    title = "layerwise",
    description = "Diffusion-transformer inference with weights streamed block by block."
))]
pub struct Head;

/// The document as served: rendered once, when the router is made.
#[derive(Debug, Clone)]
pub struct Served(Arc<str>);

impl Served {
    /// `doc`, rendered as the JSON a client reads.
    pub fn new(doc: &utoipa::openapi::OpenApi) -> Self {
        Served(
            doc.to_pretty_json()
                .expect("an OpenAPI document renders as JSON")
                .into(),
        )
    }
}

/// This document
///
/// OpenAPI 3.1, derived from the handlers and the request and response types.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "openapi",
    tag = "server",
    responses((status = 200, description = "OpenAPI 3.1", content_type = "application/json"))
)]
pub async fn serve(Extension(doc): Extension<Served>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        doc.0.to_string(),
    )
        .into_response()
}
