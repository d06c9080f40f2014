//! layerwise engine: serve diffusion transformers larger than one accelerator by streaming
//! their blocks through a few device slots. See docs/architecture.md for the map.
//!
//! The engine builds on `layerwise-core` (checkpoint headers, layouts, the memory model,
//! strategies, bounds), re-exported here under the same module names. Without the
//! `runtime` feature this crate is that core and the model families' metadata, which is all
//! the node agent needs.

pub mod cache;
#[cfg(feature = "runtime")]
pub mod cli;
pub mod components;
#[cfg(feature = "runtime")]
pub mod engine;
pub mod error;
#[cfg(feature = "runtime")]
pub mod execution;
pub mod families;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "runtime")]
pub mod launch;
#[cfg(feature = "logging")]
pub mod logging;
#[cfg(feature = "runtime")]
pub mod measure;
#[cfg(feature = "runtime")]
pub mod media;
#[cfg(feature = "runtime")]
pub mod options;
#[cfg(feature = "runtime")]
pub mod samplers;
#[cfg(feature = "runtime")]
pub mod server;
#[cfg(all(test, feature = "runtime"))]
mod testing;
#[cfg(feature = "runtime")]
pub mod tools;

pub use error::{Error, Result};
pub use layerwise_core::Strategy;
pub use layerwise_core::{
    bounds, checkpoint, contract, decode, exposition, layout, memory, metric_names, slots,
    strategy, timing,
};
