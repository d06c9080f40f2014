//! Flow-matching samplers for the pipelines that save one in `scheduler/` (WanPipeline):
//! diffusers' `UniPCMultistepScheduler` with flow sigmas and `FlowMatchEulerDiscreteScheduler`.
//! Each follows its diffusers scheduler step for step, computing the schedule in float64 where
//! numpy does and in float32 where torch does, so a request samples what diffusers samples.
//! A [`Sampler`] is one request's schedule and state, driven the way the pipeline drives the
//! scheduler: `set_timesteps(steps)`, `set_begin_index(0)`, one `step` per timestep.

mod config_checks;
mod euler;
mod sampler;
mod schedule;
mod scheduler;
mod solve;
mod unipc;
mod unipc_config;

pub use euler::{FlowMatchEuler, FlowMatchEulerConfig};
pub use sampler::Sampler;
pub(crate) use scheduler::parse;
pub use scheduler::FlowScheduler;
pub use unipc::UniPc;
pub use unipc_config::UniPcConfig;
