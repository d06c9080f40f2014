//! The agent's one error type. Every variant names what is at fault (file, cgroup, model,
//! node) so the message in a `DiffusionNode` status or a log line says where to look.

use std::path::PathBuf;

/// Result with the agent's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint the engine's reader refused; its message names the file and tensor.
    #[error("{0}")]
    Checkpoint(#[from] layerwise_engine::Error),
    /// A checkpoint or model root the core's reader refused, by the same messages.
    #[error("{0}")]
    Core(#[from] layerwise_core::Error),
    #[error("cgroup {path}: {msg}")]
    Cgroup { path: String, msg: String },
    #[error("kubernetes API call failed while {action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    /// A checkpoint the profiler process could not profile: the reader's message (file and
    /// tensor), or why the process ended (its memory or time limit).
    #[error("{0}")]
    Profile(String),
    /// The prewarm worker process misbehaved (could not start, died, spoke nonsense).
    #[error("prewarm worker: {0}")]
    Worker(String),
    /// A model request the agent cannot act on (for example a location it cannot reach).
    #[error("model {id}: {msg}")]
    Model { id: String, msg: String },
    #[error("invalid {field}: {msg}")]
    Invalid { field: String, msg: String },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn cgroup(path: impl Into<String>, msg: impl std::fmt::Display) -> Self {
        Error::Cgroup {
            path: path.into(),
            msg: msg.to_string(),
        }
    }

    pub fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }

    /// The label of the `kind` dimension of the errors metric: one mapping, used everywhere.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Checkpoint(_) | Error::Core(_) | Error::Profile(_) => "checkpoint",
            Error::Cgroup { .. } => "cgroup",
            Error::Kube { .. } => "kube",
            Error::Worker(_) => "worker",
            Error::Model { .. } => "model",
            Error::Invalid { .. } => "invalid",
        }
    }
}
