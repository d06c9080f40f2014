//! Fused elementwise steps of a transformer block, for f32 on the CPU: the adaLN
//! `LayerNorm(x) · (1 + scale) + shift`, the gated residual `x + y · gate` and the tanh
//! GELU, each one pass over its tensors with one output allocation. Composed of candle's
//! ops they take seven, two and (GELU) one scalar-`tanh` pass, and on the CPU those passes
//! and their allocations cost as much as the block's matrix products' bias adds and more
//! than its attention. Any other device or dtype runs the composed ops, unchanged.
//!
//! The kernels are written so the compiler vectorises them (independent lanes of partial
//! sums, a branch-free `exp`), and split rows over rayon's threads. Their results depend
//! on neither the thread count nor which rows share a call, so outputs stay bit-identical
//! across strategies, dp and K.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::Result;

/// Rows per rayon task: enough work per task to outweigh its scheduling.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

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

fn fast(ts: &[&Tensor]) -> bool {
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

/// Sum of `v` in eight interleaved lanes, then the lanes pairwise: vectorises, and the
/// order depends only on `v`'s length.
#[inline(always)]
fn sum_lanes(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (acc, &x) in lanes.iter_mut().zip(c) {
            *acc += f(x);
        }
    }
    for (acc, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *acc += f(x);
    }
    let [a, b, c, d, e, g, h, i] = lanes;
    ((a + b) + (c + d)) + ((e + g) + (h + i))
}

/// One row of [`layer_norm_modulate`]: `out = (x − mean) · rstd · scale1 + shift`, where
/// `scale1` already holds `1 + scale`.
pub fn layer_norm_modulate_row(
    x: &[f32],
    scale1: &[f32],
    shift: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let n = x.len() as f32;
    let mean = sum_lanes(x, |v| v) / n;
    let var = sum_lanes(x, |v| (v - mean) * (v - mean)) / n;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, &v), &s), &b) in out.iter_mut().zip(x).zip(scale1).zip(shift) {
        *o = (v - mean) * rstd * s + b;
    }
}

/// Runs `row(sample, input rows, output rows)` over the [B·T, D] rows of `out`, in
/// parallel tasks of whole rows that never straddle two samples.
fn rows(
    b: usize,
    t: usize,
    d: usize,
    out: &mut [f32],
    row: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    let per_task = (MIN_ELEMS_PER_TASK / d.max(1)).clamp(1, t.max(1));
    out.par_chunks_mut(d * t)
        .enumerate()
        .take(b)
        .for_each(|(s, sample)| {
            sample
                .par_chunks_mut(d * per_task)
                .enumerate()
                .for_each(|(c, chunk)| row(s, c * per_task, chunk));
        });
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
        let scale1: Vec<f32> = scale.iter().map(|s| 1.0 + s).collect();
        let mut out = vec![0f32; x.len()];
        rows(b, t, d, &mut out, |s, r0, chunk| {
            let (sc, sh) = (&scale1[s * d..(s + 1) * d], &shift[s * d..(s + 1) * d]);
            for (i, o) in chunk.chunks_exact_mut(d).enumerate() {
                let at = (s * t + r0 + i) * d;
                layer_norm_modulate_row(&x[at..at + d], sc, sh, self.eps, o);
            }
        });
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
        rows(b, t, d, &mut out, |s, r0, chunk| {
            let g = &gate[s * d..(s + 1) * d];
            for (i, o) in chunk.chunks_exact_mut(d).enumerate() {
                let at = (s * t + r0 + i) * d;
                for (((o, &x), &y), &g) in
                    o.iter_mut().zip(&x[at..at + d]).zip(&y[at..at + d]).zip(g)
                {
                    *o = x + y * g;
                }
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `e^x` within 2 ulp over the f32 range, branch-free so a loop of it vectorises (Cody
/// and Waite's reduction with Cephes' `expf` polynomial): x is clamped to [−87.3, 88.3],
/// split as `n ln2 + r` with |r| ≤ ln2/2 (n rounded by adding 1.5·2²³, ln2 in two parts
/// so `n ln2` is exact), `e^r` by a degree-7 polynomial, and `2^n` built in the exponent.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 × 2²³
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    let bits = (shifted.to_bits() as i32 - ROUND.to_bits() as i32 + 127) << 23;
    e * f32::from_bits(bits as u32)
}

/// One element of [`gelu_tanh`].
#[inline(always)]
pub fn gelu_tanh_one(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    let u = K * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp(-2.0 * u))
}

struct GeluTanh;

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "layerwise-gelu-tanh"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(MIN_ELEMS_PER_TASK)
            .zip(x.par_chunks(MIN_ELEMS_PER_TASK))
            .for_each(|(o, x)| {
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = gelu_tanh_one(x);
                }
            });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// One row of [`softmax_scaled`], in place.
pub fn softmax_scaled_row(row: &mut [f32], scale: f32) {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    for (m, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *m = m.max(x);
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for v in row.iter_mut() {
        *v = exp((*v - max) * scale);
    }
    let inv = 1.0 / sum_lanes(row, |v| v);
    for v in row.iter_mut() {
        *v *= inv;
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
        let per_task = (MIN_ELEMS_PER_TASK / n).max(1) * n;
        out.par_chunks_mut(per_task).for_each(|rows| {
            for row in rows.chunks_exact_mut(n) {
                softmax_scaled_row(row, self.scale);
            }
        });
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
    fn exp_is_within_two_ulp_over_the_range() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (ours, exact) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((ours - exact).abs() / exact);
            x += 0.0137;
        }
        assert!(worst < 2.5 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-200.0) < 1e-37 && exp(-200.0) >= 0.0);
        assert!(exp(200.0).is_finite() && exp(200.0) > 1e38);
    }

    #[test]
    fn gelu_matches_the_tanh_formula() {
        for i in -4000..4000 {
            let x = i as f32 * 0.005;
            let xd = x as f64;
            let exact = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            let ours = gelu_tanh_one(x) as f64;
            assert!(
                (ours - exact).abs() <= 4e-7 * (1.0 + exact.abs()),
                "x={x}: {ours} vs {exact}"
            );
        }
        assert!(gelu_tanh_one(-100.0).abs() < 1e-30);
        assert_eq!(gelu_tanh_one(100.0), 100.0);
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
