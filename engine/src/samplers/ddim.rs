//! DDIM (eta = 0) following diffusers' `DDIMScheduler` step for step: the same beta
//! schedules, timestep spacings, `final_alpha_cumprod`, prediction types and clipping,
//! with the schedule computed in f32 as torch does.

use std::path::Path;

use candle_core::Tensor;
use serde::Deserialize;

use crate::{Error, Result};

/// `scheduler/scheduler_config.json`, with diffusers' defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct DdimConfig {
    #[serde(default = "d1000")]
    pub num_train_timesteps: usize,
    #[serde(default = "dstart")]
    pub beta_start: f64,
    #[serde(default = "dend")]
    pub beta_end: f64,
    #[serde(default = "dlinear")]
    pub beta_schedule: String,
    #[serde(default = "dtrue")]
    pub clip_sample: bool,
    #[serde(default = "done")]
    pub clip_sample_range: f64,
    #[serde(default = "dtrue")]
    pub set_alpha_to_one: bool,
    #[serde(default)]
    pub steps_offset: usize,
    #[serde(default = "deps")]
    pub prediction_type: String,
    #[serde(default = "dleading")]
    pub timestep_spacing: String,
    #[serde(default)]
    pub thresholding: bool,
}

fn d1000() -> usize {
    1000
}
fn dstart() -> f64 {
    0.0001
}
fn dend() -> f64 {
    0.02
}
fn dlinear() -> String {
    "linear".into()
}
fn dtrue() -> bool {
    true
}
fn done() -> f64 {
    1.0
}
fn deps() -> String {
    "epsilon".into()
}
fn dleading() -> String {
    "leading".into()
}

impl Default for DdimConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults parse")
    }
}

impl DdimConfig {
    /// The scheduler DiT-XL/2 ships with.
    pub fn dit() -> Self {
        DdimConfig {
            clip_sample: false,
            ..Self::default()
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        let c: DdimConfig = crate::checkpoint::read_json(path)?;
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        if !matches!(
            c.beta_schedule.as_str(),
            "linear" | "scaled_linear" | "squaredcos_cap_v2"
        ) {
            return bad(
                "beta_schedule",
                format!("`{}` is not supported", c.beta_schedule),
            );
        }
        if !matches!(
            c.prediction_type.as_str(),
            "epsilon" | "v_prediction" | "sample"
        ) {
            return bad(
                "prediction_type",
                format!("`{}` is not supported", c.prediction_type),
            );
        }
        if !matches!(
            c.timestep_spacing.as_str(),
            "leading" | "trailing" | "linspace"
        ) {
            return bad(
                "timestep_spacing",
                format!("`{}` is not supported", c.timestep_spacing),
            );
        }
        if c.thresholding {
            return bad(
                "thresholding",
                "dynamic thresholding is not supported".into(),
            );
        }
        crate::samplers::check_train_timesteps(path, c.num_train_timesteps)?;
        if c.steps_offset >= c.num_train_timesteps {
            // Every schedule would start past the last training timestep.
            return bad(
                "steps_offset",
                format!(
                    "{}: must be below num_train_timesteps ({})",
                    c.steps_offset, c.num_train_timesteps
                ),
            );
        }
        Ok(c)
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "_class_name": "DDIMScheduler",
            "_diffusers_version": "0.30.0",
            "num_train_timesteps": self.num_train_timesteps,
            "beta_start": self.beta_start,
            "beta_end": self.beta_end,
            "beta_schedule": self.beta_schedule,
            "clip_sample": self.clip_sample,
            "clip_sample_range": self.clip_sample_range,
            "set_alpha_to_one": self.set_alpha_to_one,
            "steps_offset": self.steps_offset,
            "prediction_type": self.prediction_type,
            "timestep_spacing": self.timestep_spacing,
            "thresholding": false,
        })
    }
}

/// A DDIM schedule for a given number of inference steps.
#[derive(Debug, Clone)]
pub struct Ddim {
    cfg: DdimConfig,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    pub timesteps: Vec<usize>,
}

