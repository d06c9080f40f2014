//! What every family's denoising steps do the same way on a rank: classifier-free
//! guidance's `uncond + g (cond − uncond)` over a pass's predictions, and the request's
//! output moved to the CPU. The families differ in what they predict and decode, not in
//! these, so the arithmetic (and its order, which the latents' bits follow) is written once.

use candle_core::{Device, Tensor};

use crate::execution::work::Output;
use crate::{Error, Result};

/// Classifier-free guidance: `uncond + scale (cond − uncond)`.
pub fn guide(cond: &Tensor, uncond: &Tensor, scale: f32) -> Result<Tensor> {
    Ok((uncond + ((cond - uncond)? * scale as f64)?)?)
}

/// The step's prediction from a pass over one sequence or two: the conditional
/// prediction alone, or `combine`d with the unconditional one that follows it.
pub fn guided(
    mut predictions: impl Iterator<Item = Result<Tensor>>,
    combine: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let cond = predictions
        .next()
        .ok_or_else(|| Error::bug("step: no activations after the pass"))??;
    match predictions.next() {
        Some(uncond) => combine(&cond, &uncond?),
        None => Ok(cond),
    }
}

/// [`guided`] over the rows of `out` [rows, ..] (the conditional prediction first), as a
/// step cache hands a step's output back.
pub fn guided_rows(
    out: &Tensor,
    combine: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let rows = (0..out.dim(0)?).map(|r| Ok(out.narrow(0, r, 1)?));
    guided(rows, combine)
}

/// A request's output on the CPU: its final `latents`, the `image` decoded from them where
/// the rank decodes, and the text embeddings it was conditioned on where it keeps them.
pub fn output(
    latents: &Tensor,
    image: Option<Result<Tensor>>,
    text_embeddings: Option<Tensor>,
) -> Result<Output> {
    let cpu = |t: Tensor| t.to_device(&Device::Cpu);
    Ok(Output {
        image: image.transpose()?.map(cpu).transpose()?,
        latents: cpu(latents.clone())?,
        text_embeddings: text_embeddings.map(cpu).transpose()?,
        cache: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guidance_moves_from_the_unconditional_prediction_by_the_scale() {
        let cond = Tensor::new(&[3f32, 1.0], &Device::Cpu).unwrap();
        let uncond = Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap();
        let g = guide(&cond, &uncond, 2.5).unwrap();
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![6.0, 1.0]);
        let one = guided([Ok(cond.clone())].into_iter(), |_, _| unreachable!()).unwrap();
        assert_eq!(one.to_vec1::<f32>().unwrap(), vec![3.0, 1.0]);
        let two = guided([Ok(cond), Ok(uncond)].into_iter(), |c, u| guide(c, u, 0.0)).unwrap();
        assert_eq!(two.to_vec1::<f32>().unwrap(), vec![1.0, 1.0]);
        assert!(guided(std::iter::empty(), |c, _| Ok(c.clone())).is_err());
    }
}
