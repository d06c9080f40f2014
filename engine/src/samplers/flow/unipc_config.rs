//! `UniPCMultistepScheduler`'s saved config: every field diffusers writes, with its defaults,
//! the refusal of what the flow sampler does not compute, and `set_timesteps` with flow sigmas
//! (float64 as numpy, int64 timesteps).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::config_checks::{check_shift, check_terminal, refuse_sigma_variants, refuse_true};
use super::schedule::{linspace, shift_sigmas, stretch_to_terminal, terminal};
use crate::{Error, Result};

/// `scheduler/scheduler_config.json` of a `UniPCMultistepScheduler`, with diffusers' defaults
/// (which are not a flow config: see [`UniPcConfig::wan`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UniPcConfig {
    #[serde(default = "d1000")]
    pub num_train_timesteps: usize,
    #[serde(default = "dbeta_start")]
    pub beta_start: f64,
    #[serde(default = "dbeta_end")]
    pub beta_end: f64,
    #[serde(default = "dlinear")]
    pub beta_schedule: String,
    #[serde(default)]
    pub trained_betas: Option<Vec<f64>>,
    #[serde(default = "d2")]
    pub solver_order: usize,
    #[serde(default = "depsilon")]
    pub prediction_type: String,
    #[serde(default)]
    pub thresholding: bool,
    #[serde(default = "dratio")]
    pub dynamic_thresholding_ratio: f64,
    #[serde(default = "d1f")]
    pub sample_max_value: f64,
    #[serde(default = "dtrue")]
    pub predict_x0: bool,
    #[serde(default = "dbh2")]
    pub solver_type: String,
    #[serde(default = "dtrue")]
    pub lower_order_final: bool,
    #[serde(default)]
    pub disable_corrector: Vec<i64>,
    #[serde(default)]
    pub solver_p: Option<serde_json::Value>,
    #[serde(default)]
    pub use_karras_sigmas: bool,
    #[serde(default)]
    pub use_exponential_sigmas: bool,
    #[serde(default)]
    pub use_beta_sigmas: bool,
    #[serde(default)]
    pub use_flow_sigmas: bool,
    #[serde(default = "d1f")]
    pub flow_shift: f64,
    #[serde(default = "dlinspace")]
    pub timestep_spacing: String,
    #[serde(default)]
    pub steps_offset: usize,
    #[serde(default = "dzero")]
    pub final_sigmas_type: String,
    #[serde(default)]
    pub rescale_betas_zero_snr: bool,
    #[serde(default)]
    pub use_dynamic_shifting: bool,
    #[serde(default = "dexponential")]
    pub time_shift_type: String,
    #[serde(default)]
    pub sigma_min: Option<f64>,
    #[serde(default)]
    pub sigma_max: Option<f64>,
    #[serde(default)]
    pub shift_terminal: Option<f64>,
}

fn d1000() -> usize {
    1000
}
fn dbeta_start() -> f64 {
    0.0001
}
fn dbeta_end() -> f64 {
    0.02
}
fn dlinear() -> String {
    "linear".into()
}
fn d2() -> usize {
    2
}
fn depsilon() -> String {
    "epsilon".into()
}
fn dratio() -> f64 {
    0.995
}
fn d1f() -> f64 {
    1.0
}
fn dtrue() -> bool {
    true
}
fn dbh2() -> String {
    "bh2".into()
}
fn dlinspace() -> String {
    "linspace".into()
}
fn dzero() -> String {
    "zero".into()
}
fn dexponential() -> String {
    "exponential".into()
}

impl Default for UniPcConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("defaults parse")
    }
}

impl UniPcConfig {
    /// The scheduler the published Wan 2.1 / 2.2 text-to-video folders save: flow_shift 3.0
    /// (480p) or 5.0 (720p).
    pub fn wan(flow_shift: f64) -> Self {
        UniPcConfig {
            prediction_type: "flow_prediction".into(),
            use_flow_sigmas: true,
            flow_shift,
            ..Self::default()
        }
    }

