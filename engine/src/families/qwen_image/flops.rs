//! What one Qwen-Image transformer block computes (`FamilyCheckpoint::group_compute`),
//! from its config, as `QwenImageTransformer::block` runs it: two streams, image and
//! text, each through its own projections and feed-forward, meeting in one attention over
//! the joined sequence [text, image]. The text stream runs on the prompt's own tokens
//! (QwenImagePipeline drops the template's and pads nothing), at most the request's
//! `max_sequence_length` (the workload's `maxPromptTokens` at the bounds).
//! `engine/tests/flops.rs` holds this to the FLOPs a block executes.

use layerwise_core::family::GroupCompute;

use super::transformer::QwenImageTransformerConfig;

/// `g` (the transformer group's role, from the default) with the FLOPs of one block of
/// `cfg` per sample, d its width (heads × head width) and f its feed-forward's:
/// - per image token and per prompt token alike, the stream's q, k, v and out (d × d
///   each) and feed-forward (d × f, twice): 2·(4d² + 2df);
/// - the joint attention's q·kᵀ and p·v, 4d per (query, key) pair of the joined
///   sequence: (T + L)² pairs are T² image pairs (4d), 2·T·L image–prompt pairs (8d per
///   (image, prompt) pair, both directions) and L² prompt pairs (4d);
/// - per sample, each stream's modulation from the timestep (d × 6d): 2·2·6d².
pub fn transformer_block(cfg: &QwenImageTransformerConfig, g: GroupCompute) -> GroupCompute {
    let (d, f) = (cfg.hidden() as u64, cfg.ffn_dim() as u64);
    let stream = 2 * (4 * d * d + 2 * d * f);
    GroupCompute {
        flops_per_token: stream,
        flops_per_token_pair: 4 * d,
        flops_per_text_token: stream,
        flops_per_cross_pair: 8 * d,
        flops_per_text_pair: 4 * d,
        flops_per_sample: 2 * 2 * 6 * d * d,
        ..g
    }
}
