//! The planner: a pure function from a checkpoint profile, the candidate nodes' shapes and the
//! workload bounds (plus any fixed strategy, dp, sp or slots) to a plan or a refusal.
//!
//! A pod runs `dp` groups of `sp` ranks ([`layerwise_core::topology`]): each group serves
//! one request, its `sp` ranks splitting the request's latent sequence, and the weights
//! shard over all `dp × sp` ranks. The planner tries sp from 1 up (1, 2, 4, 8, as far as
//! the node's accelerators and [`MAX_SP`] allow, and only where the profile declares the
//! all-to-all's buffers: the families that split their sequence) and keeps the first
//! whose activations per rank fit beside the weights and whose predicted latency meets
//! `workload.maxLatencySeconds`; within that sp the options are ranked as they always
//! were. Where no sp meets the bound, it plans the fastest and says so.
//!
//! Memory is counted per rank on the device (block weights kept there, K slots of one padded
//! block, prologue/epilogue, activations of the largest allowed request, runtime overhead,
//! and the VAE decoder with its largest decode where the pods decode on the device) and per
//! pod on the host (one copy of the model, mapped, plus pinned staging
//! buffers for the offload strategies, plus runtime). Slot sizes and activation cost come
//! from the engine's [`Profile`], so there is one formula. A plan is only ever recorded for
//! nodes it fits; a refusal names the resource that falls short and by how many bytes.
//!
//! The modules, in the order they depend on one another: what the planner is given
//! ([`inputs`]), the memory model ([`need`]), refusals ([`refusal`]), the options it
//! considers ([`candidates`]), the record of what it tried ([`record`]), the search among
//! the options ([`search`]), the reasons written from that record ([`explain`]), and the
//! plan over sp ([`plan`](mod@plan)). This file only declares and re-exports.
//!
//! [`MAX_SP`]: layerwise_core::topology::MAX_SP
//! [`Profile`]: crds::Profile

mod candidates;
mod explain;
mod inputs;
mod need;
mod plan;
mod record;
mod refusal;
mod search;

pub use candidates::{sp_candidates, splits_sequence};
pub use inputs::{Candidate, Limits, NodeReport, NodeShape, Overrides};
pub use need::{
    activation_bytes, activation_bytes_per_rank, cache_hold, compute_element, decoder_bytes, need,
    Need,
};
pub use plan::{plan, plan_candidates, plan_deployment, Recorded};
pub use refusal::{Refusal, Shortage};

#[cfg(test)]
mod tests;
