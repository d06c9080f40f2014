//! What the whole-system tests that run the chart under the node runner share: the model a
//! fake node holds, written by `layerwise synth` in the engine image as a node's own folder,
//! and the check that fails a wait at once when the runner could not run a pod or one of its
//! containers ended, rather than letting the wait time out with nothing to show.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::images;
use crate::runner::NodeRunner;

/// `layerwise synth --preset PRESET` into `dir`, in the engine image (as 65532, so `dir`
/// is made writable for it; what it writes is readable by all).
pub fn synth(preset: &str, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
    let mount = format!("{}:/out", path_str(dir)?);
    images::podman_ok(&[
        "run",
        "--rm",
        "--read-only",
        "--network",
        "none",
        "-v",
        &mount,
        &images::tag("engine")?,
        "synth",
        "--preset",
        preset,
        "--out",
        "/out",
    ])
    .with_context(|| format!("layerwise synth --preset {preset} in the engine image"))?;
    Ok(())
}

/// `p` as the UTF-8 a command's argument needs.
pub fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

/// Fails the wait at once when the runner could not run a pod or a container ended.
pub fn check_runner(runner: &NodeRunner) -> Result<()> {
    let failures = runner.failures();
    if !failures.is_empty() {
        bail!("the node runner could not run pods: {failures:#?}");
    }
    if let Some(e) = runner.exits().iter().find(|e| !e.stopping) {
        bail!(
            "{} in pod {} on {} ended ({:?}, {}): {}",
            e.command,
            e.pod,
            e.node,
            e.code,
            e.reason.as_deref().unwrap_or("exited by itself"),
            e.log_tail
        );
    }
    Ok(())
}
