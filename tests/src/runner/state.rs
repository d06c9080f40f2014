//! What the runner shares between its tasks and shows the test: its configuration, the
//! containers running, those that ended, and the pods it could not run.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

/// What the runner is given.
#[derive(Debug, Clone)]
pub struct Config {
    /// The namespace whose pods it runs.
    pub namespace: String,
    /// Fake node name to the folder that plays its host filesystem.
    pub node_roots: BTreeMap<String, PathBuf>,
    /// Where logs, service-account files and `emptyDir` folders go (made traversable by
    /// every user, for the containers' users).
    pub work: PathBuf,
}

/// One container that ended.
#[derive(Debug, Clone)]
pub struct Exit {
    pub pod: String,
    pub node: String,
    /// The container's `command[0]`.
    pub command: String,
    /// The exit code as the runtime reports it (128 + the signal's number when a signal
    /// ended it); `None` when it could not be read.
    pub code: Option<i32>,
    /// Whether the pod was being deleted (an expected stop) rather than the container dying
    /// or being killed by a failed probe.
    pub stopping: bool,
    /// Why it ended, when the runner ended it for a failed probe.
    pub reason: Option<String>,
    /// The tail of its log.
    pub log_tail: String,
}

/// A container the runner started, as the test sees it.
#[derive(Debug, Clone)]
pub struct Running {
    pub pod: String,
    pub node: String,
    pub ip: IpAddr,
    /// The container's name in podman.
    pub container: String,
    pub image: String,
    /// The host pid of the container's process.
    pub pid: u32,
    /// `command[1..]` and `args`, as the process got them.
    pub args: Vec<String>,
    /// The container's environment from the pod spec, resolved (the image's own comes too).
    pub env: Vec<(String, String)>,
    pub ready: bool,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) running: BTreeMap<String, Running>,
    pub(super) exits: Vec<Exit>,
    /// Pods the runner could not run, with the kubelet's reason and why.
    pub(super) failures: Vec<String>,
}
