//! The seam between the rank loop and a model family. The rank loop, the pipeline and the
//! lockstep know nothing family-specific: a family says which groups of blocks stream
//! (and from which mapped component), what each rank keeps resident, and how one request
//! walks through passes over those groups. Each pass runs over one group's blocks in
//! order; a request may need passes over several groups (a text encoder once, then one of
//! two experts per denoising step), and every rank of the pod runs the same pass at the
//! same time, computing only when its own request wants that group.

use candle_core::{DType, Device, Tensor};

use super::need::Need;
use super::seq::Split;
use super::weights::Weights;
use super::work::{Output, Request};
use crate::checkpoint::Mapped;
use crate::layout::GroupLayout;
use crate::Result;
use layerwise_core::family::FamilyCheckpoint;

/// A family's runtime over one opened, mapped pipeline folder. Shared by every rank.
pub trait FamilyRuntime: Send + Sync {
    /// The family's name (`dit`, `wan`).
    fn name(&self) -> &'static str;
    /// The checked folder this runtime maps: its groups, sizes and byte counts.
    fn checkpoint(&self) -> &dyn FamilyCheckpoint;
    /// Each streamed group's block layout for `dp` ranks, in group order: each of the
    /// checkpoint's groups over its mapped component.
    fn layouts(&self, dp: usize) -> Result<Vec<GroupLayout>> {
        self.checkpoint()
            .groups()
            .iter()
            .zip(self.mappings())
            .map(|((_, g), m)| {
                GroupLayout::new(&m.component, &g.block, g.count, |i| g.block_prefix(i), dp)
            })
            .collect::<layerwise_core::Result<_>>()
            .map_err(Into::into)
    }
    /// Each streamed group's mapped component (same order as [`Self::layouts`]).
    fn mappings(&self) -> Vec<Mapped>;
    /// Each streamed group's pipeline component (`text_encoder`, `transformer`, ...; same
    /// order as [`Self::layouts`]).
    fn group_components(&self) -> Vec<String> {
        self.checkpoint()
            .groups()
            .into_iter()
            .map(|(c, _)| c.to_string())
            .collect()
    }
    /// The image size the model was trained at, `(width, height)` in pixels.
    fn native_size(&self) -> (usize, usize) {
        self.checkpoint().native_size()
    }
    /// The number of classes of a class-conditional family.
    fn classes(&self) -> Option<usize> {
        None
    }
    /// The class a name picks (one of the checkpoint's `id2label` names, in any case), for
    /// class-conditional families whose folder names its classes.
    fn class_named(&self, _name: &str) -> Option<u32> {
        None
    }
    /// How clips are shaped, for a family that makes them; `None` for image-only families.
    fn video(&self) -> Option<VideoSpec> {
        None
    }
    /// Steps and guidance scale of a request that names neither.
    fn defaults(&self) -> (usize, f32);
    /// Whether `req` runs under classifier-free guidance, as the family's diffusers pipeline
    /// decides: here a scale above 1 (`WanPipeline`, `DiTPipeline`); a family whose rule
    /// differs says so. What the rank runs and what admission reserves both read it.
    fn guided(&self, req: &Request) -> bool {
        req.guidance > 1.0
    }
    /// Checks a request before it takes a rank (a clear error naming the field).
    fn validate(&self, req: &Request) -> Result<()>;
    /// Device bytes a rank keeps outside the slots: prologues, epilogues and, when
    /// decoding on the rank, the decoder, at their size in the checkpoint (what the
    /// planner reads from a profile).
    fn resident_bytes(&self, decode: bool) -> u64 {
        let ck = self.checkpoint();
        ck.resident_device_bytes() + if decode { ck.decoder_bytes() } else { 0 }
    }
    /// As [`Self::resident_bytes`], at the size they take once loaded for compute in
    /// `dtype` (a bf16 checkpoint computed in f32 holds its prologue at twice its file
    /// size; decoders are held in f32): what a rank charges its device budget.
    fn stored_resident_bytes(&self, decode: bool, dtype: DType) -> u64 {
        let ck = self.checkpoint();
        ck.resident_stored_bytes(dtype.size_in_bytes() as u64)
            + if decode {
                ck.decoder_stored_bytes(4)
            } else {
                0
            }
    }
    /// The compute dtypes this family's forward passes run in ([`super::dtype`]): what its
    /// checkpoint declares ([`FamilyCheckpoint::compute_dtypes`]), which the profile
    /// carries to the planner.
    fn compute_dtypes(&self) -> Vec<DType> {
        self.checkpoint()
            .compute_dtypes()
            .iter()
            .map(|e| super::dtype::candle(*e))
            .collect()
    }
    /// Loads one rank's resident weights onto `device`, for compute in `dtype` (one of
    /// [`Self::compute_dtypes`]).
    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>>;
    /// The decoder alone (for a server's decode thread).
    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>>;
    /// The group a new request's first pass runs over (a prefetch hint for queued work).
    fn first_group(&self) -> usize {
        0
    }
    /// The most ranks one request's sequence may split across ([`Split`]), with what
    /// bounds it (its attention heads, in the units an exchange moves them in); `None`
    /// for a family whose tasks compute the whole sequence on one rank.
    fn sequence_parallel(&self) -> Option<(usize, String)> {
        None
    }
    /// The step caches this family's denoising passes honour ([`crate::cache`]); a
    /// request asking for another is refused by name.
    fn step_caches(&self) -> &'static [crate::cache::CacheKind] {
        &[]
    }
}

