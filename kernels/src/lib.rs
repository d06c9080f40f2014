//! The engine's CPU kernels over f32 slices: the elementwise steps of a transformer block
//! fused into one pass each (adaLN's `LayerNorm(x) · (1 + scale) + shift`, the gated
//! residual `x + y · gate`, the tanh GELU and the scaled softmax of attention scores).
//! The engine wraps them as candle ops (`families::fused`).
//!
//! A crate of its own so that every build compiles them optimised: the workspace's dev
//! profile (what `cargo run` and the tests build) compiles the engine at opt-level 1, where
//! these loops' closures are not inlined nor vectorised and a DiT-XL/2 step took twice
//! as long as the release build's; this crate gets opt-level 3 in every profile (the
//! workspace's `Cargo.toml`). So its public functions are not generic: a generic one
//! would be compiled in, and at the opt-level of, the crate that calls it.
//!
//! The kernels are written so the compiler vectorises them (independent lanes of partial
//! sums, a branch-free `exp`), and split rows over rayon's threads. Their results depend
//! on neither the thread count nor which rows share a call.

mod linear;
mod operands;

pub use linear::{linear, linear_share, FEW_ROWS, MIN_FEATURES};
use operands::check;
use rayon::prelude::*;

/// Rows per rayon task: enough work per task to outweigh its scheduling.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

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

/// `out = LayerNorm(x) · (1 + scale) + shift` for x [b, t, d] and per-sample `shift`,
/// `scale` [b, d]: a LayerNorm over the last dimension without affine parameters (biased
/// variance), then adaLN's modulation.
///
/// # Panics
/// When a slice's length is not what (b, t, d) makes it.
pub fn layer_norm_modulate(
    x: &[f32],
    shift: &[f32],
    scale: &[f32],
    (b, t, d): (usize, usize, usize),
    eps: f32,
    out: &mut [f32],
) {
    check(&[
        (x.len(), b * t * d),
        (out.len(), b * t * d),
        (shift.len(), b * d),
        (scale.len(), b * d),
    ]);
    let scale1: Vec<f32> = scale.iter().map(|s| 1.0 + s).collect();
    rows(b, t, d, out, |s, r0, chunk| {
        let (sc, sh) = (&scale1[s * d..(s + 1) * d], &shift[s * d..(s + 1) * d]);
        for (i, o) in chunk.chunks_exact_mut(d).enumerate() {
            let at = (s * t + r0 + i) * d;
            layer_norm_modulate_row(&x[at..at + d], sc, sh, eps, o);
        }
    });
}

/// `out = x + y · gate` for x, y [b, t, d] and a per-sample `gate` [b, d].
///
/// # Panics
/// When a slice's length is not what (b, t, d) makes it.
pub fn gated_residual(
    x: &[f32],
    y: &[f32],
    gate: &[f32],
    (b, t, d): (usize, usize, usize),
    out: &mut [f32],
) {
    check(&[
        (x.len(), b * t * d),
        (y.len(), b * t * d),
        (out.len(), b * t * d),
        (gate.len(), b * d),
    ]);
    rows(b, t, d, out, |s, r0, chunk| {
        let g = &gate[s * d..(s + 1) * d];
        for (i, o) in chunk.chunks_exact_mut(d).enumerate() {
            let at = (s * t + r0 + i) * d;
            for (((o, &x), &y), &g) in o.iter_mut().zip(&x[at..at + d]).zip(&y[at..at + d]).zip(g) {
                *o = x + y * g;
            }
        }
    });
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

/// `out = GELU(x)`, tanh approximation: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`,
/// computed as the equal `x · σ(2u)` with the same `u`.
///
/// # Panics
/// When `out` is not as long as `x`.
pub fn gelu_tanh(x: &[f32], out: &mut [f32]) {
    check(&[(out.len(), x.len())]);
    out.par_chunks_mut(MIN_ELEMS_PER_TASK)
        .zip(x.par_chunks(MIN_ELEMS_PER_TASK))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = gelu_tanh_one(x);
            }
        });
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

/// `softmax(x · scale)` of each row of `n` values of `data`, in place.
///
/// # Panics
/// When `data` is not whole rows.
pub fn softmax_scaled(data: &mut [f32], n: usize, scale: f32) {
    if n == 0 {
        return;
    }
    assert_eq!(
        data.len() % n,
        0,
        "{} values are not rows of {n}",
        data.len()
    );
    let per_task = (MIN_ELEMS_PER_TASK / n).max(1) * n;
    data.par_chunks_mut(per_task).for_each(|rows| {
        for row in rows.chunks_exact_mut(n) {
            softmax_scaled_row(row, scale);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn softmax_rows_sum_to_one_and_keep_their_order() {
        let mut rows: Vec<f32> = (0..3 * 37)
            .map(|i| ((i * 7919) % 101) as f32 * 0.1)
            .collect();
        let before = rows.clone();
        softmax_scaled(&mut rows, 37, 0.5);
        for (r, b) in rows.chunks(37).zip(before.chunks(37)) {
            assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            let (i, j) = (0..37).fold((0, 0), |(lo, hi), k| {
                (
                    if b[k] < b[lo] { k } else { lo },
                    if b[k] > b[hi] { k } else { hi },
                )
            });
            assert!(r[i] < r[j]);
        }
    }

    #[test]
    #[should_panic(expected = "where its shape makes")]
    fn a_misshapen_operand_is_refused() {
        let mut out = vec![0.0; 6];
        gated_residual(&[0.0; 6], &[0.0; 6], &[0.0; 2], (1, 2, 3), &mut out);
    }
}
