//! layerwise core: what the engine, the operator, the node agent and the Kubernetes API
//! agree on, in one crate with no tensor math, no async runtime and no HTTP.
//!
//! - [`checkpoint`]: diffusers pipeline folders read from their headers and configs;
//! - [`profile`]: what a checkpoint needs (bytes, blocks, activation cost), as the node
//!   agent publishes it;
//! - [`family`]: what a model family declares about its checkpoint (tensors, block groups,
//!   activation cost), the trait every family implements;
//! - [`layout`] and [`memory`]: how a group's blocks are laid out in shards and slots, and
//!   the one memory model the planner and the engine's start check both call;
//! - [`strategy`], [`bounds`], [`decode`]: the streaming strategies, the request bounds and
//!   where the decoder runs;
//! - [`contract`]: everything a plan tells an engine, as the engine's flags parse it and
//!   the operator's pods pass it;
//! - [`slots`]: how many slots a rank streams through and how many blocks it keeps;
//! - [`timing`]: the one step-time model, which the planner and the engine's `bench`
//!   choose resident blocks and components by;
//! - [`step_cache`]: the step caches' parameter ranges and what a request's cache holds;
//! - [`topology`]: dp groups of sp ranks, and how a request's sequence splits over a group;
//! - [`bytesize`]: the one grammar of a byte size (Kubernetes quantities and typed units);
//! - [`metric_names`]: the engine's metrics, by the names the autoscaler reads, and
//!   [`exposition`]: the Prometheus rules every binary's `/metrics` is tested against.
//!
//! The engine's families and execution build on this crate; nothing here reads them.
//! See docs/architecture.md for the map.

pub mod bounds;
pub mod bytesize;
pub mod checkpoint;
pub mod compute_dtype;
pub mod contract;
pub mod decode;
pub mod error;
pub mod exposition;
pub mod family;
pub mod layout;
pub mod memory;
pub mod metric_names;
pub mod profile;
pub mod slots;
pub mod step_cache;
pub mod strategy;
pub mod timing;
pub mod topology;

pub use error::{Error, Result};
pub use strategy::Strategy;
