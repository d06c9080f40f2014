//! diffusers' `FlowMatchEulerDiscreteScheduler`: the training schedule shifted in float32 (the
//! constructor's torch tensors), the inference schedule between its ends shifted again in
//! float64 (numpy), as diffusers does, then the Euler step `x + (σ_next − σ)·v` in float32.

use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::Sampler;
use crate::{Error, Result};

/// `scheduler/scheduler_config.json` of a `FlowMatchEulerDiscreteScheduler`, with diffusers'
/// defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowMatchEulerConfig {
    #[serde(default = "d1000")]
    pub num_train_timesteps: usize,
    #[serde(default = "d1f")]
    pub shift: f64,
    #[serde(default)]
    pub use_dynamic_shifting: bool,
    #[serde(default = "dbase_shift")]
    pub base_shift: Option<f64>,
    #[serde(default = "dmax_shift")]
    pub max_shift: Option<f64>,
    #[serde(default = "d256")]
    pub base_image_seq_len: usize,
    #[serde(default = "d4096")]
    pub max_image_seq_len: usize,
    #[serde(default)]
    pub invert_sigmas: bool,
    #[serde(default)]
    pub shift_terminal: Option<f64>,
    #[serde(default)]
    pub use_karras_sigmas: bool,
    #[serde(default)]
    pub use_exponential_sigmas: bool,
    #[serde(default)]
    pub use_beta_sigmas: bool,
    #[serde(default = "dexponential")]
    pub time_shift_type: String,
    #[serde(default)]
    pub stochastic_sampling: bool,
}

fn d1000() -> usize {
    1000
}
fn d1f() -> f64 {
    1.0
}
fn dbase_shift() -> Option<f64> {
    Some(0.5)
}
fn dmax_shift() -> Option<f64> {
    Some(1.15)
}
fn d256() -> usize {
    256
}
fn d4096() -> usize {
    4096
}
fn dexponential() -> String {
    "exponential".into()
}

impl Default for FlowMatchEulerConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults parse")
    }
}

impl FlowMatchEulerConfig {
    /// diffusers' defaults with a static `shift` (e.g. 3.0 for Wan at 480p).
    pub fn with_shift(shift: f64) -> Self {
        FlowMatchEulerConfig {
            shift,
            ..Self::default()
        }
    }

    /// Refuses values whose math is not implemented here, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        crate::samplers::check_train_timesteps(path, self.num_train_timesteps)?;
        super::check_shift(path, "shift", self.shift)?;
        super::check_terminal(path, self.shift_terminal)?;
        super::refuse_sigma_variants(
            path,
            self.use_karras_sigmas,
            self.use_exponential_sigmas,
            self.use_beta_sigmas,
            self.use_dynamic_shifting,
        )?;
        super::refuse_true(
            path,
            "stochastic_sampling",
            self.stochastic_sampling,
            "it draws fresh noise every step",
        )?;
        if !matches!(self.time_shift_type.as_str(), "exponential" | "linear") {
            return bad(
                "time_shift_type",
                format!("`{}`: must be exponential or linear", self.time_shift_type),
            );
        }
        Ok(())
    }

    /// `set_timesteps(steps)`: (timesteps, sigmas).
    fn schedule(&self, steps: usize) -> (Vec<f32>, Vec<f32>) {
        let n = self.num_train_timesteps;
        let nf = n as f32;
        // The constructor's shifted training sigmas at both ends (torch, f32): N/N (exactly 1)
        // and 1/N.
        let shift32 = |s: f32| (self.shift as f32 * s) / (1.0 + ((self.shift - 1.0) as f32) * s);
        let sigma_max = shift32(1.0) as f64;
        let sigma_min = shift32(1.0 / nf) as f64;
        let mut s = super::linspace(sigma_max * n as f64, sigma_min * n as f64, steps);
        for x in &mut s {
            *x /= n as f64;
        }
        super::shift_sigmas(&mut s, self.shift);
        if let Some(t) = super::terminal(self.shift_terminal) {
            super::stretch_to_terminal(&mut s, t);
        }
        let mut sigmas: Vec<f32> = s.iter().map(|&x| x as f32).collect();
        if self.invert_sigmas {
            for x in &mut sigmas {
                *x = 1.0 - *x;
            }
        }
        let timesteps = sigmas.iter().map(|&x| x * nf).collect();
        sigmas.push(if self.invert_sigmas { 1.0 } else { 0.0 });
        (timesteps, sigmas)
    }
}

