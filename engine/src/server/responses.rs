//! What the API answers, as types: the models, the images, the video objects and lists, and
//! the one error body every status shares. The handlers build these and the OpenAPI
//! document is derived from them. A job's own status is the scheduler's [`JobStatus`].

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, Schema, SchemaFormat, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

use super::scheduler::{JobState, JobStatus};

/// `GET /v1/models`: OpenAI's model list, of the one model this server serves.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    #[schema(inline)]
    pub object: ListTag,
    pub data: Vec<ModelCard>,
}

/// The served model as OpenAI's model object shows one, with what it makes and what this
/// server admits.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Model)]
pub struct ModelCard {
    /// The name requests give as `model` (--served-model-name).
    pub id: String,
    #[schema(inline)]
    pub object: ModelTag,
    /// When the server started (unix seconds).
    pub created: u64,
    pub owned_by: &'static str,
    /// The model's family (`dit`, `wan`, ...).
    pub family: &'static str,
    #[schema(inline)]
    pub modalities: Vec<Modality>,
    #[schema(inline)]
    pub conditioning: Conditioning,
    pub limits: Limits,
}

/// What a model makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    Image,
    Video,
}

/// What a model generates from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Conditioning {
    /// A class label (or a prompt naming a class).
    Class,
    /// A prompt.
    Text,
}

/// What this server admits, each bound within what the model itself runs (its position
/// tables): a request beyond any is a 422 naming the field, before it is queued.
#[derive(Debug, Serialize, ToSchema)]
pub struct Limits {
    /// Widest output in pixels.
    pub max_width: u64,
    /// Tallest output in pixels.
    pub max_height: u64,
    /// Most frames of one clip (1 for an image-only model).
    pub max_frames: u64,
    /// Most denoising steps.
    pub max_steps: u64,
    /// Most images per request.
    pub max_n: u64,
    /// Largest max_sequence_length (0 for a class-conditional model).
    pub max_prompt_tokens: u64,
    /// Whether a guidance scale above 1 is taken.
    pub guidance: bool,
    /// The fewest latent tokens a request may have: the ranks its sequence is split over
    /// (`--sp`), each of which needs one; fewer is a 422 naming `size`. A request's tokens
    /// are ceil(width × height × latent frames / `pixels_per_latent_token`), its latent
    /// frames (frames − 1) / `frames_per_latent_frame` + 1.
    pub min_latent_tokens: u64,
    /// Output pixels per latent token of one latent frame (the VAE's and the patch's
    /// scales, squared).
    pub pixels_per_latent_token: u64,
    /// Frames per latent frame after the first (1 for an image model).
    pub frames_per_latent_frame: u64,
}

/// `POST /v1/images/generations`: the images, in the shape of OpenAI's image response, with
/// the job's status beside them.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = GenerationResponse)]
pub struct ImageResponse {
    /// Unix seconds.
    pub created: u64,
    /// The job's id (its images stay at `GET /v1/jobs/{id}/result?index=i` for a while).
    pub id: String,
    pub model: String,
    /// WxH of every image.
    pub size: String,
    #[schema(inline)]
    pub output_format: OutputFormat,
    pub data: Vec<ImageData>,
    /// The job's status as it finished: steps and timings.
    pub timings: JobStatus,
}

/// One image: in the answer, or where to fetch it (`response_format`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageData {
    /// The PNG, base64 (`response_format: b64_json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b64_json: Option<String>,
    /// Where the PNG is (`response_format: url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// A video job in the shape of OpenAI's video object, with the engine's own progress beside
/// it (steps and frames done, the job's state).
#[derive(Debug, Serialize, ToSchema)]
pub struct Video {
    pub id: String,
    #[schema(inline)]
    pub object: VideoTag,
    pub model: String,
    #[schema(inline)]
    pub status: VideoStatus,
    /// Percent done: denoising steps are 90 of it, decoded frames the last 10.
    #[schema(maximum = 100)]
    pub progress: u32,
    /// Unix seconds.
    pub created_at: u64,
    pub completed_at: Option<u64>,
    /// When the clip goes (sooner when the byte budget for kept outputs needs the room).
    pub expires_at: Option<u64>,
    /// Why it failed; `code` `cancelled` for a cancelled job.
    pub error: Option<VideoError>,
    pub prompt: Option<String>,
    /// WxH in pixels.
    pub size: String,
    /// The clip's length in seconds, as a short decimal ("5.06").
    pub seconds: String,
    /// Always null: this server makes no remixes.
    pub remixed_from_video_id: Option<String>,
    pub state: JobState,
    pub frames: usize,
    /// Frames per second the MP4 plays at.
    pub fps: f64,
    pub steps: usize,
    pub seed: u64,
    pub steps_done: usize,
    pub steps_total: usize,
    pub frames_decoded: usize,
    /// Images queued ahead of this job (null once it runs).
    pub queue_position: Option<usize>,
    /// The clip is gone; downloading it is a 410.
    pub expired: bool,
}

