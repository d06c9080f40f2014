//! The operator's one error type, and its mapping to metric labels and condition reasons.

use kube::runtime::finalizer;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API call failed while {action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error("serializing {what}: {source}")]
    Serialize {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("object has no {0}")]
    MissingObjectKey(&'static str),
    #[error("no random bytes for {what}: {msg}")]
    Random { what: &'static str, msg: String },
    #[error("{0}")]
    Settings(String),
    #[error("the Node and DiffusionNode stores are not synced: {0}")]
    StoresNotSynced(&'static str),
    #[error("the writer of DiffusionNode {0}'s prepare requests stopped before it wrote")]
    WriterStopped(String),
    /// An error shared by every reconcile whose change one write carried.
    #[error(transparent)]
    Shared(std::sync::Arc<Error>),
    #[error("leader election on Lease {lease}: {source}")]
    Lease {
        lease: String,
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The label of the `error` dimension in logs and metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "kube",
            Error::Finalizer(_) => "finalizer",
            Error::Serialize { .. } => "serialize",
            Error::MissingObjectKey(_) => "missing_key",
            Error::Random { .. } => "random",
            Error::Settings(_) => "settings",
            Error::StoresNotSynced(_) => "stores_not_synced",
            Error::Lease { .. } => "lease",
            Error::WriterStopped(_) => "writer_stopped",
            Error::Shared(e) => e.metric_label(),
        }
    }

    /// The condition / event reason a person sees for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "KubernetesApiError",
            Error::Finalizer(_) => "FinalizerError",
            Error::Serialize { .. } => "InternalError",
            Error::MissingObjectKey(_) => "InvalidObject",
            Error::Random { .. } => "InternalError",
            Error::Settings(_) => "InvalidSettings",
            Error::StoresNotSynced(_) => "StoresNotSynced",
            Error::Lease { .. } => "LeaderElectionFailed",
            Error::WriterStopped(_) => "InternalError",
            Error::Shared(e) => e.reason(),
        }
    }
}

/// Wraps a kube error with what the operator was doing.
pub(crate) fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}
