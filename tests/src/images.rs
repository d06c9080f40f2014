//! The project's container images (`scripts/images`) and podman, for tests that run them.
//!
//! Images are built once per process by `scripts/images` (cached: a no-op when nothing
//! changed), unless `LAYERWISE_IMAGES_BUILT=1` says the caller (scripts/test) just built
//! them. podman runs with `images/containers.conf`, as the script does. A [`Container`] is
//! removed when dropped, so a failing test leaves none behind; what a running one is, as
//! the kernel sees it (user, group, read-only root), is read from `/proc/<pid>`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

use anyhow::{bail, ensure, Context, Result};

use crate::tools::repo;

/// The images `scripts/images` builds, by short name.
pub const NAMES: [&str; 4] = ["operator", "agent", "engine", "engine-cuda"];

/// The binary each image runs, by short name.
pub fn binary(name: &str) -> &'static str {
    match name {
        "operator" => "layerwise-operator",
        "agent" => "layerwise-agent",
        _ => "layerwise",
    }
}

/// The user and group every image runs as.
pub const USER: u32 = 65532;

/// Whether the CUDA engine image is built here (`LAYERWISE_IMAGES_CUDA=0` turns it off,
/// in scripts/images and in these tests alike).
pub fn cuda_enabled() -> bool {
    std::env::var("LAYERWISE_IMAGES_CUDA").map_or(true, |v| v != "0")
}

/// The tag of image `name`: `layerwise-<name>:<chart appVersion>`.
pub fn tag(name: &str) -> Result<String> {
    Ok(format!("layerwise-{name}:{}", app_version()?))
}

