//! `text_encoder/config.json` of a Qwen2.5-VL model (transformers'
//! `Qwen2_5_VLForConditionalGeneration`), of which only the language model runs, and the
//! tensors it implies: the embedding table (rows read from the host mapping per prompt),
//! `num_hidden_layers` decoder layers that stream, and the final RMS norm that stays
//! resident. The vision tower and `lm_head.weight` may sit in the folder; they are never
//! loaded.
//!
//! Two layouts of the config are read, as transformers 5.24 reads them: the one it writes
//! (the language model's fields in a nested `text_config`), and the flat one of the
//! published Qwen-Image folder (transformers 4.5x: the fields at the top level beside a
//! nested `vision_config`, rotary in `rope_scaling` and `rope_theta`). When `text_config`
//! is there it is the language model's config and the top-level fields are not read.
//!
//! By concern: `text` the language model's config (presets, both layouts read, the
//! checks, the JSON written), `fields` the typed reading of one JSON object's fields,
//! `prefix` where a checkpoint keeps the tensors and which it never loads, `specs` the
//! sizes and tensors the config implies.

mod fields;
mod prefix;
mod specs;
#[cfg(test)]
mod tests;
mod text;

pub use prefix::{is_unused, TensorPrefix};
pub use text::Qwen25VlConfig;
