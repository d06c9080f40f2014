//! The flags of `layerwise bench` and the values of its `--resident-blocks`
//! ([`KeptBlocks`]): what a user asks for, before [`super::options`] expands it into runs.

use std::fmt;
use std::str::FromStr;

use clap::Args;

use crate::cli::args::RequestArgs;
use crate::contract::ResidentBlocks;
use crate::options::EngineArgs;

#[derive(Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    pub(crate) request: RequestArgs,
    /// Strategies to compare (comma-separated); `resident` is the reference.
    #[arg(
        long,
        env = "LAYERWISE_STRATEGIES",
        default_value = "resident,sharded,offload,offload-sharded",
        value_delimiter = ','
    )]
    pub(crate) strategies: Vec<String>,
    /// Blocks of each streamed group kept on the device, one row per value for each
    /// streaming strategy (comma-separated; `resident` runs once, as the reference): a
    /// number, `auto` (as many as `--device-memory-mib` holds after the slots, the
    /// activations and the overhead) or `L/k` (the deepest streamed group's blocks ÷ k,
    /// rounded down), e.g. `0,auto,L/2`.
    #[arg(
        long,
        env = crate::bounds::ENV_RESIDENT_BLOCKS,
        default_value = "0",
        value_delimiter = ','
    )]
    pub(crate) resident_blocks: Vec<KeptBlocks>,
    /// Ranks per request to compare, in place of `--sp`: every configuration once per
    /// value (comma-separated, e.g. `1,2,4`), the first value's `resident` the reference.
    /// Each row prints its activation bytes per rank beside its step time.
    #[arg(long, env = "LAYERWISE_SP_EACH", value_delimiter = ',')]
    pub(crate) sp_each: Vec<usize>,
    /// Rounds over all configurations; each configuration's best round is reported.
    #[arg(long, env = "LAYERWISE_ROUNDS", default_value_t = 2)]
    pub(crate) rounds: usize,
    /// Print the rows as JSON (every figure of each run, bytes exact) instead of a table.
    #[arg(long, env = "LAYERWISE_JSON")]
    pub(crate) json: bool,
}

/// One value of bench's `--resident-blocks`: blocks of each streamed group kept on the
/// device, as a number, `auto`, or a share of the deepest group (`L/k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptBlocks {
    Fixed(usize),
    /// As many as the device memory budget holds (the engine's `--resident-blocks auto`).
    Auto,
    /// The deepest streamed group's blocks ÷ k, rounded down.
    Share(usize),
    /// Every count from 0 to one short of the deepest group's blocks, one row each.
    Each,
    /// The counts per component the step-time model chooses, at rates calibrated in this
    /// run ([`super::plan`]).
    Plan,
}

impl FromStr for KeptBlocks {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s {
            "auto" => return Ok(KeptBlocks::Auto),
            "each" => return Ok(KeptBlocks::Each),
            "plan" => return Ok(KeptBlocks::Plan),
            _ => {}
        }
        if let Some(k) = s.strip_prefix("L/") {
            return match k.parse::<usize>() {
                Ok(k) if k > 0 => Ok(KeptBlocks::Share(k)),
                _ => Err(format!(
                    "`{s}`: expected L/k with k ≥ 1 (the deepest group's blocks ÷ k)"
                )),
            };
        }
        s.parse().map(KeptBlocks::Fixed).map_err(|_| {
            format!("`{s}`: expected a number of blocks, `auto`, L/k (e.g. L/2), `each` or `plan`")
        })
    }
}

impl fmt::Display for KeptBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeptBlocks::Fixed(n) => write!(f, "{n}"),
            KeptBlocks::Auto => f.write_str("auto"),
            KeptBlocks::Share(k) => write!(f, "L/{k}"),
            KeptBlocks::Each => f.write_str("each"),
            KeptBlocks::Plan => f.write_str("plan"),
        }
    }
}

impl KeptBlocks {
    /// The engine's `--resident-blocks` for a model whose deepest streamed group has
    /// `deepest` blocks (`plan` keeps none beside its counts per component; `each` is
    /// expanded into numbers before anything runs).
    pub fn resolve(self, deepest: usize) -> ResidentBlocks {
        match self {
            KeptBlocks::Fixed(n) => ResidentBlocks::Fixed(n),
            KeptBlocks::Auto => ResidentBlocks::Auto,
            KeptBlocks::Share(k) => ResidentBlocks::Fixed(deepest / k),
            KeptBlocks::Each | KeptBlocks::Plan => ResidentBlocks::Fixed(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_blocks_parse_and_resolve() {
        for (s, want, resolved) in [
            ("0", KeptBlocks::Fixed(0), ResidentBlocks::Fixed(0)),
            ("5", KeptBlocks::Fixed(5), ResidentBlocks::Fixed(5)),
            ("auto", KeptBlocks::Auto, ResidentBlocks::Auto),
            ("L/2", KeptBlocks::Share(2), ResidentBlocks::Fixed(6)),
            (" L/5 ", KeptBlocks::Share(5), ResidentBlocks::Fixed(2)),
            ("each", KeptBlocks::Each, ResidentBlocks::Fixed(0)),
            ("plan", KeptBlocks::Plan, ResidentBlocks::Fixed(0)),
        ] {
            let k: KeptBlocks = s.parse().unwrap();
            assert_eq!(k, want, "{s}");
            assert_eq!(k.resolve(12), resolved, "{s}");
            assert_eq!(k.to_string().parse::<KeptBlocks>().unwrap(), k);
        }
        for bad in ["L/0", "L/x", "half", "-1", "L"] {
            let e = bad.parse::<KeptBlocks>().unwrap_err();
            assert!(e.contains(bad.trim()), "{e}");
        }
    }
}
