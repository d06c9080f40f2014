//! `--compute-dtype`: the element type that block weights and activations have while a
//! rank computes. A GPU computes in the checkpoint's own dtype (bf16 or f16 tensor-core
//! GEMMs, as diffusers does with `torch_dtype=bfloat16`), so a block's weights are used
//! where they land, with no cast kernel and no f32 temporary. The CPU computes in f32 by
//! default (it has no fast half-precision GEMM) but runs any dtype on request, so the
//! half-precision path is tested on machines without a GPU.
//!
//! Whatever the dtype, the sampler's arithmetic and the latents between steps stay f32,
//! and numerically delicate reductions (normalisation statistics, softmax) are taken in
//! f32 and cast back, as PyTorch's half-precision kernels accumulate in f32. The same
//! operations run in the same order under every strategy, so outputs stay bit-identical
//! across strategies, dp and K for each dtype.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Tensor};
use layerwise_core::compute_dtype::{Backend, ComputeElement};
use safetensors::Dtype;

use crate::{Error, Result};

/// `--compute-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    /// The checkpoint's dtype on a GPU, f32 on the CPU.
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    /// The dtype a run computes in, on a GPU (`gpu`) or the CPU, for a model whose
    /// streamed blocks hold `weights` (every dtype any block holds). `auto` takes the
    /// half-precision dtype the blocks are stored in (bf16 before f16 when a checkpoint
    /// mixes them; f32 norms beside bf16 matrices are the usual mix, and count as bf16;
    /// fp8 weights count as bf16).
    pub fn resolve(self, gpu: bool, weights: &[Dtype]) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
            ComputeDtype::F16 => DType::F16,
            // The planner's decision too ([`ComputeElement::for_checkpoint`]).
            ComputeDtype::Auto => {
                let backend = if gpu { Backend::Gpu } else { Backend::Cpu };
                let names: Vec<String> = weights.iter().map(|d| format!("{d:?}")).collect();
                candle(ComputeElement::for_checkpoint(
                    backend,
                    names.iter().map(String::as_str),
                ))
            }
        }
    }
}

/// The candle dtype of a compute element.
pub fn candle(e: ComputeElement) -> DType {
    match e {
        ComputeElement::F32 => DType::F32,
        ComputeElement::Bf16 => DType::BF16,
        ComputeElement::F16 => DType::F16,
    }
}

/// The compute element of a candle dtype the blocks compute in; `None` for any other.
pub fn element(d: DType) -> Option<ComputeElement> {
    match d {
        DType::F32 => Some(ComputeElement::F32),
        DType::BF16 => Some(ComputeElement::Bf16),
        DType::F16 => Some(ComputeElement::F16),
        _ => None,
    }
}

impl FromStr for ComputeDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ComputeDtype::Auto),
            "f32" | "float32" => Ok(ComputeDtype::F32),
            "bf16" | "bfloat16" => Ok(ComputeDtype::Bf16),
            "f16" | "float16" => Ok(ComputeDtype::F16),
            _ => Err(Error::invalid(
                "compute-dtype",
                format!("`{s}`: expected auto, f32, bf16 or f16"),
            )),
        }
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputeDtype::Auto => "auto",
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        })
    }
}

/// The name `--compute-dtype` uses for a resolved dtype.
pub fn name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "other",
    }
}

