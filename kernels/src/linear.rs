//! `y = x Wᵀ + b`, the linear layer of every block, over gemm's kernels.
//!
//! candle's CPU matmul hands gemm the whole product with gemm's own threading. For a
//! linear layer gemm then works on the transposed product (`yᵀ = W xᵀ`, so that its
//! micro-kernel's long side runs along `y`'s contiguous rows) and has to repack W, the
//! large operand, into panels on every call; with its jobs split along the tokens, every
//! thread repacks the whole of W. On DiT-XL/2's block at 256 px that packing took a
//! quarter of the matrix products' time. Here the output features are split into one
//! contiguous range per thread instead, and each thread runs gemm single-threaded on its
//! rows of W: each weight is packed once, by the thread that uses it. The bias is the
//! destination gemm accumulates into, so there is no second pass over `y` to add it.
//! Products of at most [`FEW_ROWS`] rows skip gemm: dot products with W's rows as stored.
//!
//! An output's sum runs over k in the blocks gemm derives from k alone, in order, so
//! results depend on neither the thread count, nor the rows (past [`FEW_ROWS`], and
//! [`linear_share`] takes a share of a sequence down the path of its whole), nor how the
//! features are split (a split
//! never makes a range under [`MIN_FEATURES`], which would take gemm's small-matrix path).

use crate::operands::check;
use rayon::prelude::*;

/// The fewest output features a thread's range holds: gemm's micro-kernel covers 64
/// (AVX-512) or 48 (AVX2) features at a time, and a range of at least 128 keeps it out of
/// gemm's separate path for matrices of at most 64 × 64.
pub const MIN_FEATURES: usize = 128;

/// Multiply-adds under which a product runs on one thread: splitting costs more.
const MIN_MACS_PER_THREAD: usize = 1 << 21;

/// Rows up to which a product runs as dot products of each row with each weight row
/// ([`few_rows`]): a conditioning vector (one row per sample) through a modulation layer
/// reads the whole of W for a few multiply-adds per weight, where gemm would first
/// repack all of W. A request's activations always have the same rows, so which path a
/// layer takes never changes between runs of a request.
pub const FEW_ROWS: usize = 16;

/// Weight rows per rayon task of [`few_rows`].
const FEW_ROWS_TASK: usize = 64;

/// `out = x Wᵀ + bias` as m dot products per weight row, W read once, in order: each
/// output a sum over k in eight interleaved lanes, then the bias.
fn few_rows(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    let dst = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(FEW_ROWS_TASK))
        .into_par_iter()
        .for_each(|c| {
            for j in c * FEW_ROWS_TASK..((c + 1) * FEW_ROWS_TASK).min(n) {
                let wj = &w[j * k..(j + 1) * k];
                let b = bias.map_or(0.0, |b| b[j]);
                for i in 0..m {
                    let v = dot(&x[i * k..(i + 1) * k], wj) + b;
                    // SAFETY: i < m and j < n index `out` [m, n]; each task writes only the
                    // columns of its own weight rows.
                    unsafe { *dst.ptr().add(i * n + j) = v };
                }
            }
        });
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (a, b) in ca.zip(cb) {
        for ((acc, &a), &b) in lanes.iter_mut().zip(a).zip(b) {
            *acc += a * b;
        }
    }
    for ((acc, &a), &b) in lanes.iter_mut().zip(ra).zip(rb) {
        *acc += a * b;
    }
    let [a, b, c, d, e, g, h, i] = lanes;
    ((a + b) + (c + d)) + ((e + g) + (h + i))
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    /// The pointer. A closure that calls this captures the whole `SendPtr` (and so its
    /// `Send`), where naming the field would capture the bare pointer.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: each task writes only its own columns of the destination (disjoint ranges).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out = x Wᵀ + bias` for x [m, k], W [n, k] (PyTorch's layout of a linear layer's
/// weight), an optional bias [n], and out [m, n], all row-major.
///
/// # Panics
/// When a slice's length is not what (m, k, n) makes it.
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    linear_share(x, w, bias, (m, k, n), out, m)
}

/// Rows past which gemm's path no longer depends on them (see [`linear_share`]).
const SAME_PATH_ROWS: usize = 65;

/// As [`linear`] for `m` rows that are a share of a product of `whole` rows computed
/// elsewhere (one rank's tokens of a sequence split across ranks): each row takes the
/// path the whole product would, so its sums run in the same order and its outputs are
/// the whole product's bit for bit. A share of fewer than [`SAME_PATH_ROWS`] rows (and
/// fewer than the whole's) runs padded with zero rows, which costs little at that size.
///
/// # Panics
/// As [`linear`].
pub fn linear_share(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    whole: usize,
) {
    check(&[(x.len(), m * k), (w.len(), n * k), (out.len(), m * n)]);
    if let Some(b) = bias {
        check(&[(b.len(), n)]);
        for row in out.chunks_exact_mut(n.max(1)) {
            row.copy_from_slice(b);
        }
    }
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if bias.is_none() {
            out.fill(0.0);
        }
        return;
    }
    if whole.max(m) <= FEW_ROWS {
        few_rows(x, w, bias, (m, k, n), out);
        return;
    }
    // gemm picks its path from the shape: a matrix-vector one for one row, a
    // "horizontal" one for at most 256 outputs, a small one up to 64 × 64. Past
    // SAME_PATH_ROWS rows it takes none of them, whatever the rows; a share of fewer rows
    // runs padded with zero rows to the whole's path.
    let padded = whole.min(SAME_PATH_ROWS).max(m);
    if padded > m {
        let mut xp = x.to_vec();
        xp.resize(padded * k, 0.0);
        let mut op = vec![0f32; padded * n];
        op[..m * n].copy_from_slice(out);
        if let Some(b) = bias {
            for row in op[m * n..].chunks_exact_mut(n) {
                row.copy_from_slice(b);
            }
        }
        gemm_rows(&xp, w, bias.is_some(), (padded, k, n), &mut op);
        out.copy_from_slice(&op[..m * n]);
        return;
    }
    gemm_rows(x, w, bias.is_some(), (m, k, n), out);
}

