//! Fixtures the operator's planner tests and cluster tests share.

use std::collections::BTreeMap;

use crds::{ActivationCost, ComponentProfile, Profile};
use layerwise_core::memory::GroupBytes;

/// The profile of a DiT checkpoint as an agent would report it: `blocks` bf16 blocks of
/// `block` bytes, `outside` transformer bytes outside them, a VAE of `vae` bytes and a
/// DiT-like activation cost (hidden 3072, 24 heads, 16×16-pixel tokens).
pub fn dit_profile(blocks: usize, block: u64, outside: u64, vae: u64) -> Profile {
    let transformer = blocks as u64 * block + outside;
    Profile {
        family: "dit".into(),
        total_bytes: transformer + vae,
        transformer_bytes: transformer,
        vae_bytes: vae,
        components: vec![
            ComponentProfile {
                name: "transformer".into(),
                bytes: transformer,
                blocks,
                largest_block_bytes: block,
            },
            ComponentProfile {
                name: "vae".into(),
                bytes: vae,
                blocks: 0,
                largest_block_bytes: 0,
            },
        ],
        files: 2,
        blocks,
        block_bytes: vec![block; blocks],
        largest_block_bytes: block,
        max_block_bytes_by_dtype: BTreeMap::from([("BF16".to_string(), block)]),
        outside_block_bytes: outside,
        bytes_by_dtype: BTreeMap::from([("BF16".to_string(), transformer + vae)]),
        native_width: 1024,
        native_height: 1024,
        activation: ActivationCost {
            pixels_per_token: 256,
            bytes_per_token: 4 * 10 * 3072,
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 4 * 2 * 24,
            vae_bytes_per_pixel: 4 * 5 * 128,
            attention_bytes: 0,
            frames_per_latent: 1,
            decoder_frames: 1,
            bytes_per_text_token: 0,
            template_tokens: 0,
            encoder_bytes_per_token: 0,
            encoder_attention_bytes_per_token: 0,
            encoder_bytes_per_token_pair: 0,
            guidance_samples: 2,
            samples_in_turn: false,
            waiting_bytes_per_token: 0,
            waiting_bytes_per_text_token: 0,
            encoder_waiting_bytes_per_token: 0,
            exchange_bytes_per_token: 0,
            hidden_bytes_per_token: 0,
            output_bytes_per_token: 0,
            cache_states: 1,
        },
        decoder_bytes: vae,
        groups: vec![GroupBytes {
            component: "transformer".into(),
            blocks_by_dtype: BTreeMap::from([("BF16".to_string(), vec![block; blocks])]),
        }],
        limits: Default::default(),
        compute: Vec::new(),
        compute_dtypes: layerwise_core::compute_dtype::f32_only(),
        decode: None,
    }
}
