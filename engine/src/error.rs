//! The engine's one error type. Every variant names the thing at fault (file, tensor,
//! field, rank) so that a person reading the message knows where to look.

use std::path::PathBuf;

use layerwise_core::Error as CoreError;

/// Result with the engine's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The cause an internal or device failure carries.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A checkpoint, tensor, config field or option at fault, as the core found it
    /// ([`layerwise_core::Error`]: its message unchanged).
    #[error(transparent)]
    Core(#[from] layerwise_core::Error),
    /// An allocation that would exceed the device's memory budget.
    #[error("device memory exhausted on rank {rank}: {what} needs {need} bytes, {free} of {capacity} free")]
    OutOfDeviceMemory {
        rank: usize,
        what: String,
        need: u64,
        free: u64,
        capacity: u64,
    },
    /// A stream, transfer or collective that failed or made no progress.
    #[error("weight transfer failed: {0}")]
    Transfer(String),
    /// A rank, stream or collective that failed; carries the first cause.
    #[error("rank {rank}: {msg}")]
    Rank { rank: usize, msg: String },
    /// A rank that stopped only because another rank failed first: never the root cause
    /// of a failed run, which is the other rank's error ([`Abandoned::cause`] quotes it).
    #[error(transparent)]
    Abandoned(#[from] Abandoned),
    /// Decoding one output on a device failed (out of device memory, a kernel error);
    /// only that output's job fails.
    #[error("decoding on {device}: {msg}")]
    Decode { device: String, msg: String },
    /// A request body that is not the JSON object the API expects.
    #[error("bad request: {msg}")]
    BadRequest { msg: String },
    /// A result with NaN or infinity in it (corrupt weights, or a request that overflows).
    #[error("{what}")]
    NotFinite { what: String },
    /// A request body that did not arrive in time.
    #[error("the request body did not arrive within {seconds} s")]
    RequestTimeout { seconds: u64 },
    /// A request body in a media type the API does not read.
    #[error("content-type `{content_type}`: send application/json (or multipart/form-data where OpenAI's clients use it)")]
    UnsupportedMediaType { content_type: String },
    /// A request body over the server's limit.
    #[error("request body over the {limit}-byte limit")]
    PayloadTooLarge { limit: usize },
    /// A request whose credential is malformed, or that needs one it does not carry
    /// (listing jobs anonymously where the operator has not allowed it).
    #[error("unauthorized: {msg}")]
    Unauthorized { msg: String },
    /// A job id that the server does not know (never existed or already evicted).
    #[error("no {what}")]
    NotFound { what: String },
    /// A result the server kept for a while and has let go (its time or its byte budget
    /// ran out).
    #[error("{what}")]
    Gone { what: String },
    /// A job whose result is not there (yet, or ever): still queued or running, or cancelled.
    #[error("{what}")]
    Conflict { what: String },
    /// A job whose owner, the replica that accepted it, no longer runs (its pod was deleted
    /// or restarted): its status and outputs went with it.
    #[error("job `{job}` was served by replica {owner}, which is no longer running (its pod was deleted or restarted); its status and outputs went with it")]
    ReplicaGone { job: String, owner: String },
    /// The replica that owns a job took the forwarded request but gave no whole answer.
    #[error("job `{job}` is served by replica {owner}, which did not answer: {msg}")]
    ReplicaUnreachable {
        job: String,
        owner: String,
        msg: String,
    },
    /// The queue is at capacity; try again after `retry_after` seconds. Outputs waiting for
    /// the decoder hold their places too (`decoding` of `queued`).
    #[error("queue full: {queued} of {capacity} places taken ({decoding} of them by outputs waiting for or in the decoder), {need} more asked for")]
    QueueFull {
        queued: usize,
        decoding: usize,
        capacity: usize,
        need: usize,
        retry_after: u64,
    },
    /// The server cannot take work: starting, shutting down, or its ranks failed.
    #[error("unavailable: {msg}")]
    Unavailable { msg: String },
    /// A failure inside the engine or the machine it runs on, not in what the client sent:
    /// a thread or runtime that would not start, an encoder that failed, an invariant of the
    /// engine's own tensors broken. The cause, when there is one, is chained (`source`) and
    /// named in the message.
    #[error("{what}{}", cause_suffix(.cause))]
    Internal {
        what: String,
        #[source]
        cause: Option<Cause>,
    },
    /// The accelerator or its driver failed: a CUDA call, a host-memory registration, a
    /// device that cannot be used. The driver's error is chained and named in the message.
    #[error("device: {what}: {cause}")]
    Device {
        what: String,
        #[source]
        cause: Cause,
    },
    #[cfg(feature = "runtime")]
    #[error("tensor math: {0}")]
    Candle(#[from] candle_core::Error),
}

/// `: cause` after an internal failure's message, when it has a cause.
fn cause_suffix(cause: &Option<Cause>) -> String {
    cause.as_ref().map(|c| format!(": {c}")).unwrap_or_default()
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CoreError::io(path, source).into()
    }
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        CoreError::checkpoint(path, msg).into()
    }
    pub fn tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        CoreError::tensor(path, tensor, msg).into()
    }
    pub fn config(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        CoreError::config(path, field, msg).into()
    }
    /// The HTTP status this error answers with: the one mapping from error to status.
    pub fn http_status(&self) -> u16 {
        match self {
            Error::BadRequest { .. } => 400,
            Error::Unauthorized { .. } => 401,
            Error::NotFound { .. } => 404,
            Error::Conflict { .. } => 409,
            Error::Gone { .. } | Error::ReplicaGone { .. } => 410,
            Error::ReplicaUnreachable { .. } => 502,
            Error::RequestTimeout { .. } => 408,
            Error::PayloadTooLarge { .. } => 413,
            Error::UnsupportedMediaType { .. } => 415,
            Error::Core(CoreError::Invalid { .. }) => 422,
            Error::QueueFull { .. } => 429,
            Error::Unavailable { .. } => 503,
            _ => 500,
        }
    }

    /// Seconds a client should wait before trying again (`Retry-After`), for the errors
    /// a retry can cure: a full queue, and a replica that is starting, shutting down or
    /// restarting (another replica behind the Service may take it at once).
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Error::QueueFull { retry_after, .. } => Some(*retry_after),
            Error::Unavailable { .. } => Some(1),
            _ => None,
        }
    }

    /// A short, stable label for metrics and the API's `error.type`.
    pub fn label(&self) -> &'static str {
        match self {
            Error::BadRequest { .. } => "bad_request",
            Error::Unauthorized { .. } => "unauthorized",
            Error::NotFound { .. } => "not_found",
            Error::Conflict { .. } => "conflict",
            Error::Gone { .. } => "expired",
            Error::ReplicaGone { .. } => "replica_gone",
            Error::ReplicaUnreachable { .. } => "replica_unreachable",
            Error::RequestTimeout { .. } => "request_timeout",
            Error::PayloadTooLarge { .. } => "payload_too_large",
            Error::UnsupportedMediaType { .. } => "unsupported_media_type",
            Error::Core(CoreError::Invalid { .. }) => "invalid_request",
            Error::QueueFull { .. } => "queue_full",
            Error::Unavailable { .. } => "unavailable",
            Error::Rank { .. } | Error::Abandoned(_) => "rank_failed",
            Error::Transfer(_) => "transfer_failed",
            Error::OutOfDeviceMemory { .. } => "out_of_device_memory",
            Error::NotFinite { .. } => "not_finite",
            Error::Decode { .. } => "decode_failed",
            Error::Device { .. } => "device_failed",
            _ => "internal",
        }
    }

    /// The field at fault, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::Core(e) => e.field(),
            _ => None,
        }
    }

    pub fn unavailable(msg: impl Into<String>) -> Self {
        Error::Unavailable { msg: msg.into() }
    }

    /// What the client (or the operator, by a flag) asked for is outside what the engine
    /// can do: a 422 naming `field`. Only for input; a failure of the engine's own is
    /// [`Error::internal`] or [`Error::device`].
    pub fn invalid(field: impl Into<String>, msg: impl Into<String>) -> Self {
        CoreError::invalid(field, msg).into()
    }

    /// A failure of the engine's own with its cause (a 500): `what` says what was being
    /// done, `cause` why it failed.
    pub fn internal(what: impl Into<String>, cause: impl Into<Cause>) -> Self {
        Error::Internal {
            what: what.into(),
            cause: Some(cause.into()),
        }
    }

    /// An invariant of the engine's own broken, with no underlying error (a 500).
    pub fn bug(what: impl Into<String>) -> Self {
        Error::Internal {
            what: what.into(),
            cause: None,
        }
    }

    /// The accelerator or its driver failed doing `what` (a 500).
    pub fn device(what: impl Into<String>, cause: impl Into<Cause>) -> Self {
        Error::Device {
            what: what.into(),
            cause: cause.into(),
        }
    }
}

