//! What one UMT5 encoder block computes (`FamilyCheckpoint::group_compute` of the
//! families that stream it), from its config, as `Umt5Encoder::block` runs it: the
//! prompt padded to the request's `max_sequence_length`, every token attending to every
//! other (the padding masked, not skipped). `engine/tests/flops.rs` holds this to the
//! FLOPs a block executes.

use layerwise_core::family::GroupCompute;

use super::Umt5Config;

/// `g` (the text encoder group's role, from the default) with the FLOPs of one block of
/// `cfg` per sequence, d its width, i its attention's (heads × d_kv) and f its
/// feed-forward's: per token q, k, v, o (d × i each) and the gated feed-forward (d × f,
/// three of them), 2·(4di + 3df); per pair of tokens q·kᵀ and p·v, 4i. The relative
/// position bias is added elementwise.
pub fn encoder_block(cfg: &Umt5Config, g: GroupCompute) -> GroupCompute {
    let (d, i, f) = (cfg.d_model as u64, cfg.inner_dim() as u64, cfg.d_ff as u64);
    GroupCompute {
        flops_per_token: 2 * (4 * d * i + 3 * d * f),
        flops_per_token_pair: 4 * i,
        ..g
    }
}
