//! The request bounds an engine pod enforces: the one definition the server's flags read and
//! the operator writes (from a DiffusionDeployment's `workload`), so the two cannot drift. The
//! planner sizes activations for a request at exactly these bounds
//! ([`crate::checkpoint::ActivationCost::checked_bytes`]), and the server refuses anything
//! beyond them with a 422 naming the field.
//!
//! A model has limits of its own besides memory ([`ModelLimits`]: Wan's rotary tables hold so
//! many positions per axis). Bounds beyond them would admit requests that fail once they run,
//! so the server checks its bounds against the checkpoint at start and the planner refuses a
//! workload beyond them, both through [`RequestBounds::beyond`].

use serde::{Deserialize, Serialize};

use crate::checkpoint::{ActivationCost, RequestShape};
use crate::compute_dtype::ComputeElement;
use crate::{Error, Result};

/// The slowest frame rate a clip is made at: below it a frame's duration overflows the
/// containers' time fields (GIF's u16 centiseconds, the MP4 ticks of [`MAX_FPS`]'s scale).
pub const MIN_FPS: f64 = 0.1;
/// The fastest frame rate a clip is made at.
pub const MAX_FPS: f64 = 240.0;

/// A clip's frame rate, checked once for every party that takes one: the API document
/// states [`MIN_FPS`]..=[`MAX_FPS`], the server refuses a request's `fps` outside it with a
/// 422 before queueing, and the engine refuses it before running (so a family such as
/// Cosmos3, whose positions divide by it, never sees a rate it would turn into
/// non-finite values). `field` names what gave it (`fps`, `--fps`).
pub fn check_fps(field: &str, fps: f64) -> Result<f64> {
    if fps.is_finite() && (MIN_FPS..=MAX_FPS).contains(&fps) {
        return Ok(fps);
    }
    Err(Error::invalid(
        field,
        format!("{fps}: expected a frame rate of {MIN_FPS} to {MAX_FPS} frames per second"),
    ))
}

/// Latent tokens of one output `width` × `height` pixels and `frames` frames, as the
/// activation cost counts them: its latent frames (the first alone, then one per
/// [`ActivationCost::frames_per_latent`]) times its pixels over
/// [`ActivationCost::pixels_per_token`]. Exact for every size the family takes (whole
/// patches).
pub fn latent_tokens(cost: &ActivationCost, width: u64, height: u64, frames: u64) -> u64 {
    let latent_frames = (frames.max(1) - 1) / cost.frames_per_latent.max(1) + 1;
    width
        .saturating_mul(height)
        .saturating_mul(latent_frames)
        .div_ceil(cost.pixels_per_token.max(1))
}

/// A request of `tokens` latent tokens split over a group of `sp` ranks (`--sp`): every
/// rank of the group needs at least one, so fewer than `sp` is refused, naming `size`. The
/// server checks it at submit ([`latent_tokens`] of the request) and each family again
/// when a group takes the request.
pub fn split_tokens(tokens: u64, sp: u64) -> Result<()> {
    if tokens < sp {
        return Err(Error::invalid(
            "size",
            format!(
                "the request has {tokens} latent tokens, fewer than the {sp} ranks its sequence splits over (--sp): ask for a larger size or more frames"
            ),
        ));
    }
    Ok(())
}

/// The range one request bound may be set to, stated once for the engine's flag
/// (`--max-width`, refused at start outside it) and the DiffusionDeployment's `workload`
/// field (`maxWidth`, whose CEL rule [`Self::cel`] writes), so `kubectl apply` and
/// `layerwise serve` refuse the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundRange {
    /// The engine's flag, without its dashes.
    pub flag: &'static str,
    /// The `workload` field of a DiffusionDeployment.
    pub workload_field: &'static str,
    pub min: u64,
    pub max: u64,
}

impl BoundRange {
    /// `value` when it lies in the range, else an error naming the flag and the range.
    pub fn check(&self, value: u64) -> Result<u64> {
        if (self.min..=self.max).contains(&value) {
            return Ok(value);
        }
        Err(Error::invalid(
            self.flag,
            format!("{value}: --{} takes {}..={}", self.flag, self.min, self.max),
        ))
    }

    /// The CRD's CEL rule for the workload field.
    pub fn cel(&self) -> String {
        format!("self >= {} && self <= {}", self.min, self.max)
    }

    /// The message `kubectl apply` shows when [`Self::cel`] fails.
    pub fn cel_message(&self) -> String {
        format!(
            "{} must be between {} and {}",
            self.workload_field, self.min, self.max
        )
    }
}