/// A video's status as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VideoStatus {
    Queued,
    InProgress,
    Completed,
    /// Failed or cancelled (then `error.code` is `cancelled`).
    Failed,
}

/// Why a video failed.
#[derive(Debug, Serialize, ToSchema)]
pub struct VideoError {
    /// The error's stable label (`error.type` of the API's errors), or `cancelled`.
    pub code: Option<&'static str>,
    pub message: String,
}

impl Video {
    /// `st` (a video job's status) as the video object of a server serving `model`.
    pub fn new(st: &JobStatus, model: &str) -> Self {
        let status = match st.state {
            JobState::Queued => VideoStatus::Queued,
            JobState::Running => VideoStatus::InProgress,
            JobState::Succeeded => VideoStatus::Completed,
            JobState::Failed | JobState::Cancelled => VideoStatus::Failed,
        };
        let fps = st.fps.unwrap_or(1.0);
        let error = match (st.state, &st.error) {
            (JobState::Cancelled, _) => Some(VideoError {
                code: Some("cancelled"),
                message: "cancelled (DELETE /v1/videos/{id})".into(),
            }),
            (_, Some(m)) => Some(VideoError {
                code: st.error_type,
                message: m.clone(),
            }),
            _ => None,
        };
        Video {
            id: st.id.clone(),
            object: VideoTag::Video,
            model: model.into(),
            status,
            progress: st.progress(),
            created_at: st.created_at,
            completed_at: st.finished_at,
            expires_at: st.expires_at,
            error,
            prompt: st.prompt.clone(),
            size: format!("{}x{}", st.width, st.height),
            seconds: seconds_text(st.frames as f64 / fps),
            remixed_from_video_id: None,
            state: st.state,
            frames: st.frames,
            fps,
            steps: st.steps,
            seed: st.seed,
            steps_done: st.steps_done,
            steps_total: st.steps_total,
            frames_decoded: st.frames_decoded,
            queue_position: st.queue_position,
            expired: st.expired,
        }
    }
}

/// Seconds as a short decimal string ("5.0625" → "5.06", "4" → "4").
fn seconds_text(secs: f64) -> String {
    let t = format!("{secs:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// An output as it is downloaded: its content type and its bytes (a PNG or an MP4).
#[derive(Debug)]
pub struct Download(pub &'static str, pub Vec<u8>);

/// A body of bytes, whose content type says what they are.
impl PartialSchema for Download {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl ToSchema for Download {}

impl IntoResponse for Download {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, self.0)], Body::from(self.1)).into_response()
    }
}

/// `GET /v1/videos`: a page of the video jobs the server still holds.
#[derive(Debug, Serialize, ToSchema)]
pub struct VideoList {
    #[schema(inline)]
    pub object: ListTag,
    pub data: Vec<Video>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    /// More videos follow (ask again with `after` = `last_id`).
    pub has_more: bool,
}

/// `DELETE /v1/videos/{id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct VideoDeleted {
    pub id: String,
    #[schema(inline)]
    pub object: VideoDeletedTag,
    pub deleted: bool,
    /// The job's state after the cancel.
    pub state: JobState,
}

/// Every error, whatever its status, unknown routes and methods included.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// The error's stable label (`invalid_request`, `not_found`, `queue_full`, ...).
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, where one is.
    pub field: Option<String>,
}

/// `object` of a list.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ListTag {
    List,
}

/// `object` of a model.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ModelTag {
    Model,
}

/// `object` of a video.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum VideoTag {
    Video,
}

/// `object` of a deleted video.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub enum VideoDeletedTag {
    #[serde(rename = "video.deleted")]
    VideoDeleted,
}

/// The images' file format.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    Png,
}
