//! The shape every text family's request takes on a rank: one pass over the text
//! encoder's group that encodes the prompts once, then one pass per denoising step over
//! the step's group. [`EncodeOnce`] keeps that order, the step count and the encoded text;
//! a family writes only what its passes compute ([`EncodeThenSteps`]).

use crate::execution::family::Task;
use crate::execution::weights::Weights;
use crate::execution::work::Output;
use crate::Result;

/// What one family's request computes in each pass; [`EncodeOnce`] decides which pass
/// runs when.
pub trait EncodeThenSteps: Send {
    /// What the encoding pass leaves for every step (the prompts' embeddings, or their
    /// keys and values).
    type Text: Send;

    /// The group of the text encoder's blocks.
    fn encoder_group(&self) -> usize;
    /// The group step `step` streams; `None` past the last step.
    fn step_group(&self, step: usize) -> Option<usize>;
    /// The number of denoising steps.
    fn total(&self) -> usize;

    fn begin_encode(&mut self) -> Result<()>;
    fn encode_block(&mut self, index: usize, w: &dyn Weights) -> Result<()>;
    fn end_encode(&mut self) -> Result<Self::Text>;

    /// Before step `step`'s pass (which may note what it reads in `text`).
    fn begin_step(&mut self, text: &mut Self::Text, step: usize) -> Result<()>;
    fn step_block(
        &mut self,
        text: &Self::Text,
        step: usize,
        index: usize,
        w: &dyn Weights,
    ) -> Result<()>;
    /// After step `step`'s pass: guide and advance the latents.
    fn end_step(&mut self, text: &Self::Text, step: usize) -> Result<()>;

    /// The output, with the encoded text when the encoding pass ran.
    fn finish(self, text: Option<Self::Text>) -> Result<Output>;
}

/// A [`Task`] that runs `T`'s encoding pass once, then its steps in order.
pub struct EncodeOnce<T: EncodeThenSteps> {
    inner: T,
    text: Option<T::Text>,
    step: usize,
}

impl<T: EncodeThenSteps> EncodeOnce<T> {
    pub fn new(inner: T) -> Self {
        EncodeOnce {
            inner,
            text: None,
            step: 0,
        }
    }
}

impl<T: EncodeThenSteps> Task for EncodeOnce<T> {
    fn wants(&self) -> Option<usize> {
        match &self.text {
            None => Some(self.inner.encoder_group()),
            Some(_) => self.inner.step_group(self.step),
        }
    }

    fn wants_after(&self) -> Option<usize> {
        match &self.text {
            None => self.inner.step_group(0),
            Some(_) => self.inner.step_group(self.step + 1),
        }
    }

    fn begin(&mut self) -> Result<()> {
        match &mut self.text {
            None => self.inner.begin_encode(),
            Some(text) => self.inner.begin_step(text, self.step),
        }
    }

    fn block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        match &self.text {
            None => self.inner.encode_block(index, w),
            Some(text) => self.inner.step_block(text, self.step, index, w),
        }
    }

    fn end(&mut self) -> Result<Option<(usize, usize)>> {
        let Some(text) = &self.text else {
            self.text = Some(self.inner.end_encode()?);
            return Ok(None);
        };
        self.inner.end_step(text, self.step)?;
        self.step += 1;
        Ok(Some((self.step, self.inner.total())))
    }

    fn finish(self: Box<Self>) -> Result<Output> {
        let EncodeOnce { inner, text, .. } = *self;
        inner.finish(text)
    }
}