    /// Refuses values whose math is not implemented here, or that make diffusers sample
    /// inf/NaN, naming the field. diffusers' aliases of `bh2` (`midpoint`, `heun`, `logrho`)
    /// must be normalised first, as [`super::FlowScheduler::load`] does.
    pub fn validate(&self, path: &Path) -> Result<()> {
        crate::samplers::check_train_timesteps(path, self.num_train_timesteps)?;
        self.validate_flow(path)?;
        self.validate_solver(path)?;
        self.validate_last_step(path)
    }

    /// The betas, the prediction and the sigmas: only flow matching's, as diffusers
    /// computes them, is implemented.
    fn validate_flow(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        if self.trained_betas.is_none()
            && !matches!(
                self.beta_schedule.as_str(),
                "linear" | "scaled_linear" | "squaredcos_cap_v2"
            )
        {
            return bad(
                "beta_schedule",
                format!("`{}` is not a diffusers beta schedule", self.beta_schedule),
            );
        }
        if self.prediction_type != "flow_prediction" {
            return bad(
                "prediction_type",
                format!(
                    "`{}` is not supported: only flow_prediction is implemented",
                    self.prediction_type
                ),
            );
        }
        if !self.use_flow_sigmas {
            return bad(
                "use_flow_sigmas",
                "false is not supported: only flow sigmas are implemented".into(),
            );
        }
        if !self.predict_x0 {
            return bad(
                "predict_x0",
                "false is not supported with flow_prediction".into(),
            );
        }
        refuse_true(
            path,
            "thresholding",
            self.thresholding,
            "dynamic thresholding",
        )?;
        refuse_sigma_variants(
            path,
            self.use_karras_sigmas,
            self.use_exponential_sigmas,
            self.use_beta_sigmas,
            self.use_dynamic_shifting,
        )
    }

    /// The solver and its time steps: no external predictor, an order, the shift, the
    /// spacing.
    fn validate_solver(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        if self.solver_p.as_ref().is_some_and(|p| !p.is_null()) {
            return bad("solver_p", "an external predictor is not supported".into());
        }
        if self.solver_order == 0 {
            return bad("solver_order", "must be at least 1".into());
        }
        check_shift(path, "flow_shift", self.flow_shift)?;
        check_terminal(path, self.shift_terminal)?;
        if !matches!(
            self.timestep_spacing.as_str(),
            "linspace" | "leading" | "trailing"
        ) {
            return bad(
                "timestep_spacing",
                format!("`{}` is not supported", self.timestep_spacing),
            );
        }
        Ok(())
    }

