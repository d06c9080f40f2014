//! What flows between a source of work (a fixed list, or the server's scheduler) and the
//! rank threads: requests, outputs, and the [`WorkSource`] interface the rank loop calls.
//! Family-agnostic: a request names its conditioning, and the family interprets it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;

use super::pipeline::PipelineStats;
use crate::{Error, Result};

/// Tokens text families pad and truncate prompts to unless a request says otherwise
/// (diffusers' `max_sequence_length` default).
pub const DEFAULT_MAX_SEQUENCE_LENGTH: usize = crate::bounds::DEFAULT_MAX_PROMPT_TOKENS as usize;

/// What a request is conditioned on.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// A class-conditional family's class (DiT: an ImageNet class).
    Class(u32),
    /// A text-conditioned family's prompt, and what to steer away from: `None` when the
    /// caller gave no negative prompt, which is not the same as an empty one (diffusers'
    /// `QwenImagePipeline` runs unguided without one, `WanPipeline` and
    /// `Cosmos3OmniPipeline` guide against an empty one: each family's `guided` says).
    Prompt {
        prompt: String,
        negative: Option<String>,
    },
}

/// One image or clip to generate.
#[derive(Debug, Clone)]
pub struct Request {
    pub condition: Condition,
    pub seed: u64,
    pub steps: usize,
    pub guidance: f32,
    /// Guidance of the second expert of a two-expert family (default: `guidance`).
    pub guidance_2: Option<f32>,
    pub width: usize,
    pub height: usize,
    /// Frames of a clip (1 for an image).
    pub frames: usize,
    /// Text families: prompts are padded and truncated to this many tokens (diffusers'
    /// `max_sequence_length`); a longer prompt is refused.
    pub max_sequence_length: usize,
    /// Start from these latents instead of seeded noise (the family's latent shape).
    pub init_latents: Option<Tensor>,
    /// The frame rate a clip is for (`None`: the family's default). Families whose
    /// conditioning reads it (Cosmos3: its prompt's duration sentence and its rotary time
    /// axis) condition on it; every family's clip is written at it.
    pub fps: Option<f64>,
    /// The step cache this request runs under (`None`: every block of every step).
    pub cache: Option<crate::cache::config::StepCache>,
}

impl Request {
    /// An image request of `width × height` with the given conditioning.
    pub fn image(condition: Condition, width: usize, height: usize) -> Request {
        Request {
            condition,
            seed: 0,
            steps: 25,
            guidance: 4.0,
            guidance_2: None,
            width,
            height,
            frames: 1,
            max_sequence_length: DEFAULT_MAX_SEQUENCE_LENGTH,
            init_latents: None,
            fps: None,
            cache: None,
        }
    }
}

/// What a request produced.
pub struct Output {
    /// Final latents before the decoder.
    pub latents: Tensor,
    /// The decoded pixels in [-1, 1] when decoding was asked for: [3, H, W] for an
    /// image, [T, 3, H, W] for a clip.
    pub image: Option<Tensor>,
    /// Text embeddings the request was conditioned on (text families): [2, S, D] with the
    /// prompt first and the negative prompt second.
    pub text_embeddings: Option<Tensor>,
    /// What the request's step cache decided, when it ran under one.
    pub cache: Option<crate::cache::run::CacheReport>,
}

/// Which output of which request: every message between ranks and their source carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkKey {
    pub id: u64,
    pub index: u32,
}

impl std::fmt::Display for WorkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.id, self.index)
    }
}

/// One output to generate, as a rank receives it.
pub struct Work {
    pub key: WorkKey,
    pub req: Request,
    /// Set by the source to stop the work at the rank's next step boundary.
    pub cancel: Option<Arc<AtomicBool>>,
}

/// The answer to [`WorkSource::take`].
pub struct Taken {
    pub work: Option<Work>,
    /// The source's arrival generation seen before looking (for [`WorkSource::wait`]).
    pub generation: u64,
    /// The source will never hand this rank work again.
    pub closed: bool,
}

/// Figures of one pass of one rank, for live metrics.
pub struct PassReport<'a> {
    /// The rank computed (it had a request) rather than only joining the collectives.
    pub busy: bool,
    pub elapsed: Duration,
    pub pipeline: &'a PipelineStats,
    pub device_bytes: u64,
    /// The most each phase of this rank has held so far, measured ([`crate::measure`]).
    pub phase_peaks: &'a crate::measure::PhasePeaks,
}

/// Where ranks get requests and where they report. Called from rank threads.
pub trait WorkSource: Sync {
    /// The next request for `rank`, if one is waiting (does not block on arrivals).
    fn take(&self, rank: usize) -> Result<Taken>;
    /// Work is queued that a free rank could take (a prefetch hint).
    fn pending(&self, rank: usize) -> bool;
    /// Blocks until an arrival newer than `generation`, or until the source closes.
    fn wait(&self, rank: usize, generation: u64) -> Result<()>;
    /// `rank` has its pipeline and can serve.
    fn ready(&self, _rank: usize) {}
    /// `key` has finished denoising step `step` of `total`.
    fn step_done(&self, _rank: usize, _key: WorkKey, _step: usize, _total: usize, _took: Duration) {
    }
    /// `rank` has finished a pass.
    fn pass_done(&self, _rank: usize, _report: &PassReport) {}
    /// `key` is done: its output, or why not (a failure of its own, or cancellation).
    fn finished(&self, rank: usize, key: WorkKey, out: Result<Output>);
    /// `rank` failed; the group is poisoned and every rank will stop.
    fn failed(&self, _rank: usize, _error: &Error) {}
}
