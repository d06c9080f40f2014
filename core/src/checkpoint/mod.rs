//! Checkpoints in the diffusers folder layout: `model_index.json`, and one folder per
//! component (`transformer/`, `vae/`, `scheduler/`), each with a `config.json` and its
//! weights as one safetensors file or several listed by a `*.safetensors.index.json`.
//!
//! Opening a component reads headers only; [`Mapped`] maps the files with memmap2 so the
//! weights are shared page cache, never copied whole into anonymous memory.
//!
//! This file only declares the parts and re-exports their names at the paths the other
//! crates use. The profile the node agent publishes is [`crate::profile`]: it builds on the
//! family, layout, memory and timing models, which read checkpoints, so it sits above
//! this module and is not re-exported from it (that would close a loop through them).

mod activation;
pub mod check;
mod component;
mod config_limits;
mod files;
mod folder;
pub mod fp8;
pub mod header;
pub mod hf_cache;
mod mapped;

pub use activation::{ActivationCost, CacheHold, PhaseBytes, RequestShape, F32_BYTES};
pub use component::Component;
pub use config_limits::{
    at_most, layers_at_most, MAX_CONFIG_BLOCKS_PER_LEVEL, MAX_CONFIG_LATENT_SIDE,
    MAX_CONFIG_LAYERS, MAX_CONFIG_LEVELS,
};
pub use files::{confine, parse_json, read_json, read_small, regular_file, MAX_SMALL_FILE};
pub use folder::ModelFolder;
pub use header::{Header, TensorInfo};
pub use mapped::Mapped;
