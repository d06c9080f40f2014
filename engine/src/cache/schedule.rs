//! The step caches' schedules that need no tensor: MagCache's accumulators and decision
//! from its ratios, TaylorSeer's interval. Apart from the row states (which hold tensors)
//! so that the setting's figures (`StepCache::computed_share`) are there for the planner,
//! which builds without the compute runtime.

/// MagCache's step counter and accumulators, apart from its residual so a decision ahead
/// can be simulated on a copy.
#[derive(Debug, Clone, Copy)]
pub struct MagAcc {
    pub step_index: usize,
    pub accumulated_ratio: f32,
    pub accumulated_err: f32,
    pub accumulated_steps: usize,
}

impl Default for MagAcc {
    fn default() -> Self {
        MagAcc {
            step_index: 0,
            accumulated_ratio: 1.0,
            accumulated_err: 0.0,
            accumulated_steps: 0,
        }
    }
}

/// MagCache's parameters for one request.
pub struct MagParams {
    pub threshold: f32,
    pub max_skip_steps: usize,
    /// Steps from which skipping may start (`int(retention_ratio × steps + 0.5)`).
    pub retention_step: usize,
    /// Ratios per step, interpolated to the request's steps (float32, as diffusers'
    /// tensor holds them); empty when calibrating.
    pub ratios: Vec<f32>,
    pub steps: usize,
    pub calibrate: bool,
}

impl MagParams {
    pub fn new(
        threshold: f64,
        max_skip_steps: usize,
        retention_ratio: f64,
        ratios: Option<&[f64]>,
        calibrate: bool,
        steps: usize,
    ) -> MagParams {
        let ratios = match ratios {
            Some(r) if !calibrate => nearest_interp(r, steps),
            _ => Vec::new(),
        };
        MagParams {
            threshold: threshold as f32,
            max_skip_steps,
            retention_step: (retention_ratio * steps as f64 + 0.5) as usize,
            ratios,
            steps,
            calibrate,
        }
    }

    /// The decision taken `ahead` calls from now (0: the next one) by a row whose
    /// accumulators are `acc` and which holds a residual when `has_prev`, on copies: a
    /// schedule the prefetcher and the time model read before the run.
    pub fn peek_from(&self, mut acc: MagAcc, mut has_prev: bool, ahead: usize) -> bool {
        for k in 0..=ahead {
            let compute = self.decide(&mut acc, has_prev);
            if k == ahead {
                return compute;
            }
            has_prev |= compute;
            if self.step(&mut acc) {
                has_prev = false;
            }
        }
        true
    }

    pub(super) fn decide(&self, s: &mut MagAcc, has_prev: bool) -> bool {
        if self.calibrate {
            return true;
        }
        let step = s.step_index;
        let scale = self.ratios.get(step).copied().unwrap_or(1.0);
        if step < self.retention_step {
            return true;
        }
        s.accumulated_ratio *= scale;
        s.accumulated_steps += 1;
        s.accumulated_err += (1.0 - s.accumulated_ratio).abs();
        if has_prev
            && s.accumulated_err <= self.threshold
            && s.accumulated_steps <= self.max_skip_steps
        {
            return false;
        }
        s.accumulated_ratio = 1.0;
        s.accumulated_steps = 0;
        s.accumulated_err = 0.0;
        true
    }
}

impl MagParams {
    /// Advances the step counter; true when it started over.
    pub(super) fn step(&self, s: &mut MagAcc) -> bool {
        s.step_index += 1;
        if s.step_index < self.steps {
            return false;
        }
        *s = MagAcc::default();
        true
    }
}

/// diffusers' `nearest_interp`: `round(i × (n − 1) / (len − 1))` in float32, rounding
/// half to even as `torch.round` does.
pub fn nearest_interp(src: &[f64], len: usize) -> Vec<f32> {
    let src: Vec<f32> = src.iter().map(|&x| x as f32).collect();
    if src.len() == len {
        return src;
    }
    if len == 1 {
        return vec![*src.last().expect("ratios are not empty")];
    }
    let scale = ((src.len() - 1) as f64 / (len - 1) as f64) as f32;
    (0..len)
        .map(|i| src[((i as f32) * scale).round_ties_even() as usize])
        .collect()
}

/// Whether TaylorSeer computes at its `step`-th call (from 0).
pub fn taylor_schedule(step: i64, interval: usize, before: usize, after: Option<usize>) -> bool {
    let warmup = step < before as i64;
    let refresh = (step - before as i64 - 1).rem_euclid(interval as i64) == 0;
    let cooldown = after.is_some_and(|a| step >= a as i64);
    warmup || refresh || cooldown
}