/// `--max-width` / `maxWidth`: 8 pixels (one latent patch of the smallest VAE) to 16384.
pub const WIDTH_RANGE: BoundRange = BoundRange {
    flag: "max-width",
    workload_field: "maxWidth",
    min: 8,
    max: 16384,
};
/// `--max-height` / `maxHeight`.
pub const HEIGHT_RANGE: BoundRange = BoundRange {
    flag: "max-height",
    workload_field: "maxHeight",
    min: 8,
    max: 16384,
};
/// `--max-frames` / `maxFrames` (1: images only).
pub const FRAMES_RANGE: BoundRange = BoundRange {
    flag: "max-frames",
    workload_field: "maxFrames",
    min: 1,
    max: 1024,
};
/// `--max-steps` / `maxSteps`.
pub const STEPS_RANGE: BoundRange = BoundRange {
    flag: "max-steps",
    workload_field: "maxSteps",
    min: 1,
    max: 1000,
};
/// `--max-n` / `maxBatch`: outputs per request.
pub const N_RANGE: BoundRange = BoundRange {
    flag: "max-n",
    workload_field: "maxBatch",
    min: 1,
    max: 64,
};
/// `--max-prompt-tokens` / `maxPromptTokens`.
pub const PROMPT_TOKENS_RANGE: BoundRange = BoundRange {
    flag: "max-prompt-tokens",
    workload_field: "maxPromptTokens",
    min: 1,
    max: 4096,
};

/// Environment variable of `layerwise serve --max-width`.
pub const ENV_MAX_WIDTH: &str = "LAYERWISE_MAX_WIDTH";
/// Environment variable of `layerwise serve --max-height`.
pub const ENV_MAX_HEIGHT: &str = "LAYERWISE_MAX_HEIGHT";
/// Environment variable of `layerwise serve --max-frames`.
pub const ENV_MAX_FRAMES: &str = "LAYERWISE_MAX_FRAMES";
/// Environment variable of `layerwise serve --max-steps`.
pub const ENV_MAX_STEPS: &str = "LAYERWISE_MAX_STEPS";
/// Environment variable of `layerwise serve --max-n`.
pub const ENV_MAX_N: &str = "LAYERWISE_MAX_N";
/// The most prompt tokens a server takes unless told otherwise, and the padded length of a
/// prompt whose request names none (diffusers' `max_sequence_length` default).
pub const DEFAULT_MAX_PROMPT_TOKENS: u64 = 512;
/// Environment variable of `layerwise serve --max-prompt-tokens`.
pub const ENV_MAX_PROMPT_TOKENS: &str = "LAYERWISE_MAX_PROMPT_TOKENS";
/// Environment variable of `layerwise serve --guidance-allowed`.
pub const ENV_GUIDANCE_ALLOWED: &str = "LAYERWISE_GUIDANCE_ALLOWED";
/// Environment variable of the engine's `--device-memory-mib`.
pub const ENV_DEVICE_MEMORY_MIB: &str = "LAYERWISE_DEVICE_MEMORY_MIB";
/// Environment variable of the engine's `--device-overhead-mib`.
pub const ENV_DEVICE_OVERHEAD_MIB: &str = "LAYERWISE_DEVICE_OVERHEAD_MIB";
/// Environment variable of the engine's `--resident-components`.
pub const ENV_RESIDENT_COMPONENTS: &str = "LAYERWISE_RESIDENT_COMPONENTS";
/// Environment variable of the engine's `--resident-blocks`.
pub const ENV_RESIDENT_BLOCKS: &str = "LAYERWISE_RESIDENT_BLOCKS";
/// Environment variable of the engine's `--resident-blocks-by-component`, in the form
/// [`crate::memory::format_component_blocks`] writes.
pub const ENV_RESIDENT_BLOCKS_BY_COMPONENT: &str = "LAYERWISE_RESIDENT_BLOCKS_BY_COMPONENT";

/// What one request may ask for, beyond what the model itself can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBounds {
    /// Largest output width in pixels.
    pub max_width: u64,
    /// Largest output height in pixels.
    pub max_height: u64,
    /// Most frames of one clip (1: images only).
    pub max_frames: u64,
    /// Most denoising steps.
    pub max_steps: u64,
    /// Most outputs per request.
    pub max_n: u64,
    /// Whether requests may use classifier-free guidance (a scale above 1, which doubles the
    /// transformer's batch). Without it requests run unguided, as the plan sized them.
    pub guidance: bool,
    /// Most tokens of a prompt (its padded length, a request's `max_sequence_length`), for
    /// text families; a family that reads no prompt ignores it.
    pub max_prompt_tokens: u64,
}

/// The largest request a model itself can run, from its configs alone: its position tables
/// (not memory, which the activation cost accounts for). `None` where nothing but memory
/// bounds a dimension.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelLimits {
    /// Widest output in pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_width: Option<u64>,
    /// Tallest output in pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_height: Option<u64>,
    /// Most frames of one clip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_frames: Option<u64>,
    /// What sets them (the config file and field), for the messages that cite them.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// One dimension of a request's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dimension {
    Width,
    Height,
    Frames,
}

