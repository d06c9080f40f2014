//! SeaCache (diffusers 0.42's `hooks/sea_cache.py`, as it applies to Cosmos3): before a
//! step, the latents go through the SEA filter (a spectral filter over frames, rows and
//! columns that keeps what the step's noise level leaves of the clean signal); the
//! relative L1 change of that indicator since the last step accumulates, and while it stays
//! under the threshold the decoder stack is skipped and its output predicted from the last
//! residuals. The decision reads only the latents and the step's sigma, so it is taken at
//! the pass boundary, before any block is copied, and is the same for every guidance row
//! (diffusers keeps one state per cache context, `cond` and `uncond`, but both read the
//! same latents at the same steps, so their gates agree step for step).

use candle_core::{DType, Device, Tensor};

use crate::Result;

/// SeaCache's parameters for one request (`SeaCacheConfig`).
#[derive(Debug, Clone, Copy)]
pub struct SeaParams {
    pub threshold: f64,
    pub residual_order: usize,
    pub retention_steps: usize,
    pub cache_end_steps: usize,
    /// 0: no limit.
    pub max_consecutive_cached: usize,
    pub power_exp: f64,
}

/// One transformer group's gate (`SeaCacheContextState`'s trajectory fields).
#[derive(Default)]
pub struct SeaGate {
    previous_indicator: Option<Tensor>,
    accumulated_distance: f64,
    consecutive_cached: usize,
    /// The last distance measured, for the guess of the step after the one gated.
    last_distance: Option<f64>,
    /// The decision for the step gated last, until its pass ends: (step, compute).
    pub pending: Option<(usize, bool)>,
}

impl SeaGate {
    /// `SeaCacheSharedState.resolve_gate` for step `step` of `steps` with this step's
    /// `indicator`, then the fallback of `prepare_decoder_stack`: a skip with no residual
    /// kept yet (`has_history` false) computes instead.
    pub fn resolve(
        &mut self,
        p: &SeaParams,
        step: usize,
        steps: usize,
        indicator: Tensor,
        has_history: bool,
    ) -> Result<bool> {
        let retained = step < p.retention_steps;
        let in_end = step + p.cache_end_steps >= steps;
        let max_consecutive =
            p.max_consecutive_cached > 0 && self.consecutive_cached >= p.max_consecutive_cached;
        let mut candidate = 0.0;
        let natural = match &self.previous_indicator {
            Some(prev) if !(retained || in_end || max_consecutive) => {
                let d = relative_l1(&indicator, prev)?;
                self.last_distance = Some(d);
                candidate = self.accumulated_distance + d;
                candidate >= p.threshold
            }
            _ => true,
        };
        let gate = natural || max_consecutive;
        self.accumulated_distance = if gate { 0.0 } else { candidate };
        self.previous_indicator = Some(indicator);
        let compute = gate || !has_history;
        if compute {
            self.accumulated_distance = 0.0;
        } else {
            self.consecutive_cached += 1;
        }
        self.pending = Some((step, compute));
        Ok(compute)
    }

    /// A guess, for the prefetch, of whether the step after the one gated last computes
    /// (its latents are not known before the gated step has run): certain where the gate
    /// forces it (the edges, the run-length limit), otherwise whether the last distance
    /// measured, added again, would reach the threshold. A wrong guess costs a stall (the
    /// step computes, nothing was prefetched) or blocks dropped (it skips, they moved).
    pub fn guess_next(&self, p: &SeaParams, steps: usize) -> bool {
        let Some((step, computed)) = self.pending else {
            return true;
        };
        let next = step + 1;
        let consecutive = if computed { 0 } else { self.consecutive_cached };
        let accumulated = if computed {
            0.0
        } else {
            self.accumulated_distance
        };
        next < p.retention_steps
            || next + p.cache_end_steps >= steps
            || (p.max_consecutive_cached > 0 && consecutive >= p.max_consecutive_cached)
            || self
                .last_distance
                .is_none_or(|d| accumulated + d >= p.threshold)
    }

    /// After a step whose stack ran (`_record_full_execution`).
    pub fn computed(&mut self) {
        self.consecutive_cached = 0;
    }
}

/// `mean|cur − prev| / (mean|prev| + 1e-16)`, in float32 as the hook computes it.
fn relative_l1(cur: &Tensor, prev: &Tensor) -> Result<f64> {
    let num = (cur - prev)?.abs()?.mean_all()?.to_scalar::<f32>()?;
    let den = prev.abs()?.mean_all()?.to_scalar::<f32>()? + 1e-16f32;
    Ok((num / den) as f64)
}

