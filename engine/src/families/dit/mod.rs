//! DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers"), class-conditional,
//! in diffusers' `DiTPipeline` layout: its config and checkpoint checks (metadata, always
//! built, so the node agent can profile) and its forward pass (with the `runtime` feature).

pub mod checkpoint;
pub mod config;
pub mod entry;
pub mod flops;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod synth;

pub use checkpoint::DitCheckpoint;
pub use config::{DitConfig, TIMESTEP_CHANNELS};
pub use entry::FAMILY;
