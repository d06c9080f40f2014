//! Tools beside the engine: synthetic checkpoints (`synth`), fp8 copies of checkpoints
//! (`quantize`), drawing a trace as a timeline (`trace_svg`), a bounded load generator
//! for a running server (`loadgen`) and a bounded soak of one (`soak`).

pub mod loadgen;
pub mod quantize;
pub mod soak;
pub mod synth;
pub mod trace_svg;
