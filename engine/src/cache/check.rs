//! Whether a family honours a request's step cache: the kinds it offers, by name, and
//! the setting's own bounds.

use super::config::{CacheKind, StepCache};
use crate::execution::work::Request;
use crate::{Error, Result};

/// Refuses a request's cache that `family` (named `name`) cannot honour, by name.
pub fn check(name: &str, honoured: &[CacheKind], r: &Request) -> Result<()> {
    let Some(c) = &r.cache else { return Ok(()) };
    check_setting("cache", name, honoured, c)
}

/// Refuses `c`, given as `field` (a request's `cache`, a server's `--cache`), when
/// `family` (named `name`) cannot honour it, by name.
pub fn check_setting(field: &str, name: &str, honoured: &[CacheKind], c: &StepCache) -> Result<()> {
    c.check(field)?;
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
            field,
            format!(
                "`{}` is not available for the {name} family (it offers: {offered})",
                c.kind()
            ),
        ));
    }
    Ok(())
}
