//! The checkpoint profile: everything a planner needs to size a deployment, computed
//! from headers and configs only (no weight bytes are read), so it costs milliseconds
//! on a checkpoint of any size.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::family::FamilyCheckpoint;
use crate::layout::GroupLayout;
use crate::memory::{self, GroupBytes, Placement};
use crate::{Error, Result};

/// Device memory one request needs beside the weights, as a function of its size.
/// Computed by the engine from the family's shapes (f32 activations), so the planner
/// never guesses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ActivationCost {
    /// Image pixels per transformer token: (VAE upscale × patch size)².
    pub pixels_per_token: u64,
    /// Bytes live per token per sample at the peak of a block.
    pub bytes_per_token: u64,
    /// Bytes per (token, token) pair per sample: the attention scores of all heads, for
    /// families whose attention materialises them.
    pub bytes_per_token_pair: u64,
    /// Bytes of attention scores at any time, for families whose attention runs in query
    /// chunks within this budget (a fixed cost, whatever the length).
    #[serde(default)]
    pub attention_bytes: u64,
    /// Bytes per output pixel at the peak of the VAE decoder (one image or one chunk of
    /// frames at a time).
    pub vae_bytes_per_pixel: u64,
    /// Video frames per latent frame (1 for image families; Wan: 4, the first frame
    /// alone): a clip of F frames has (F - 1) / this + 1 latent frames.
    #[serde(default = "one")]
    pub frames_per_latent: u64,
    /// Video frames the decoder holds at full resolution at its peak (its chunk).
    #[serde(default = "one")]
    pub decoder_frames: u64,
    /// Bytes per prompt token per sample live at a transformer block's peak, for text
    /// families: the text keys and values of cross-attention (or a joint block's text
    /// stream) beside the latent tokens.
    #[serde(default)]
    pub bytes_per_text_token: u64,
    /// Bytes per prompt token per sequence at the peak of a text-encoder layer (its
    /// hidden states, projections and feed-forward), for families that encode prompts on
    /// the device.
    #[serde(default)]
    pub encoder_bytes_per_token: u64,
    /// Bytes per (token, token) pair per sequence of a text-encoder layer whose attention
    /// materialises its scores (scores, softmax and position bias of all heads).
    #[serde(default)]
    pub encoder_bytes_per_token_pair: u64,
    /// Samples a guided output runs as at once: 2 where classifier-free guidance batches
    /// the conditional and unconditional passes (and encodes the negative prompt beside
    /// the prompt), 1 where a family runs them one after the other.
    #[serde(default = "two")]
    pub guidance_samples: u64,
    /// Bytes per latent token per sample that sequence parallelism adds to a rank's block
    /// peak: the attention's queries, keys, values and output held in both layouts while
    /// an all-to-all moves them (tokens split, then heads split). 0 for a family whose
    /// transformer does not split its sequence.
    #[serde(default)]
    pub exchange_bytes_per_token: u64,
}

fn one() -> u64 {
    1
}

fn two() -> u64 {
    2
}

/// The shape of a request as the activation formula reads it: the size of each output,
/// how many go through at once, whether guided, and its prompt's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestShape {
    pub width: u64,
    pub height: u64,
    pub frames: u64,
    /// Outputs computed together.
    pub batch: u64,
    /// Classifier-free guidance is on.
    pub guidance: bool,
    /// Tokens of the (padded) prompt: its `max_sequence_length`; 0 for a family that reads
    /// no prompt.
    pub text_tokens: u64,
}

impl ActivationCost {
    /// Peak activation bytes of a request of `shape`. Saturates at `u64::MAX` (see
    /// [`Self::checked_bytes`]).
    pub fn bytes(&self, shape: &RequestShape) -> u64 {
        self.checked_bytes(shape).unwrap_or(u64::MAX)
    }

    /// The one activation formula the engine and the planner share: the largest of a
    /// transformer block's peak (latent tokens, their attention, the prompt's tokens beside
    /// them), a text-encoder layer's (every sequence of the prompt) and the decoder's;
    /// `None` when a request that large would overflow (no device could hold it).
    pub fn checked_bytes(&self, shape: &RequestShape) -> Option<u64> {
        self.checked_bytes_per_rank(shape, 1)
    }

