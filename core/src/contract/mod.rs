//! The engine contract: everything a plan tells an engine (the model and its roots, the
//! strategy, dp, sp, slots, the blocks kept, the request bounds, the decode site and the
//! device budget) as one typed struct, [`EngineContract`]. The engine's clap arguments
//! parse into it; the operator builds it from a plan and renders it into a pod's command
//! line and environment ([`EngineContract::argv`], [`EngineContract::env`]). Every flag
//! reads one environment variable, named by one constant ([`names`]), so what the operator
//! writes is what the engine parses, and a test reads a pod back through the engine's own
//! arguments ([`parse_container`]).

mod args;
mod container;
pub mod names;
mod values;

pub use args::{
    BoundsArgs, EngineContract, KeptArgs, RootsArgs, RunArgs, DEFAULT_MAX_FRAMES, DEFAULT_MAX_SIDE,
};
pub use container::parse_container;
pub use names::*;
pub use values::{BlocksByComponent, ResidentBlocks, SlotsChoice};
