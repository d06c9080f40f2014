//! What one Qwen2.5-VL decoder layer computes (`FamilyCheckpoint::group_compute` of the
//! families that stream it as a text encoder), from its config, as `Qwen25VlEncoder::block`
//! runs it over the chat template's tokens and the prompt's. `engine/tests/flops.rs` holds
//! this to the FLOPs a layer executes.

use layerwise_core::family::GroupCompute;

use super::Qwen25VlConfig;

/// `g` (the text encoder group's role, from the default) with the FLOPs of one layer of
/// `cfg` per sequence, d its width, q its query width (heads × head width), k its
/// key/value width and f its MLP's: per token q (d × q), k and v (d × k), o (q × d) and
/// the gated MLP (d × f, three of them), 2·(2dq + 2dk + 3df); per pair of tokens the
/// causal attention's q·kᵀ and p·v over every query head, 4q. The causal attention runs in
/// query chunks against the keys up to each chunk's end; at prompt lengths one chunk
/// holds every row, so all L² pairs are computed (half of them masked).
pub fn encoder_block(cfg: &Qwen25VlConfig, g: GroupCompute) -> GroupCompute {
    let d = cfg.hidden_size as u64;
    let q = (cfg.num_attention_heads * cfg.head_dim()) as u64;
    let k = (cfg.num_key_value_heads * cfg.head_dim()) as u64;
    let f = cfg.intermediate_size as u64;
    GroupCompute {
        flops_per_token: 2 * (2 * d * q + 2 * d * k + 3 * d * f),
        flops_per_token_pair: 4 * q,
        ..g
    }
}
