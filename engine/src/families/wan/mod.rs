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
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod synth;
pub mod transformer;

pub use checkpoint::WanCheckpoint;

/// The Wan family in the registry ([`crate::families::FAMILIES`]).
pub const FAMILY: crate::families::FamilyEntry = crate::families::FamilyEntry {
    name: "wan",
    pipelines: &["WanPipeline"],
    unnamed: false,
    #[cfg(feature = "runtime")]
    presets: synth::PRESETS,
    open: |root| Ok(std::sync::Arc::new(WanCheckpoint::open(root)?)),
};

/// Group indices of a Wan model's streamed blocks.
pub const TEXT_ENCODER: usize = 0;
pub const TRANSFORMER: usize = 1;
pub const TRANSFORMER_2: usize = 2;
