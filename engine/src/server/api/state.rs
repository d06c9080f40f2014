//! What every handler works from: the state the router shares ([`AppState`], the server's
//! [`Bounds`]), and reading a request against it: its query string, its body within the
//! bounds on size and time, and which of this replica's jobs an id names.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::Query;
use serde::de::DeserializeOwned;

use crate::bounds::RequestBounds;
use crate::engine::Model;
use crate::server::error::ApiError;
use crate::server::forward::Forwarding;
use crate::server::ids::Owner;
use crate::server::owner::Caller;
use crate::server::scheduler::{JobStatus, Scheduler};
use crate::server::{body, openai_fields};
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
    /// Ranks one request's sequence is split over (`--sp`): a request needs at least one
    /// latent token for each.
    pub sp: usize,
    /// Whether a caller without a credential may list jobs (`--anonymous-list`): it then
    /// sees every anonymous caller's ([`crate::server::owner`]).
    pub anonymous_list: bool,
    /// The step cache (`--cache`): each request's default and bound
    /// ([`crate::cache::bound`]).
    pub cache: Option<crate::cache::StepCache>,
}

/// The name a model folder is served under by default: its last path component.
pub fn folder_name(path: &std::path::Path) -> String {
    path.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .or_else(|| path.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

/// A query string the route cannot read, as a JSON 400.
pub(super) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Error> {
    q.map(|Query(t)| t).map_err(|r| Error::BadRequest {
        msg: format!("query string: {}", r.body_text()),
    })
}

/// A generation request's body as `T`, with OpenAI's fields of `api` taken out first
/// ([`openai_fields::take`]), and what came of them.
pub(super) async fn read_openai_body<T: DeserializeOwned>(
    s: &AppState,
    req: axum::extract::Request,
    api: openai_fields::Api,
) -> Result<(T, openai_fields::Tolerated), Error> {
    let mut fields = body::read_fields(req, s.bounds.body_limit, s.bounds.body_timeout).await?;
    let tolerated = openai_fields::take(&mut fields, api)?;
    Ok((fields.parse()?, tolerated))
}

/// This replica's number for the job `id` names (the middleware in [`crate::server::forward`] sends the
/// requests for other replicas' jobs on before a handler runs).
pub(super) fn here(s: &AppState, id: &str) -> Result<u64, Error> {
    match s.scheduler.shared.ids.parse(id)? {
        Owner::Here(n) => Ok(n),
        Owner::Peer(_) => Err(Error::NotFound {
            what: format!("job `{id}` on this replica"),
        }),
    }
}

/// The status of the job `id` names when it is `caller`'s; another caller's job is not
/// found, exactly as one that never existed ([`crate::server::owner`]).
pub(super) async fn caller_job(
    s: &AppState,
    caller: Caller,
    id: &str,
) -> Result<JobStatus, ApiError> {
    let st = s.scheduler.status(here(s, id)?).await?;
    if !caller.owns(st.owner) {
        return Err(Error::NotFound {
            what: format!("job `{id}`"),
        }
        .into());
    }
    Ok(st)
}
