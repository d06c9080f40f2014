//! Helpers the crate's unit tests share.

use candle_core::Tensor;

/// Max |a − b| over all elements.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .unwrap_or(f32::INFINITY)
}
