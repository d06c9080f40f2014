//! The four ways weights can live and move (docs/architecture.md has the table).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// The fewest device slots a streaming strategy runs with: one block computing while the
/// next arrives. The engine refuses fewer at start, the planner never plans fewer, and the
/// DiffusionDeployment's CEL rule refuses fewer at `kubectl apply` (a test checks the rule
/// against this constant).
pub const MIN_STREAMING_SLOTS: u32 = 2;

/// How the weights live and move: the one strategy type of the engine, the planner and the
/// DiffusionDeployment's plan. The default is what an engine command runs when its flags
/// name none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// The whole model on every device; nothing moves per step.
    Resident,
    /// 1/dp of every block resident on each device; all-gather into a slot per block.
    Sharded,
    /// Weights on the host; each rank copies whole blocks into its slots.
    Offload,
    /// Weights on the host; each rank copies 1/dp of a block, then all-gather.
    #[default]
    OffloadSharded,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Resident,
        Strategy::Sharded,
        Strategy::Offload,
        Strategy::OffloadSharded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Resident => "resident",
            Strategy::Sharded => "sharded",
            Strategy::Offload => "offload",
            Strategy::OffloadSharded => "offload-sharded",
        }
    }

    /// Whether blocks stream through slots (everything but `resident`).
    pub fn streams(self) -> bool {
        self != Strategy::Resident
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "strategy",
                    format!("`{s}`: expected one of resident, sharded, offload, offload-sharded"),
                )
            })
    }
}
