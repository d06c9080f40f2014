//! Samplers: the denoising schedules and update rules, each following its diffusers
//! scheduler step for step and loaded from the pipeline's `scheduler/` config.

pub mod ddim;
pub mod flow;