/// The chart's appVersion, which tags the images.
pub fn app_version() -> Result<String> {
    let chart = repo().join("charts/layerwise/Chart.yaml");
    let text =
        std::fs::read_to_string(&chart).with_context(|| format!("reading {}", chart.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .with_context(|| format!("no appVersion in {}", chart.display()))
}

/// Makes sure the images are there: runs `scripts/images` once per process, or, when
/// `LAYERWISE_IMAGES_BUILT=1`, checks that each tag exists.
pub fn ensure_built() -> Result<()> {
    let names: Vec<&str> = NAMES
        .into_iter()
        .filter(|n| *n != "engine-cuda" || cuda_enabled())
        .collect();
    ensure(&names)
}

/// Makes sure images `names` are there: runs `scripts/images NAMES` for those this process
/// has not made sure of yet, or, when `LAYERWISE_IMAGES_BUILT=1`, checks that each tag
/// exists.
pub fn ensure(names: &[&str]) -> Result<()> {
    static DONE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    let todo: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !done.iter().any(|d| d == n))
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    for name in &todo {
        ensure!(NAMES.contains(name), "{name} is not one of the images");
    }
    if std::env::var("LAYERWISE_IMAGES_BUILT").as_deref() != Ok("1") {
        let script = repo().join("scripts/images");
        eprintln!("images: running {} {}", script.display(), todo.join(" "));
        let mut cmd = Command::new(&script);
        // The binaries of this test build's own profile (a test in target/debug: the dev
        // build `cargo test` just made, so nothing is compiled a second time).
        if std::env::var_os("LAYERWISE_IMAGES_PROFILE").is_none() {
            cmd.env("LAYERWISE_IMAGES_PROFILE", crate::tools::cargo_profile()?);
        }
        let status = cmd
            .args(&todo)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .status()
            .with_context(|| format!("running {}", script.display()))?;
        ensure!(status.success(), "{} failed ({status})", script.display());
    }
    for name in todo {
        let tag = tag(name)?;
        let out = podman(&["image", "exists", &tag])?;
        ensure!(
            out.status.success(),
            "image {tag} is missing: run scripts/images"
        );
        done.push(name.to_string());
    }
    Ok(())
}

/// Runs `podman ARGS` with the project's containers.conf.
pub fn podman(args: &[&str]) -> Result<Output> {
    Command::new("podman")
        .args(args)
        .env("CONTAINERS_CONF", repo().join("images/containers.conf"))
        .stdin(Stdio::null())
        .output()
        .context("running podman (scripts/images installs it)")
}

/// The stdout of `podman ARGS`, which must succeed.
pub fn podman_ok(args: &[&str]) -> Result<String> {
    let out = podman(args)?;
    ensure!(
        out.status.success(),
        "podman {} failed ({}): {}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A container started detached; removed (killed first) when dropped.
pub struct Container {
    pub name: String,
}

impl Container {
    /// `podman run -d --name NAME ARGS` (ARGS: options, the image, then its arguments).
    pub fn start(name: &str, args: &[&str]) -> Result<Container> {
        let name = format!("{name}-{}", std::process::id());
        let _ = podman(&["rm", "-f", "-t", "0", &name]);
        let mut all = vec!["run", "-d", "--name", &name];
        all.extend_from_slice(args);
        podman_ok(&all)?;
        Ok(Container { name })
    }

    /// The host pid of the container's process (0 once it has exited).
    pub fn pid(&self) -> Result<u32> {
        let pid = podman_ok(&["inspect", "--format", "{{.State.Pid}}", &self.name])?;
        pid.trim()
            .parse()
            .with_context(|| format!("pid of {}: {pid:?}", self.name))
    }

    /// Whether the container still runs.
    pub fn running(&self) -> Result<bool> {
        let state = podman_ok(&["inspect", "--format", "{{.State.Running}}", &self.name])?;
        Ok(state.trim() == "true")
    }

    /// Everything the container printed so far.
    pub fn logs(&self) -> String {
        match podman(&["logs", &self.name]) {
            Ok(out) => format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => format!("(no logs: {e:#})"),
        }
    }

    /// Checks, from /proc, that the container's process runs as [`USER`]:[`USER`] (real,
    /// effective, saved and file-system ids, and no supplementary group but its own) with a
    /// read-only root file system.
    pub fn check_user_and_read_only_root(&self) -> Result<()> {
        let pid = self.pid()?;
        ensure!(pid != 0, "{} is not running:\n{}", self.name, self.logs());
        check_user_and_read_only_root(pid, &self.name)
    }

    /// Stops the container (SIGTERM, then SIGKILL after `grace_seconds`) and returns its exit
    /// code.
    pub fn stop(&self, grace_seconds: u32) -> Result<i32> {
        podman_ok(&["stop", "-t", &grace_seconds.to_string(), &self.name])?;
        let code = podman_ok(&["inspect", "--format", "{{.State.ExitCode}}", &self.name])?;
        code.trim()
            .parse()
            .with_context(|| format!("exit code of {}: {code:?}", self.name))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", "-t", "0", &self.name]);
    }
}

/// Checks, from /proc, that process `pid` (`what`, for messages) runs as [`USER`]:[`USER`]
/// (real, effective, saved and file-system ids, and no supplementary group but its own) with
/// a read-only root file system.
pub fn check_user_and_read_only_root(pid: u32, what: &str) -> Result<()> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let status = std::fs::read_to_string(proc.join("status"))
        .with_context(|| format!("{what}: reading /proc/{pid}/status"))?;
    for key in ["Uid:", "Gid:"] {
        let ids: Vec<&str> = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .with_context(|| format!("{key} in /proc/{pid}/status"))?
            .split_whitespace()
            .collect();
        ensure!(
            ids.len() == 4 && ids.iter().all(|id| *id == USER.to_string()),
            "{what}: {key} {ids:?}, want {USER} four times"
        );
    }
    let groups = status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .unwrap_or_default()
        .split_whitespace()
        .filter(|g| *g != USER.to_string())
        .collect::<Vec<_>>();
    ensure!(groups.is_empty(), "{what}: supplementary groups {groups:?}");
    ensure!(
        root_is_read_only(&proc.join("mountinfo"))?,
        "{what}: its root file system is mounted read-write"
    );
    Ok(())
}

/// Checks, from /proc, that process `pid` (`what`, for messages) runs with the chart's
/// security context: [`check_user_and_read_only_root`], no capabilities at all (permitted,
/// effective, bounding or ambient), no new privileges, and the runtime's seccomp filter.
pub fn check_chart_security(pid: u32, what: &str) -> Result<()> {
    check_user_and_read_only_root(pid, what)?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("{what}: reading /proc/{pid}/status"))?;
    let field = |key: &str| -> Result<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_string())
            .with_context(|| format!("{what}: no {key} in /proc/{pid}/status"))
    };
    for key in ["CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
        let caps = u64::from_str_radix(&field(key)?, 16)
            .with_context(|| format!("{what}: {key} is not hexadecimal"))?;
        ensure!(caps == 0, "{what}: {key} {caps:#x}, want no capabilities");
    }
    ensure!(
        field("NoNewPrivs:")? == "1",
        "{what}: NoNewPrivs is not set (allowPrivilegeEscalation: false)"
    );
    ensure!(
        field("Seccomp:")? == "2",
        "{what}: no seccomp filter (seccompProfile: RuntimeDefault)"
    );
    Ok(())
}

/// Whether the mount at `/` in a mountinfo file is read-only.
fn root_is_read_only(mountinfo: &Path) -> Result<bool> {
    let text = std::fs::read_to_string(mountinfo)?;
    // id parent major:minor root mount-point options ...; the last mount at `/` is the one
    // the process sees.
    let root = text
        .lines()
        .rev()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .with_context(|| format!("no / in {}", mountinfo.display()))?;
    let options = root.split_whitespace().nth(5).unwrap_or_default();
    Ok(options.split(',').any(|o| o == "ro"))
}

/// A folder the containers' user can read and write (tempdirs are the creator's alone).
pub fn shared_dir(parent: &Path, name: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    Ok(dir)
}

/// Fails unless `text` holds `needle`, showing the text.
pub fn expect_in(text: &str, needle: &str, what: &str) -> Result<()> {
    if !text.contains(needle) {
        bail!("{what}: expected {needle:?} in:\n{text}");
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
