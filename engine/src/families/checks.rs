//! Request checks text-to-video families share: a clip's size and length in what the VAE
//! makes and within the model's limits, guidance scales, prompt lengths, and initial
//! latents of the family's shape (and the noise in their place). Each refusal names its
//! field.

use candle_core::{DType, Tensor};

use crate::bounds::{Dimension, ModelLimits};
use crate::execution::weights::seeded_noise;
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
    if r.frames == 0 || !(r.frames - 1).is_multiple_of(tup) {
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

/// A clip's latent shape, [1, `channels`, (F − 1) / `tup` + 1, H / `up`, W / `up`], for a
/// VAE of `up` pixels per latent across and `tup` frames per latent frame after the first.
pub fn clip_latents(r: &Request, channels: usize, (up, tup): (usize, usize)) -> [usize; 5] {
    [
        1,
        channels,
        (r.frames.max(1) - 1) / tup + 1,
        r.height / up,
        r.width / up,
    ]
}

/// A request of `tokens` latent tokens split `sp` ways: every rank of its group needs at
/// least one token.
pub fn split_tokens(tokens: usize, sp: usize) -> Result<()> {
    // The server's check at submit, the same one.
    Ok(crate::bounds::split_tokens(tokens as u64, sp as u64)?)
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

/// The latents a request starts from: its initial latents (checked by [`init_latents`])
/// in f32, or else noise of `shape` from its seed.
pub fn start_latents(r: &Request, shape: &[usize]) -> Result<Tensor> {
    match &r.init_latents {
        Some(l) => Ok(l.to_dtype(DType::F32)?),
        None => seeded_noise(r.seed, shape),
    }
}

/// Guidance scales finite and ≥ 0; a second scale only for a model of two `experts`.
pub fn guidance(r: &Request, experts: usize) -> Result<()> {
    for (field, g) in [("guidance", Some(r.guidance)), ("guidance_2", r.guidance_2)] {
        if let Some(g) = g.filter(|g| !(g.is_finite() && *g >= 0.0)) {
            return Err(Error::invalid(
                field,
                format!("{g}: must be a finite number ≥ 0"),
            ));
        }
    }
    if r.guidance_2.is_some() && experts < 2 {
        return Err(Error::invalid(
            "guidance_2",
            "this model has one transformer; a second guidance scale needs two experts",
        ));
    }
    Ok(())
}

/// The prompt and the negative prompt within `max_sequence_length` tokens as `count` counts
/// them (`counted` says what the count includes, for the refusal).
pub fn prompt_lengths(
    r: &Request,
    texts: [&str; 2],
    counted: &str,
    count: impl Fn(&str) -> Result<usize>,
) -> Result<()> {
    if r.max_sequence_length == 0 {
        return Err(Error::invalid("max_sequence_length", "must be at least 1"));
    }
    for (field, text) in ["prompt", "negative_prompt"].into_iter().zip(texts) {
        let n = count(text)?;
        if n > r.max_sequence_length {
            return Err(Error::invalid(
                field,
                format!(
                    "{n} tokens{counted} is over the limit of {} (max_sequence_length)",
                    r.max_sequence_length
                ),
            ));
        }
    }
    Ok(())
}

/// Width, height and, for a clip (`frames`), frames within the model's `limits` (what its
/// rotary tables place); the refusal names the first dimension past its bound.
pub fn within_limits(r: &Request, limits: &ModelLimits, frames: bool) -> Result<()> {
    let mut asked = vec![
        (Dimension::Width, r.width as u64),
        (Dimension::Height, r.height as u64),
    ];
    if frames {
        asked.push((Dimension::Frames, r.frames as u64));
    }
    match limits.beyond(&asked) {
        Some(b) => Err(Error::invalid(b.dimension.request_field(), b.to_string())),
        None => Ok(()),
    }
}
