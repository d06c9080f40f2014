//! Qwen-Image text-to-image in diffusers' `QwenImagePipeline` layout: a Qwen2.5-VL text
//! encoder read through a fixed prompt template, a double-stream MMDiT
//! (`QwenImageTransformer2DModel`: text and image streams with joint attention), the Wan 2.1
//! VAE (`AutoencoderKLQwenImage`), and flow-matching Euler with the shift following the
//! image's sequence length.
//!
//! Two groups of blocks stream through the rank's slots: the text encoder's decoder layers
//! (group 0, one pass per request over the prompt and, under guidance, the negative prompt)
//! and the transformer's blocks (group 1, one pass per denoising step). The text encoder's
//! embedding table never goes to the device: the rows a prompt needs are read from the
//! mapping.

pub mod checkpoint;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod synth;
pub mod transformer;
pub mod vae;

pub use checkpoint::QwenImageCheckpoint;

/// The Qwen-Image family in the registry ([`crate::families::FAMILIES`]).
pub const FAMILY: crate::families::FamilyEntry = crate::families::FamilyEntry {
    name: "qwen-image",
    pipelines: &[checkpoint::CLASS_NAME],
    unnamed: false,
    #[cfg(feature = "runtime")]
    presets: synth::PRESETS,
    open: |root| Ok(std::sync::Arc::new(QwenImageCheckpoint::open(root)?)),
};

/// Group indices of a Qwen-Image model's streamed blocks.
pub const TEXT_ENCODER: usize = 0;
pub const TRANSFORMER: usize = 1;

/// The most prompt tokens QwenImagePipeline reads (`max_sequence_length` may not exceed it).
pub const MAX_SEQUENCE_LENGTH: usize = 1024;
