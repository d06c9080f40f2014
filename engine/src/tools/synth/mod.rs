//! Synthetic checkpoints: a complete pipeline folder in the diffusers layout (DiT: a
//! transformer, a VAE, a scheduler; Wan: a tokenizer, a UMT5 text encoder, one or two
//! expert transformers, the Wan VAE, a flow scheduler; ...) with seeded random weights (or,
//! with `sparse`, real headers over sparse files that read as zeros). Tests and
//! benchmarks make their models with this, never download.
//!
//! Each family writes its own folder and names its presets in its registry entry
//! ([`crate::families::FamilyEntry::presets`]); this module finds a preset by name and
//! runs the writer.

pub mod pipeline;
pub mod presets;
pub mod write;

pub use pipeline::{SynthOptions, SynthPipeline, SynthPreset, SynthReport};
pub use presets::{preset_names, synth};
