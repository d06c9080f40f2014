//! The ranges of `layerwise serve`'s operator flags, checked at start before the model is
//! opened or a port is bound. A value outside them would not fail at start but later and
//! worse: `--timeout-seconds 0` kills the server on its first job, `--max-connections 1`
//! lets one idle client hold the slot every probe needs, `--keep-finished 0` forgets a job
//! the moment it ends, a huge `--max-queue` aborts on allocating its channels, and a request
//! bound of 0 (`--max-width 0`) makes a ready server that refuses everything. So each is
//! refused here, naming the flag and its range; the request bounds' ranges are the ones the
//! DiffusionDeployment's CEL rules state ([`crate::bounds::RequestBounds::checked`]).

use crate::{Error, Result};

/// One flag's accepted values, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlagRange {
    /// The flag, without its dashes.
    pub flag: &'static str,
    pub min: u64,
    pub max: u64,
    /// Why the range is what it is, for the error.
    pub why: &'static str,
}

impl FlagRange {
    /// `value` when it lies in the range, else an error naming the flag and the range.
    pub fn check(&self, value: u64) -> Result<u64> {
        if (self.min..=self.max).contains(&value) {
            return Ok(value);
        }
        Err(Error::invalid(
            self.flag,
            format!(
                "{value}: --{} takes {}..={} ({})",
                self.flag, self.min, self.max, self.why
            ),
        ))
    }
}

const DAY: u64 = 24 * 3600;
const MIB: u64 = 1 << 20;

/// `--timeout-seconds`.
pub const TIMEOUT_SECONDS: FlagRange = FlagRange {
    flag: "timeout-seconds",
    min: 1,
    max: DAY,
    why: "the watchdog ends a server whose ranks make no progress for this long, so 0 ends it on its first job",
};
/// `--max-queue`.
pub const MAX_QUEUE: FlagRange = FlagRange {
    flag: "max-queue",
    min: 1,
    max: 65_536,
    why: "the queue's channels are allocated at start for this many outputs",
};
/// `--body-limit`.
pub const BODY_LIMIT: FlagRange = FlagRange {
    flag: "body-limit",
    min: 256,
    max: 64 * MIB,
    why: "bytes of a request body: enough for the smallest request, and held in memory per connection",
};
/// `--header-timeout-seconds`.
pub const HEADER_TIMEOUT_SECONDS: FlagRange = FlagRange {
    flag: "header-timeout-seconds",
    min: 1,
    max: 3600,
    why: "0 would close every connection before its request",
};
/// `--body-timeout-seconds`.
pub const BODY_TIMEOUT_SECONDS: FlagRange = FlagRange {
    flag: "body-timeout-seconds",
    min: 1,
    max: 3600,
    why: "0 would refuse every body",
};
/// `--max-connections`.
pub const MAX_CONNECTIONS: FlagRange = FlagRange {
    flag: "max-connections",
    min: 2,
    max: 65_536,
    why: "with one, a single idle client holds the connection every probe needs",
};
/// `--grace-seconds`.
pub const GRACE_SECONDS: FlagRange = FlagRange {
    flag: "grace-seconds",
    min: 0,
    max: DAY,
    why: "seconds running jobs get after SIGTERM",
};
/// `--keep-finished`.
pub const KEEP_FINISHED: FlagRange = FlagRange {
    flag: "keep-finished",
    min: 1,
    max: 1_000_000,
    why: "with 0 a finished job is forgotten before its client can read it",
};
/// `--result-bytes`.
pub const RESULT_BYTES: FlagRange = FlagRange {
    flag: "result-bytes",
    min: MIB,
    max: 1 << 40,
    why: "below a MiB an output is let go before its client can download it",
};
/// `--result-ttl-seconds`.
pub const RESULT_TTL_SECONDS: FlagRange = FlagRange {
    flag: "result-ttl-seconds",
    min: 1,
    max: 30 * DAY,
    why: "with 0 an output is let go the moment it is made",
};
/// `--forward-timeout-seconds`.
pub const FORWARD_TIMEOUT_SECONDS: FlagRange = FlagRange {
    flag: "forward-timeout-seconds",
    min: 1,
    max: 3600,
    why: "0 would fail every request sent on to a job's owner",
};