/// `out (+)= x Wᵀ` by gemm, the output features split over threads (`read_dst`: `out`
/// holds the bias to accumulate into).
fn gemm_rows(
    x: &[f32],
    w: &[f32],
    read_dst: bool,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    let threads = rayon::current_num_threads();
    let parts = threads
        .min(n / MIN_FEATURES)
        .min(m * n * k / MIN_MACS_PER_THREAD)
        .max(1);
    // Ranges of whole 64-feature panels, the last one taking the rest (so it is never
    // shorter than the others).
    let per = n.div_ceil(parts).div_ceil(64) * 64;
    let ranges = (n / per).max(1);
    let dst = SendPtr(out.as_mut_ptr());
    (0..ranges).into_par_iter().for_each(|p| {
        let (lo, hi) = (p * per, if p + 1 == ranges { n } else { (p + 1) * per });
        // SAFETY: the pointers and strides address x [m, k] (row-major), W's rows lo..hi
        // read as the columns of Wᵀ, and out's columns lo..hi: in bounds by the checks
        // above, and the tasks' columns of `out` are disjoint.
        unsafe {
            gemm::gemm(
                m,
                hi - lo,
                k,
                dst.ptr().add(lo),
                1,
                n as isize,
                read_dst,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr().add(lo * k),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random fill in [-1, 1).
    fn fill(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn reference(
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
                y[i * n + j] = dot + b.map_or(0.0, |b| b[j] as f64);
            }
        }
        y
    }

    #[test]
    fn matches_a_plain_product_at_odd_and_split_shapes() {
        for &(m, k, n, bias) in &[
            (1, 7, 3, true),
            (2, 1152, 200, true),
            (16, 33, 70, false),
            (17, 33, 70, false),
            (64, 96, 300, true),
            (130, 257, 1030, true),
            (3, 0, 4, true),
        ] {
            let (x, w, b) = (fill(m * k, 1), fill(n * k, 2), fill(n, 3));
            let b = bias.then_some(&b[..]);
            let mut out = vec![f32::NAN; m * n];
            linear(&x, &w, b, (m, k, n), &mut out);
            for (i, (&got, &want)) in out.iter().zip(&reference(&x, &w, b, (m, k, n))).enumerate() {
                let tol = 1e-5 * (k as f64).sqrt().max(1.0);
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "({m}, {k}, {n})[{i}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_share_of_the_rows_gives_the_wholes_bits() {
        let mut bad = Vec::new();
        // Features past and under 128, wholes past and under 64 and 16, k past gemm's
        // 512-wide blocks.
        for (whole, k, n) in [
            (40, 640, 256),
            (64, 96, 128),
            (12, 64, 256),
            (300, 1024, 128),
            (90, 700, 48),
            (30, 96, 24),
            (200, 32, 8),
        ] {
            let (x, w, b) = (fill(whole * k, 1), fill(n * k, 2), fill(n, 3));
            let mut all = vec![0f32; whole * n];
            linear(&x, &w, Some(&b), (whole, k, n), &mut all);
            for (start, rows) in [
                (0, 1),
                (whole - 1, 1),
                (3, 2),
                (5, whole / 3),
                (0, whole / 2),
            ] {
                let mut part = vec![0f32; rows * n];
                let xs = &x[start * k..(start + rows) * k];
                linear_share(xs, &w, Some(&b), (rows, k, n), &mut part, whole);
                let want = &all[start * n..(start + rows) * n];
                if !part
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                {
                    bad.push(format!(
                        "whole {whole}, rows {start}..{}, k {k}, n {n}",
                        start + rows
                    ));
                }
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[test]
    fn the_split_does_not_change_a_bit() {
        let (m, k, n) = (96, 1152, 1152);
        let (x, w, b) = (fill(m * k, 4), fill(n * k, 5), fill(n, 6));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut out = vec![0f32; m * n];
            pool.install(|| linear(&x, &w, Some(&b), (m, k, n), &mut out));
            out
        };
        let one = run(1);
        for threads in [2, 3, 5] {
            assert!(one == run(threads), "{threads} threads changed the result");
        }
    }

    #[test]
    #[should_panic(expected = "operand")]
    fn a_misshapen_weight_panics() {
        linear(&[0.0; 6], &[0.0; 5], None, (2, 3, 2), &mut [0.0; 4]);
    }
}