    /// [`Self::checked_bytes`] on each rank of a group of `sp` that splits the request's
    /// sequence ([`crate::topology`]): the latent tokens' terms on the largest share of
    /// the tokens (the scores' term too: each rank's heads see every key, so its share of
    /// the token pairs is its share of the heads), the exchange's buffers beside them when
    /// `sp > 1`; the prompt, the text encoder and the decoder stay whole on every rank.
    pub fn checked_bytes_per_rank(&self, shape: &RequestShape, sp: u64) -> Option<u64> {
        let sp = sp.max(1);
        let latent_frames = (shape.frames.max(1) - 1) / self.frames_per_latent.max(1) + 1;
        let pixels = shape.width as u128 * shape.height as u128;
        let tokens =
            (pixels * latent_frames as u128).div_ceil(self.pixels_per_token.max(1) as u128);
        let text = shape.text_tokens as u128;
        let per_output = if shape.guidance {
            self.guidance_samples.max(1) as u128
        } else {
            1
        };
        let samples = shape.batch as u128 * per_output;
        let share = tokens.div_ceil(sp as u128);
        let exchange = if sp > 1 {
            self.exchange_bytes_per_token as u128
        } else {
            0
        };
        let transformer = samples
            * ((self.bytes_per_token as u128 + exchange) * share
                + self.bytes_per_token_pair as u128 * tokens * share
                + self.bytes_per_text_token as u128 * text)
            + self.attention_bytes as u128;
        let encoder = samples
            * (self.encoder_bytes_per_token as u128 * text
                + self.encoder_bytes_per_token_pair as u128 * text * text);
        let peak = transformer
            .max(encoder)
            .max(self.decode_peak(shape.width, shape.height));
        (peak <= (u64::MAX / 4) as u128).then_some(peak as u64)
    }

    /// Peak bytes of decoding one output of `width × height` (an image, or a clip of any
    /// length: the decoder holds one chunk of frames and its cache at a time): the VAE
    /// term of [`Self::checked_bytes`], and what a decoder beside the ranks keeps free on
    /// their device ([`crate::decode::DecoderBytes::peak`]). `None` as there.
    pub fn decode_bytes(&self, width: u64, height: u64) -> Option<u64> {
        let peak = self.decode_peak(width, height);
        (peak <= (u64::MAX / 4) as u128).then_some(peak as u64)
    }

    fn decode_peak(&self, width: u64, height: u64) -> u128 {
        let pixels = width as u128 * height as u128;
        (self.vae_bytes_per_pixel as u128 * self.decoder_frames.max(1) as u128)
            .saturating_mul(pixels)
    }
}

/// One component's share of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ComponentProfile {
    /// Its folder in the pipeline (`text_encoder`, `transformer`, `transformer_2`, `vae`).
    pub name: String,
    pub bytes: u64,
    /// Blocks streamed from this component (0: it stays resident or is the decoder).
    pub blocks: usize,
    pub largest_block_bytes: u64,
}

/// What a checkpoint costs to hold and to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub family: String,
    /// Every weight byte in the folder (all components).
    pub total_bytes: u64,
    /// Bytes of the transformer components (both experts of a two-expert model).
    pub transformer_bytes: u64,
    pub vae_bytes: u64,
    /// Each component with weights, in pipeline order.
    #[serde(default)]
    pub components: Vec<ComponentProfile>,
    pub files: usize,
    /// Streamed blocks over every group (text encoder, transformers).
    pub blocks: usize,
    /// Bytes of each block, group after group.
    pub block_bytes: Vec<u64>,
    pub largest_block_bytes: u64,
    /// Per dtype, the most bytes any block of any group holds of it (sizes a slot for
    /// any dp: every group streams through the same slots).
    pub max_block_bytes_by_dtype: BTreeMap<String, u64>,
    /// Bytes outside the blocks that stay resident on the device (prologues and
    /// epilogues; not the decoder, which is `vae_bytes`).
    pub outside_block_bytes: u64,
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// The image size the model was trained at.
    pub native_width: u64,
    pub native_height: u64,
    pub activation: ActivationCost,
    /// Bytes of the VAE decoder's weights, which every rank that decodes keeps on its
    /// device (the rest of the VAE, its encoder, is never loaded).
    #[serde(default)]
    pub decoder_bytes: u64,
    /// Each streamed group's block bytes by dtype (text encoder, transformers), which the
    /// memory model lays out for any dp ([`crate::memory`]).
    #[serde(default)]
    pub groups: Vec<GroupBytes>,
    /// The largest request the model itself can run (its position tables): the planner
    /// refuses a workload beyond it, as the engine refuses such bounds at start. Empty
    /// (no limit but memory) in profiles of agents that predate it.
    #[serde(default)]
    pub limits: crate::bounds::ModelLimits,
    /// What one block of each of `groups` computes (same order), as the family declares
    /// it: the step-time model's input ([`crate::timing`]). Empty in profiles of agents
    /// that predate it ([`Self::group_compute`] then derives it from the bytes).
    #[serde(default)]
    pub compute: Vec<crate::family::GroupCompute>,
}

