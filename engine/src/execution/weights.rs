//! Where model code gets its tensors: resident weights loaded once, or the views of a
//! streamed block in a device slot. Model code never knows which.

use candle_core::Tensor;

use crate::Result;

/// A set of named tensors on the compute device, in the compute dtype (f32).
pub trait Weights {
    /// The tensor called `name` (relative to this set's prefix), shaped as stored.
    fn get(&self, name: &str) -> Result<Tensor>;
}

impl Weights for std::collections::HashMap<String, Tensor> {
    fn get(&self, name: &str) -> Result<Tensor> {
        self.get(name).cloned().ok_or_else(|| {
            crate::Error::invalid("weights", format!("tensor `{name}` is not loaded"))
        })
    }
}
