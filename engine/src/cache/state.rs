//! One guidance row's cache state in one transformer, as diffusers keeps it per cache
//! context (`cond`, `uncond`) and per model, and the decisions each cache takes from it.
//! The arithmetic follows the hooks line by line (including where they compute in
//! float32), so a decision near a threshold falls the same way as diffusers'.

use candle_core::{DType, Tensor, D};

use crate::Result;

pub use super::schedule::{taylor_schedule, MagAcc, MagParams};

/// A row's state; each cache reads its own fields.
pub struct RowState {
    // First-Block Cache (`FBCSharedBlockState`).
    /// The first block's residual at the last step that ran the other blocks.
    pub head_residual: Option<Tensor>,
    /// The other blocks' residual (last block's output − first block's) at that step.
    pub tail_residual: Option<Tensor>,
    // MagCache (`MagCacheState`).
    pub mag: MagAcc,
    /// The block stack's residual (last block's output − first block's input).
    pub previous_residual: Option<Tensor>,
    pub calibration: Vec<f64>,
    // TaylorSeer (`TaylorSeerState`), over the transformer's output.
    pub current_step: i64,
    pub last_update_step: Option<i64>,
    /// Divided differences, order 0 first.
    pub factors: Vec<Tensor>,
    // SeaCache (`SeaCacheContextState.history`; its gate is shared by the rows).
    pub sea: super::sea::SeaHistory,
}

impl Default for RowState {
    fn default() -> Self {
        RowState {
            head_residual: None,
            tail_residual: None,
            mag: MagAcc::default(),
            previous_residual: None,
            calibration: Vec::new(),
            current_step: -1,
            last_update_step: None,
            factors: Vec::new(),
            sea: Default::default(),
        }
    }
}

/// `FBCHeadBlockHook._should_compute_remaining_blocks`: the relative mean absolute change
/// of the first block's residual against the last computed one, above `threshold`.
pub fn fbc_should_compute(
    prev: Option<&Tensor>,
    residual: &Tensor,
    threshold: f64,
) -> Result<bool> {
    let Some(prev) = prev else { return Ok(true) };
    let absmean = (residual - prev)?.abs()?.mean_all()?.to_scalar::<f32>()?;
    let prev_absmean = prev.abs()?.mean_all()?.to_scalar::<f32>()?;
    Ok((absmean / prev_absmean) as f64 > threshold)
}

impl MagParams {
    /// `MagCacheHeadHook.new_forward`'s decision, updating the accumulators.
    pub fn should_compute(&self, s: &mut RowState) -> bool {
        let has_prev = s.previous_residual.is_some();
        self.decide(&mut s.mag, has_prev)
    }

    /// The decision the row takes `ahead` calls from now (0: the next one), on a copy
    /// of its state: a schedule the prefetcher can read before the pass.
    pub fn peek(&self, s: &RowState, ahead: usize) -> bool {
        self.peek_from(s.mag, s.previous_residual.is_some(), ahead)
    }

    /// After a step that ran the blocks: the calibration ratio, then the residual kept.
    pub fn record(&self, s: &mut RowState, residual: Tensor) -> Result<()> {
        if self.calibrate {
            let ratio = match &s.previous_residual {
                None => 1.0,
                Some(prev) => {
                    let norm = |t: &Tensor| -> Result<Tensor> {
                        Ok(t.to_dtype(DType::F32)?.sqr()?.sum(D::Minus1)?.sqrt()?)
                    };
                    let r = (norm(&residual)? / (norm(prev)? + 1e-8)?)?;
                    r.mean_all()?.to_scalar::<f32>()? as f64
                }
            };
            s.calibration.push(ratio);
        }
        s.previous_residual = Some(residual);
        Ok(())
    }

    /// `MagCacheBlockHook._advance_step`: past the last step, the state starts over (and
    /// a calibration is complete: its ratios are returned).
    pub fn advance(&self, s: &mut RowState) -> Option<Vec<f64>> {
        if !self.step(&mut s.mag) {
            return None;
        }
        s.previous_residual = None;
        let done = std::mem::take(&mut s.calibration);
        self.calibrate.then_some(done)
    }
}

/// TaylorSeer's schedule (`TaylorSeerCacheHook._measure_should_compute`), advancing the
/// row's step.
pub fn taylor_should_compute(
    s: &mut RowState,
    interval: usize,
    before: usize,
    after: Option<usize>,
) -> bool {
    s.current_step += 1;
    taylor_schedule(s.current_step, interval, before, after)
}

/// `TaylorSeerState.update`: the new output and its divided differences up to `order`.
pub fn taylor_update(s: &mut RowState, out: &Tensor, order: usize) -> Result<()> {
    let mut new = vec![out.clone()];
    if let Some(last) = s.last_update_step {
        let delta = (s.current_step - last) as f64;
        for j in 0..order {
            match s.factors.get(j) {
                Some(prev) if prev.dims() == new[j].dims() => {
                    let d = ((&new[j] - prev)? / delta)?;
                    new.push(d);
                }
                _ => break,
            }
        }
    }
    s.factors = new;
    s.last_update_step = Some(s.current_step);
    Ok(())
}

/// `TaylorSeerState.predict`: Σ factorₖ × offsetᵏ / k!, summed from zero in order.
pub fn taylor_predict(s: &RowState) -> Result<Tensor> {
    let last = s
        .last_update_step
        .ok_or_else(|| crate::Error::bug("taylorseer: a prediction before any update"))?;
    let offset = (s.current_step - last) as f64;
    let mut out = s.factors[0].zeros_like()?;
    let mut fact = 1.0f64;
    for (k, f) in s.factors.iter().enumerate() {
        if k > 0 {
            fact *= k as f64;
        }
        out = (out + (f * (offset.powi(k as i32) / fact))?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::schedule::nearest_interp;
    use super::*;

    #[test]
    fn ratios_stretch_by_nearest_index_with_ties_to_even() {
        let r = [1.0, 2.0, 3.0];
        assert_eq!(nearest_interp(&r, 5), vec![1.0, 1.0, 2.0, 3.0, 3.0]);
        assert_eq!(nearest_interp(&r, 1), vec![3.0]);
        assert_eq!(nearest_interp(&r, 3), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn magcache_skips_within_the_error_and_the_run_length() {
        let p = MagParams::new(0.06, 2, 0.2, Some(&[1.0; 10]), false, 10);
        assert_eq!(p.retention_step, 2);
        let mut s = RowState::default();
        let mut runs = Vec::new();
        for _ in 0..10 {
            let c = p.should_compute(&mut s);
            if c {
                s.previous_residual =
                    Some(Tensor::zeros(1, DType::F32, &candle_core::Device::Cpu).unwrap());
            }
            p.advance(&mut s);
            runs.push(c);
        }
        // Ratios of 1 add no error: two skips, then a computed step, and again.
        let want = [
            true, true, false, false, true, false, false, true, false, false,
        ];
        assert_eq!(runs, want);
    }

    #[test]
    fn taylorseer_refreshes_every_interval_after_the_warmup() {
        let mut s = RowState::default();
        let c: Vec<bool> = (0..10)
            .map(|_| taylor_should_compute(&mut s, 3, 2, Some(9)))
            .collect();
        assert_eq!(
            c,
            [true, true, false, true, false, false, true, false, false, true]
        );
    }
}
