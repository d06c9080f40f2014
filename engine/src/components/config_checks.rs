//! The field checks every model config here makes the same way: read `config.json` and
//! validate it, refuse a size of zero, refuse a foreign `_class_name`; each error names the
//! file and the field, in the one wording the configs' tests assert. A config states its
//! rules as calls, one rule a call, so the wording lives here once.

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// `named!(self: a, b)` is `[("a", self.a), ("b", self.b)]`: each field beside its own
/// name, written once, for the checks above that take `(field, value)` lists.
macro_rules! named {
    ($cfg:ident: $($field:ident),+ $(,)?) => {
        [$((stringify!($field), $cfg.$field)),+]
    };
}
pub(crate) use named;

/// Reads `path` as a `T` and refuses it unless `validate` accepts it.
pub fn load<T: DeserializeOwned>(path: &Path, validate: fn(&T, &Path) -> Result<()>) -> Result<T> {
    let cfg: T = crate::checkpoint::read_json(path)?;
    validate(&cfg, path)?;
    Ok(cfg)
}

/// Fails with `msg` against `field` of `path` unless `ok`; `msg` is only built on failure.
pub fn ensure(path: &Path, field: &str, ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::config(path, field, msg()))
    }
}

/// How a config words a foreign `_class_name` (each wording is one its tests assert).
#[derive(Debug, Clone, Copy)]
pub enum ClassWording {
    /// "expected {expected}, found {found:?}"
    ExpectedFound,
    /// "`{found}` is not {expected}"
    IsNot,
    /// "`{found}`: expected {expected}"
    FoundExpected,
}

/// Refuses a `_class_name` other than `expected`, worded as `wording` says.
pub fn class_name(path: &Path, found: &str, expected: &str, wording: ClassWording) -> Result<()> {
    ensure(path, "_class_name", found == expected, || match wording {
        ClassWording::ExpectedFound => format!("expected {expected}, found {found:?}"),
        ClassWording::IsNot => format!("`{found}` is not {expected}"),
        ClassWording::FoundExpected => format!("`{found}`: expected {expected}"),
    })
}

/// Refuses the first of `fields` whose size is zero: "must be at least 1".
pub fn at_least_one(path: &Path, fields: &[(&str, usize)]) -> Result<()> {
    at_least_one_under(path, "", fields)
}

/// [`at_least_one`] for fields nested under `prefix` (such as `text_config.`), which the
/// error's field name starts with.
pub fn at_least_one_under(path: &Path, prefix: &str, fields: &[(&str, usize)]) -> Result<()> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((field, _)) => Err(Error::config(
            path,
            format!("{prefix}{field}"),
            "must be at least 1",
        )),
        None => Ok(()),
    }
}

/// Refuses a config whose depth, `field` = `expected`, disagrees with the blocks the
/// component's weights hold (`block_of` places a tensor name in its block; `unit` names
/// them): one clear message rather than a missing-tensor error for the first absent block.
pub fn depth_matches(
    c: &crate::checkpoint::Component,
    field: &str,
    expected: usize,
    block_of: impl Fn(&str) -> Option<usize>,
    unit: &str,
) -> Result<()> {
    let found = c
        .index
        .keys()
        .filter_map(|n| block_of(n))
        .max()
        .map_or(0, |m| m + 1);
    ensure(&c.dir.join("config.json"), field, found == expected, || {
        format!("says {expected} but the weights hold {found} {unit}")
    })
}

/// Refuses an odd rotary head width: rotary embedding rotates pairs of channels.
pub fn rotary_head_dim(path: &Path, head_dim: usize) -> Result<()> {
    ensure(
        path,
        "attention_head_dim",
        head_dim.is_multiple_of(2),
        || format!("{head_dim}: rotary embedding rotates pairs of channels, so it must be even"),
    )
}

/// One row of a config test's table: the field a break must be refused for, and the break.
#[cfg(test)]
pub type Break<C> = (&'static str, fn(&mut C));

/// Asserts that `validate` refuses `valid` after each of `cases`' breaks, naming the case's
/// field: a config test's table of one broken field a row.
#[cfg(test)]
pub fn assert_each_break_is_named<C: Clone>(
    valid: &C,
    validate: fn(&C, &Path) -> Result<()>,
    cases: &[Break<C>],
) {
    for (field, break_it) in cases {
        let mut c = valid.clone();
        break_it(&mut c);
        let e = validate(&c, Path::new("cfg.json")).unwrap_err().to_string();
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_zero_is_named_under_its_prefix() {
        let p = Path::new("c.json");
        assert!(at_least_one(p, &[("a", 1), ("b", 2)]).is_ok());
        let e = at_least_one_under(p, "text_config.", &[("a", 1), ("b", 0), ("c", 0)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("text_config.b"), "{e}");
        assert!(e.contains("must be at least 1"), "{e}");
        assert!(ensure(p, "x", true, || unreachable!()).is_ok());
    }
}