/// Runs a product (`f`: a matmul, a linear layer, a convolution) of `xs` in their dtype,
/// except bf16 on the CPU, whose matmul candle does not implement everywhere (its
/// convolution refuses bf16): there the operands are
/// widened to f32 (exactly), multiplied with f32 accumulation and the result rounded to
/// bf16, which is what a GPU's bf16 GEMM computes (bf16 inputs, f32 accumulation, a bf16
/// result), up to summation order.
pub fn product(xs: &[&Tensor], f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Result<Tensor> {
    let widen = xs
        .iter()
        .any(|x| x.dtype() == DType::BF16 && x.device().is_cpu());
    if !widen {
        return f(&xs.iter().map(|x| (*x).clone()).collect::<Vec<_>>());
    }
    let wide = xs
        .iter()
        .map(|x| x.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(f(&wide)?.to_dtype(DType::BF16)?)
}

/// An fp8 weight in the compute dtype: `f32(w) × scale`, then cast to `dtype`
/// ([`crate::checkpoint::fp8`]). Every step is exact or one IEEE rounding (E4M3 → f32 is
/// exact, the product is one f32 rounding, the cast one more), so the CPU and a GPU give
/// the same bits, and so does a checkpoint holding `f32(w) × scale` as f32 weights.
/// `scale` is a one-element F32 tensor on `w`'s device (no host round trip).
pub fn dequantize(w: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    let scale = scale.to_dtype(DType::F32)?.reshape((1, 1))?;
    let wide = w.to_dtype(DType::F32)?;
    let wide = match wide.rank() {
        2 => wide,
        _ => {
            return Err(Error::invalid(
                "fp8 weight",
                format!("shape {:?}: fp8 weights are 2-D", w.dims()),
            ))
        }
    };
    Ok(wide.broadcast_mul(&scale)?.to_dtype(dtype)?)
}

/// Bytes a tensor of `numel` elements takes once loaded for compute in `compute`: weights
/// stored in a float dtype are converted to the compute dtype when loaded whole (resident
/// prologues and epilogues), so a bf16 checkpoint computed in f32 holds them at twice
/// their file size.
pub fn stored_bytes(numel: u64, compute: DType) -> u64 {
    numel * compute.size_in_bytes() as u64
}

/// The element type candle holds a checkpoint's tensors of dtype `d` in: the dtypes the
/// engine streams, and a clear refusal of any other.
pub fn candle_dtype(d: Dtype) -> Result<DType> {
    Ok(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F8_E4M3 => DType::F8E4M3,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("{other:?} weights are not supported"),
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_the_checkpoints_half_dtype_on_a_gpu_and_f32_on_the_cpu() {
        let a = ComputeDtype::Auto;
        assert_eq!(a.resolve(true, &[Dtype::F32, Dtype::BF16]), DType::BF16);
        assert_eq!(a.resolve(true, &[Dtype::F16]), DType::F16);
        assert_eq!(a.resolve(true, &[Dtype::F16, Dtype::BF16]), DType::BF16);
        assert_eq!(a.resolve(true, &[Dtype::F32]), DType::F32);
        assert_eq!(a.resolve(false, &[Dtype::BF16]), DType::F32);
    }

    #[test]
    fn an_explicit_dtype_wins_on_either_device() {
        for gpu in [false, true] {
            assert_eq!(ComputeDtype::Bf16.resolve(gpu, &[Dtype::F32]), DType::BF16);
            assert_eq!(ComputeDtype::F16.resolve(gpu, &[Dtype::BF16]), DType::F16);
            assert_eq!(ComputeDtype::F32.resolve(gpu, &[Dtype::BF16]), DType::F32);
        }
    }

    #[test]
    fn parses_and_prints_the_flag() {
        for s in ["auto", "f32", "bf16", "f16"] {
            assert_eq!(s.parse::<ComputeDtype>().unwrap().to_string(), s);
        }
        assert_eq!(
            "BFloat16".parse::<ComputeDtype>().unwrap(),
            ComputeDtype::Bf16
        );
        let e = "fp8".parse::<ComputeDtype>().unwrap_err().to_string();
        assert!(e.contains("compute-dtype") && e.contains("fp8"), "{e}");
    }

    #[test]
    fn a_cpu_bf16_product_is_the_rounded_f32_product() {
        let dev = candle_core::Device::Cpu;
        let a = Tensor::new(&[[1.5f32, -2.25], [0.1, 3.0]], &dev).unwrap();
        let b = Tensor::new(&[[0.7f32], [1.3]], &dev).unwrap();
        let (a16, b16) = (
            a.to_dtype(DType::BF16).unwrap(),
            b.to_dtype(DType::BF16).unwrap(),
        );
        let got = product(&[&a16, &b16], |x| Ok(x[0].matmul(&x[1])?)).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        let want = a16
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&b16.to_dtype(DType::F32).unwrap())
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        assert_eq!(bits(&got), bits(&want));
        // f32 passes through untouched.
        let same = product(&[&a, &b], |x| Ok(x[0].matmul(&x[1])?)).unwrap();
        assert_eq!(same.dtype(), DType::F32);
    }

    #[test]
    fn fp8_counts_as_bf16_on_a_gpu() {
        let a = ComputeDtype::Auto;
        assert_eq!(a.resolve(true, &[Dtype::F32, Dtype::F8_E4M3]), DType::BF16);
        assert_eq!(a.resolve(false, &[Dtype::F8_E4M3]), DType::F32);
    }

    #[test]
    fn dequantize_is_the_f32_product_cast_once() {
        let dev = candle_core::Device::Cpu;
        let codes = [0x00u8, 0x38, 0xb8, 0x7e, 0x01, 0x55, 0xd3, 0x40];
        let w: Vec<float8::F8E4M3> = codes
            .iter()
            .map(|&b| float8::F8E4M3::from_bits(b))
            .collect();
        let w = Tensor::from_vec(w, (2, 4), &dev).unwrap();
        let scale = Tensor::new(&[0.037f32], &dev).unwrap();
        let want: Vec<f32> = codes
            .iter()
            .map(|&b| float8::F8E4M3::from_bits(b).to_f32() * 0.037f32)
            .collect();
        let got = dequantize(&w, &scale, DType::F32).unwrap();
        assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        // 1.0 (0x38), 448 (0x7e): exact.
        assert_eq!((want[1], want[3]), (0.037, 448.0 * 0.037));
        let got = dequantize(&w, &scale, DType::BF16).unwrap();
        let want16: Vec<half::bf16> = want.iter().map(|&x| half::bf16::from_f32(x)).collect();
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(),
            want16
        );
    }

    #[test]
    fn stored_size_follows_the_compute_dtype() {
        assert_eq!(stored_bytes(10, DType::F32), 40);
        assert_eq!(stored_bytes(10, DType::BF16), 20);
    }
}
