//! A synthetic pipeline laid out as a Hugging Face hub cache repository, the way the hub's
//! own download tools leave it: each file's bytes once under `blobs/<sha256>`, the pipeline
//! as `snapshots/<commit>/…` whose files are relative symlinks (`../../blobs/…`, one more
//! `../` per folder level), and `refs/main` naming the commit. Tests serve and profile this
//! layout without downloading a repository.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Moves the pipeline folder `pipeline` into a new hub cache repository folder `repo` at
/// `commit` (`refs/main` names it) and returns the snapshot folder. Every regular file
/// becomes a blob and a relative link to it; folders stay folders.
pub fn into_hub_cache(pipeline: &Path, repo: &Path, commit: &str) -> io::Result<PathBuf> {
    let blobs = repo.join("blobs");
    let snapshot = repo.join("snapshots").join(commit);
    fs::create_dir_all(&blobs)?;
    fs::create_dir_all(repo.join("refs"))?;
    fs::create_dir_all(&snapshot)?;
    link_tree(pipeline, &snapshot, &blobs, 2)?;
    fs::write(repo.join("refs").join("main"), commit)?;
    fs::remove_dir_all(pipeline)?;
    Ok(snapshot)
}

/// Lays `from`'s files into `blobs` and links them from `to`, `depth` folders below the
/// repository folder.
fn link_tree(from: &Path, to: &Path, blobs: &Path, depth: usize) -> io::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(from)?.collect::<io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            fs::create_dir_all(&dest)?;
            link_tree(&path, &dest, blobs, depth + 1)?;
            continue;
        }
        let bytes = fs::read(&path)?;
        let name = format!("{:x}", Sha256::digest(&bytes));
        let blob = blobs.join(&name);
        if !blob.exists() {
            fs::rename(&path, &blob)?;
        }
        let up = "../".repeat(depth);
        std::os::unix::fs::symlink(format!("{up}blobs/{name}"), &dest)?;
    }
    Ok(())
}
