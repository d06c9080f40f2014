//! The served model (OpenAI's model list): its card, with the limits this server admits, and
//! the check that a request's `model` names it.

use axum::extract::{Path, State};
use axum::Json;

use super::state::AppState;
use crate::server::error::ApiError;
use crate::server::responses::{
    Conditioning, ErrorBody, Limits, ListTag, Modality, ModelCard, ModelList, ModelTag,
};
use crate::Error;

fn model_card(s: &AppState) -> ModelCard {
    let m = &s.model;
    ModelCard {
        id: s.model_name.clone(),
        object: ModelTag::Model,
        created: s.scheduler.shared.started_unix,
        owned_by: "layerwise",
        family: m.family.name(),
        modalities: if m.family.video().is_some() {
            vec![Modality::Image, Modality::Video]
        } else {
            vec![Modality::Image]
        },
        conditioning: if m.family.classes().is_some() {
            Conditioning::Class
        } else {
            Conditioning::Text
        },
        limits: limits(s),
    }
}

/// What this server admits (its bounds, each within what the model runs): a request beyond
/// any is a 422 naming the field, before it is queued.
fn limits(s: &AppState) -> Limits {
    let (b, video) = (&s.bounds.request, s.model.family.video().is_some());
    let cost = s.model.checkpoint.activation_cost();
    Limits {
        min_latent_tokens: s.sp.max(1) as u64,
        pixels_per_latent_token: cost.pixels_per_token,
        frames_per_latent_frame: cost.frames_per_latent,
        max_width: b.max_width,
        max_height: b.max_height,
        max_frames: if video { b.max_frames } else { 1 },
        max_steps: b.max_steps,
        max_n: b.max_n,
        max_prompt_tokens: if s.model.family.classes().is_some() {
            0
        } else {
            b.max_prompt_tokens
        },
        guidance: b.guidance,
    }
}

/// The served model (OpenAI's model list)
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "models",
    responses((status = 200, description = "A list of one model", body = ModelList))
)]
pub(super) async fn list_models(State(s): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: ListTag::List,
        data: vec![model_card(&s)],
    })
}

/// The served model by name
#[utoipa::path(
    get,
    path = "/v1/models/{model}",
    tag = "models",
    params(("model" = String, Path, description = "The served model's name")),
    responses(
        (status = 200, description = "The model", body = ModelCard),
        (status = 404, description = "Not the served model", body = ErrorBody),
    )
)]
pub(super) async fn get_model(
    State(s): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    check_model_name(&s, &model)?;
    Ok(Json(model_card(&s)))
}

pub(super) fn check_model_name(s: &AppState, name: &str) -> Result<(), Error> {
    if name == s.model_name {
        return Ok(());
    }
    Err(Error::NotFound {
        what: format!(
            "model `{name}`: this server serves `{}` (GET /v1/models)",
            s.model_name
        ),
    })
}