impl Profile {
    /// Profiles a pipeline folder of `family` opened from its headers and configs (the
    /// engine's registry opens it: `layerwise_engine::families::profile`).
    pub fn of(family: &str, ck: &dyn FamilyCheckpoint) -> Result<Profile> {
        let mut by_dtype: BTreeMap<String, u64> = BTreeMap::new();
        let mut components = Vec::new();
        let (mut block_bytes, mut max_by_dtype) = (Vec::new(), BTreeMap::<String, u64>::new());
        let groups = ck.groups();
        for (name, c) in ck.components() {
            for h in &c.files {
                for t in &h.tensors {
                    *by_dtype.entry(format!("{:?}", t.dtype)).or_default() += t.len;
                }
            }
            let (mut blocks, mut largest) = (0, 0);
            for (_, g) in groups.iter().filter(|(comp, _)| *comp == name) {
                let mut bytes = vec![0u64; g.count];
                let mut dtypes: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); g.count];
                for h in &c.files {
                    for t in &h.tensors {
                        if let Some(b) = g.block_of(&t.name).filter(|b| *b < g.count) {
                            bytes[b] += t.len;
                            *dtypes[b].entry(format!("{:?}", t.dtype)).or_default() += t.len;
                        }
                    }
                }
                for m in &dtypes {
                    for (k, v) in m {
                        let e = max_by_dtype.entry(k.clone()).or_default();
                        *e = (*e).max(*v);
                    }
                }
                blocks += g.count;
                largest = bytes.iter().copied().max().unwrap_or(0).max(largest);
                block_bytes.extend(bytes);
            }
            components.push(ComponentProfile {
                name: name.to_string(),
                bytes: c.tensor_bytes(),
                blocks,
                largest_block_bytes: largest,
            });
        }
        let sum = |pred: &dyn Fn(&str) -> bool| {
            components
                .iter()
                .filter(|c| pred(&c.name))
                .map(|c| c.bytes)
                .sum()
        };
        // Each group's bytes as the engine lays it out: one code path for both.
        let mut group_bytes = Vec::with_capacity(groups.len());
        for (name, g) in &groups {
            let (_, c) = ck
                .components()
                .into_iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| Error::invalid("profile", format!("no component {name}")))?;
            let layout = GroupLayout::new(c, &g.block, g.count, |i| g.block_prefix(i), 1)?;
            group_bytes.push(GroupBytes::of(name, &layout));
        }
        let (native_width, native_height) = ck.native_size();
        Ok(Profile {
            family: family.into(),
            total_bytes: ck.total_bytes(),
            transformer_bytes: sum(&|n| n.starts_with("transformer")),
            vae_bytes: sum(&|n| n == "vae"),
            files: ck.components().iter().map(|(_, c)| c.files.len()).sum(),
            blocks: block_bytes.len(),
            largest_block_bytes: block_bytes.iter().copied().max().unwrap_or(0),
            block_bytes,
            max_block_bytes_by_dtype: max_by_dtype,
            outside_block_bytes: ck.resident_device_bytes(),
            bytes_by_dtype: by_dtype,
            native_width: native_width as u64,
            native_height: native_height as u64,
            activation: ck.activation_cost(),
            components,
            decoder_bytes: ck.decoder_bytes(),
            groups: group_bytes,
            limits: ck.limits(),
            compute: ck.group_compute(),
        })
    }

    /// What one block of each group computes: the family's declaration, or where the
    /// profile lacks one (an older agent's), the default derived from the groups' bytes
    /// ([`crate::timing::default_compute`]).
    pub fn group_compute(&self) -> Vec<crate::family::GroupCompute> {
        if self.compute.len() == self.groups.len() {
            self.compute.clone()
        } else {
            crate::timing::default_compute(&self.groups)
        }
    }

    /// Bytes of one device slot when blocks are split `dp` ways (padding included) and
    /// every group streams: the memory model's slot.
    pub fn slot_bytes(&self, dp: u64) -> u64 {
        let p = Placement::new(crate::Strategy::Offload, dp, 1, self.groups.len());
        memory::slot_bytes(&self.groups, &p)
    }
}
