//! Where model code gets its tensors: resident weights loaded once, or the views of a
//! streamed block in a device slot. Model code never knows which.

use candle_core::Tensor;

use crate::Result;

/// A set of named tensors on the compute device, in the run's compute dtype
/// ([`super::dtype`]).
pub trait Weights {
    /// The tensor called `name` (relative to this set's prefix), shaped as stored.
    fn get(&self, name: &str) -> Result<Tensor>;
}

impl Weights for std::collections::HashMap<String, Tensor> {
    fn get(&self, name: &str) -> Result<Tensor> {
        self.get(name)
            .cloned()
            .ok_or_else(|| crate::Error::bug(format!("tensor `{name}` is not loaded")))
    }
}

/// Loads named tensors of a mapped component onto `device`, converted to `dtype` (for
/// weights that stay resident: prologues and epilogues in the compute dtype, decoders in
/// f32).
pub fn load(
    mapped: &crate::checkpoint::Mapped,
    names: impl Iterator<Item = String>,
    device: &candle_core::Device,
    dtype: candle_core::DType,
) -> Result<std::collections::HashMap<String, Tensor>> {
    let mut out = std::collections::HashMap::new();
    for name in names {
        let (h, info) = mapped.component.get(&name).ok_or_else(|| {
            crate::Error::tensor(&mapped.component.dir, &name, "missing from the checkpoint")
        })?;
        let bytes = mapped.bytes(&name).expect("indexed tensor");
        let stored = super::dtype::candle_dtype(info.dtype)
            .map_err(|e| crate::Error::tensor(&h.path, &name, e.to_string()))?;
        let t = Tensor::from_raw_buffer(bytes, stored, &info.shape, device)?;
        let t = if stored == candle_core::DType::F8E4M3 {
            // An fp8 linear weight outside the blocks: dequantized once, at load.
            let scale = crate::checkpoint::fp8::scale_of(&mapped.component, &name)?;
            let s = mapped.bytes(&scale).expect("indexed tensor");
            let s = Tensor::from_raw_buffer(s, candle_core::DType::F32, &[1], device)?;
            super::dtype::dequantize(&t, &s, dtype)?
        } else {
            t.to_dtype(dtype)?
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Seeded standard-normal noise of `shape`, drawn on the host so every device and every
/// strategy starts from the same bits.
pub fn seeded_noise(seed: u64, shape: &[usize]) -> Result<Tensor> {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rand_distr::StandardNormal.sample(&mut rng))
        .collect();
    Ok(Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?)
}
