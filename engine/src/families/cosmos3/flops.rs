//! What one Cosmos3 layer computes on each pathway (`FamilyCheckpoint::group_compute`),
//! from its config, as `Cosmos3Transformer` runs it. The understanding pathway runs once
//! per request over the prompt's tokens, attending causally to itself; the generation
//! pathway runs every step over the vision tokens, which attend to the prompt's keys and
//! values the understanding pathway left and to their own. The prompt is the chat
//! template's tokens with the prompt's, unpadded (the workload's `maxPromptTokens` at the
//! bounds). `engine/tests/flops.rs` holds this to the FLOPs a layer executes.

use layerwise_core::family::{GroupCompute, Runs, Tokens};

use super::config::Cosmos3Config;

/// FLOPs per token of a layer's linear layers on either pathway (their shapes are the
/// same): q (d × Hq·hd), k and v (d × Hkv·hd), out (Hq·hd × d) and the MLP (d × ff, three
/// of them gated, two for the squared ReLU).
fn linear_per_token(cfg: &Cosmos3Config) -> u64 {
    let d = cfg.hidden_size as u64;
    let qw = (cfg.num_attention_heads * cfg.head_dim) as u64;
    let kvw = (cfg.num_key_value_heads * cfg.head_dim) as u64;
    let mlp = if cfg.gated() { 3 } else { 2 };
    2 * (2 * d * qw + 2 * d * kvw + mlp * d * cfg.intermediate_size as u64)
}

/// q·kᵀ and p·v per (query, key) pair: 4 × the query width (the key/value heads are
/// repeated to every query head before the products).
fn per_pair(cfg: &Cosmos3Config) -> u64 {
    4 * (cfg.num_attention_heads * cfg.head_dim) as u64
}

/// `g` with the FLOPs of one understanding layer per sequence: its linear layers per
/// prompt token and its causal attention per pair. The causal attention runs in query
/// chunks, each against the keys up to its last row with the later ones masked; at prompt
/// lengths one chunk holds every row, so all L² pairs are computed (half of them masked).
/// The last layer computes only its keys and values (and queries), which this leaves
/// uncounted: one layer's out-projection, MLP and attention too many per request.
pub fn understanding_block(cfg: &Cosmos3Config, g: GroupCompute) -> GroupCompute {
    GroupCompute {
        runs: Runs::PerRequest,
        tokens: Tokens::Text,
        flops_per_token: linear_per_token(cfg),
        flops_per_token_pair: per_pair(cfg),
        ..g
    }
}

/// `g` with the FLOPs of one generation layer per sample: its linear layers per vision
/// token, its attention per pair of vision tokens and per (vision token, prompt token)
/// pair; the prompt's keys and values are the understanding pathway's, computed once.
pub fn generation_block(cfg: &Cosmos3Config, g: GroupCompute) -> GroupCompute {
    GroupCompute {
        flops_per_token: linear_per_token(cfg),
        flops_per_token_pair: per_pair(cfg),
        flops_per_text_token: 0,
        flops_per_cross_pair: per_pair(cfg),
        flops_per_text_pair: 0,
        flops_per_sample: 0,
        ..g
    }
}
