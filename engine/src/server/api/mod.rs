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
//!
//! One file a resource ([`images`], [`jobs`], [`videos`], [`models`], [`health`]), beside
//! what they share: the state and request reading ([`state`]), the value checks
//! ([`validate`]), the error answers ([`errors`]), answers that carry their job until sent
//! ([`delivery`]) and the router ([`router`]).

mod delivery;
mod errors;
mod health;
mod images;
mod jobs;
mod models;
mod router;
mod state;
mod validate;
mod videos;

pub use router::app;
pub use state::{folder_name, AppState, Bounds};

#[cfg(test)]
mod tests {
    use serde_json::Value;
    use utoipa::{IntoParams, PartialSchema};

    use super::validate::MAX_GUIDANCE;
    use super::videos::MAX_LIST;
    use crate::bounds::{MAX_FPS, MIN_FPS};
    use crate::server::requests::{ImageRequest, ListQuery, VideoRequest};

    fn maximum(schema: impl serde::Serialize, field: &str) -> Option<f64> {
        let v = serde_json::to_value(schema).unwrap();
        v["properties"][field]["maximum"].as_f64()
    }

    fn minimum(schema: impl serde::Serialize, field: &str) -> Option<f64> {
        let v = serde_json::to_value(schema).unwrap();
        v["properties"][field]["minimum"].as_f64()
    }

    /// The bounds the document states are the ones the handlers check.
    #[test]
    fn the_documented_bounds_are_the_checked_ones() {
        assert_eq!(maximum(VideoRequest::schema(), "fps"), Some(MAX_FPS));
        assert_eq!(minimum(VideoRequest::schema(), "fps"), Some(MIN_FPS));
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
