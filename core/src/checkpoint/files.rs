//! How every file of a model folder is read: only regular files (a FIFO or a device would
//! never end), only inside the model roots once the process is [`confine`]d, and a config,
//! index or tokenizer file only up to [`MAX_SMALL_FILE`] bytes. The one gate all readers of
//! a folder pass through, so a checkpoint cannot lead a reader elsewhere.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The largest config, index or tokenizer file read (UMT5's `tokenizer.json` is 16 MiB).
pub const MAX_SMALL_FILE: u64 = 64 << 20;

/// The folders this process may read model files from, once [`confine`] set them.
static ROOTS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

/// Confines every model file this process reads to `roots` for the rest of its life: a file
/// whose path, its symlinks followed, lies outside all of them is refused by
/// [`regular_file`], which every reader of a model folder goes through. A process serving
/// models for others calls it once at start (the engine's `--model-roots`, the agent's
/// profiler); unconfined, files may lead anywhere (a Hugging Face cache's snapshot links).
/// The roots must exist; confining again to other roots is an error.
pub fn confine(roots: &[PathBuf]) -> Result<()> {
    let mut real = roots
        .iter()
        .map(|r| r.canonicalize().map_err(|e| Error::io(r, e)))
        .collect::<Result<Vec<_>>>()?;
    real.sort();
    real.dedup();
    let set = ROOTS.get_or_init(|| real.clone());
    if *set != real {
        return Err(Error::Invalid {
            field: "model roots".into(),
            msg: format!("already confined to {set:?}, not {real:?}"),
        });
    }
    Ok(())
}

/// Refuses `path` when the process is confined and the file it leads to lies outside every
/// root. The error names the file and the roots, never where the link points.
fn within_roots(path: &Path) -> Result<()> {
    let Some(roots) = ROOTS.get() else {
        return Ok(());
    };
    let real = path.canonicalize().map_err(|e| Error::io(path, e))?;
    if roots.iter().any(|r| real.starts_with(r)) {
        return Ok(());
    }
    let names: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    Err(Error::checkpoint(
        path,
        format!(
            "leads outside the model roots ({}) through a symlink; a model's files must stay inside them",
            names.join(", ")
        ),
    ))
}

/// Checks that `path` (its symlinks followed) is a regular file, as every file of a model
/// folder must be: a FIFO would block the reader forever and a device (`/dev/zero`) never
/// ends; and that it lies inside the model roots when the process is [`confine`]d. Returns
/// its length.
pub fn regular_file(path: &Path) -> Result<u64> {
    within_roots(path)?;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        return Err(Error::checkpoint(
            path,
            format!("{what}; a model folder holds files"),
        ));
    }
    Ok(meta.len())
}

/// Reads a config, index or tokenizer file whole: a regular file of at most
/// [`MAX_SMALL_FILE`] bytes (checked again while reading, should it grow).
pub fn read_small(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let len = regular_file(path)?;
    let too_big = || {
        Error::checkpoint(
            path,
            format!("over {MAX_SMALL_FILE} bytes: too large for a config, index or tokenizer file"),
        )
    };
    if len > MAX_SMALL_FILE {
        return Err(too_big());
    }
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_SMALL_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Reads and parses a JSON config file, naming the file and the field on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = read_small(path)?;
    let mut de = serde_json::Deserializer::from_slice(&text);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| config_error(path, e))?;
    // Anything after the document (`{} {}`) is as corrupt as no document.
    de.end()
        .map_err(|e| Error::config(path, "(document)", e.to_string()))?;
    Ok(value)
}

/// Parses a config document already read as JSON, naming the file and the field on failure.
pub fn parse_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    doc: serde_json::Value,
) -> Result<T> {
    serde_path_to_error::deserialize(doc).map_err(|e| config_error(path, e))
}

/// The config error of a failed parse: the field is the path to the value at fault
/// (`text_config.rope_scaling.mrope_section`), or the field serde names as missing or
/// unknown at the top level; `(document)` only for a file that is not JSON at all.
fn config_error(path: &Path, e: serde_path_to_error::Error<serde_json::Error>) -> Error {
    let at = e.path().to_string();
    let inner = e.into_inner();
    let msg = inner.to_string();
    let named = || {
        let quoted = msg.split('`').nth(1)?;
        (msg.starts_with("missing field") || msg.starts_with("unknown field"))
            .then(|| quoted.to_string())
    };
    let field = match at.as_str() {
        "." | "" => named().unwrap_or_else(|| "(document)".into()),
        _ => match named() {
            // A missing field inside a nested object: its full path.
            Some(f) => format!("{at}.{f}"),
            None => at,
        },
    };
    Error::config(path, field, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Inner {
        mrope_section: Vec<usize>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Config {
        num_layers: usize,
        #[serde(default)]
        kind: Option<Kind>,
        #[serde(default)]
        rope: Option<Inner>,
    }

    #[derive(serde::Deserialize, Debug)]
    #[serde(rename_all = "lowercase")]
    enum Kind {
        Exponential,
    }

    fn field(text: &str) -> String {
        let dir = std::env::temp_dir().join(format!("layerwise-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("c{}.json", text.len()));
        std::fs::write(&p, text).unwrap();
        match read_json::<Config>(&p).unwrap_err() {
            Error::Config { field, path, .. } => {
                assert_eq!(path, p);
                field
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn type_errors_name_the_field_not_the_value_or_the_document() {
        assert_eq!(field(r#"{"num_layers": "two"}"#), "num_layers");
        assert_eq!(field(r#"{"num_layers": 2, "kind": "linear"}"#), "kind");
        assert_eq!(
            field(r#"{"num_layers": 2, "rope": {"mrope_section": [1, "x"]}}"#),
            "rope.mrope_section[1]"
        );
        assert_eq!(
            field(r#"{"num_layers": 2, "rope": {}}"#),
            "rope.mrope_section"
        );
        assert_eq!(field(r#"{}"#), "num_layers");
        assert_eq!(field(r#"not json"#), "(document)");
        assert_eq!(field(r#""a string""#), "(document)");
    }
}
