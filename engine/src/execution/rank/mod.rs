//! The one rank loop. Each dp rank is a thread with its own pipeline and device budget;
//! all share one mapping of the checkpoint and move in lockstep by group and block index.
//! A rank pulls requests from a [`WorkSource`](crate::execution::work::WorkSource) (a fixed
//! list for `Model::run`, the scheduler for the server) at pass boundaries, so a rank whose
//! request finishes takes the next one at once while the others carry on with theirs. At
//! every pass boundary the ranks meet at the
//! [`Coordinator`](crate::execution::lockstep::Coordinator) and take the same decision: run a
//! pass over one group (ranks whose request wants another group, or that have none, join it
//! without computing, so the collectives line up), or pause together until work arrives, or
//! exit. Nothing here knows the family: requests are
//! [`Task`](crate::execution::family::Task)s of a
//! [`FamilyRuntime`](crate::execution::family::FamilyRuntime).
//!
//! The loop's parts, one a module: what a run is asked to do ([`options`]); starting it, from
//! its topology and compute dtype ([`start`]) and its memory sizing ([`sizing`]) to the
//! devices and exchanges it opens ([`devices`]); the state its rank threads share and hold
//! ([`state`]); one thread per rank and what a failing one does to its peers ([`threads`]);
//! the boundary loop and the passes it runs ([`passes`]); taking requests from the source
//! ([`intake`]); a sequence-parallel group's leader and followers ([`sp`]); what a rank
//! reports at its end ([`report`]); and which failures end a request or name a run's root
//! cause ([`failure`]). This file only declares them and re-exports the loop's public face.

mod devices;
mod failure;
mod intake;
mod options;
mod passes;
mod report;
mod sizing;
mod sp;
mod start;
mod state;
mod threads;

pub use failure::first_cause;
pub use options::EngineOptions;
pub use report::RankResult;
pub(crate) use start::compute_dtype;
pub use start::{drive, topology};
