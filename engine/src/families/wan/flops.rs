//! What one Wan transformer block computes (`FamilyCheckpoint::group_compute`), from its
//! config, as `WanTransformer::block` runs it: self-attention over the latent tokens,
//! cross-attention from them to the projected prompt, and the feed-forward. The prompt's
//! length is the request's `max_sequence_length`: WanPipeline pads every prompt to it, so
//! the cross-attention's keys are that many whatever the prompt (the workload's
//! `maxPromptTokens` at the bounds). `engine/tests/flops.rs` holds this to the FLOPs a
//! block executes.

use layerwise_core::family::GroupCompute;

use super::transformer::WanTransformerConfig;

/// `g` (a transformer group's role, from the default) with the FLOPs of one block of
/// `cfg` per sample, d its width (heads × head width) and f its feed-forward's:
/// - per latent token, self-attention's q, k, v, out and cross-attention's q and out
///   (d × d each) and the feed-forward's two (d × f): 2·(6d² + 2df);
/// - per pair of latent tokens, self-attention's q·kᵀ and p·v: 4d;
/// - per prompt token, cross-attention's k and v (d × d each): 4d²;
/// - per (latent, prompt) pair, cross-attention's q·kᵀ and p·v: 4d.
///
/// The modulation is the prologue's (one table per block, added elementwise).
pub fn transformer_block(cfg: &WanTransformerConfig, g: GroupCompute) -> GroupCompute {
    let (d, f) = (cfg.hidden() as u64, cfg.ffn_dim as u64);
    GroupCompute {
        flops_per_token: 2 * (6 * d * d + 2 * d * f),
        flops_per_token_pair: 4 * d,
        flops_per_text_token: 2 * 2 * d * d,
        flops_per_cross_pair: 4 * d,
        flops_per_text_pair: 0,
        flops_per_sample: 0,
        ..g
    }
}
