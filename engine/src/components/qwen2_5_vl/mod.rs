//! The Qwen2.5-VL text encoder that Qwen-Image conditions on (transformers'
//! `Qwen2_5_VLForConditionalGeneration`, its language model alone) as a streamed
//! component, and the Qwen-Image prompt in front of it: the config in both of its layouts,
//! the tensor specs and the checkpoint's prefix (metadata, always built), and the encoder's
//! math, the tokenizer and the pipeline's template (with the `runtime` feature).
//!
//! A family streams it as umt5 is streamed: [`Qwen25VlConfig::check`] the folder (it says
//! which [`TensorPrefix`] the tensors use), [`Qwen25VlEncoder::embed`] a prompt's rows from
//! the mapping, `prologue`, `block` per decoder layer of [`Qwen25VlConfig::block_group`],
//! `epilogue`, then [`prompt::prompt_embeds`].

pub mod config;
pub mod flops;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
pub mod prompt;
#[cfg(feature = "runtime")]
pub mod synth;

pub use config::{is_unused, Qwen25VlConfig, TensorPrefix};
#[cfg(feature = "runtime")]
pub use model::{Qwen25VlEncoder, Qwen25VlState};
#[cfg(feature = "runtime")]
pub use prompt::QwenTokenizer;
