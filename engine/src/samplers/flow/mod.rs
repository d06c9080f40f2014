//! Flow-matching samplers for the pipelines that save one in `scheduler/` (WanPipeline):
//! diffusers' `UniPCMultistepScheduler` with flow sigmas and `FlowMatchEulerDiscreteScheduler`.
//! Each follows its diffusers scheduler step for step, computing the schedule in float64 where
//! numpy does and in float32 where torch does, so a request samples what diffusers samples.
//! A [`Sampler`] is one request's schedule and state, driven the way the pipeline drives the
//! scheduler: `set_timesteps(steps)`, `set_begin_index(0)`, one `step` per timestep.

mod euler;
mod solve;
mod unipc;
mod unipc_config;

use std::path::Path;

use candle_core::Tensor;

pub use euler::{FlowMatchEuler, FlowMatchEulerConfig};
pub use unipc::UniPc;
pub use unipc_config::UniPcConfig;

use crate::{Error, Result};

/// The diffusers version whose `save_config` [`FlowScheduler::to_json`] writes like.
const DIFFUSERS_VERSION: &str = "0.42.1";

/// `scheduler/scheduler_config.json` of a flow-matching pipeline: which scheduler and its config.
// One per loaded model: the size of the UniPC variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum FlowScheduler {
    UniPc(UniPcConfig),
    Euler(FlowMatchEulerConfig),
}

impl FlowScheduler {
    /// Reads the config, choosing the scheduler by `_class_name`; fields this implementation
    /// cannot follow are refused by name.
    pub fn load(path: &Path) -> Result<Self> {
        let doc: serde_json::Value = crate::checkpoint::read_json(path)?;
        let class = doc
            .get("_class_name")
            .and_then(|c| c.as_str())
            .ok_or_else(|| Error::config(path, "_class_name", "missing or not a string"))?;
        let this = match class {
            "UniPCMultistepScheduler" => {
                let mut c: UniPcConfig = parse(path, doc.clone())?;
                // diffusers' constructor registers these aliases as bh2.
                if matches!(c.solver_type.as_str(), "midpoint" | "heun" | "logrho") {
                    c.solver_type = "bh2".into();
                }
                FlowScheduler::UniPc(c)
            }
            "FlowMatchEulerDiscreteScheduler" => FlowScheduler::Euler(parse(path, doc.clone())?),
            other => {
                return Err(Error::config(
                    path,
                    "_class_name",
                    format!(
                        "`{other}` is not a flow-matching scheduler this engine implements \
                         (UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler)"
                    ),
                ))
            }
        };
        this.validate(path)?;
        Ok(this)
    }

    /// Refuses values whose math is not implemented, or that diffusers itself turns into
    /// inf/NaN samples, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        match self {
            FlowScheduler::UniPc(c) => c.validate(path),
            FlowScheduler::Euler(c) => c.validate(path),
        }
    }

    /// The JSON diffusers' `save_config` writes for this scheduler.
    pub fn to_json(&self) -> serde_json::Value {
        let (class, mut v) = match self {
            FlowScheduler::UniPc(c) => ("UniPCMultistepScheduler", serde_json::to_value(c)),
            FlowScheduler::Euler(c) => ("FlowMatchEulerDiscreteScheduler", serde_json::to_value(c)),
        };
        let v = v.as_mut().expect("scheduler configs serialise");
        let m = v.as_object_mut().expect("a config is an object");
        m.insert("_class_name".into(), class.into());
        m.insert("_diffusers_version".into(), DIFFUSERS_VERSION.into());
        v.take()
    }

    pub fn num_train_timesteps(&self) -> usize {
        match self {
            FlowScheduler::UniPc(c) => c.num_train_timesteps,
            FlowScheduler::Euler(c) => c.num_train_timesteps,
        }
    }

    /// A sampler for one request of `steps` steps (1 to `num_train_timesteps`).
    pub fn sampler(&self, steps: usize) -> Result<Box<dyn Sampler>> {
        Ok(match self {
            FlowScheduler::UniPc(c) => Box::new(UniPc::new(c, steps)?),
            FlowScheduler::Euler(c) => Box::new(FlowMatchEuler::new(c, steps)?),
        })
    }
}

/// One request's schedule and sampler state.
pub trait Sampler: Send {
    /// The timesteps the model sees, in order (the `t` the pipeline passes to the transformer).
    fn timesteps(&self) -> &[f32];
    /// The noise levels: one per timestep and the final one the last step goes to.
    fn sigmas(&self) -> &[f32];
    /// One step: the model output (flow/velocity prediction) at the current timestep and the
    /// current sample → the next sample. Stateful: multistep samplers keep past outputs.
    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor>;
}

