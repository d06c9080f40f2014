//! `scheduler/scheduler_config.json` of a flow-matching pipeline: reading it (choosing the
//! scheduler by `_class_name`), writing it back as diffusers does, and making one request's
//! [`Sampler`] from it. Above both schedulers: it names each of them, and neither names it.

use std::path::Path;

use super::{FlowMatchEuler, FlowMatchEulerConfig, Sampler, UniPc, UniPcConfig};
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

/// A config from the parsed document, naming the field serde stumbled on as `read_json` does.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    path: &Path,
    doc: serde_json::Value,
) -> Result<T> {
    Ok(crate::checkpoint::parse_json(path, doc)?)
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
}
