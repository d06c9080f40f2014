//! How compute reads a block's weights: views into the slot's (or the block's own resident)
//! buffers, cast to the compute dtype or dequantized from fp8 only when a tensor is asked for.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::execution::weights::Weights;
use crate::layout::BlockLayout;
use crate::{Error, Result};

/// The views of one block's tensors in device memory, converted to the compute dtype on
/// request: a tensor stored in that dtype is used in place, with no cast and no copy; an
/// fp8 weight is dequantized with its scale from the same slot, right before compute.
pub struct BlockWeights {
    tensors: HashMap<String, Tensor>,
    /// fp8 weights' scales, by the weight's name.
    scales: HashMap<String, Tensor>,
    dtype: DType,
}

impl BlockWeights {
    /// Views of `block`'s tensors in `buffers`; `region_of` maps the block's regions to
    /// the buffers (identity for a block's own resident buffers).
    pub(super) fn view(
        buffers: &[Tensor],
        region_of: &[usize],
        block: &BlockLayout,
        dtype: DType,
    ) -> Result<BlockWeights> {
        let mut tensors = HashMap::with_capacity(block.tensors.len());
        let mut scales = HashMap::new();
        for t in &block.tensors {
            let buf = &buffers[region_of[t.region]];
            let esz = buf.dtype().size_in_bytes() as u64;
            let numel: usize = t.shape.iter().product();
            let v = buf
                .narrow(0, (t.offset / esz) as usize, numel)?
                .reshape(t.shape.as_slice())?;
            match &t.scales {
                Some(w) => scales.insert(w.clone(), v),
                None => tensors.insert(t.name.clone(), v),
            };
        }
        Ok(BlockWeights {
            tensors,
            scales,
            dtype,
        })
    }
}

impl Weights for BlockWeights {
    fn get(&self, name: &str) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::bug(format!("block weights: no tensor `{name}` in this block"))
        })?;
        if t.dtype() == DType::F8E4M3 {
            let scale = self
                .scales
                .get(name)
                .ok_or_else(|| Error::bug(format!("block weights: fp8 `{name}` has no scale")))?;
            return crate::execution::dtype::dequantize(t, scale, self.dtype);
        }
        // candle's to_dtype hands back the same storage when the dtype already matches.
        Ok(t.to_dtype(self.dtype)?)
    }
}
