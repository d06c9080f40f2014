//! The UMT5 encoder (transformers' `UMT5EncoderModel`) that Wan conditions on, and the
//! prompt tokenizer in front of it: the config and tensor specs, diffusers' prompt
//! cleaning and a synthetic tokenizer (metadata, always built), and the encoder's math and
//! the tokenizer itself (with the `runtime` feature).

pub mod config;
mod entities;
pub mod flops;
#[cfg(feature = "runtime")]
pub mod model;
pub mod prompt;
pub mod synth;
#[cfg(feature = "runtime")]
pub mod tokenizer;

pub use config::{embedding_table, TokenIds, Umt5Config, EMBEDDING_NAMES, FINAL_NORM};
#[cfg(feature = "runtime")]
pub use model::{Umt5Encoder, Umt5State};
pub use prompt::prompt_clean;
pub use synth::{synth_tokenizer_config, synth_tokenizer_json, SYNTH_VOCAB_SIZE};
#[cfg(feature = "runtime")]
pub use tokenizer::PromptTokenizer;
