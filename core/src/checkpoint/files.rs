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

/// Reads and parses a JSON config file, naming the file on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = read_small(path)?;
    serde_json::from_slice(&text).map_err(|e| {
        let field = e.to_string();
        Error::config(
            path,
            field.split('`').nth(1).unwrap_or("(document)"),
            e.to_string(),
        )
    })
}
