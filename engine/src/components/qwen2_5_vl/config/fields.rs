//! The typed reading of one JSON object's language-model fields, each error naming the
//! field under its prefix, absent fields at transformers' defaults.

use std::path::Path;

use serde_json::Value;

use crate::{Error, Result};

/// Reads the language model's fields of one JSON object, naming `{prefix}{field}` in
/// errors; absent (or `null`) fields take transformers 5.24's defaults
/// (`Qwen2_5_VLTextConfig`).
pub(super) struct Fields<'a> {
    pub(super) obj: &'a serde_json::Map<String, Value>,
    pub(super) path: &'a Path,
    pub(super) prefix: String,
}

impl Fields<'_> {
    pub(super) fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub(super) fn error(&self, name: &str, msg: impl Into<String>) -> Error {
        Error::config(self.path, format!("{}{name}", self.prefix), msg)
    }

    pub(super) fn usize(&self, name: &str, default: usize) -> Result<usize> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.error(name, format!("{v}: want a count"))),
        }
    }

    pub(super) fn f64(&self, name: &str) -> Result<Option<f64>> {
        self.get(name)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.error(name, format!("{v}: want a number")))
            })
            .transpose()
    }

    pub(super) fn string(&self, name: &str) -> Result<Option<&str>> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.error(name, format!("{v}: want a string")))
            })
            .transpose()
    }

    pub(super) fn object(&self, name: &str) -> Result<Option<Fields<'_>>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                obj,
                path: self.path,
                prefix: format!("{}{name}.", self.prefix),
            })),
            Some(v) => Err(self.error(name, format!("{v}: want an object"))),
        }
    }
}
