//! What `layerwise bench` runs: the configurations its flags expand into, in the order
//! they run and print; a count that would stream nothing is refused before anything runs.

use anyhow::{bail, Result};

use super::args::{BenchArgs, KeptBlocks};
use crate::contract::ResidentBlocks;
use crate::Strategy;

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
