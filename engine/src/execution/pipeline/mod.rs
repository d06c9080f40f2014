//! The block pipeline of one rank: copy, gather and compute as three streams of work
//! joined by events. While block i computes, blocks i+1 .. i+K-1 are being copied and
//! gathered into the other slots; a slot is refilled only after the compute that reads
//! it has recorded its `free` event. One implementation for every backend.
//!
//! A model streams one or more groups of blocks (see [`crate::layout`]) through the same
//! K slots. A pass runs over one group; when the next pass is known (and over which
//! group), its first blocks are issued while this pass's last blocks compute, so the
//! switch from one group to another (a text encoder to a transformer, one expert to the
//! other) costs no stall.
//!
//! Its parts, one a module: what shapes a pipeline and what it counts ([`options`]); the
//! groups a model streams and which blocks stay ([`streamed`]); the device buffers a rank
//! allocates for them ([`buffers`]); the pipeline's state, set up and loaded ([`setup`]);
//! the transfers that fill a slot ([`transfer`]); a pass over one group ([`pass`]); and the
//! views compute reads a block's weights through ([`block_weights`]). This file only
//! declares them and re-exports the pipeline's public face.

mod block_weights;
mod buffers;
mod options;
mod pass;
mod setup;
mod streamed;
mod transfer;

pub use block_weights::BlockWeights;
pub use options::{Hook, PipelineOptions, PipelineStats, Stage};
pub use setup::Pipeline;
pub use streamed::Streamed;
