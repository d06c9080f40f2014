//! Wan 2.1 / 2.2 text-to-video (and text-to-image, one frame) in diffusers' `WanPipeline`
//! layout: a UMT5 text encoder, one transformer (or two experts that take turns across
//! the denoising steps, Wan 2.2), the causal 3D VAE, and a flow-matching scheduler.

pub mod transformer;
pub mod vae;