/// A config from the parsed document, naming the field serde stumbled on as `read_json` does.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    path: &Path,
    doc: serde_json::Value,
) -> Result<T> {
    serde_json::from_value(doc).map_err(|e| {
        let msg = e.to_string();
        let field = msg.split('`').nth(1).unwrap_or("(document)").to_string();
        Error::config(path, field, msg)
    })
}

/// `steps` within 1..=`num_train_timesteps`, and not one step with a terminal shift, whose
/// stretch divides 0 by 0 in diffusers.
fn check_steps(steps: usize, num_train_timesteps: usize, terminal: Option<f64>) -> Result<()> {
    if steps == 0 || steps > num_train_timesteps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: must be between 1 and num_train_timesteps ({num_train_timesteps})"),
        ));
    }
    if steps == 1 && terminal.is_some() {
        return Err(Error::invalid(
            "steps",
            "1 step with the scheduler's shift_terminal: the stretch to the terminal value is \
             0/0 (diffusers samples NaN); use at least 2",
        ));
    }
    Ok(())
}

/// A schedule whose sigmas are all finite (guards the corner cases the checks above miss).
fn check_finite(sigmas: &[f32], steps: usize) -> Result<()> {
    match sigmas.iter().find(|s| !s.is_finite()) {
        Some(s) => Err(Error::invalid(
            "steps",
            format!("the {steps}-step schedule has a non-finite sigma ({s})"),
        )),
        None => Ok(()),
    }
}

/// `shift_terminal` as diffusers tests it (`if config.shift_terminal:`): null and 0 are off.
fn terminal(shift_terminal: Option<f64>) -> Option<f64> {
    shift_terminal.filter(|&t| t != 0.0)
}

/// `shift_terminal`, when set, must leave `1 - shift_terminal` a positive divisor.
fn check_terminal(path: &Path, shift_terminal: Option<f64>) -> Result<()> {
    match terminal(shift_terminal) {
        Some(t) if !(t.is_finite() && t < 1.0) => Err(Error::config(
            path,
            "shift_terminal",
            format!("{t}: must be below 1"),
        )),
        _ => Ok(()),
    }
}

/// Refuses a switch this implementation does not compute when it is on, naming it.
fn refuse_true(path: &Path, field: &str, on: bool, why: &str) -> Result<()> {
    if on {
        return Err(Error::config(
            path,
            field,
            format!("true is not supported ({why})"),
        ));
    }
    Ok(())
}

/// Refuses the sigma schedules and the dynamic shifting that both flow schedulers parse
/// (diffusers writes them) but neither implements.
fn refuse_sigma_variants(
    path: &Path,
    karras: bool,
    exponential: bool,
    beta: bool,
    dynamic_shifting: bool,
) -> Result<()> {
    for (field, on, why) in [
        ("use_karras_sigmas", karras, "Karras sigmas"),
        ("use_exponential_sigmas", exponential, "exponential sigmas"),
        ("use_beta_sigmas", beta, "beta sigmas"),
        (
            "use_dynamic_shifting",
            dynamic_shifting,
            "it needs a `mu` the pipeline never passes",
        ),
    ] {
        refuse_true(path, field, on, why)?;
    }
    Ok(())
}

/// A shift (`flow_shift`, `shift`) must be a positive number.
fn check_shift(path: &Path, field: &str, shift: f64) -> Result<()> {
    if shift.is_finite() && shift > 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            path,
            field,
            format!("{shift}: must be positive"),
        ))
    }
}

/// `np.linspace(start, stop, num)` in float64: `i * step + start`, the last element `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num <= 1 {
        return vec![start; num];
    }
    let div = (num - 1) as f64;
    let delta = stop - start;
    let step = delta / div;
    let mut y: Vec<f64> = (0..num)
        .map(|i| {
            // numpy divides first when the step underflows to zero.
            let v = if step == 0.0 {
                i as f64 / div * delta
            } else {
                i as f64 * step
            };
            v + start
        })
        .collect();
    y[num - 1] = stop;
    y
}

/// The static flow shift `shift·σ / (1 + (shift − 1)·σ)` in float64 (numpy).
fn shift_sigmas(sigmas: &mut [f64], shift: f64) {
    for s in sigmas {
        *s = shift * *s / (1.0 + (shift - 1.0) * *s);
    }
}

