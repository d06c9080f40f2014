//! Types both kinds share: where a model's files are, and the strategy names.

use kube::KubeSchema;
use layerwise_core::Strategy;
use serde::{Deserialize, Serialize};

use crate::source::{ClaimMode, S3Source};

/// Where a model's pipeline folder is: exactly one source of `hostPath`,
/// `persistentVolumeClaim` and `s3`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.hostPath), has(self.persistentVolumeClaim), has(self.s3)].filter(x, x).size() == 1").message("set exactly one source: hostPath, persistentVolumeClaim or s3"))]
#[x_kube(validation = Rule::new("!has(self.revision) || !has(self.s3)").message("revision names a snapshot of a Hugging Face hub cache folder (hostPath or persistentVolumeClaim), not of s3"))]
pub struct ModelLocation {
    /// Absolute path of the pipeline folder on every node that may run the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("hostPath must be an absolute path (start with /)"))]
    #[schemars(length(max = 1024))]
    pub host_path: Option<String>,
    /// A PersistentVolumeClaim (in the deployment's namespace) holding the pipeline folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PvcSource>,
    /// A pipeline folder in an S3-compatible object store, copied into each node's model
    /// cache by its agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Boxed: every node's requests carry a location, most of them without it.
    pub s3: Option<Box<S3Source>>,
    /// Set where the folder (`hostPath`, or the claim's `subPath`) is a Hugging Face hub cache
    /// repository (`models--org--name`, holding `blobs/`, `refs/` and `snapshots/`): the
    /// pipeline is its snapshot at this revision, a commit hash (`snapshots/<commit>`) or a
    /// branch or tag whose commit `refs/<revision>` names (`main`). The whole repository
    /// folder is mounted, so the snapshot's links into `blobs/` resolve, and the engine reads
    /// only inside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9][A-Za-z0-9._-]*$')").message("revision must be a commit hash or a ref name: letters, digits, '.', '_' and '-', starting with a letter or digit"))]
    #[schemars(length(min = 1, max = 128))]
    pub revision: Option<String>,
}

/// A PersistentVolumeClaim and the folder inside it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Folder inside the volume, relative (no leading `/`, no `..`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')").message("subPath must be relative and must not contain '..'"))]
    #[schemars(length(max = 1024))]
    pub sub_path: Option<String>,
    /// How the engine pods read the claim's files: `InPlace` (mounted read-only) or
    /// `Staged` (copied into the node model cache).
    #[serde(default)]
    pub mode: ClaimMode,
}

/// Whether the host path `path` lies inside one of `roots`, judged by path components:
/// absolute, no `..`, and under a root (`/models2` is not under `/models`). No roots: any
/// absolute path without `..`. The operator refuses a DiffusionDeployment whose model lies
/// outside the roots the chart configures, and the agent checks the same before it reads.
pub fn within_roots(path: &str, roots: &[String]) -> bool {
    use std::path::{Component, Path};
    let p = Path::new(path);
    if !p.is_absolute() || p.components().any(|c| c == Component::ParentDir) {
        return false;
    }
    roots.is_empty() || roots.iter().any(|r| p.starts_with(Path::new(r)))
}

impl ModelLocation {
    /// A short human form: the host path, or `pvc:<claim>/<subPath>`, and `@<revision>` for
    /// a hub cache repository.
    pub fn describe(&self) -> String {
        let at = self
            .revision
            .as_ref()
            .map(|r| format!("@{r}"))
            .unwrap_or_default();
        format!("{}{at}", self.describe_folder())
    }

    /// The folder named, without the revision.
    fn describe_folder(&self) -> String {
        match (&self.host_path, &self.persistent_volume_claim) {
            (Some(p), _) => p.clone(),
            (None, Some(pvc)) => format!(
                "pvc:{}/{}",
                pvc.claim_name,
                pvc.sub_path.as_deref().unwrap_or("")
            ),
            (None, None) => match &self.s3 {
                Some(s3) => s3.describe(),
                None => "<none>".into(),
            },
        }
    }
}

/// `spec.strategy`: `auto` lets the planner choose, or one of the engine's strategies
/// ([`Strategy`], docs/architecture.md's table). Written as the strategy's name or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum StrategyChoice {
    #[default]
    Auto,
    Fixed(Strategy),
}

impl StrategyChoice {
    /// Its name: `auto` or the strategy's.
    pub fn as_str(self) -> &'static str {
        match self {
            StrategyChoice::Auto => "auto",
            StrategyChoice::Fixed(s) => s.as_str(),
        }
    }
}

impl Serialize for StrategyChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for StrategyChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        if name == "auto" {
            return Ok(StrategyChoice::Auto);
        }
        name.parse().map(StrategyChoice::Fixed).map_err(|_| {
            serde::de::Error::custom(format!(
                "unknown strategy `{name}`: expected auto, {}",
                strategy_names().join(", ")
            ))
        })
    }
}

fn strategy_names() -> Vec<&'static str> {
    Strategy::ALL.iter().map(|s| s.as_str()).collect()
}

impl schemars::JsonSchema for StrategyChoice {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "StrategyChoice".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let mut names = vec!["auto"];
        names.extend(strategy_names());
        schemars::json_schema!({ "type": "string", "enum": names })
    }
}

#[cfg(test)]
mod roots_tests {
    use super::within_roots;

    #[test]
    fn paths_are_within_roots_by_component() {
        let roots = vec!["/models".to_string(), "/data/ckpt/".to_string()];
        for (path, inside) in [
            ("/models/wan", true),
            ("/models", true),
            ("/data/ckpt/a/b", true),
            ("/models2/wan", false),
            ("/etc", false),
            ("/models/../etc", false),
            ("models/wan", false),
            ("/", false),
        ] {
            assert_eq!(within_roots(path, &roots), inside, "{path}");
        }
        assert!(within_roots("/anywhere", &[]));
        assert!(!within_roots("/a/../b", &[]));
    }
}

#[cfg(test)]
mod strategy_tests {
    use super::{Strategy, StrategyChoice};

    #[test]
    fn a_choice_is_auto_or_an_engine_strategy_by_name() {
        for s in Strategy::ALL {
            let json = serde_json::to_value(StrategyChoice::Fixed(s)).unwrap();
            assert_eq!(json, s.as_str());
            assert_eq!(
                serde_json::from_value::<StrategyChoice>(json).unwrap(),
                StrategyChoice::Fixed(s)
            );
        }
        assert_eq!(
            serde_json::from_value::<StrategyChoice>("auto".into()).unwrap(),
            StrategyChoice::Auto
        );
        let e = serde_json::from_value::<StrategyChoice>("fastest".into())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fastest") && e.contains("offload-sharded"),
            "{e}"
        );
    }
}