impl Ddim {
    pub fn new(cfg: DdimConfig, steps: usize) -> Result<Self> {
        let n = cfg.num_train_timesteps;
        if steps == 0 || steps > n {
            return Err(Error::invalid(
                "steps",
                format!("{steps}: must be between 1 and {n}"),
            ));
        }
        let betas: Vec<f32> = match cfg.beta_schedule.as_str() {
            "linear" => linspace(cfg.beta_start as f32, cfg.beta_end as f32, n),
            "scaled_linear" => linspace(
                (cfg.beta_start as f32).sqrt(),
                (cfg.beta_end as f32).sqrt(),
                n,
            )
            .into_iter()
            .map(|b| b * b)
            .collect(),
            _ => {
                let abar = |t: f64| {
                    ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0)
                        .cos()
                        .powi(2)
                };
                (0..n)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
                        (1.0 - abar(t2) / abar(t1)).min(0.999) as f32
                    })
                    .collect()
            }
        };
        let mut acc = 1f32;
        let alphas_cumprod: Vec<f32> = betas
            .iter()
            .map(|b| {
                acc *= 1.0 - b;
                acc
            })
            .collect();
        let final_alpha_cumprod = if cfg.set_alpha_to_one {
            1.0
        } else {
            alphas_cumprod[0]
        };
        let timesteps: Vec<usize> = match cfg.timestep_spacing.as_str() {
            "leading" => {
                let ratio = n / steps;
                (0..steps)
                    .rev()
                    .map(|i| i * ratio + cfg.steps_offset)
                    .collect()
            }
            "trailing" => {
                let ratio = n as f64 / steps as f64;
                let mut v = Vec::new();
                let mut t = n as f64;
                while t > 0.0 {
                    v.push((t.round() as usize).saturating_sub(1));
                    t -= ratio;
                }
                v
            }
            _ => {
                let ls = linspace64(0.0, (n - 1) as f64, steps);
                ls.into_iter()
                    .rev()
                    .map(|x| round_half_even(x) as usize)
                    .collect()
            }
        };
        if let Some(&t) = timesteps.iter().find(|&&t| t >= n) {
            return Err(Error::invalid(
                "steps",
                format!("timestep {t} past the schedule (steps_offset too large?)"),
            ));
        }
        Ok(Ddim {
            cfg,
            alphas_cumprod,
            final_alpha_cumprod,
            timesteps,
        })
    }

    /// One DDIM update from `sample` at `timestep` given the model output.
    pub fn step(&self, model_output: &Tensor, timestep: usize, sample: &Tensor) -> Result<Tensor> {
        let n = self.cfg.num_train_timesteps;
        let prev = timestep as i64 - (n / self.timesteps.len()) as i64;
        let a_t = self.alphas_cumprod[timestep];
        let a_prev = if prev >= 0 {
            self.alphas_cumprod[prev as usize]
        } else {
            self.final_alpha_cumprod
        };
        let b_t = 1.0 - a_t;
        let (sa, sb) = (a_t.sqrt() as f64, b_t.sqrt() as f64);
        let (x0, eps) = match self.cfg.prediction_type.as_str() {
            "epsilon" => (
                ((sample - (model_output * sb)?)? / sa)?,
                model_output.clone(),
            ),
            "sample" => {
                let x0 = model_output.clone();
                let eps = ((sample - (&x0 * sa)?)? / sb)?;
                (x0, eps)
            }
            _ => (
                ((sample * sa)? - (model_output * sb)?)?,
                ((model_output * sa)? + (sample * sb)?)?,
            ),
        };
        let x0 = if self.cfg.clip_sample {
            let r = self.cfg.clip_sample_range;
            x0.clamp(-r, r)?
        } else {
            x0
        };
        let dir = (eps * ((1.0 - a_prev).sqrt() as f64))?;
        Ok(((x0 * (a_prev.sqrt() as f64))? + dir)?)
    }
}

/// torch.linspace in f32: start + i·step, with the second half computed from the end.
fn linspace(a: f32, b: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![a];
    }
    let step = (b - a) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                a + step * i as f32
            } else {
                b - step * (n - 1 - i) as f32
            }
        })
        .collect()
}

fn linspace64(a: f64, b: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![a];
    }
    (0..n)
        .map(|i| a + (b - a) * i as f64 / (n - 1) as f64)
        .collect()
}

/// numpy's round: halves go to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_timesteps_match_diffusers() {
        let d = Ddim::new(DdimConfig::dit(), 10).unwrap();
        assert_eq!(
            d.timesteps,
            vec![900, 800, 700, 600, 500, 400, 300, 200, 100, 0]
        );
        let mut c = DdimConfig::dit();
        c.timestep_spacing = "trailing".into();
        assert_eq!(Ddim::new(c, 4).unwrap().timesteps, vec![999, 749, 499, 249]);
        let mut c = DdimConfig::dit();
        c.timestep_spacing = "linspace".into();
        assert_eq!(Ddim::new(c, 4).unwrap().timesteps, vec![999, 666, 333, 0]);
    }

    #[test]
    fn alphas_cumprod_matches_torch_float32() {
        // Reference values from torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0).
        let d = Ddim::new(DdimConfig::dit(), 10).unwrap();
        assert!((d.alphas_cumprod[0] - 0.9999).abs() < 1e-7);
        assert!(
            (d.alphas_cumprod[999] - 4.0358e-5).abs() < 1e-7,
            "{}",
            d.alphas_cumprod[999]
        );
    }

    #[test]
    fn too_many_steps_is_an_error() {
        assert!(Ddim::new(DdimConfig::dit(), 1001).is_err());
        assert!(Ddim::new(DdimConfig::dit(), 0).is_err());
    }
}
