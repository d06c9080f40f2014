//! layerwise engine: serve diffusion transformers larger than one accelerator by streaming
//! their blocks through a few device slots. See docs/architecture.md for the map.
//!
//! Without the `runtime` feature this crate is the header-only checkpoint reader and the
//! model families' metadata, which is all the node agent needs.

pub mod bounds;
pub mod checkpoint;
#[cfg(feature = "runtime")]
pub mod cli;
pub mod decode;
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
pub mod layout;
#[cfg(feature = "runtime")]
pub mod media;
pub mod memory;
pub mod metric_names;
#[cfg(feature = "runtime")]
pub mod options;
#[cfg(feature = "runtime")]
pub mod samplers;
#[cfg(feature = "runtime")]
pub mod server;
pub mod strategy;
#[cfg(all(test, feature = "runtime"))]
mod testing;
#[cfg(feature = "runtime")]
pub mod tools;

pub use error::{Error, Result};
pub use strategy::Strategy;
