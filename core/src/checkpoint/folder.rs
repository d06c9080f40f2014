//! A diffusers pipeline folder: checking `model_index.json` (a transformer and a vae, the
//! pipeline class, DiT's class labels) and the paths of the components inside it.

use std::path::{Path, PathBuf};

use super::files::read_small;
use crate::{Error, Result};

/// The paths of a diffusers model folder.
#[derive(Debug, Clone)]
pub struct ModelFolder {
    pub root: PathBuf,
    /// The pipeline class `model_index.json` names (`_class_name`), if it names one.
    pub class_name: Option<String>,
    /// Class names by label, as diffusers' `DiTPipeline` keeps them (`id2label`: each
    /// value one or more comma-separated names); empty when the folder has none.
    pub id2label: std::collections::BTreeMap<u32, String>,
}

impl ModelFolder {
    /// Checks that `root` looks like a diffusers pipeline folder.
    pub fn new(root: &Path) -> Result<ModelFolder> {
        let index = root.join("model_index.json");
        if !index.is_file() {
            return Err(Error::checkpoint(
                root,
                "no model_index.json: not a diffusers model folder",
            ));
        }
        let text = read_small(&index)?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| Error::checkpoint(&index, format!("not valid JSON: {e}")))?;
        for part in ["transformer", "vae"] {
            if v.get(part).is_none() {
                return Err(Error::config(
                    &index,
                    part,
                    "missing; this pipeline needs a transformer and a vae",
                ));
            }
        }
        let class_name = match v.get("_class_name") {
            None => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(Error::config(
                    &index,
                    "_class_name",
                    format!("{other} is not a pipeline class name"),
                ))
            }
        };
        let mut id2label = std::collections::BTreeMap::new();
        if let Some(map) = v.get("id2label").filter(|m| !m.is_null()) {
            let bad = |msg: String| Error::config(&index, "id2label", msg);
            let map = map
                .as_object()
                .ok_or_else(|| bad(format!("{map}: expected an object of label: names")))?;
            for (k, name) in map {
                let label = k
                    .parse::<u32>()
                    .map_err(|_| bad(format!("key `{k}` is not a class label")))?;
                let name = name
                    .as_str()
                    .ok_or_else(|| bad(format!("label {k}: {name} is not a string")))?;
                id2label.insert(label, name.to_string());
            }
        }
        Ok(ModelFolder {
            root: root.to_path_buf(),
            class_name,
            id2label,
        })
    }
    pub fn transformer(&self) -> PathBuf {
        self.root.join("transformer")
    }
    pub fn vae(&self) -> PathBuf {
        self.root.join("vae")
    }
    pub fn scheduler_config(&self) -> PathBuf {
        self.root.join("scheduler").join("scheduler_config.json")
    }
}