/// One row's residual history: (step, stack output − stack input), the last
/// `residual_order + 1` full executions.
#[derive(Default)]
pub struct SeaHistory(Vec<(usize, Tensor)>);

impl SeaHistory {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn record(&mut self, p: &SeaParams, step: usize, residual: Tensor) {
        self.0.push((step, residual));
        let keep = p.residual_order + 1;
        if self.0.len() > keep {
            self.0.drain(..self.0.len() - keep);
        }
    }

    /// The residual a skipped step `step` adds: the latest, or at order 1 the line through
    /// the last two extended to `step`.
    pub fn predict(&self, p: &SeaParams, step: usize) -> Result<Tensor> {
        let Some((latest_step, latest)) = self.0.last() else {
            return Err(crate::Error::bug("seacache: a skip with no residual kept"));
        };
        if p.residual_order == 1 && self.0.len() >= 2 {
            let (previous_step, previous) = &self.0[self.0.len() - 2];
            if latest_step != previous_step {
                let scale = (step as f64 - *latest_step as f64)
                    / (*latest_step as f64 - *previous_step as f64);
                return Ok((latest + ((latest - previous)? * scale)?)?);
            }
        }
        Ok(latest.clone())
    }
}

/// The SEA indicator of latents [C, T, H, W] at noise level `sigma` (`_apply_sea_filter`
/// over the frames, rows and columns): the real part of `ifftn(fftn(x) × gain)`, where the
/// gain is a product of one real, even response per axis normalised to unit mean. A real
/// even response is a circular convolution with a real kernel, so each axis is one
/// product with a circulant matrix, which runs on any device.
pub fn indicator(latents: &Tensor, sigma: f64, power_exp: f64) -> Result<Tensor> {
    let dims = latents.dims4()?;
    let sizes = [dims.1, dims.2, dims.3];
    let gains: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| axis_gain(n, sigma, power_exp))
        .collect();
    // The mean of the product is the product of the means; the hook divides by it when it
    // is finite and positive.
    let mean: f64 = gains
        .iter()
        .map(|g| g.iter().map(|&x| x as f64).sum::<f64>() / g.len() as f64)
        .product();
    let norm = if mean.is_finite() && mean > 0.0 {
        mean
    } else {
        1.0
    };
    let mut x = latents.to_dtype(DType::F32)?;
    for (axis, g) in gains.iter().enumerate() {
        let scale = if axis == 0 { norm } else { 1.0 };
        let m = circulant(g, scale, latents.device())?;
        x = along(&x, axis + 1, &m)?;
    }
    Ok(x.to_dtype(latents.dtype())?)
}

/// One axis' response: `s·P / (s²·P + σ² + 1e-16)` with the clean power `P = 1 / (|f|^p +
/// 1e-16)` at `fftfreq(n)`, in float32 with the scalars rounded to it as torch does.
fn axis_gain(n: usize, sigma: f64, power_exp: f64) -> Vec<f32> {
    let sigma = sigma.clamp(1e-6, 1.0 - 1e-6);
    let (s, noise) = (1.0 - sigma, sigma);
    let (s32, s2, n2) = (s as f32, (s * s) as f32, (noise * noise) as f32);
    (0..n)
        .map(|k| {
            let k = k as i64;
            let signed = if k < (n as i64 + 1) / 2 {
                k
            } else {
                k - n as i64
            };
            let f = (signed as f32) / (n as f32);
            let p = 1.0f32 / (f.abs().powf(power_exp as f32) + 1e-16f32);
            s32 * p / (s2 * p + n2 + 1e-16f32)
        })
        .collect()
}

/// The n×n matrix of the circular convolution whose frequency response is `gain`
/// (symmetric, so its kernel is real), divided by `scale`.
fn circulant(gain: &[f32], scale: f64, device: &Device) -> Result<Tensor> {
    let n = gain.len();
    let kernel: Vec<f64> = (0..n)
        .map(|m| {
            let sum: f64 = gain
                .iter()
                .enumerate()
                .map(|(k, &g)| {
                    let phase = 2.0 * std::f64::consts::PI * ((k * m) % n) as f64 / n as f64;
                    g as f64 * phase.cos()
                })
                .sum();
            sum / n as f64 / scale
        })
        .collect();
    let mut m = Vec::with_capacity(n * n);
    for i in 0..n {
        for j in 0..n {
            m.push(kernel[(i + n - j) % n] as f32);
        }
    }
    Ok(Tensor::from_vec(m, (n, n), device)?)
}

