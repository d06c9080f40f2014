//! Step caches: diffusers 0.42's First-Block Cache, MagCache and TaylorSeer (lite), which
//! reuse a transformer's residual or output on steps where its input barely moved. They
//! live apart from the families because the decisions are the same for every family
//! whose transformer is one stack of blocks over one hidden stream: a family hands over
//! its hidden states and its output ([`crate::families::encode_once`]) and says which
//! kinds it honours ([`crate::execution::family::FamilyRuntime::step_caches`]); a block
//! no row of a pass computes is skipped, and its weights are not needed.

mod config;
mod run;
mod state;

pub use config::{kinds, CacheKind, StepCache};
pub use run::{CacheReport, StepCacheRun};

use crate::execution::work::Request;
use crate::{Error, Result};

/// Refuses a request's cache that `family` (named `name`) cannot honour, by name.
pub fn check(name: &str, honoured: &[CacheKind], r: &Request) -> Result<()> {
    let Some(c) = &r.cache else { return Ok(()) };
    c.check("cache")?;
    if c.kind() == CacheKind::Sea {
        return Err(Error::invalid(
            "cache",
            "`sea` (SeaCache) is not implemented by this engine; diffusers applies it to \
             Cosmos3 only",
        ));
    }
    if !honoured.contains(&c.kind()) {
        let offered = if honoured.is_empty() {
            "none".to_string()
        } else {
            honoured
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(Error::invalid(
            "cache",
            format!(
                "`{}` is not available for the {name} family (it offers: {offered})",
                c.kind()
            ),
        ));
    }
    Ok(())
}
