//! The field checks both flow scheduler configs make when loaded: the values whose math is
//! not implemented, or that diffusers itself turns into inf/NaN samples, refused by name.

use std::path::Path;

use super::schedule::terminal;
use crate::{Error, Result};

/// `shift_terminal`, when set, must leave `1 - shift_terminal` a positive divisor.
pub(super) fn check_terminal(path: &Path, shift_terminal: Option<f64>) -> Result<()> {
    match terminal(shift_terminal) {
        Some(t) if !(t.is_finite() && t < 1.0) => Err(Error::config(
            path,
            "shift_terminal",
            format!("{t}: must be below 1"),
        )),
        _ => Ok(()),
    }
}

/// Refuses a switch this implementation does not compute when it is on, naming it.
pub(super) fn refuse_true(path: &Path, field: &str, on: bool, why: &str) -> Result<()> {
    if on {
        return Err(Error::config(
            path,
            field,
            format!("true is not supported ({why})"),
        ));
    }
    Ok(())
}

/// Refuses the sigma schedules and the dynamic shifting that both flow schedulers parse
/// (diffusers writes them) but neither implements.
pub(super) fn refuse_sigma_variants(
    path: &Path,
    karras: bool,
    exponential: bool,
    beta: bool,
    dynamic_shifting: bool,
) -> Result<()> {
    for (field, on, why) in [
        ("use_karras_sigmas", karras, "Karras sigmas"),
        ("use_exponential_sigmas", exponential, "exponential sigmas"),
        ("use_beta_sigmas", beta, "beta sigmas"),
        (
            "use_dynamic_shifting",
            dynamic_shifting,
            "it needs a `mu` the pipeline never passes",
        ),
    ] {
        refuse_true(path, field, on, why)?;
    }
    Ok(())
}

/// A shift (`flow_shift`, `shift`) must be a positive number.
pub(super) fn check_shift(path: &Path, field: &str, shift: f64) -> Result<()> {
    if shift.is_finite() && shift > 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            path,
            field,
            format!("{shift}: must be positive"),
        ))
    }
}
