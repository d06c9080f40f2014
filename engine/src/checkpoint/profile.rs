//! The checkpoint profile: everything a planner needs to size a deployment, computed
//! from headers and configs only (no weight bytes are read), so it costs milliseconds
//! on a checkpoint of any size.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::families::dit::DitCheckpoint;
use crate::families::dit::DitConfig;
use crate::layout::ALIGN;
use crate::Result;

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
    /// Bytes per (token, token) pair per sample: the attention scores of all heads.
    pub bytes_per_token_pair: u64,
    /// Bytes per output pixel at the peak of the VAE decoder (one image at a time).
    pub vae_bytes_per_pixel: u64,
}

impl ActivationCost {
    /// Peak activation bytes for `batch` images of `width × height` (× `frames`), with or
    /// without classifier-free guidance (which doubles the transformer's batch).
    pub fn bytes(&self, width: u64, height: u64, frames: u64, batch: u64, guidance: bool) -> u64 {
        let tokens = (width * height * frames.max(1)).div_ceil(self.pixels_per_token.max(1));
        let samples = batch * if guidance { 2 } else { 1 };
        let transformer =
            samples * (self.bytes_per_token * tokens + self.bytes_per_token_pair * tokens * tokens);
        let vae = self.vae_bytes_per_pixel * width * height * frames.max(1);
        transformer.max(vae)
    }
}

/// What a checkpoint costs to hold and to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub family: String,
    /// Every weight byte in the folder (transformer and VAE).
    pub total_bytes: u64,
    pub transformer_bytes: u64,
    pub vae_bytes: u64,
    pub files: usize,
    pub blocks: usize,
    /// Bytes of each block, in order.
    pub block_bytes: Vec<u64>,
    pub largest_block_bytes: u64,
    /// Per dtype, the most bytes any block holds of it (sizes a slot for any dp).
    pub max_block_bytes_by_dtype: BTreeMap<String, u64>,
    /// Transformer bytes outside the blocks (stay resident on the device).
    pub outside_block_bytes: u64,
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// The image size the model was trained at.
    pub native_width: u64,
    pub native_height: u64,
    pub activation: ActivationCost,
}

impl Profile {
    /// Profiles the DiT pipeline folder at `root`, reading headers and configs only.
    pub fn read(root: &Path) -> Result<Profile> {
        Ok(Self::of(&DitCheckpoint::open(root)?))
    }

    pub fn of(ck: &DitCheckpoint) -> Profile {
        let cfg = &ck.config;
        let mut block_bytes = vec![0u64; cfg.num_layers];
        let mut block_dtype: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); cfg.num_layers];
        let mut outside = 0;
        let mut by_dtype: BTreeMap<String, u64> = BTreeMap::new();
        for h in ck.transformer.files.iter().chain(&ck.vae.files) {
            for t in &h.tensors {
                *by_dtype.entry(format!("{:?}", t.dtype)).or_default() += t.len;
            }
        }
        for h in &ck.transformer.files {
            for t in &h.tensors {
                match DitConfig::block_of(&t.name) {
                    Some(b) => {
                        block_bytes[b] += t.len;
                        *block_dtype[b].entry(format!("{:?}", t.dtype)).or_default() += t.len;
                    }
                    None => outside += t.len,
                }
            }
        }
        let mut max_by_dtype: BTreeMap<String, u64> = BTreeMap::new();
        for m in &block_dtype {
            for (k, v) in m {
                let e = max_by_dtype.entry(k.clone()).or_default();
                *e = (*e).max(*v);
            }
        }
        let (transformer_bytes, vae_bytes) = (ck.transformer.tensor_bytes(), ck.vae.tensor_bytes());
        let up = ck.vae_config.upscale() as u64;
        let d = cfg.hidden() as u64;
        let p = cfg.patch() as u64;
        let ch = &ck.vae_config.block_out_channels;
        let activation = ActivationCost {
            pixels_per_token: (up * p) * (up * p),
            // x, norm(x), q, k, v, attention out, 4d MLP hidden before and after GELU,
            // plus the unpatchified output: f32 each.
            bytes_per_token: 4 * (10 * d + 2 * p * p * cfg.out() as u64),
            // Scores and their softmax, per head.
            bytes_per_token_pair: 4 * 2 * cfg.num_attention_heads as u64,
            // At full resolution the decoder holds about four maps of the first block's
            // width plus the upsampled map of the second's.
            vae_bytes_per_pixel: 4 * (4 * ch[0] as u64 + *ch.get(1).unwrap_or(&ch[0]) as u64),
        };
        let side = cfg.sample_size as u64 * up;
        Profile {
            family: "dit".into(),
            total_bytes: transformer_bytes + vae_bytes,
            transformer_bytes,
            vae_bytes,
            files: ck.transformer.files.len() + ck.vae.files.len(),
            blocks: cfg.num_layers,
            largest_block_bytes: block_bytes.iter().copied().max().unwrap_or(0),
            block_bytes,
            max_block_bytes_by_dtype: max_by_dtype,
            outside_block_bytes: outside,
            bytes_by_dtype: by_dtype,
            native_width: side,
            native_height: side,
            activation,
        }
    }

    /// Bytes of one device slot when blocks are split `dp` ways (padding included).
    pub fn slot_bytes(&self, dp: u64) -> u64 {
        let unit = dp.max(1) * ALIGN;
        self.max_block_bytes_by_dtype
            .values()
            .map(|b| b.div_ceil(unit) * unit)
            .sum()
    }
}