/// What a rank gave up on because another rank failed first: its all-gather, whose peer
/// will never send its shard, or the pass coordinator's barrier, which that peer will never
/// reach. Cloned to every waiter of the stream it poisons (see
/// `execution::fault`), so the rank loop tells it from a root cause by its type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {what} abandoned: {cause}")]
pub struct Abandoned {
    /// The rank that gave up.
    pub rank: usize,
    /// What gave up: `all-gather` or `pass coordinator`.
    pub what: &'static str,
    /// The first failure, as the rank that failed reported it (it names that rank).
    pub cause: String,
}

/// What a caught panic said (its `&str` or `String` payload), for the error it becomes.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// Internal and device failures are 5xx, name their cause and chain it as `source`.
    #[test]
    fn internal_and_device_failures_are_5xx_with_their_cause_chained() {
        let io = std::io::Error::other("no threads left");
        let e = Error::internal("cannot start the engine thread", io);
        assert_eq!((e.http_status(), e.label()), (500, "internal"));
        assert_eq!(
            e.to_string(),
            "cannot start the engine thread: no threads left"
        );
        assert_eq!(e.source().unwrap().to_string(), "no threads left");
        assert_eq!(e.field(), None);

        let e = Error::device("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!((e.http_status(), e.label()), (500, "device_failed"));
        assert_eq!(
            e.to_string(),
            "device: cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"
        );
        assert!(e.source().is_some());

        let e = Error::bug("no activations after the pass");
        assert_eq!(
            (e.http_status(), e.to_string().as_str()),
            (500, "no activations after the pass")
        );
        assert!(e.source().is_none());

        // Only input is a 4xx.
        let e = Error::invalid("steps", "must be at least 1");
        assert_eq!((e.http_status(), e.field()), (422, Some("steps")));
    }

    #[test]
    fn a_rank_that_gave_up_answers_like_a_failed_rank() {
        let failed = Error::Rank {
            rank: 1,
            msg: "panicked: disk on fire".into(),
        };
        let gave_up = Error::Abandoned(Abandoned {
            rank: 0,
            what: "all-gather",
            cause: "rank 1 failed: panicked: disk on fire".into(),
        });
        assert_eq!(gave_up.http_status(), 500);
        assert_eq!(
            (gave_up.http_status(), gave_up.label()),
            (failed.http_status(), failed.label())
        );
        assert_eq!(
            gave_up.to_string(),
            "rank 0: all-gather abandoned: rank 1 failed: panicked: disk on fire"
        );
    }
}
