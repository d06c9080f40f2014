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
pub mod entry;
pub mod flops;
pub mod groups;
pub mod prompt;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod start_checks;
#[cfg(feature = "runtime")]
pub mod synth;
pub mod transformer;
pub mod vae;

pub use checkpoint::QwenImageCheckpoint;
pub use entry::FAMILY;
pub use groups::{TEXT_ENCODER, TRANSFORMER};
pub use prompt::MAX_SEQUENCE_LENGTH;
