//! Step caches: diffusers 0.42's First-Block Cache, MagCache, TaylorSeer (lite) and
//! SeaCache (`sea.rs`, which decides from the latents before a step), which
//! reuse a transformer's residual or output on steps where its input barely moved. They
//! live apart from the families because the decisions are the same for every family
//! whose transformer is one stack of blocks over one hidden stream: a family hands over
//! its hidden states and its output ([`crate::families::encode_once`]) and says which
//! kinds it honours ([`crate::execution::family::FamilyRuntime::step_caches`]); a block
//! no row of a pass computes is skipped, and its weights are not needed.
//!
//! The setting and its figures ([`config`], over the tensor-free [`schedule`]) build
//! without the compute runtime, so the Kubernetes API and the planner read a deployment's
//! cache with the engine's own parser, ranges and figures.

#[cfg(feature = "runtime")]
pub mod bound;
#[cfg(feature = "runtime")]
mod check;
pub mod config;
#[cfg(feature = "runtime")]
pub mod run;
pub mod schedule;
#[cfg(feature = "runtime")]
mod sea;
#[cfg(feature = "runtime")]
mod state;

#[cfg(feature = "runtime")]
pub use bound::request_setting;
#[cfg(feature = "runtime")]
pub use check::check;
pub use config::{kinds, CacheKind, StepCache};
#[cfg(feature = "runtime")]
pub use run::{CacheReport, StepCacheRun};
