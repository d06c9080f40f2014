//! Tools beside the engine: synthetic checkpoints (`synth`), drawing a trace as a
//! timeline (`trace_svg`), and a bounded load generator for a running server (`loadgen`).

pub mod loadgen;
pub mod synth;
pub mod trace_svg;