/// `m` applied along `axis` of `x`.
fn along(x: &Tensor, axis: usize, m: &Tensor) -> Result<Tensor> {
    let moved = x.transpose(0, axis)?.contiguous()?;
    let shape = moved.dims().to_vec();
    let flat = moved.reshape((shape[0], moved.elem_count() / shape[0]))?;
    let out = m.matmul(&flat)?.reshape(shape)?;
    Ok(out.transpose(0, axis)?.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filter against a direct evaluation of `Re(ifftn(fftn(x) × gain / mean))` by
    /// its definition, on a small odd and even grid.
    #[test]
    fn the_filter_is_the_spectral_product_it_is_defined_as() {
        let (c, t, h, w) = (2usize, 3usize, 4usize, 5usize);
        let data: Vec<f32> = (0..c * t * h * w)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let x = Tensor::from_vec(data.clone(), (c, t, h, w), &Device::Cpu).unwrap();
        let (sigma, p) = (0.4, 3.0);
        let ours = indicator(&x, sigma, p).unwrap();
        let g: Vec<Vec<f32>> = [t, h, w].iter().map(|&n| axis_gain(n, sigma, p)).collect();
        let mean: f64 = g
            .iter()
            .map(|a| a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64)
            .product();
        let dims = [t, h, w];
        let mut want = vec![0f32; data.len()];
        let tau = 2.0 * std::f64::consts::PI;
        for ch in 0..c {
            for a in 0..t * h * w {
                let pos = [a / (h * w), a / w % h, a % w];
                let mut acc = 0f64;
                for k in 0..t * h * w {
                    let freq = [k / (h * w), k / w % h, k % w];
                    let gain = (0..3).map(|d| g[d][freq[d]] as f64).product::<f64>() / mean;
                    // Σ_b x[b] e^{-iωb} e^{iωa} gain, real part.
                    for b in 0..t * h * w {
                        let src = [b / (h * w), b / w % h, b % w];
                        let phase: f64 = (0..3)
                            .map(|d| {
                                tau * freq[d] as f64 * (pos[d] as f64 - src[d] as f64)
                                    / dims[d] as f64
                            })
                            .sum();
                        acc += data[ch * t * h * w + b] as f64 * gain * phase.cos();
                    }
                }
                want[ch * t * h * w + a] = (acc / (t * h * w) as f64) as f32;
            }
        }
        let ours = ours.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in ours.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// diffusers' defaults.
    fn defaults() -> SeaParams {
        SeaParams {
            threshold: 0.25,
            residual_order: 1,
            retention_steps: 1,
            cache_end_steps: 1,
            max_consecutive_cached: 2,
            power_exp: 3.0,
        }
    }

    #[test]
    fn the_gate_skips_within_the_budget_and_forces_the_edges() {
        let p = defaults();
        let mut g = SeaGate::default();
        let same = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let decisions: Vec<bool> = (0..7)
            .map(|s| {
                let c = g.resolve(&p, s, 7, same.clone(), s > 0).unwrap();
                if c {
                    g.computed();
                }
                c
            })
            .collect();
        // An unchanged indicator: retention, two skips, a forced run, two skips, the end.
        assert_eq!(decisions, [true, false, false, true, false, false, true]);
    }

    #[test]
    fn the_prefetch_guess_follows_the_forced_steps_and_the_last_distance() {
        let p = defaults();
        let one = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let mut g = SeaGate::default();
        g.resolve(&p, 0, 6, one.clone(), false).unwrap();
        // No distance measured yet: the next step is guessed to compute.
        assert!(g.guess_next(&p, 6));
        g.computed();
        // A tenth's change: the next one, alike, would stay under the threshold.
        g.resolve(&p, 1, 6, (&one * 1.1).unwrap(), true).unwrap();
        assert!(!g.guess_next(&p, 6));
        // Three tenths: it would reach it.
        g.resolve(&p, 2, 6, (&one * 1.43).unwrap(), true).unwrap();
        assert!(g.guess_next(&p, 6));
        // The last step is forced whatever the distance.
        let mut g = SeaGate::default();
        g.resolve(&p, 3, 6, one.clone(), false).unwrap();
        g.resolve(&p, 4, 6, one.clone(), true).unwrap();
        assert!(g.guess_next(&p, 6));
    }
}
