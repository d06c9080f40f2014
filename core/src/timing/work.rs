//! The request's side of the model: the workload at its bounds, as the tokens, steps,
//! samples and passes one request runs ([`Work`]).

use crate::bounds::RequestBounds;
use crate::checkpoint::ActivationCost;

/// The request the model times: the workload at its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    /// Latent tokens of one sample.
    pub tokens: u64,
    /// Prompt tokens of one sequence.
    pub text_tokens: u64,
    pub steps: u64,
    /// Samples one pass computes at once (outputs × guidance's batched samples).
    pub samples: u64,
    /// Passes over the per-step groups per step (2 where guidance runs its samples one
    /// after the other).
    pub passes_per_step: u64,
    /// Ranks that split the request's latent sequence (1: no sequence parallelism).
    pub sp: u64,
    /// Bytes per latent token per sample one block's all-to-alls move under sequence
    /// parallelism ([`ActivationCost::exchange_bytes_per_token`]: q, k, v and the
    /// attention's output).
    pub exchange_bytes_per_token: u64,
}

impl Work {
    /// The largest request `bounds` allow, by the family's activation cost (its tokens
    /// per pixel and how guidance batches).
    pub fn at_bounds(cost: &ActivationCost, b: &RequestBounds) -> Work {
        let latent_frames = (b.max_frames.max(1) - 1) / cost.frames_per_latent.max(1) + 1;
        let pixels = b.max_width.saturating_mul(b.max_height);
        let tokens = pixels
            .saturating_mul(latent_frames)
            .div_ceil(cost.pixels_per_token.max(1));
        let batched = b.guidance && cost.guidance_samples > 1;
        Work {
            tokens,
            text_tokens: b.max_prompt_tokens,
            steps: b.max_steps.max(1),
            samples: b.max_n.max(1) * if batched { cost.guidance_samples } else { 1 },
            passes_per_step: if b.guidance && !batched { 2 } else { 1 },
            sp: 1,
            exchange_bytes_per_token: cost.exchange_bytes_per_token,
        }
    }

    /// This request under a step cache that runs the per-step groups' blocks on `share`
    /// of its steps (`StepCache::computed_share` of the engine's setting): the steps the
    /// model times are those computed, rounded up, at least one. A skipped step copies
    /// and computes nothing of those groups; what it still does (First-Block Cache's first
    /// block, the sampler) is inside the share the setting states.
    pub fn with_computed_share(self, share: f64) -> Work {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            1.0
        };
        Work {
            steps: ((self.steps as f64 * share).ceil() as u64).max(1),
            ..self
        }
    }

    /// This request with its latent sequence split over `sp` ranks (at least 1).
    pub fn with_sp(self, sp: u64) -> Work {
        Work {
            sp: sp.max(1),
            ..self
        }
    }
}
