//! `QwenImageTransformer2DModel`: its config, tensor specs, rotary positions and activation
//! cost (metadata, always built) and its forward pass split into prologue, streamed
//! double-stream blocks and epilogue (`model`, with the `runtime` feature).

pub mod config;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
mod rope;

pub use config::QwenImageTransformerConfig;
