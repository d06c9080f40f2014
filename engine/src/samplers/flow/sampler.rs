//! The interface the pipelines drive a flow-matching sampler through, one request at a
//! time. A module of its own because each scheduler implements it: defined in the flow
//! module's root, it would have each scheduler's file reach back into the file that
//! declares it.

use candle_core::Tensor;

use crate::Result;

/// One request's schedule and sampler state.
pub trait Sampler: Send {
    /// The timesteps the model sees, in order (the `t` the pipeline passes to the transformer).
    fn timesteps(&self) -> &[f32];
    /// The noise levels: one per timestep and the final one the last step goes to.
    fn sigmas(&self) -> &[f32];
    /// One step: the model output (flow/velocity prediction) at the current timestep and the
    /// current sample → the next sample. Stateful: multistep samplers keep past outputs.
    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor>;
}
