//! Fused elementwise steps of a transformer block, for f32 on the CPU: the adaLN
//! `LayerNorm(x) · (1 + scale) + shift`, the gated residual `x + y · gate` and the tanh
//! GELU, each one pass over its tensors with one output allocation. Composed of candle's
//! ops they take seven, two and (GELU) one scalar-`tanh` pass, and on the CPU those passes
//! and their allocations cost as much as the block's matrix products' bias adds and more
//! than its attention. Any other device or dtype runs the composed ops, unchanged. Beside
//! them, the linear layer every family's blocks run ([`linear`]): candle's `Linear` on the
//! CPU packs the whole weight on every thread, this one each weight once.
//!
//! The kernels themselves are the `layerwise-kernels` crate's, compiled optimised in
//! every profile; their results depend on neither the thread count nor which rows share a
//! call, so outputs stay bit-identical across strategies, dp and K.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Module, Shape, Tensor, D,
};
use layerwise_kernels as kernels;

use crate::Result;

/// `LayerNorm(x) · (1 + scale) + shift` for x [B, T, D] and per-sample `shift`, `scale`
/// [B, D]: a LayerNorm over the last dimension without affine parameters (biased variance,
/// statistics in f32), then adaLN's modulation. Returns `x`'s dtype.
pub fn layer_norm_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    if fast(&[x, shift, scale]) {
        let (x, shift, scale) = (x.contiguous()?, shift.contiguous()?, scale.contiguous()?);
        return Ok(x.apply_op3_no_bwd(&shift, &scale, &LayerNormModulate { eps: eps as f32 })?);
    }
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let n = xc.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
    let scale = (scale.unsqueeze(1)? + 1.0)?;
    Ok(n.broadcast_mul(&scale)?
        .broadcast_add(&shift.unsqueeze(1)?)?)
}

/// `x + y · gate` for x, y [B, T, D] and a per-sample `gate` [B, D].
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    if fast(&[x, y, gate]) {
        let (x, y, gate) = (x.contiguous()?, y.contiguous()?, gate.contiguous()?);
        return Ok(x.apply_op3_no_bwd(&y, &gate, &GatedResidual)?);
    }
    Ok((x + y.broadcast_mul(&gate.unsqueeze(1)?)?)?)
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, computed as
/// the equal `x · σ(2u)` with the same `u`.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    if fast(&[x]) {
        return Ok(x.contiguous()?.apply_op1_no_bwd(&GeluTanh)?);
    }
    Ok(x.gelu()?)
}

/// `softmax(x · scale)` over the last dimension (attention scores), in f32.
pub fn softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    if fast(&[x]) {
        return Ok(x.contiguous()?.apply_op1_no_bwd(&SoftmaxScaled {
            scale: scale as f32,
        })?);
    }
    let dtype = x.dtype();
    let p = candle_nn::ops::softmax_last_dim(&(x * scale)?.to_dtype(DType::F32)?)?;
    Ok(p.to_dtype(dtype)?)
}

/// A linear layer, `x Wᵀ + bias`, for x [.., K], W [N, K] and bias [N]: on the CPU in f32
/// by `layerwise-kernels`' product (each thread packs only its share of W, the bias added
/// as the product accumulates), elsewhere by candle's `Linear`.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_share(x, weight, bias, None)
}

/// [`linear`] of x's rows that are a share of `whole` rows computed elsewhere (one rank's
/// tokens of a sequence split across a group, [`crate::execution::seq::Split`]): on the
/// CPU each row comes out as the whole product's would, bit for bit
/// ([`kernels::linear_share`]). `None`: x is the whole.
pub fn linear_share(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    whole: Option<usize>,
) -> Result<Tensor> {
    // 2 FLOPs per multiply-add of the product; the bias is elementwise.
    if let (Some(&k), Some(&n)) = (x.dims().last(), weight.dims().first()) {
        let rows = x.elem_count().checked_div(k).unwrap_or(0);
        crate::components::flops::add(crate::components::flops::product_flops(1, rows, k, n));
    }
    let mut ts = vec![x, weight];
    ts.extend(bias);
    if fast(&ts) {
        let (x, w) = (x.contiguous()?, weight.contiguous()?);
        let op = Linear { whole };
        return Ok(match bias {
            Some(b) => x.apply_op3_no_bwd(&w, &b.contiguous()?, &op)?,
            None => x.apply_op2_no_bwd(&w, &op)?,
        });
    }
    Ok(candle_nn::Linear::new(weight.clone(), bias.cloned()).forward(x)?)
}

/// Whether the fused ops run for these tensors (f32 on the CPU); elsewhere each op runs
/// its composition of candle's.
pub fn fast(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what}: expected f32");
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what}: expected a contiguous tensor"),
    }
}

