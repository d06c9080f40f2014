//! What one DiT block computes (`FamilyCheckpoint::group_compute`), from its config, as
//! `Dit::block` runs it: its own timestep embedder and adaLN modulation per sample, then
//! self-attention and the feed-forward over the patch tokens. Class-conditional: no
//! prompt. `engine/tests/flops.rs` holds this to the FLOPs a block executes.

use layerwise_core::family::GroupCompute;

use super::{DitConfig, TIMESTEP_CHANNELS};

/// `g` (the transformer group's role, from the default) with the FLOPs of one block of
/// `cfg` per sample, d its width (heads × head width):
/// - per token, q, k, v and out (d × d each) and the feed-forward (d × 4d, twice):
///   2·(4d² + 8d²);
/// - per pair of tokens, attention's q·kᵀ and p·v: 4d;
/// - per sample, the timestep embedder (256 × d, d × d) and the modulation (d × 6d).
pub fn transformer_block(cfg: &DitConfig, g: GroupCompute) -> GroupCompute {
    let d = cfg.hidden() as u64;
    GroupCompute {
        flops_per_token: 2 * (4 * d * d + 8 * d * d),
        flops_per_token_pair: 4 * d,
        flops_per_sample: 2 * (TIMESTEP_CHANNELS as u64 * d + d * d + 6 * d * d),
        ..g
    }
}
