//! The Hugging Face hub cache layout: a repository folder (`models--org--name`) holding
//! `blobs/` (the files, named by their hash), `refs/` (a branch or tag name → commit) and
//! `snapshots/<commit>/…`, whose files are relative symlinks into `../../blobs/`.
//!
//! A pipeline in such a cache is the snapshot folder, but its files live in `blobs/`: who
//! serves it mounts the whole repository folder and confines reads to it, so the links
//! resolve and stay inside the model roots ([`super::confine`] follows links and accepts
//! targets inside the roots only; a link escaping the repository is still refused, by name).
//! This module owns finding the snapshot a revision names, the one place the engine (its
//! `--model`) and the node agent (a request's `revision`) agree on it.

use std::path::{Path, PathBuf};

use super::files::read_small;
use crate::{Error, Result};

/// The folder of a repository's snapshots, one per commit.
pub const SNAPSHOTS: &str = "snapshots";
/// The folder of a repository's refs: a file per branch or tag, holding its commit.
pub const REFS: &str = "refs";
/// The longest revision name accepted (a commit hash is 40).
pub const MAX_REVISION: usize = 128;

/// Checks a revision name: a commit hash or a ref (`main`, `v1.0`): letters, digits, `.`,
/// `_` and `-`, starting with a letter or digit, at most [`MAX_REVISION`] long; so it is one
/// path component and never `..`. `field` names where it came from in the error.
pub fn check_revision(field: &str, revision: &str) -> Result<()> {
    let ok = !revision.is_empty()
        && revision.len() <= MAX_REVISION
        && revision.as_bytes()[0].is_ascii_alphanumeric()
        && revision
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        return Ok(());
    }
    Err(Error::Invalid {
        field: field.into(),
        msg: format!(
            "`{revision}` is not a revision: a commit hash or a ref name (letters, digits, `.`, `_`, `-`, starting with a letter or digit, at most {MAX_REVISION} characters)"
        ),
    })
}

/// The snapshot folder of the hub cache repository `repo` at `revision`: `snapshots/<revision>`
/// where that folder exists (a commit hash), else the snapshot of the commit `refs/<revision>`
/// names (a branch or tag). Errors name the repository and what is missing.
pub fn snapshot(repo: &Path, revision: &str) -> Result<PathBuf> {
    check_revision("revision", revision)?;
    let snapshots = repo.join(SNAPSHOTS);
    if !snapshots.is_dir() {
        return Err(Error::checkpoint(
            repo,
            "no snapshots/ folder: not a Hugging Face hub cache repository (models--org--name)",
        ));
    }
    let direct = snapshots.join(revision);
    if direct.is_dir() {
        return Ok(direct);
    }
    let reference = repo.join(REFS).join(revision);
    if !reference.is_file() {
        return Err(Error::checkpoint(
            repo,
            format!(
                "revision `{revision}` is neither a snapshot (snapshots/{revision}) nor a ref (refs/{revision}) of this repository"
            ),
        ));
    }
    let text = read_small(&reference)?;
    let commit = String::from_utf8_lossy(&text).trim().to_string();
    check_revision(&reference.display().to_string(), &commit)?;
    let target = snapshots.join(&commit);
    if !target.is_dir() {
        return Err(Error::checkpoint(
            &reference,
            format!("names commit {commit}, which has no snapshot (snapshots/{commit}): the repository was downloaded without it"),
        ));
    }
    Ok(target)
}

/// The pipeline folder a model path names: a path `<repo>/snapshots/<ref>` where no such
/// snapshot folder exists but the repository has `refs/<ref>` is the snapshot that ref
/// names (so `--model …/snapshots/main` follows the branch, as the hub's own tools do);
/// any other path is returned as it is.
pub fn resolve_model_path(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let (Some(name), Some(parent)) = (path.file_name(), path.parent()) else {
        return Ok(path.to_path_buf());
    };
    let Some(repo) = parent
        .file_name()
        .filter(|n| *n == SNAPSHOTS)
        .and_then(|_| parent.parent())
    else {
        return Ok(path.to_path_buf());
    };
    let name = name.to_string_lossy();
    if !repo.join(REFS).join(name.as_ref()).is_file() {
        return Ok(path.to_path_buf());
    }
    snapshot(repo, &name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A hub cache repository with one snapshot whose file links into `blobs/`, and `main`
    /// naming it.
    fn repo(dir: &Path) -> PathBuf {
        let repo = dir.join("models--org--name");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        fs::create_dir_all(repo.join("blobs")).unwrap();
        fs::create_dir_all(repo.join("refs")).unwrap();
        fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        fs::write(repo.join("blobs/abc"), b"{}").unwrap();
        std::os::unix::fs::symlink(
            "../../blobs/abc",
            repo.join("snapshots").join(commit).join("model_index.json"),
        )
        .unwrap();
        fs::write(repo.join("refs/main"), format!("{commit}\n")).unwrap();
        repo
    }

    #[test]
    fn a_revision_is_a_snapshot_or_the_commit_a_ref_names() {
        let d = tempfile::tempdir().unwrap();
        let repo = repo(d.path());
        let commit = repo.join("snapshots/0123456789abcdef0123456789abcdef01234567");
        assert_eq!(snapshot(&repo, "main").unwrap(), commit);
        assert_eq!(
            snapshot(&repo, "0123456789abcdef0123456789abcdef01234567").unwrap(),
            commit
        );
        assert_eq!(
            resolve_model_path(&repo.join("snapshots/main")).unwrap(),
            commit
        );
        assert_eq!(resolve_model_path(&commit).unwrap(), commit);
        let plain = d.path().join("plain");
        assert_eq!(resolve_model_path(&plain).unwrap(), plain);
        assert!(commit.join("model_index.json").is_file());
    }

    #[test]
    fn bad_revisions_and_missing_parts_are_named() {
        let d = tempfile::tempdir().unwrap();
        let repo = repo(d.path());
        for bad in ["..", "../x", "a/b", "", ".hidden", &"a".repeat(129)] {
            let e = snapshot(&repo, bad).unwrap_err().to_string();
            assert!(e.contains("is not a revision"), "{bad}: {e}");
        }
        let e = snapshot(&repo, "v2").unwrap_err().to_string();
        assert!(
            e.contains("neither a snapshot") && e.contains("refs/v2"),
            "{e}"
        );
        fs::write(repo.join("refs/old"), "fedcba").unwrap();
        let e = snapshot(&repo, "old").unwrap_err().to_string();
        assert!(
            e.contains("refs/old") && e.contains("fedcba") && e.contains("no snapshot"),
            "{e}"
        );
        fs::write(repo.join("refs/evil"), "../../etc").unwrap();
        let e = snapshot(&repo, "evil").unwrap_err().to_string();
        assert!(
            e.contains("refs/evil") && e.contains("is not a revision"),
            "{e}"
        );
        let e = snapshot(d.path(), "main").unwrap_err().to_string();
        assert!(e.contains("not a Hugging Face hub cache"), "{e}");
    }
}