/// (B, T, D) of a [B, T, D] activation with a [B, D] per-sample operand, or an error.
fn per_sample(
    op: &str,
    x: &Layout,
    other: &Layout,
    per: &Layout,
) -> candle_core::Result<(usize, usize, usize)> {
    let (b, t, d) = x.shape().dims3()?;
    if other.shape().dims() != x.shape().dims() || per.shape().dims() != [b, d] {
        candle_core::bail!(
            "{op}: shapes {:?}, {:?}, {:?}: want [B, T, D], [B, T, D], [B, D]",
            x.shape(),
            other.shape(),
            per.shape()
        );
    }
    Ok((b, t, d))
}

struct LayerNormModulate {
    eps: f32,
}

impl CustomOp3 for LayerNormModulate {
    fn name(&self) -> &'static str {
        "layerwise-layer-norm-modulate"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, shift, scale) = (
            f32s(s1, l1, self.name())?,
            f32s(s2, l2, self.name())?,
            f32s(s3, l3, self.name())?,
        );
        let (b, t, d) = per_sample(self.name(), l1, l1, l2)?;
        if l3.shape().dims() != [b, d] {
            candle_core::bail!("{}: scale {:?}, want [{b}, {d}]", self.name(), l3.shape());
        }
        let mut out = vec![0f32; x.len()];
        kernels::layer_norm_modulate(x, shift, scale, (b, t, d), self.eps, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

struct GatedResidual;

impl CustomOp3 for GatedResidual {
    fn name(&self) -> &'static str {
        "layerwise-gated-residual"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, y, gate) = (
            f32s(s1, l1, self.name())?,
            f32s(s2, l2, self.name())?,
            f32s(s3, l3, self.name())?,
        );
        let (b, t, d) = per_sample(self.name(), l1, l2, l3)?;
        let mut out = vec![0f32; x.len()];
        kernels::gated_residual(x, y, gate, (b, t, d), &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

struct Linear {
    /// Rows of the whole product x's rows are a share of (none: x is the whole).
    whole: Option<usize>,
}

impl Linear {
    /// `x Wᵀ + bias` of contiguous f32 storages, with (m, k, n) and y's shape checked.
    fn run(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = "layerwise-linear";
        let (x, w) = (f32s(sx, lx, name)?, f32s(sw, lw, name)?);
        let (n, k) = lw.shape().dims2()?;
        let dims = lx.shape().dims();
        if dims.last() != Some(&k) {
            candle_core::bail!("{name}: input {:?} for weight [{n}, {k}]", lx.shape());
        }
        let b = match bias {
            Some((sb, lb)) if lb.shape().dims() == [n] => Some(f32s(sb, lb, name)?),
            Some((_, lb)) => candle_core::bail!("{name}: bias {:?}, want [{n}]", lb.shape()),
            None => None,
        };
        let m = x.len() / k.max(1);
        let mut out = vec![0f32; m * n];
        kernels::linear_share(x, w, b, (m, k, n), &mut out, self.whole.unwrap_or(m));
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("a last dimension") = n;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "layerwise-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.run((s1, l1), (s2, l2), None)
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "layerwise-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.run((s1, l1), (s2, l2), Some((s3, l3)))
    }
}

struct GeluTanh;

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "layerwise-gelu-tanh"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let mut out = vec![0f32; x.len()];
        kernels::gelu_tanh(x, &mut out);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

struct SoftmaxScaled {
    scale: f32,
}

impl CustomOp1 for SoftmaxScaled {
    fn name(&self) -> &'static str {
        "layerwise-softmax-scaled"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let n = *l.shape().dims().last().unwrap_or(&1);
        if n == 0 {
            return Ok((CpuStorage::F32(Vec::new()), l.shape().clone()));
        }
        let mut out = x.to_vec();
        kernels::softmax_scaled(&mut out, n, self.scale);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn random(seed: u64, shape: &[usize]) -> Tensor {
        crate::execution::weights::seeded_noise(seed, shape).unwrap()
    }

    fn composed_ln(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Tensor {
        let mean = x.mean_keepdim(D::Minus1).unwrap();
        let xc = x.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let n = xc
            .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
            .unwrap();
        let scale = (scale.unsqueeze(1).unwrap() + 1.0).unwrap();
        n.broadcast_mul(&scale)
            .unwrap()
            .broadcast_add(&shift.unsqueeze(1).unwrap())
            .unwrap()
    }

    use crate::testing::max_abs_diff;

    #[test]
    fn gelu_matches_candles() {
        // The tensor op against candle's own tanh GELU, on a batch larger than one task.
        let x = (random(7, &[3, 5000]) * 3.0).unwrap();
        assert!(max_abs_diff(&gelu_tanh(&x).unwrap(), &x.gelu().unwrap()) < 1e-5);
    }

    #[test]
    fn fused_ops_match_the_composed_ones() {
        let (b, t, d) = (3, 37, 72);
        let x = random(1, &[b, t, d]).affine(4.0, 1.5).unwrap();
        let shift = random(2, &[b, d]);
        let scale = random(3, &[b, d]);
        let ours = layer_norm_modulate(&x, &shift, &scale, 1e-6).unwrap();
        let theirs = composed_ln(&x, &shift, &scale, 1e-6);
        assert!(max_abs_diff(&ours, &theirs) < 1e-5);
        // Per-sample operands taken as narrowed views of a wider tensor, as adaLN's chunks.
        let ada = random(4, &[b, 3 * d]);
        let gate = ada.narrow(1, d, d).unwrap();
        let y = random(5, &[b, t, d]);
        let ours = gated_residual(&x, &y, &gate).unwrap();
        let theirs = (&x + y.broadcast_mul(&gate.unsqueeze(1).unwrap()).unwrap()).unwrap();
        assert_eq!(max_abs_diff(&ours, &theirs), 0.0);
    }

    #[test]
    fn softmax_matches_candles() {
        let x = (random(11, &[2, 3, 5, 37]) * 6.0).unwrap();
        let theirs = candle_nn::ops::softmax_last_dim(&(&x * 0.3).unwrap()).unwrap();
        let ours = softmax_scaled(&x, 0.3).unwrap();
        assert!(max_abs_diff(&ours, &theirs) < 1e-6);
        let sums = ours.sum_keepdim(D::Minus1).unwrap();
        let ones = Tensor::ones(sums.shape(), DType::F32, &Device::Cpu).unwrap();
        assert!(max_abs_diff(&sums, &ones) < 1e-6);
    }

    #[test]
    fn linear_matches_candles() {
        // 3-D input as the blocks pass it, wider than one thread's share of features.
        let x = random(12, &[2, 37, 96]);
        let w = (random(13, &[300, 96]) * 0.1).unwrap();
        let b = random(14, &[300]);
        for bias in [Some(&b), None] {
            let ours = linear(&x, &w, bias).unwrap();
            let theirs = candle_nn::Linear::new(w.clone(), bias.cloned())
                .forward(&x)
                .unwrap();
            assert_eq!(ours.dims(), [2, 37, 300]);
            assert!(max_abs_diff(&ours, &theirs) < 1e-5);
        }
        // A transposed view of the input is made contiguous first, not misread.
        let xt = random(15, &[96, 5]).t().unwrap();
        let theirs = candle_nn::Linear::new(w.clone(), None)
            .forward(&xt)
            .unwrap();
        assert!(max_abs_diff(&linear(&xt, &w, None).unwrap(), &theirs) < 1e-5);
        let err = linear(&random(16, &[4, 95]), &w, Some(&b)).unwrap_err();
        assert!(err.to_string().contains("[300, 96]"), "{err}");
    }

    #[test]
    fn a_sample_does_not_depend_on_its_batch() {
        let (t, d) = (300, 64);
        let x = random(6, &[2, t, d]);
        let shift = random(7, &[2, d]);
        let scale = random(8, &[2, d]);
        let both = layer_norm_modulate(&x, &shift, &scale, 1e-5).unwrap();
        let one = |v: &Tensor| v.narrow(0, 1, 1).unwrap();
        let alone = layer_norm_modulate(&one(&x), &one(&shift), &one(&scale), 1e-5).unwrap();
        let bits = |v: &Tensor| {
            v.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|f| f.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&one(&both)), bits(&alone));
        // Nor a linear layer's rows (rows of three samples against the last two alone).
        let x = random(9, &[3, t, d]);
        let w = random(10, &[200, d]);
        let b = random(11, &[200]);
        let all = linear(&x, &w, Some(&b)).unwrap();
        let last = linear(&x.narrow(0, 1, 2).unwrap(), &w, Some(&b)).unwrap();
        assert_eq!(bits(&all.narrow(0, 1, 2).unwrap()), bits(&last));
    }

    #[test]
    fn other_dtypes_take_the_composed_ops() {
        let x = random(9, &[1, 4, 8]).to_dtype(DType::F16).unwrap();
        let s = random(10, &[1, 8]).to_dtype(DType::F16).unwrap();
        let y = layer_norm_modulate(&x, &s, &s, 1e-6).unwrap();
        assert_eq!(y.dtype(), DType::F16);
        assert_eq!(gated_residual(&x, &x, &s).unwrap().dtype(), DType::F16);
        assert_eq!(gelu_tanh(&x).unwrap().dtype(), DType::F16);
        assert!(Device::Cpu.is_cpu());
    }
}
