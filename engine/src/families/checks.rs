//! Request checks text-to-video families share: a clip's size and length in what the VAE
//! makes, and initial latents of the family's shape. Each refusal names its field.

use crate::execution::work::Request;
use crate::{Error, Result};

/// Width and height positive multiples of `unit` pixels (VAE upscale × patch), and frames
/// `tup`k + 1 (the VAE turns each latent frame after the first into `tup`).
pub fn clip_shape(r: &Request, unit: usize, tup: usize) -> Result<()> {
    for (field, v) in [("width", r.width), ("height", r.height)] {
        if v == 0 || v % unit != 0 {
            return Err(Error::invalid(
                field,
                format!("{v}: must be a positive multiple of {unit}"),
            ));
        }
    }
    if r.frames == 0 || (r.frames - 1) % tup != 0 {
        return Err(Error::invalid(
            "frames",
            format!(
                "{}: must be of the form {tup}k + 1 (1, {}, {}, ...): the VAE turns each latent frame after the first into {tup}",
                r.frames,
                tup + 1,
                2 * tup + 1
            ),
        ));
    }
    Ok(())
}

/// The request's initial latents, when given, of shape `want`.
pub fn init_latents(r: &Request, want: &[usize]) -> Result<()> {
    match &r.init_latents {
        Some(l) if l.dims() != want => Err(Error::invalid(
            "init_latents",
            format!("shape {:?}, expected {want:?}", l.dims()),
        )),
        _ => Ok(()),
    }
}
