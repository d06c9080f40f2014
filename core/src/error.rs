//! The core's errors: a checkpoint, a tensor, a config field or an option that is not what
//! it must be. Each names the file, tensor or field at fault. The engine's error type wraps
//! these as they are ([`Error`] converts into it), so a message reads the same whichever
//! crate found the fault.

use std::path::PathBuf;

/// Result with the core's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file whose bytes are not what they claim to be.
    #[error("{path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    /// A tensor that is missing, unexpected, or of the wrong shape or dtype.
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// A configuration value that is missing, malformed, or disagrees with the weights.
    #[error("{path}: config field `{field}`: {msg}")]
    Config {
        path: PathBuf,
        field: String,
        msg: String,
    },
    /// A request or option outside what the engine can do.
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
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }
    pub fn config(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Config {
            path: path.into(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    pub fn invalid(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.into(),
            msg: msg.into(),
        }
    }

    /// The field at fault, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::Invalid { field, .. } | Error::Config { field, .. } => Some(field),
            _ => None,
        }
    }
}
