//! diffusers' `UniPCMultistepScheduler` stepping as flow-matching pipelines configure it
//! (`prediction_type: flow_prediction`, `use_flow_sigmas`, `predict_x0`): the UniP predictor
//! and UniC corrector with their scalar coefficients in float32 (torch 0-d tensors), the
//! order warm-up and the lower final orders.
//! The coefficients use the platform's `logf`/`expm1f`; torch's own kernels (MKL's log, SLEEF's
//! expm1 on AVX machines, so torch's result depends on the CPU) sometimes round an ulp
//! differently, which moves the samples by about 1e-7 relative.

use std::collections::VecDeque;

use candle_core::Tensor;

use super::schedule::{check_finite, check_steps, terminal};
use super::{solve::solve, Sampler, UniPcConfig};
use crate::{Error, Result};

/// One request's UniPC schedule and multistep state.
pub struct UniPc {
    timesteps: Vec<f32>,
    sigmas: Vec<f32>,
    /// λ = log(α) − log(σ) per sigma, in f32 from the f32 sigmas as diffusers computes them.
    lambdas: Vec<f32>,
    solver_order: usize,
    bh2: bool,
    lower_order_final: bool,
    disable_corrector: Vec<i64>,
    step_index: usize,
    /// The converted (x0) model outputs of the last `solver_order` steps, newest last.
    model_outputs: VecDeque<Tensor>,
    /// The (corrected) sample the last predictor started from.
    last_sample: Option<Tensor>,
    this_order: usize,
    lower_order_nums: usize,
}

impl UniPc {
    pub fn new(cfg: &UniPcConfig, steps: usize) -> Result<Self> {
        check_steps(steps, cfg.num_train_timesteps, terminal(cfg.shift_terminal))?;
        let (timesteps, sigmas) = cfg.schedule(steps);
        check_finite(&sigmas, steps)?;
        let lambdas = sigmas.iter().map(|&s| (1.0 - s).ln() - s.ln()).collect();
        Ok(UniPc {
            timesteps,
            sigmas,
            lambdas,
            solver_order: cfg.solver_order,
            bh2: cfg.solver_type == "bh2",
            lower_order_final: cfg.lower_order_final,
            disable_corrector: cfg.disable_corrector.clone(),
            step_index: 0,
            model_outputs: VecDeque::new(),
            last_sample: None,
            this_order: 0,
            lower_order_nums: 0,
        })
    }

    /// The scalars of one UniP/UniC update from sigma index `s0` to `t`, using the `order − 1`
    /// outputs before the newest (indices `s0 − 1`, `s0 − 2`, … in the schedule).
    fn coefficients(&self, s0: usize, t: usize, order: usize) -> Coefficients {
        let (sigma_t, sigma_s0) = (self.sigmas[t], self.sigmas[s0]);
        let alpha_t = 1.0 - sigma_t;
        let lambda_s0 = self.lambdas[s0];
        let h = self.lambdas[t] - lambda_s0;
        let mut rks: Vec<f32> = (1..order)
            .map(|k| (self.lambdas[s0 - k] - lambda_s0) / h)
            .collect();
        rks.push(1.0);
        let hh = -h;
        let h_phi_1 = hh.exp_m1();
        let b_h = if self.bh2 { hh.exp_m1() } else { hh };
        let mut h_phi_k = h_phi_1 / hh - 1.0;
        let mut factorial = 1u64;
        let mut r = Vec::with_capacity(order);
        let mut b = Vec::with_capacity(order);
        for i in 1..=order {
            r.push(rks.iter().map(|&x| pow(x, i - 1)).collect::<Vec<f32>>());
            b.push(h_phi_k * factorial as f32 / b_h);
            factorial *= i as u64 + 1;
            // `1 / factorial` is a Python float, rounded to f32 against the tensor.
            h_phi_k = h_phi_k / hh - (1.0 / factorial as f64) as f32;
        }
        Coefficients {
            rks,
            r,
            b,
            x_scale: sigma_t / sigma_s0,
            m0_scale: alpha_t * h_phi_1,
            res_scale: alpha_t * b_h,
        }
    }

    /// `(m_k − m0) / r_k` for the `order − 1` outputs before the newest.
    fn differences(&self, c: &Coefficients, m0: &Tensor) -> Result<Vec<Tensor>> {
        let n = self.model_outputs.len();
        (1..c.rks.len())
            .map(|k| {
                let mk = &self.model_outputs[n - 1 - k];
                Ok((mk - m0)?.broadcast_div(&scalar_like(c.rks[k - 1], m0)?)?)
            })
            .collect()
    }

