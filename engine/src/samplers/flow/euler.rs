//! diffusers' `FlowMatchEulerDiscreteScheduler`: the training schedule shifted in float32 (the
//! constructor's torch tensors), the inference schedule between its ends shifted again in
//! float64 (numpy), as diffusers does, then the Euler step `x + (σ_next − σ)·v` in float32.

use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::config_checks::{check_shift, check_terminal, refuse_sigma_variants, refuse_true};
use super::schedule::{
    check_finite, check_steps, linspace, shift_sigmas, stretch_to_terminal, terminal,
};
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

    /// The published Qwen-Image scheduler: the shift follows the image's sequence length
    /// (0.5 at 256 tokens to 0.9 at 8192, exponential), the schedule stretched to end at 0.02.
    pub fn qwen_image() -> Self {
        FlowMatchEulerConfig {
            use_dynamic_shifting: true,
            base_shift: Some(0.5),
            max_shift: Some(0.9),
            base_image_seq_len: 256,
            max_image_seq_len: 8192,
            shift_terminal: Some(0.02),
            ..Self::default()
        }
    }

    /// Refuses values whose math is not implemented here, naming the field. Dynamic shifting
    /// is refused: the pipelines that call [`Self::schedule`]'s spacing pass no `mu`.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.check(path, false)
    }

    /// [`Self::validate`] for a pipeline that passes its own sigmas and, with dynamic
    /// shifting, the `mu` of its image sequence ([`FlowMatchEuler::for_image`]).
    pub fn validate_for_image(&self, path: &Path) -> Result<()> {
        self.check(path, true)
    }

    fn check(&self, path: &Path, mu_given: bool) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        crate::samplers::check_train_timesteps(path, self.num_train_timesteps)?;
        check_shift(path, "shift", self.shift)?;
        check_terminal(path, self.shift_terminal)?;
        refuse_sigma_variants(
            path,
            self.use_karras_sigmas,
            self.use_exponential_sigmas,
            self.use_beta_sigmas,
            self.use_dynamic_shifting && !mu_given,
        )?;
        if self.use_dynamic_shifting {
            self.check_dynamic(path)?;
        }
        refuse_true(
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

    /// Whether a request of `steps` steps is one this scheduler runs (the client's part of a
    /// schedule; a schedule that still fails is the config's fault).
    pub fn check_steps(&self, steps: usize) -> Result<()> {
        check_steps(
            steps,
            self.num_train_timesteps,
            terminal(self.shift_terminal),
        )
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
        let mut s = linspace(sigma_max * n as f64, sigma_min * n as f64, steps);
        for x in &mut s {
            *x /= n as f64;
        }
        shift_sigmas(&mut s, self.shift);
        if let Some(t) = terminal(self.shift_terminal) {
            stretch_to_terminal(&mut s, t);
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

    /// The fields dynamic shifting reads must make a finite, increasing line.
    fn check_dynamic(&self, path: &Path) -> Result<()> {
        for (field, v) in [
            ("base_shift", self.base_shift),
            ("max_shift", self.max_shift),
        ] {
            if !v.is_some_and(f64::is_finite) {
                return Err(Error::config(
                    path,
                    field,
                    "must be a number: use_dynamic_shifting computes the shift from it",
                ));
            }
        }
        if self.max_image_seq_len <= self.base_image_seq_len {
            return Err(Error::config(
                path,
                "max_image_seq_len",
                format!(
                    "{}: must exceed base_image_seq_len ({})",
                    self.max_image_seq_len, self.base_image_seq_len
                ),
            ));
        }
        if self.time_shift_type == "linear" && self.mu(self.base_image_seq_len) <= 0.0 {
            return Err(Error::config(
                path,
                "base_shift",
                "a linear time shift needs a positive shift at base_image_seq_len",
            ));
        }
        Ok(())
    }

    /// The pipelines' `calculate_shift` (float64): `mu` on the line through
    /// (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift).
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        let (base, max) = (
            self.base_shift.unwrap_or(0.5),
            self.max_shift.unwrap_or(1.15),
        );
        let m = (max - base) / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = base - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }

    /// `set_timesteps(sigmas=np.linspace(1, 1/steps, steps), mu=mu)` as QwenImagePipeline
    /// calls it: the given sigmas cast to float32, then every operation in float32 (numpy
    /// keeps a float32 array float32 beside Python scalars): the time shift by `mu` with
    /// dynamic shifting (else the static shift), the terminal stretch, timesteps σ·N.
    fn image_schedule(&self, steps: usize, image_seq_len: usize) -> (Vec<f32>, Vec<f32>) {
        let nf = self.num_train_timesteps as f32;
        let given = linspace(1.0, 1.0 / steps as f64, steps);
        let mut sigmas: Vec<f32> = given.iter().map(|&x| x as f32).collect();
        if self.use_dynamic_shifting {
            let mu = self.mu(image_seq_len);
            let linear = self.time_shift_type == "linear";
            let e = if linear { mu as f32 } else { mu.exp() as f32 };
            for t in &mut sigmas {
                *t = e / (e + (1.0 / *t - 1.0));
            }
        } else {
            let shift = self.shift as f32;
            for s in &mut sigmas {
                *s = shift * *s / (1.0 + (shift - 1.0) * *s);
            }
        }
        if let Some(terminal) = terminal(self.shift_terminal) {
            let last = *sigmas.last().expect("at least one step");
            // `1 - shift_terminal` is a Python float, cast to float32 once.
            let scale = (1.0 - last) / ((1.0 - terminal) as f32);
            for s in &mut sigmas {
                *s = 1.0 - (1.0 - *s) / scale;
            }
        }
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
        check_steps(steps, cfg.num_train_timesteps, terminal(cfg.shift_terminal))?;
        let (timesteps, sigmas) = cfg.schedule(steps);
        Self::of(timesteps, sigmas, steps)
    }

    /// The schedule of an image pipeline that passes `sigmas = linspace(1, 1/steps, steps)`
    /// and the `mu` of its packed latent sequence of `image_seq_len` tokens
    /// (QwenImagePipeline): see [`FlowMatchEulerConfig::validate_for_image`].
    pub fn for_image(
        cfg: &FlowMatchEulerConfig,
        steps: usize,
        image_seq_len: usize,
    ) -> Result<Self> {
        check_steps(steps, cfg.num_train_timesteps, terminal(cfg.shift_terminal))?;
        let (timesteps, sigmas) = cfg.image_schedule(steps, image_seq_len);
        Self::of(timesteps, sigmas, steps)
    }

    fn of(timesteps: Vec<f32>, sigmas: Vec<f32>, steps: usize) -> Result<Self> {
        check_finite(&sigmas, steps)?;
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
    fn image_schedule_matches_diffusers() {
        // QwenImagePipeline on the committed fixture: 3 steps on 4x6 patches, 2 on 3x2.
        let c = FlowMatchEulerConfig::qwen_image();
        c.validate_for_image(Path::new("x")).unwrap();
        let s = FlowMatchEuler::for_image(&c, 3, 24).unwrap();
        assert_eq!(s.timesteps, vec![1000.0, 582.428_6, 19.999_98]);
        let s = FlowMatchEuler::for_image(&c, 2, 6).unwrap();
        assert_eq!(s.timesteps, vec![1000.0, 20.000_04]);
        assert_eq!(*s.sigmas.last().unwrap(), 0.0);
        // Without the terminal stretch and with a static shift, as the pipeline passes them.
        let mut c = FlowMatchEulerConfig::with_shift(3.0);
        let s = FlowMatchEuler::for_image(&c, 2, 6).unwrap();
        assert_eq!(s.sigmas, vec![1.0, 0.75, 0.0]);
        // Dynamic shifting is for the pipelines that pass `mu` only, and needs its line.
        c.use_dynamic_shifting = true;
        assert!(refused(&c).contains("`use_dynamic_shifting`"));
        c.max_image_seq_len = 256;
        let e = c
            .validate_for_image(Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`max_image_seq_len`"), "{e}");
        c.max_image_seq_len = 4096;
        c.max_shift = None;
        let e = c
            .validate_for_image(Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`max_shift`"), "{e}");
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