/// One request's flow-matching Euler schedule.
pub struct FlowMatchEuler {
    timesteps: Vec<f32>,
    sigmas: Vec<f32>,
    step_index: usize,
}

impl FlowMatchEuler {
    pub fn new(cfg: &FlowMatchEulerConfig, steps: usize) -> Result<Self> {
        super::check_steps(
            steps,
            cfg.num_train_timesteps,
            super::terminal(cfg.shift_terminal),
        )?;
        let (timesteps, sigmas) = cfg.schedule(steps);
        super::check_finite(&sigmas, steps)?;
        Ok(FlowMatchEuler {
            timesteps,
            sigmas,
            step_index: 0,
        })
    }
}

impl Sampler for FlowMatchEuler {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor> {
        let i = self.step_index;
        if i >= self.timesteps.len() {
            return Err(Error::bug(format!(
                "step: the {}-step schedule is already finished",
                self.timesteps.len()
            )));
        }
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        // diffusers upcasts the sample to f32 and casts the result back to the output's dtype.
        let sample = sample.to_dtype(DType::F32)?;
        let prev = (sample + (model_output.to_dtype(DType::F32)? * dt as f64)?)?;
        self.step_index += 1;
        Ok(prev.to_dtype(model_output.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Edit = fn(&mut FlowMatchEulerConfig);

    fn refused(c: &FlowMatchEulerConfig) -> String {
        c.validate(Path::new("scheduler_config.json"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn defaults_are_diffusers() {
        let d = FlowMatchEulerConfig::default();
        assert_eq!(d.num_train_timesteps, 1000);
        assert_eq!(d.shift, 1.0);
        assert_eq!((d.base_shift, d.max_shift), (Some(0.5), Some(1.15)));
        assert_eq!((d.base_image_seq_len, d.max_image_seq_len), (256, 4096));
        assert_eq!(d.time_shift_type, "exponential");
        assert!(!d.invert_sigmas && !d.use_dynamic_shifting && d.shift_terminal.is_none());
        d.validate(Path::new("x")).unwrap();
    }

    #[test]
    fn refusals_name_the_field() {
        let cases: Vec<(&str, Edit)> = vec![
            ("use_dynamic_shifting", |c| c.use_dynamic_shifting = true),
            ("use_karras_sigmas", |c| c.use_karras_sigmas = true),
            ("use_exponential_sigmas", |c| {
                c.use_exponential_sigmas = true
            }),
            ("use_beta_sigmas", |c| c.use_beta_sigmas = true),
            ("stochastic_sampling", |c| c.stochastic_sampling = true),
            ("time_shift_type", |c| c.time_shift_type = "cubic".into()),
            ("shift", |c| c.shift = -1.0),
            ("shift_terminal", |c| c.shift_terminal = Some(1.5)),
            ("num_train_timesteps", |c| c.num_train_timesteps = 0),
        ];
        for (field, edit) in cases {
            let mut c = FlowMatchEulerConfig::with_shift(3.0);
            edit(&mut c);
            let e = refused(&c);
            assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
        }
    }

    #[test]
    fn schedule_matches_diffusers() {
        // FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(4): diffusers shifts the
        // already shifted ends again, hence the small last sigma.
        let s = FlowMatchEuler::new(&FlowMatchEulerConfig::with_shift(3.0), 4).unwrap();
        assert_eq!(s.timesteps, vec![1000.0, 857.692_3, 602.150_6, 8.928_572]);
        assert_eq!(s.sigmas[4], 0.0);
        let mut c = FlowMatchEulerConfig::with_shift(3.0);
        c.invert_sigmas = true;
        let s = FlowMatchEuler::new(&c, 2).unwrap();
        assert_eq!(s.timesteps[0], 0.0);
        assert_eq!(s.sigmas[2], 1.0);
    }
}