    /// `multistep_uni_p_bh_update`: from `x` at this step's sigma to the next one's.
    fn predict(&self, x: &Tensor, order: usize) -> Result<Tensor> {
        let i = self.step_index;
        let m0 = self
            .model_outputs
            .back()
            .expect("an output was just stored");
        let c = self.coefficients(i, i + 1, order);
        let x_t = ((x * c.x_scale as f64)? - (m0 * c.m0_scale as f64)?)?;
        let d1s = self.differences(&c, m0)?;
        if d1s.is_empty() {
            return Ok(x_t);
        }
        let rhos = if order == 2 {
            vec![0.5]
        } else {
            let k = order - 1;
            let r = c.r[..k].iter().map(|row| row[..k].to_vec()).collect();
            solve(r, c.b[..k].to_vec())
        };
        let res = weighted_sum(&rhos, &d1s)?;
        Ok((x_t - (res * c.res_scale as f64)?)?)
    }

    /// `multistep_uni_c_bh_update`: redoes the last step from `last_sample` with this step's
    /// converted output `model_t` as well.
    fn correct(&self, model_t: &Tensor, x: &Tensor, order: usize) -> Result<Tensor> {
        let i = self.step_index;
        let m0 = self
            .model_outputs
            .back()
            .expect("the corrector follows a step");
        let c = self.coefficients(i - 1, i, order);
        let x_t = ((x * c.x_scale as f64)? - (m0 * c.m0_scale as f64)?)?;
        let d1s = self.differences(&c, m0)?;
        let rhos = if order == 1 {
            vec![0.5]
        } else {
            solve(c.r.clone(), c.b.clone())
        };
        let d1_t = (model_t - m0)?;
        let last = (d1_t * rhos[order - 1] as f64)?;
        let res = if d1s.is_empty() {
            last
        } else {
            (weighted_sum(&rhos[..order - 1], &d1s)? + last)?
        };
        Ok((x_t - (res * c.res_scale as f64)?)?)
    }
}

struct Coefficients {
    rks: Vec<f32>,
    r: Vec<Vec<f32>>,
    b: Vec<f32>,
    /// σ_t / σ_s0, α_t·hφ₁(h), α_t·B(h).
    x_scale: f32,
    m0_scale: f32,
    res_scale: f32,
}

/// `torch.pow(x, e)` for the small integer exponents UniPC uses (torch squares and cubes by
/// multiplying).
fn pow(x: f32, e: usize) -> f32 {
    match e {
        0 => 1.0,
        1 => x,
        2 => x * x,
        3 => x * x * x,
        _ => x.powf(e as f32),
    }
}

/// `einsum("k,bkc...->bc...", w, d)`: Σ w_k·d_k.
fn weighted_sum(w: &[f32], d: &[Tensor]) -> Result<Tensor> {
    let mut acc = (&d[0] * w[0] as f64)?;
    for (wk, dk) in w.iter().zip(d).skip(1) {
        acc = (acc + (dk * *wk as f64)?)?;
    }
    Ok(acc)
}

impl Sampler for UniPc {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let i = self.step_index;
        let len = self.timesteps.len();
        if i >= len {
            return Err(Error::bug(format!(
                "step: the {len}-step schedule is already finished"
            )));
        }
        // Flow prediction to x0: sample − σ·v.
        let x0 = (sample - (model_output * self.sigmas[i] as f64)?)?;
        let use_corrector = i > 0
            && !self.disable_corrector.contains(&(i as i64 - 1))
            && self.last_sample.is_some();
        let sample = match (&self.last_sample, use_corrector) {
            (Some(last), true) => self.correct(&x0, last, self.this_order)?,
            _ => sample.clone(),
        };
        self.model_outputs.push_back(x0);
        if self.model_outputs.len() > self.solver_order {
            self.model_outputs.pop_front();
        }
        let order = if self.lower_order_final {
            self.solver_order.min(len - i)
        } else {
            self.solver_order
        };
        // Warm-up: the order grows with the outputs there are.
        self.this_order = order.min(self.lower_order_nums + 1);
        let prev = self.predict(&sample, self.this_order)?;
        self.last_sample = Some(sample);
        if self.lower_order_nums < self.solver_order {
            self.lower_order_nums += 1;
        }
        self.step_index += 1;
        Ok(prev)
    }
}

/// The f32 scalar as a 0-d tensor on the sample's device and dtype, for exact elementwise
/// division (candle's `tensor / f64` multiplies by the reciprocal instead).
fn scalar_like(v: f32, like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::new(v, like.device())?.to_dtype(like.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wan_schedule_matches_diffusers() {
        // UniPCMultistepScheduler(flow_shift=3.0, ...).set_timesteps(4).
        let s = UniPc::new(&UniPcConfig::wan(3.0), 4).unwrap();
        assert_eq!(s.timesteps, vec![999.0, 900.0, 750.0, 500.0]);
        assert_eq!(
            s.sigmas,
            vec![0.999_999, 0.900_119_96, 0.750_374_8, 0.500_999, 0.0]
        );
    }

    #[test]
    fn stepping_past_the_schedule_is_an_error() {
        let mut s = UniPc::new(&UniPcConfig::wan(3.0), 1).unwrap();
        let x = Tensor::ones((1, 2), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        s.step(&x, &x).unwrap();
        assert!(s.step(&x, &x).unwrap_err().to_string().contains("finished"));
    }
}
