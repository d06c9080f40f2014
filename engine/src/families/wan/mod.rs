//! Wan 2.1 / 2.2 text-to-video (and text-to-image, one frame) in diffusers' `WanPipeline`
//! layout: a UMT5 text encoder, one transformer (or two experts that take turns across
//! the denoising steps, Wan 2.2), the causal 3D VAE, and a flow-matching scheduler.
//!
//! Three groups of blocks stream through the rank's slots: the text encoder's layers
//! (group 0, one pass per request), the transformer's blocks (group 1) and, with two
//! experts, the second expert's (group 2); each denoising step is one pass over the
//! expert its timestep selects. The embedding table of the text encoder (2 GB for
//! UMT5-XXL) never goes to the device: the rows a prompt needs are read from the mapping.

pub mod checkpoint;
pub mod entry;
pub mod flops;
pub mod groups;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod synth;
pub mod transformer;

pub use checkpoint::WanCheckpoint;
pub use entry::FAMILY;
pub use groups::{TEXT_ENCODER, TRANSFORMER, TRANSFORMER_2};