/// diffusers' `stretch_shift_to_terminal` in float64: rescales `1 − σ` so the last sigma
/// lands on `terminal`.
fn stretch_to_terminal(sigmas: &mut [f64], terminal: f64) {
    let Some(&last) = sigmas.last() else { return };
    let scale = (1.0 - last) / (1.0 - terminal);
    for s in sigmas {
        *s = 1.0 - ((1.0 - *s) / scale);
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

    fn write(dir: &Path, doc: serde_json::Value) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join("scheduler_config.json");
        std::fs::write(&p, doc.to_string()).unwrap();
        p
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("layerwise-flow-{}-{name}", std::process::id()))
    }

    #[test]
    fn load_chooses_by_class_and_refuses_others_by_name() {
        let wan = FlowScheduler::UniPc(UniPcConfig::wan(5.0));
        let p = write(&tmp("unipc"), wan.to_json());
        assert_eq!(FlowScheduler::load(&p).unwrap(), wan);
        let euler = FlowScheduler::Euler(FlowMatchEulerConfig::with_shift(3.0));
        let p = write(&tmp("euler"), euler.to_json());
        assert_eq!(FlowScheduler::load(&p).unwrap(), euler);
        assert_eq!(FlowScheduler::load(&p).unwrap().num_train_timesteps(), 1000);

        let p = write(
            &tmp("ddim"),
            serde_json::json!({"_class_name": "DDIMScheduler"}),
        );
        let e = FlowScheduler::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("`_class_name`") && e.contains("DDIMScheduler"),
            "{e}"
        );
        let p = write(&tmp("none"), serde_json::json!({"shift": 3.0}));
        let e = FlowScheduler::load(&p).unwrap_err().to_string();
        assert!(e.contains("`_class_name`"), "{e}");
        let mut doc = euler.to_json();
        doc["shift"] = "three".into();
        let p = write(&tmp("badtype"), doc);
        let e = FlowScheduler::load(&p).unwrap_err().to_string();
        assert!(e.contains("scheduler_config.json"), "{e}");
    }

    #[test]
    fn load_reads_bh2_aliases_as_bh2() {
        let mut doc = FlowScheduler::UniPc(UniPcConfig::wan(3.0)).to_json();
        doc["solver_type"] = "midpoint".into();
        let p = write(&tmp("midpoint"), doc);
        assert_eq!(
            FlowScheduler::load(&p).unwrap(),
            FlowScheduler::UniPc(UniPcConfig::wan(3.0))
        );
    }

    #[test]
    fn load_refuses_what_validate_refuses() {
        let mut doc = FlowScheduler::UniPc(UniPcConfig::wan(3.0)).to_json();
        doc["use_karras_sigmas"] = true.into();
        let p = write(&tmp("karras"), doc);
        let e = FlowScheduler::load(&p).unwrap_err().to_string();
        assert!(e.contains("`use_karras_sigmas`"), "{e}");
    }

    #[test]
    fn steps_are_bounded_by_the_config() {
        let s = FlowScheduler::UniPc(UniPcConfig::wan(3.0));
        assert!(s.sampler(1).is_ok() && s.sampler(1000).is_ok());
        for bad in [0, 1001] {
            let e = s.sampler(bad).err().unwrap().to_string();
            assert!(
                e.contains("steps") && e.contains("num_train_timesteps"),
                "{e}"
            );
        }
        let mut c = FlowMatchEulerConfig::with_shift(3.0);
        c.shift_terminal = Some(0.1);
        let s = FlowScheduler::Euler(c);
        assert!(s
            .sampler(1)
            .err()
            .unwrap()
            .to_string()
            .contains("shift_terminal"));
        assert!(s.sampler(2).is_ok());
    }

    #[test]
    fn linspace_is_numpys() {
        // np.linspace(1, 0.001, 5) and np.linspace(1000.0, 2.994012087583542, 3).
        assert_eq!(
            linspace(1.0, 0.001, 5),
            vec![1.0, 0.75025, 0.5005, 0.25075000000000003, 0.001]
        );
        assert_eq!(
            linspace(1000.0, 2.994012087583542, 3),
            vec![1000.0, 501.49700604379177, 2.994012087583542]
        );
        assert_eq!(linspace(7.0, 1.0, 1), vec![7.0]);
    }

    #[test]
    fn terminal_stretch_ends_on_the_terminal_value() {
        let mut s = vec![0.9, 0.5, 0.2];
        stretch_to_terminal(&mut s, 0.1);
        // numpy: [0.8875000000000001, 0.4375, 0.09999999999999998].
        assert_eq!(s, vec![0.8875000000000001, 0.4375, 0.09999999999999998]);
        assert_eq!(terminal(Some(0.0)), None);
        assert_eq!(terminal(None), None);
    }
}
