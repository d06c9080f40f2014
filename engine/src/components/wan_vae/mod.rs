//! `AutoencoderKLWan`: its config and tensor specs (metadata) and its causal 3D decoder.
//!
//! The metadata half (`config` and `specs`) is what the node agent needs without the
//! compute runtime: `vae/config.json` as diffusers 0.42.1 writes it, the checks that refuse
//! what the decoder cannot compute (naming the field), and the exact names and shapes of
//! every tensor in the checkpoint. The decoder (`decoder`, with `runtime`) turns the
//! pipeline's latents into video frames one latent frame at a time, as diffusers does.
//!
//! Two variants share the class: Wan 2.1's (16 latent channels, 8× in space) and Wan 2.2's
//! residual one with a 2×2 pixel patch (`is_residual`, `patch_size` 2, 48 latent channels,
//! 16× in space; the TI2V 5B VAE, also Cosmos3's).

mod budget;
pub mod config;
#[cfg(test)]
mod config_tests;
#[cfg(feature = "runtime")]
pub mod decoder;
#[cfg(feature = "runtime")]
mod layers;
#[cfg(all(test, feature = "runtime"))]
mod parity_tests;
pub mod specs;
#[cfg(test)]
mod specs_tests;
#[cfg(feature = "runtime")]
pub mod tiling;

pub use config::{WanVaeConfig, CLASS_NAME, DIFFUSERS_VERSION};
pub use specs::{
    DecoderLayout, DupUpLayout, EncoderLayer, ResidualDownBlockLayout, UpBlockLayout, Upsample,
};
