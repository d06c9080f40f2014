//! The host side: podman invocations (with the project's containers.conf), a container's
//! process and its stop, folder permissions for the containers' users, and log tails.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::process::Command;

use super::names::RUNNER_LABEL;
use crate::tools;

/// Makes `dir` and the folders above it traversable by every user (a tempdir is its
/// creator's alone), so the containers' users reach what is mounted from under it.
pub(super) fn traversable(dir: &Path) -> Result<()> {
    for d in dir
        .ancestors()
        .filter(|d| d.starts_with(std::env::temp_dir()))
    {
        if d == std::env::temp_dir() {
            break;
        }
        let mode = std::fs::metadata(d)?.permissions().mode();
        if mode & 0o011 != 0o011 {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("making {} traversable", d.display()))?;
        }
    }
    Ok(())
}

/// Removes the containers of runners whose test process has ended.
pub(super) fn remove_orphans() -> Result<()> {
    let format = format!("{{{{.ID}}}} {{{{index .Labels \"{RUNNER_LABEL}\"}}}}");
    let filter = format!("label={RUNNER_LABEL}");
    let out = crate::images::podman_ok(&["ps", "-a", "--filter", &filter, "--format", &format])?;
    for line in out.lines() {
        let mut words = line.split_whitespace();
        let (Some(id), Some(pid)) = (words.next(), words.next()) else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = crate::images::podman(&["rm", "-f", "-t", "0", id]);
        }
    }
    Ok(())
}

/// `podman ARGS` with the project's containers.conf, without blocking the runtime.
pub(super) async fn podman(args: &[&str]) -> Result<Output> {
    Command::new("podman")
        .args(args)
        .env(
            "CONTAINERS_CONF",
            tools::repo().join("images/containers.conf"),
        )
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("running podman (scripts/images installs it)")
}

/// `podman ARGS`, which must succeed: its stdout, or an error with what it said.
pub(super) async fn podman_ok(args: &[&str]) -> Result<String> {
    let out = podman(args).await?;
    anyhow::ensure!(
        out.status.success(),
        "podman {} failed ({}): {}",
        args.first().copied().unwrap_or_default(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether the container's process still runs (its monitor reaps it when it ends).
pub(super) fn alive(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The container's exit code once it has stopped.
pub(super) async fn wait(container: &str) -> Option<i32> {
    podman_ok(&["wait", container])
        .await
        .ok()
        .and_then(|code| code.trim().parse().ok())
}

/// A kubelet's stop: the preStop sleep, then SIGTERM and SIGKILL when the rest of the grace
/// period runs out. Returns the exit code.
pub(super) async fn stop(
    container: &str,
    pid: u32,
    pre_stop: Duration,
    grace: Duration,
) -> Option<i32> {
    let began = Instant::now();
    // The container keeps serving through the preStop sleep (it may also exit by itself).
    while began.elapsed() < pre_stop && alive(pid) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if alive(pid) {
        let left = grace.saturating_sub(began.elapsed());
        let secs = left.as_secs() + u64::from(left.subsec_nanos() > 0);
        if let Err(e) = podman_ok(&["stop", "-t", &secs.to_string(), container]).await {
            tracing::warn!(error = %e, container, "node runner: stopping");
        }
    }
    wait(container).await
}

/// The last `max` bytes of a container's log, without the CRI log format's timestamp,
/// stream and tag before each line.
pub fn tail(path: &Path, max: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes);
    let mut out = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_, stream, tag, rest) = (parts.next(), parts.next(), parts.next(), parts.next());
        match (stream, tag, rest) {
            (Some("stdout" | "stderr"), Some("P"), Some(rest)) => out.push_str(rest),
            (Some("stdout" | "stderr"), Some(_), Some(rest)) => {
                out.push_str(rest);
                out.push('\n');
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    let mut from = out.len().saturating_sub(max);
    while !out.is_char_boundary(from) {
        from += 1;
    }
    out[from..].to_string()
}
