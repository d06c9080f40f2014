//! The FLOPs the engine actually executes in matrix products, counted where every one of
//! them runs: the linear layers ([`crate::components::fused::linear_share`]), attention's
//! products (the query chunks, the causal chunks and the fused CUDA kernel of
//! [`crate::components::attention`]) and the few score products a model forms itself
//! (DiT's, UMT5's), each through [`matmul`] or [`add`]. A product of [m, k] by [k, n]
//! counts 2·m·n·k, the multiply-adds it runs, padding included; elementwise work (norms,
//! softmax, rotary, biases, activations) is not counted.
//!
//! The step-time model times blocks by the FLOPs each family declares
//! (`FamilyCheckpoint::group_compute`); this counter is what those declarations are held
//! against (`engine/tests/flops.rs`), so a declaration that drifts from the code fails a
//! test instead of mis-sizing a plan. The count is per thread (a rank computes its blocks
//! on its own thread, and the products count on the calling thread before they fan out
//! to the kernels' workers), always on, and costs one add per product.

use std::cell::Cell;

thread_local! {
    static EXECUTED: Cell<u64> = const { Cell::new(0) };
}

/// Adds `flops` to this thread's count.
pub fn add(flops: u64) {
    EXECUTED.with(|c| c.set(c.get().wrapping_add(flops)));
}

/// FLOPs this thread has executed so far (wrapping; differences are what mean something).
pub fn executed() -> u64 {
    EXECUTED.with(Cell::get)
}

/// Runs `f` and returns its result with the FLOPs it executed on this thread.
pub fn counted<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = executed();
    let r = f();
    (r, executed().wrapping_sub(before))
}

/// FLOPs of a product of `a` [.., m, k] by `b` [.., k, n] over `batch` leading elements:
/// 2·batch·m·n·k.
pub fn product_flops(batch: usize, m: usize, k: usize, n: usize) -> u64 {
    2 * batch as u64 * m as u64 * k as u64 * n as u64
}

#[cfg(feature = "runtime")]
pub use compute::matmul;

#[cfg(feature = "runtime")]
mod compute {
    use candle_core::Tensor;

    /// `a.matmul(b)` for a [.., m, k] and b [.., k, n], counted ([`super::add`]).
    pub fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        let out = a.matmul(b)?;
        let dims = a.dims();
        if let ([lead @ .., m, k], Some(&n)) = (dims, b.dims().last()) {
            super::add(super::product_flops(lead.iter().product(), *m, *k, n));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_per_thread_and_scoped() {
        let ((), n) = counted(|| {
            add(5);
            std::thread::spawn(|| add(1000)).join().unwrap();
            add(7);
        });
        assert_eq!(n, 12);
    }

    #[cfg(feature = "runtime")]
    #[test]
    fn a_product_counts_two_flops_per_multiply_add() {
        use candle_core::{DType, Device, Tensor};
        let a = Tensor::zeros((3, 4, 5), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((3, 5, 6), DType::F32, &Device::Cpu).unwrap();
        let (out, n) = counted(|| matmul(&a, &b).unwrap());
        assert_eq!(out.dims(), &[3, 4, 6]);
        assert_eq!(n, 2 * 3 * 4 * 5 * 6);
    }
}
