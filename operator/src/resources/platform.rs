//! What the platform gives every engine pod, whatever DiffusionDeployment it runs: the
//! chart's values, passed to the operator, beside what each spec asks for its model.

use clap::ValueEnum as _;
use k8s_openapi::api::core::v1::{EnvVar, Toleration};
use layerwise_engine::logging::{LogFormat, ENV_LOG_FORMAT};

/// What the platform gives every engine pod, whatever DiffusionDeployment it runs: the
/// chart's values, passed to the operator. Per-model settings are in the spec's `engine`
/// and `accelerator`; see [`super::deployment`] for how the two combine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnginePods {
    /// Secrets every engine pod pulls its image with (the chart's `imagePullSecrets`; each
    /// must exist in the namespace of the DiffusionDeployment).
    pub image_pull_secrets: Vec<String>,
    /// RuntimeClass of engine pods whose spec names none.
    pub runtime_class_name: Option<String>,
    /// Tolerations every engine pod carries (the taints of the platform's accelerator
    /// nodes), beside the spec's `accelerator.tolerations`.
    pub tolerations: Vec<Toleration>,
    /// How the engines write their logs: the operator's own `--log-format` (the chart's
    /// `logFormat`), so one setting covers every binary of the platform.
    pub log_format: LogFormat,
}

impl EnginePods {
    /// From the operator's flags as the chart passes them: secret names (empty ones
    /// dropped), a RuntimeClass (empty: none) and tolerations as a JSON list (empty: none).
    /// A toleration list that is not one is an error naming the flag.
    pub fn from_flags(
        image_pull_secrets: &[String],
        runtime_class_name: Option<&str>,
        tolerations: Option<&str>,
    ) -> Result<EnginePods, String> {
        let tolerations = match tolerations.map(str::trim).filter(|t| !t.is_empty()) {
            Some(json) => serde_json::from_str(json).map_err(|e| {
                format!("--engine-tolerations is not a JSON list of tolerations: {e}")
            })?,
            None => Vec::new(),
        };
        Ok(EnginePods {
            image_pull_secrets: image_pull_secrets
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            runtime_class_name: runtime_class_name
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
            tolerations,
            log_format: LogFormat::default(),
        })
    }

    /// The environment every engine container starts with, before its spec's own (which
    /// may set the same names): the engine's `--log-format` by its variable.
    pub(super) fn env(&self) -> Vec<EnvVar> {
        let format = self
            .log_format
            .to_possible_value()
            .map(|v| v.get_name().to_string());
        vec![EnvVar {
            name: ENV_LOG_FORMAT.into(),
            value: format,
            ..Default::default()
        }]
    }
}

/// `a` then what of `b` is not in it already.
pub(super) fn union<T: Clone + PartialEq>(a: &[T], b: &[T]) -> Vec<T> {
    let mut all = a.to_vec();
    for x in b {
        if !all.contains(x) {
            all.push(x.clone());
        }
    }
    all
}