    /// The last step: a final sigma and solver type implemented here, and none of the
    /// combinations that make diffusers sample inf or NaN there.
    fn validate_last_step(&self, path: &Path) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(path, f, m));
        let zero = match self.final_sigmas_type.as_str() {
            "zero" => true,
            "sigma_min" => false,
            other => return bad("final_sigmas_type", format!("`{other}` is not supported")),
        };
        let bh2 = match self.solver_type.as_str() {
            "bh2" => true,
            "bh1" => false,
            other => return bad("solver_type", format!("`{other}` is not supported")),
        };
        // The last step to sigma 0 has h = inf: bh1's B(h) = -inf times a zero residual, or a
        // second-order predictor's (m1 - m0) / -0, is what diffusers samples then.
        if zero && !bh2 {
            return bad(
                "solver_type",
                "bh1 with final_sigmas_type zero samples NaN in diffusers (B(h) = -inf on the \
                 last step); use bh2 or final_sigmas_type sigma_min"
                    .into(),
            );
        }
        if zero && !self.lower_order_final && self.solver_order >= 2 {
            return bad(
                "lower_order_final",
                "false with final_sigmas_type zero samples inf in diffusers (a higher-order \
                 last step to sigma 0)"
                    .into(),
            );
        }
        // With sigma_min the last step has h = 0; a third-order predictor there solves a
        // system of NaNs.
        if !zero && !self.lower_order_final && self.solver_order >= 3 {
            return bad(
                "lower_order_final",
                "false with final_sigmas_type sigma_min and solver_order >= 3 samples NaN in \
                 diffusers"
                    .into(),
            );
        }
        Ok(())
    }

    /// `set_timesteps(steps)` with flow sigmas: (timesteps, sigmas).
    pub(super) fn schedule(&self, steps: usize) -> (Vec<f32>, Vec<f32>) {
        let n = self.num_train_timesteps as f64;
        let mut s = linspace(1.0, 1.0 / n, steps + 1);
        s.pop();
        shift_sigmas(&mut s, self.flow_shift);
        if let Some(t) = terminal(self.shift_terminal) {
            stretch_to_terminal(&mut s, t);
        }
        // diffusers keeps the first sigma off 1 so that log(alpha) stays finite.
        if (s[0] - 1.0).abs() < 1e-6 {
            s[0] -= 1e-6;
        }
        // float64 timesteps truncated to int64 (`astype` after `sigmas * num_train_timesteps`).
        let timesteps = s.iter().map(|x| (x * n).trunc() as i64 as f32).collect();
        let last = if self.final_sigmas_type == "zero" {
            0.0
        } else {
            s[s.len() - 1]
        };
        let sigmas = s.iter().chain([&last]).map(|&x| x as f32).collect();
        (timesteps, sigmas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Edit = fn(&mut UniPcConfig);

    fn refused(c: &UniPcConfig) -> String {
        c.validate(Path::new("scheduler_config.json"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn defaults_are_diffusers_and_not_a_flow_config() {
        let d = UniPcConfig::default();
        assert_eq!(d.num_train_timesteps, 1000);
        assert_eq!(d.solver_order, 2);
        assert_eq!(d.solver_type, "bh2");
        assert_eq!(d.flow_shift, 1.0);
        assert!(d.predict_x0 && d.lower_order_final && !d.use_flow_sigmas);
        assert_eq!(d.final_sigmas_type, "zero");
        assert_eq!(d.timestep_spacing, "linspace");
        assert!(refused(&d).contains("`prediction_type`"));
        UniPcConfig::wan(3.0)
            .validate(Path::new("scheduler_config.json"))
            .unwrap();
    }

    #[test]
    fn refusals_name_the_field() {
        let cases: Vec<(&str, Edit)> = vec![
            ("use_flow_sigmas", |c| c.use_flow_sigmas = false),
            ("predict_x0", |c| c.predict_x0 = false),
            ("thresholding", |c| c.thresholding = true),
            ("use_karras_sigmas", |c| c.use_karras_sigmas = true),
            ("use_exponential_sigmas", |c| {
                c.use_exponential_sigmas = true
            }),
            ("use_beta_sigmas", |c| c.use_beta_sigmas = true),
            ("use_dynamic_shifting", |c| c.use_dynamic_shifting = true),
            ("solver_p", |c| c.solver_p = Some(serde_json::json!({}))),
            ("solver_order", |c| c.solver_order = 0),
            ("flow_shift", |c| c.flow_shift = 0.0),
            ("shift_terminal", |c| c.shift_terminal = Some(1.0)),
            ("timestep_spacing", |c| c.timestep_spacing = "karras".into()),
            ("final_sigmas_type", |c| c.final_sigmas_type = "one".into()),
            ("solver_type", |c| c.solver_type = "bh3".into()),
            ("solver_type", |c| c.solver_type = "bh1".into()),
            ("lower_order_final", |c| c.lower_order_final = false),
            ("beta_schedule", |c| c.beta_schedule = "cosine".into()),
            ("num_train_timesteps", |c| c.num_train_timesteps = 0),
        ];
        for (field, edit) in cases {
            let mut c = UniPcConfig::wan(3.0);
            edit(&mut c);
            let e = refused(&c);
            assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
        }
        let mut c = UniPcConfig::wan(3.0);
        c.final_sigmas_type = "sigma_min".into();
        c.lower_order_final = false;
        c.validate(Path::new("x")).unwrap();
        c.solver_order = 3;
        assert!(refused(&c).contains("`lower_order_final`"));
    }
}
