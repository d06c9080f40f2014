//! Cosmos3 text-to-image and text-to-video in diffusers' `Cosmos3OmniPipeline` layout: a
//! Qwen tokenizer with its chat template, one mixture-of-transformers `Cosmos3OmniTransformer`
//! (every layer an understanding pathway over the prompt and a generation pathway over the
//! latents, GQA, interleaved 3D rotary positions), the 48-channel Wan 2.2 VAE, and UniPC.
//!
//! No text encoder runs: the transformer reads token ids. The two pathways stream as two
//! groups of blocks over the transformer's layers. The understanding pathway (group 0)
//! attends only to itself and never sees the latents, so it runs once per request and
//! leaves each layer's keys and values; every denoising step then streams the generation
//! pathway (group 1) alone, half of each layer's bytes. The embedding table never goes to
//! the device: the rows a prompt needs are read from the mapping.

pub mod checkpoint;
pub mod config;
pub mod entry;
pub mod flops;
pub mod groups;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
pub mod prompt;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod synth;
pub mod template;

pub use checkpoint::Cosmos3Checkpoint;
pub use config::Cosmos3Config;
pub use entry::FAMILY;
pub use groups::{GENERATION, UNDERSTANDING};