impl Dimension {
    /// The engine's flag for it (`--max-width`); the CRD names it `maxWidth`.
    pub fn flag(self) -> &'static str {
        match self {
            Dimension::Width => "max-width",
            Dimension::Height => "max-height",
            Dimension::Frames => "max-frames",
        }
    }
    /// A request's field for it.
    pub fn request_field(self) -> &'static str {
        match self {
            Dimension::Width => "width",
            Dimension::Height => "height",
            Dimension::Frames => "frames",
        }
    }
    /// The DiffusionDeployment's `workload` field for it.
    pub fn workload_field(self) -> &'static str {
        match self {
            Dimension::Width => "maxWidth",
            Dimension::Height => "maxHeight",
            Dimension::Frames => "maxFrames",
        }
    }
}

/// A bound the model cannot run: which, what was asked, and the model's largest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Beyond {
    pub dimension: Dimension,
    pub asked: u64,
    pub max: u64,
    /// [`ModelLimits::reason`].
    pub reason: String,
}

impl std::fmt::Display for Beyond {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.dimension {
            Dimension::Width => "pixels wide",
            Dimension::Height => "pixels high",
            Dimension::Frames => "frames",
        };
        write!(
            f,
            "{}: the model runs at most {} {what} ({})",
            self.asked, self.max, self.reason
        )
    }
}

impl ModelLimits {
    /// Each dimension's limit.
    pub fn of(&self, d: Dimension) -> Option<u64> {
        match d {
            Dimension::Width => self.max_width,
            Dimension::Height => self.max_height,
            Dimension::Frames => self.max_frames,
        }
    }

    /// The first of `(dimension, asked)` that the model cannot run.
    pub fn beyond(&self, asked: &[(Dimension, u64)]) -> Option<Beyond> {
        asked.iter().find_map(|&(dimension, asked)| {
            let max = self.of(dimension)?;
            (asked > max).then(|| Beyond {
                dimension,
                asked,
                max,
                reason: self.reason.clone(),
            })
        })
    }
}

impl RequestBounds {
    /// These bounds when each lies in its range ([`WIDTH_RANGE`] and the rest), else an
    /// error naming the first flag outside: a bound of 0 would make a server that starts and
    /// then refuses every request.
    pub fn checked(self) -> Result<Self> {
        WIDTH_RANGE.check(self.max_width)?;
        HEIGHT_RANGE.check(self.max_height)?;
        FRAMES_RANGE.check(self.max_frames)?;
        STEPS_RANGE.check(self.max_steps)?;
        N_RANGE.check(self.max_n)?;
        PROMPT_TOKENS_RANGE.check(self.max_prompt_tokens)?;
        Ok(self)
    }

    /// The first of these bounds that the model cannot run.
    pub fn beyond(&self, limits: &ModelLimits) -> Option<Beyond> {
        limits.beyond(&[
            (Dimension::Width, self.max_width),
            (Dimension::Height, self.max_height),
            (Dimension::Frames, self.max_frames),
        ])
    }

    /// Device bytes the largest request within these bounds needs for activations on a
    /// rank whose blocks compute in `element`: the one formula
    /// ([`ActivationCost::checked_phases`]) the planner reserves and the engine keeps
    /// free. `None` when no device could hold such a request.
    pub fn activation_bytes(&self, cost: &ActivationCost, element: ComputeElement) -> Option<u64> {
        self.activation_bytes_per_rank(cost, 1, element)
    }

    /// [`Self::activation_bytes`] on each rank of a group of `sp` that splits a request's
    /// sequence ([`ActivationCost::checked_phases`]), in `element`
    /// ([`crate::compute_dtype::ComputeElement::auto`] decides it for planner and engine).
    pub fn activation_bytes_per_rank(
        &self,
        cost: &ActivationCost,
        sp: u64,
        element: ComputeElement,
    ) -> Option<u64> {
        self.cached_activation_bytes_per_rank(cost, sp, crate::checkpoint::CacheHold::NONE, element)
    }

    /// [`Self::activation_bytes_per_rank`] for a server whose step cache holds `cache`
    /// per sample (what its setting, each request's bound, holds): what the planner
    /// reserves for a deployment's `workload.cache` and `layerwise serve --cache` keeps
    /// free, the one figure for both.
    pub fn cached_activation_bytes_per_rank(
        &self,
        cost: &ActivationCost,
        sp: u64,
        cache: crate::checkpoint::CacheHold,
        element: ComputeElement,
    ) -> Option<u64> {
        cost.checked_phases(
            &RequestShape {
                cache,
                ..self.shape()
            },
            sp,
            element.bytes(),
        )
        .map(|p| p.peak())
    }

    /// The largest request within these bounds, as the activation formula reads it.
    pub fn shape(&self) -> RequestShape {
        RequestShape {
            width: self.max_width,
            height: self.max_height,
            frames: self.max_frames,
            batch: self.max_n,
            guidance: self.guidance,
            text_tokens: self.max_prompt_tokens,
            cache: crate::checkpoint::CacheHold::NONE,
        }
    }
}
