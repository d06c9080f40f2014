//! `WanTransformer3DModel`: its config and tensor specs (metadata, always built) and its
//! forward pass split into prologue, streamed blocks and epilogue (`model`, with the
//! `runtime` feature).

pub mod config;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
mod rope;

pub use config::WanTransformerConfig;
