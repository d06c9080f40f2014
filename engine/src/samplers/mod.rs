//! Samplers: the denoising schedules and update rules, each following its diffusers
//! scheduler step for step and loaded from the pipeline's `scheduler/` config.

pub mod ddim;
pub mod flow;

use std::path::Path;

/// The most training timesteps a scheduler config may name. Published models use 1000; the
/// schedules are built per request from this many points, so a config naming 2^40 would
/// allocate terabytes on the first request instead of being refused at load.
pub const MAX_TRAIN_TIMESTEPS: usize = 100_000;

/// Checks a scheduler config's `num_train_timesteps` (1..=[`MAX_TRAIN_TIMESTEPS`]).
pub(crate) fn check_train_timesteps(path: &Path, n: usize) -> crate::Result<()> {
    if n == 0 || n > MAX_TRAIN_TIMESTEPS {
        return Err(crate::Error::config(
            path,
            "num_train_timesteps",
            format!("{n}: expected 1..={MAX_TRAIN_TIMESTEPS} (published models use 1000)"),
        ));
    }
    Ok(())
}
