//! The shape every text family's request takes on a rank: one pass over the text
//! encoder's group that encodes the prompts once, then one pass per denoising step over
//! the step's group. [`EncodeOnce`] keeps that order, the step count and the encoded text;
//! a family writes only what its passes compute ([`EncodeThenSteps`]). A request under a
//! step cache ([`crate::cache`]) is driven here too: the family hands over its hidden
//! states and its output, the cache decides which blocks run.

use candle_core::Tensor;

use crate::cache::StepCacheRun;
use crate::execution::family::Task;
use crate::execution::need::Need;
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
    fn end_step(&mut self, text: &Self::Text, step: usize) -> Result<()> {
        let out = self.step_output(text, step)?;
        self.step_advance(text, step, out)
    }

    /// For the step caches: the hidden states the step's blocks transform, between
    /// [`Self::begin_step`] and the step's end (a family that offers caches has them).
    fn cache_hidden(&mut self) -> Option<&mut Tensor> {
        None
    }
    /// For a cache whose residual ends after the transformer's final norm
    /// ([`StepCacheRun::post_norm`]): the hidden states after the blocks, normed, which
    /// the step's output then reads as they are left.
    fn cache_normed_hidden(&mut self) -> Result<Option<&mut Tensor>> {
        Ok(None)
    }
    /// For a cache that decides from the latents before a step ([`StepCacheRun::gate`]):
    /// the latents [C, T, H, W] step `step` reads, as the transformer receives them, and
    /// the step's sigma.
    fn cache_gate(&self, _step: usize) -> Option<(Tensor, f64)> {
        None
    }
    /// For the step caches, the first half of [`Self::end_step`]: the transformer's
    /// output for every guidance row, before guidance.
    fn step_output(&mut self, _text: &Self::Text, _step: usize) -> Result<Tensor> {
        Err(crate::Error::bug(
            "step cache: this family splits no step end",
        ))
    }
    /// The second half: guide `out` and advance the latents.
    fn step_advance(&mut self, _text: &Self::Text, _step: usize, _out: Tensor) -> Result<()> {
        Err(crate::Error::bug(
            "step cache: this family splits no step end",
        ))
    }

    /// The output, with the encoded text when the encoding pass ran.
    fn finish(self, text: Option<Self::Text>) -> Result<Output>;
}

/// A [`Task`] that runs `T`'s encoding pass once, then its steps in order.
pub struct EncodeOnce<T: EncodeThenSteps> {
    inner: T,
    text: Option<T::Text>,
    step: usize,
    cache: Option<StepCacheRun>,
}

impl<T: EncodeThenSteps> EncodeOnce<T> {
    pub fn new(inner: T) -> Self {
        EncodeOnce {
            inner,
            text: None,
            step: 0,
            cache: None,
        }
    }

    /// Runs the steps under `cache` (none: every block of every step).
    pub fn with_cache(mut self, cache: Option<StepCacheRun>) -> Self {
        self.cache = cache;
        self
    }
}

/// Step `step`'s gate, for a cache that decides before the pass: its decision is ready
/// when the prefetcher asks what the pass needs.
fn gate<T: EncodeThenSteps>(
    inner: &T,
    cache: &mut Option<StepCacheRun>,
    step: usize,
) -> Result<()> {
    let Some(c) = cache.as_mut().filter(|c| c.gates_ahead()) else {
        return Ok(());
    };
    let Some(group) = inner.step_group(step) else {
        return Ok(());
    };
    let (latents, sigma) = inner
        .cache_gate(step)
        .ok_or_else(|| crate::Error::bug("step cache: the family hands over no latents"))?;
    c.gate(group, step, &latents, sigma)
}

/// The family's hidden states, which a family that offers caches must hand over.
fn hidden<T: EncodeThenSteps>(inner: &mut T) -> Result<&mut Tensor> {
    inner
        .cache_hidden()
        .ok_or_else(|| crate::Error::bug("step cache: the family hands over no hidden states"))
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

    fn needs(&self) -> Need {
        match (&self.text, &self.cache) {
            (Some(_), Some(c)) => self
                .inner
                .step_group(self.step)
                .map_or(Need::All, |g| c.need(g, 0)),
            _ => Need::All,
        }
    }

    fn needs_after(&self) -> Need {
        let Some(c) = &self.cache else {
            return Need::All;
        };
        let (now, after) = match &self.text {
            None => (None, self.inner.step_group(0)),
            Some(_) => (
                self.inner.step_group(self.step),
                self.inner.step_group(self.step + 1),
            ),
        };
        // The next pass over the same group is its second call from now.
        after.map_or(Need::All, |g| c.need(g, usize::from(now == Some(g))))
    }

    fn runs_block(&self, index: usize) -> bool {
        match (&self.text, &self.cache) {
            (Some(_), Some(c)) => c.runs(index),
            _ => true,
        }
    }

    fn begin(&mut self) -> Result<()> {
        match &mut self.text {
            None => self.inner.begin_encode(),
            Some(text) => {
                self.inner.begin_step(text, self.step)?;
                if let Some(c) = &mut self.cache {
                    let group = self.inner.step_group(self.step);
                    let group = group.ok_or_else(|| crate::Error::bug("step past the last"))?;
                    c.begin(group, hidden(&mut self.inner)?)?;
                }
                Ok(())
            }
        }
    }

    fn block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        let Some(text) = &self.text else {
            return self.inner.encode_block(index, w);
        };
        let Some(c) = &mut self.cache else {
            return self.inner.step_block(text, self.step, index, w);
        };
        if !c.runs(index) {
            return Ok(());
        }
        self.inner.step_block(text, self.step, index, w)?;
        c.after_block(index, hidden(&mut self.inner)?)
    }

    fn end(&mut self) -> Result<Option<(usize, usize)>> {
        let Some(text) = &self.text else {
            self.text = Some(self.inner.end_encode()?);
            gate(&self.inner, &mut self.cache, 0)?;
            return Ok(None);
        };
        match &mut self.cache {
            None => self.inner.end_step(text, self.step)?,
            Some(c) => {
                let x = if c.post_norm() {
                    self.inner.cache_normed_hidden()?.ok_or_else(|| {
                        crate::Error::bug("step cache: the family hands over no normed states")
                    })?
                } else {
                    hidden(&mut self.inner)?
                };
                c.end_blocks(x)?;
                let out = self.inner.step_output(text, self.step)?;
                let out = c.output(out)?;
                self.inner.step_advance(text, self.step, out)?;
            }
        }
        self.step += 1;
        gate(&self.inner, &mut self.cache, self.step)?;
        Ok(Some((self.step, self.inner.total())))
    }

    fn finish(self: Box<Self>) -> Result<Output> {
        let EncodeOnce {
            inner, text, cache, ..
        } = *self;
        let mut out = inner.finish(text)?;
        out.cache = cache.map(StepCacheRun::into_report);
        Ok(out)
    }
}
