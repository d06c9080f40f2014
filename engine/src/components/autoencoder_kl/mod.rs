//! The AutoencoderKL (diffusers layout) that turns latents into pixels, shared by the
//! families that use it (DiT today): its `vae/config.json`, the checks on it, and the
//! names and shapes of every tensor its checkpoint holds, which the node agent needs
//! without the compute runtime; and the decoder itself (`decoder`, with `runtime`).

mod config;
#[cfg(feature = "runtime")]
pub mod decoder;
mod names;
mod specs;
#[cfg(test)]
mod tests;

pub use config::{SampleSize, VaeConfig, CLASS_NAME, DIFFUSERS_VERSION, NORM_EPS};
pub use names::{current_attention_name, legacy_attention_alias, shape_compatible};
