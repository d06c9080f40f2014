//! The names the engine's contract flags read from the environment, one constant each: the
//! engine's clap arguments name them, and the operator's pods set them only through
//! [`super::EngineContract::env`]. The request bounds' and the device budget's names are
//! [`crate::bounds`]'s, the decode site's [`crate::decode::ENV_DECODE`].

/// The engine subcommand a plan runs: `layerwise serve`.
pub const SERVE_COMMAND: &str = "serve";

/// Environment variable of `--model`.
pub const ENV_MODEL: &str = "LAYERWISE_MODEL";
/// Environment variable of `--model-roots`.
pub const ENV_MODEL_ROOTS: &str = "LAYERWISE_MODEL_ROOTS";
/// Environment variable of `--strategy`.
pub const ENV_STRATEGY: &str = "LAYERWISE_STRATEGY";
/// Environment variable of `--dp`.
pub const ENV_DP: &str = "LAYERWISE_DP";
/// Environment variable of `--sp`.
pub const ENV_SP: &str = "LAYERWISE_SP";
/// Environment variable of `--slots`.
pub const ENV_SLOTS: &str = "LAYERWISE_SLOTS";
/// Environment variable of `layerwise serve --listen`.
pub const ENV_LISTEN: &str = "LAYERWISE_LISTEN";
/// Environment variable of `layerwise serve --job-key`: the deployment's key, which the
/// operator's pods take from its Secret.
pub const ENV_JOB_KEY: &str = "LAYERWISE_JOB_KEY";
/// Environment variable of `layerwise serve --pod-ip`, which the operator's pods take from
/// the downward API.
pub const ENV_POD_IP: &str = "LAYERWISE_POD_IP";
/// Environment variable of `layerwise serve --grace-seconds`, which the operator sets from
/// the deployment's drain grace (and the pod's termination grace from it).
pub const ENV_GRACE_SECONDS: &str = "LAYERWISE_GRACE_SECONDS";
/// `--grace-seconds` when nothing sets it, and the operator's drain grace when its plan
/// predicts no latency.
pub const DEFAULT_GRACE_SECONDS: u64 = 30;
