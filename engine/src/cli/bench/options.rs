//! What `layerwise bench` runs: the values of its `--resident-blocks` ([`KeptBlocks`]) and
//! the configurations its flags expand into, in the order they run and print; a count that
//! would stream nothing is refused before anything runs.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Result};

use crate::cli::BenchArgs;
use crate::execution::cuda::plan::ResidentBlocks;
use crate::Strategy;

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

/// One configuration bench runs: a strategy and, when it streams, the blocks it keeps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Config {
    pub(super) strategy: Strategy,
    /// `None` for `resident`, which keeps every block whatever the flag says.
    pub(super) kept: Option<KeptBlocks>,
    /// Ranks per request.
    pub(super) sp: usize,
}

/// The configurations `a` asks for, in the order they run and print: `resident` once,
/// every other strategy once per `--resident-blocks` value. A fixed number that keeps
/// every block of every group is refused before anything runs: that is `resident`.
pub(super) fn configs(a: &BenchArgs, deepest: usize) -> Result<Vec<Config>> {
    let strategies = a
        .strategies
        .iter()
        .map(|s| s.parse::<Strategy>())
        .collect::<Result<Vec<_>, _>>()?;
    let sps = if a.sp_each.is_empty() {
        vec![a.engine.run.sp]
    } else {
        a.sp_each.clone()
    };
    if sps.len() > 1 && a.resident_blocks.contains(&KeptBlocks::Plan) {
        bail!("--resident-blocks plan times one topology: give --sp rather than --sp-each");
    }
    let kept = if a.resident_blocks.is_empty() {
        vec![KeptBlocks::Fixed(0)]
    } else {
        a.resident_blocks.clone()
    };
    let mut out = Vec::new();
    for (sp, strategy) in sps
        .iter()
        .flat_map(|&sp| strategies.iter().map(move |&s| (sp, s)))
    {
        if !strategy.streams() {
            out.push(Config {
                strategy,
                kept: None,
                sp,
            });
            continue;
        }
        let expanded = kept.iter().flat_map(|&k| match k {
            KeptBlocks::Each => (0..deepest).map(KeptBlocks::Fixed).collect(),
            k => vec![k],
        });
        for k in expanded {
            if let ResidentBlocks::Fixed(n) = k.resolve(deepest) {
                if n >= deepest {
                    bail!(
                        "--resident-blocks {k}: keeps {n} blocks, every block of the deepest group ({deepest}), so {strategy} would stream nothing; `resident` is the row that keeps them all"
                    );
                }
            }
            out.push(Config {
                strategy,
                kept: Some(k),
                sp,
            });
        }
    }
    Ok(out)
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
