//! The bounds a component config's sizes are checked against before anything is sized by
//! them: values no published model comes near, refused by file and field.

use std::path::Path;

use crate::{Error, Result};

/// Most blocks of one streamed group a config may name (`num_layers`): the deepest published
/// DiTs and text encoders have well under 200. A config past it describes no real model, and
/// checking it against the weights would first build that many blocks' names.
pub const MAX_CONFIG_LAYERS: usize = 1024;
/// Most residual blocks per VAE level (`layers_per_block`, `num_res_blocks`; real VAEs: 2–3).
pub const MAX_CONFIG_BLOCKS_PER_LEVEL: usize = 64;
/// Most resolution levels of a VAE (`block_out_channels`, `dim_mult`; real VAEs: 4): each
/// doubles the upscale, which past this would overflow.
pub const MAX_CONFIG_LEVELS: usize = 8;
/// Largest latent side a config may name as the native size (`sample_size`; DiT-XL/2 at 512
/// px has 64).
pub const MAX_CONFIG_LATENT_SIDE: usize = 4096;

/// Refuses the first of `(field, value, bound)` whose value is over its bound, naming the
/// file, the field and the bound: a config value no real model has is refused before any
/// work is sized by it.
pub fn at_most(path: &Path, fields: &[(&str, usize, usize)]) -> Result<()> {
    match fields.iter().find(|(_, v, max)| v > max) {
        None => Ok(()),
        Some((field, v, max)) => Err(Error::config(
            path,
            *field,
            format!("{v} is over the bound of {max} this engine takes (no published model comes near it)"),
        )),
    }
}

/// [`at_most`] for a stack's `num_layers`, the bound every family's config shares.
pub fn layers_at_most(path: &Path, num_layers: usize) -> Result<()> {
    at_most(path, &[("num_layers", num_layers, MAX_CONFIG_LAYERS)])
}