/// One rank's resident weights; starts requests on that rank.
pub trait RankModel: Send {
    /// Prepares `req` (initial noise drawn on the host, so every device starts from the
    /// same bits) as a task on this rank's device, computing `split`'s share of its
    /// sequence (the whole of it unless the family says it splits sequences,
    /// [`FamilyRuntime::sequence_parallel`]).
    fn start(&self, req: Request, split: Split) -> Result<Box<dyn Task>>;
}

/// One request on a rank: a sequence of passes, then an output.
pub trait Task: Send {
    /// The group this task's next pass runs over; `None` once it has nothing left to
    /// stream (its output can be finished).
    fn wants(&self) -> Option<usize>;
    /// The group it will want after the pass it wants now has run (prefetch hint).
    fn wants_after(&self) -> Option<usize>;
    /// Which blocks of the pass over [`Self::wants`]'s group it computes, as known
    /// before the pass (a step cache's schedule); every block unless it says otherwise.
    fn needs(&self) -> Need {
        Need::All
    }
    /// The same for the pass over [`Self::wants_after`]'s group (prefetch hint).
    fn needs_after(&self) -> Need {
        Need::All
    }
    /// Whether it computes block `index` of the pass in progress (after
    /// [`Self::begin`]); a block it does not compute is not handed to [`Self::block`].
    fn runs_block(&self, _index: usize) -> bool {
        true
    }
    /// Before the pass over [`Self::wants`]'s group.
    fn begin(&mut self) -> Result<()>;
    /// Block `index` of that group, with its weights.
    fn block(&mut self, index: usize, weights: &dyn Weights) -> Result<()>;
    /// After the pass; returns `(step, total)` when the pass completed a denoising step.
    fn end(&mut self) -> Result<Option<(usize, usize)>>;
    /// The output: final latents, decoded when the rank has a decoder.
    fn finish(self: Box<Self>) -> Result<Output>;
}

/// A clip-making family's frame rules and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoSpec {
    /// A clip holds 1 + k × this many frames (the VAE's temporal upscale).
    pub frames_per_latent: usize,
    /// Frames of a request that names none.
    pub default_frames: usize,
    /// Frames per second a clip is written at when the request names no rate.
    pub default_fps: f64,
}

impl VideoSpec {
    /// The fewest frames of a valid clip that last at least `frames` frames: the next
    /// 1 + k × `frames_per_latent` at or above it.
    pub fn round_up(&self, frames: usize) -> usize {
        let unit = self.frames_per_latent.max(1);
        (frames.max(1) - 1).div_ceil(unit) * unit + 1
    }
}

/// Turns final latents into pixels in [-1, 1] ([3, H, W] or [T, 3, H, W]).
pub trait Decoder: Send {
    fn decode(&self, latents: &Tensor) -> Result<Tensor>;

    /// As [`Self::decode`], handing the frames to `f` as they are decoded, each batch as
    /// [n, 3, H, W] (an image is one batch of one frame), so a caller can report progress
    /// and hold only what it keeps.
    fn decode_frames(
        &self,
        latents: &Tensor,
        f: &mut dyn FnMut(Tensor) -> Result<()>,
    ) -> Result<()> {
        let x = self.decode(latents)?;
        f(if x.rank() == 3 { x.unsqueeze(0)? } else { x })
    }

    /// Decode within `budget` bytes at the peak (the plan's decode budget,
    /// [`crate::decode::DecodeCost::choose`]), for decoders that split their decode.
    fn set_decode_budget(&mut self, _budget: u64) {}
}
