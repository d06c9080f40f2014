//! A pipeline in the Hugging Face hub cache layout (`models--org--name/snapshots/<commit>/…`
//! whose files are relative symlinks into `../../blobs/`), as engine pods see it.
//!
//! Mounting the snapshot folder alone (what the operator once did with a `hostPath` that
//! named it) leaves the links dangling, and confined to that folder they lead outside the
//! roots: the engine refuses it. Mounting the repository folder and confining to it (what the
//! operator does for a `revision`) serves the snapshot, named by its commit or by a ref, and a
//! link that escapes the repository is still refused by name.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use common::process::{spawn_with, BIN};
use layerwise_engine::tools::synth::hub_cache::into_hub_cache;
use serde_json::json;

const COMMIT: &str = "4f1d2c3b4a5968778695a4b3c2d1e0f9a8b7c6d5";

fn inspect(model: &Path, roots: &Path) -> Output {
    Command::new(BIN)
        .env_remove("LAYERWISE_MODEL_ROOTS")
        .arg("inspect")
        .arg(model)
        .arg("--model-roots")
        .arg(roots)
        .output()
        .unwrap()
}

/// That `inspect` failed on `file` leading outside the roots, never saying where to.
fn refused(out: Output, file: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    let named = err.contains(file) && err.contains("leads outside the model roots");
    assert!(
        !out.status.success() && named && !err.contains("elsewhere"),
        "{err}"
    );
}

#[test]
fn only_the_snapshot_folder_as_the_root_refuses_the_links() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("models--layerwise--tiny");
    let snapshot = into_hub_cache(&common::tiny(d.path(), 2), &repo, COMMIT).unwrap();
    refused(inspect(&snapshot, &snapshot), "model_index.json");
}

#[tokio::test]
async fn the_repository_as_the_root_serves_the_snapshot_by_commit_or_ref() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("models--layerwise--tiny");
    let snapshot = into_hub_cache(&common::tiny(d.path(), 2), &repo, COMMIT).unwrap();
    assert!(fs::symlink_metadata(snapshot.join("model_index.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    let out = inspect(&snapshot, &repo);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_ref = repo.join("snapshots/main");
    let roots = repo.display().to_string();
    let s = spawn_with(&by_ref, "127.0.0.1:0", &["--model-roots", &roots], &[]);
    s.wait_ready().await;
    let r = s
        .call(
            "POST",
            "/v1/images/generations",
            Some(json!({ "class_label": 1, "seed": 3, "steps": 2 })),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn a_link_escaping_the_repository_is_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("models--layerwise--tiny");
    let snapshot = into_hub_cache(&common::tiny(d.path(), 2), &repo, COMMIT).unwrap();
    let outside = d.path().join("elsewhere");
    fs::create_dir_all(&outside).unwrap();
    let config = snapshot.join("vae/config.json");
    fs::copy(&config, outside.join("config.json")).unwrap();
    fs::remove_file(&config).unwrap();
    // Up out of vae/, the snapshot, snapshots/ and the repository.
    std::os::unix::fs::symlink("../../../../elsewhere/config.json", &config).unwrap();
    refused(
        inspect(&repo.join("snapshots/main"), &repo),
        "vae/config.json",
    );
}
