//! Synthetic checkpoints: a complete pipeline folder in the diffusers layout (DiT: a
//! transformer, a VAE, a scheduler; Wan: a tokenizer, a UMT5 text encoder, one or two
//! expert transformers, the Wan VAE, a flow scheduler; ...) with seeded random weights (or,
//! with `sparse`, real headers over sparse files that read as zeros). Tests and
//! benchmarks make their models with this, never download.
//!
//! Each family writes its own folder and names its presets in its registry entry
//! ([`crate::families::FamilyEntry::presets`]); `presets` finds a preset by name among the
//! registered families and runs the writer. A family's writer uses only the low-level
//! `pipeline` and `write` modules, never `presets` or this root's re-exports: `presets`
//! reads the registry, which names every family, so reaching it from a family would loop.

pub mod hub_cache;
pub mod pipeline;
pub mod presets;
pub mod write;

pub use pipeline::{SynthOptions, SynthPipeline, SynthPreset, SynthReport};
pub use presets::{preset_names, synth};
