//! A Wan pipeline folder opened and checked from its headers and configs alone:
//! `model_index.json` (which components, the expert boundary), the tokenizer's presence,
//! each component's config and every tensor against what the configs imply. Nothing here
//! reads weight data.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::transformer::WanTransformerConfig;
use crate::checkpoint::check::check_tensors;
use crate::checkpoint::{ActivationCost, Component, ModelFolder};
use crate::components::pipeline_index::listed;
use crate::components::umt5::{Umt5Config, FINAL_NORM};
use crate::components::wan_vae::WanVaeConfig;
use crate::families::{BlockGroup, FamilyCheckpoint};
use crate::{Error, Result};

/// A checked Wan pipeline folder.
#[derive(Debug, Clone)]
pub struct WanCheckpoint {
    pub folder: ModelFolder,
    pub tokenizer: PathBuf,
    pub text_encoder_config: Umt5Config,
    pub transformer_config: WanTransformerConfig,
    pub vae_config: WanVaeConfig,
    /// Wan 2.2: steps whose timestep is at least `boundary_ratio × num_train_timesteps`
    /// run on `transformer`, the rest on `transformer_2`.
    pub boundary_ratio: Option<f64>,
    pub text_encoder: Component,
    pub transformer: Component,
    pub transformer_2: Option<Component>,
    pub vae: Component,
}

/// The first field two configs disagree on (`None`: the same architecture).
fn differing_field(a: &Value, b: &Value) -> Option<String> {
    let (a, b) = (a.as_object()?, b.as_object()?);
    a.keys()
        .chain(b.keys())
        .find(|k| a.get(*k) != b.get(*k))
        .cloned()
}

/// Checks `model_index.json` (`index`, read from `path`): every component a Wan pipeline
/// needs, no per-token timesteps, and either one expert or two with the boundary between
/// them. Returns the boundary and whether there is a second expert.
fn check_index(path: &Path, index: &Value) -> Result<(Option<f64>, bool)> {
    for part in [
        "tokenizer",
        "text_encoder",
        "transformer",
        "vae",
        "scheduler",
    ] {
        if !listed(index, part) {
            return Err(Error::config(
                path,
                part,
                "missing; a Wan pipeline needs a tokenizer, text_encoder, transformer, vae and scheduler",
            ));
        }
    }
    if index.get("expand_timesteps").and_then(Value::as_bool) == Some(true) {
        return Err(Error::config(
            path,
            "expand_timesteps",
            "per-token timesteps (the Wan 2.2 TI2V 5B pipeline) are not supported",
        ));
    }
    let boundary_ratio = match index.get("boundary_ratio") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64() {
            Some(r) if r > 0.0 && r < 1.0 => Some(r),
            _ => {
                return Err(Error::config(
                    path,
                    "boundary_ratio",
                    format!("{v}: must be a number between 0 and 1"),
                ))
            }
        },
    };
    let two = listed(index, "transformer_2");
    if two != boundary_ratio.is_some() {
        return Err(Error::config(
            path,
            if two {
                "boundary_ratio"
            } else {
                "transformer_2"
            },
            "two experts need both `transformer_2` and `boundary_ratio`",
        ));
    }
    Ok((boundary_ratio, two))
}

/// Opens `root`'s `transformer_2` and checks it against its config, which must be `first`'s
/// architecture: both experts stream through the same slots.
fn open_second_expert(root: &Path, first: &WanTransformerConfig) -> Result<Component> {
    let path = root.join("transformer_2").join("config.json");
    let second = WanTransformerConfig::load(&path)?;
    if let Some(field) = differing_field(&first.to_json(), &second.to_json()) {
        return Err(Error::config(
            &path,
            field,
            "the second expert's shape differs from the first's (both experts stream through the same slots and must share their architecture)",
        ));
    }
    let c = Component::open(&root.join("transformer_2"))?;
    check_tensors(&c, &second.all_specs(), |_| None)?;
    Ok(c)
}

/// Checks that the components of `root` fit together: the transformer reads the text
/// encoder's width and the VAE's latents, and the VAE decodes RGB frames.
fn check_agreement(
    root: &Path,
    te: &Umt5Config,
    tr: &WanTransformerConfig,
    vae: &WanVaeConfig,
) -> Result<()> {
    let config = |c: &str| root.join(c).join("config.json");
    if te.d_model != tr.text_dim {
        return Err(Error::config(
            config("transformer"),
            "text_dim",
            format!(
                "{} but the text encoder's d_model is {}",
                tr.text_dim, te.d_model
            ),
        ));
    }
    if vae.z_dim != tr.in_channels || vae.z_dim != tr.out() {
        return Err(Error::config(
            config("transformer"),
            "in_channels",
            format!(
                "in {} / out {} channels but the VAE's latents have {}",
                tr.in_channels,
                tr.out(),
                vae.z_dim
            ),
        ));
    }
    if vae.video_channels() != 3 {
        return Err(Error::config(
            config("vae"),
            "out_channels",
            format!(
                "{} ({} per pixel of its patches): frames are RGB (3 channels)",
                vae.out_channels,
                vae.video_channels()
            ),
        ));
    }
    Ok(())
}

impl WanCheckpoint {
    /// Opens `root` and checks every component against its config.
    pub fn open(root: &Path) -> Result<WanCheckpoint> {
        let folder = ModelFolder::new(root)?;
        let index_path = root.join("model_index.json");
        let index: Value = crate::checkpoint::read_json(&index_path)?;
        let (boundary_ratio, two) = check_index(&index_path, &index)?;
        let tokenizer = root.join("tokenizer").join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(Error::checkpoint(
                &tokenizer,
                "the tokenizer is missing: a Wan pipeline folder holds tokenizer/tokenizer.json",
            ));
        }
        let dir = |c: &str| root.join(c);
        let text_encoder_config = Umt5Config::load(&dir("text_encoder").join("config.json"))?;
        let transformer_config =
            WanTransformerConfig::load(&dir("transformer").join("config.json"))?;
        let vae_config = WanVaeConfig::load(&dir("vae").join("config.json"))?;
        let text_encoder = Component::open(&dir("text_encoder"))?;
        let transformer = Component::open(&dir("transformer"))?;
        let vae = Component::open(&dir("vae"))?;
        text_encoder_config.check(&text_encoder)?;
        check_tensors(&transformer, &transformer_config.all_specs(), |_| None)?;
        check_tensors(&vae, &vae_config.tensor_specs(), |_| None)?;
        let transformer_2 = if two {
            Some(open_second_expert(root, &transformer_config)?)
        } else {
            None
        };
        check_agreement(root, &text_encoder_config, &transformer_config, &vae_config)?;
        Ok(WanCheckpoint {
            folder,
            tokenizer,
            text_encoder_config,
            transformer_config,
            vae_config,
            boundary_ratio,
            text_encoder,
            transformer,
            transformer_2,
            vae,
        })
    }

    /// Tensors outside the blocks that every rank keeps on its device: each expert's
    /// prologue and epilogue, and the text encoder's final norm (its embedding table is
    /// read from the host mapping).
    pub fn resident_device_names(&self) -> Vec<(&'static str, String)> {
        let mut v: Vec<(&'static str, String)> = Vec::new();
        for (comp, _) in self.components() {
            match comp {
                "transformer" | "transformer_2" => v.extend(
                    self.transformer_config
                        .resident_specs()
                        .into_iter()
                        .map(|s| (comp, s.name)),
                ),
                // The embedding table stays on the host: prompts read their rows.
                "text_encoder" => v.push((comp, FINAL_NORM.to_string())),
                _ => {}
            }
        }
        v
    }

    /// Bytes of [`Self::resident_device_names`], as stored or at `elem` bytes per element.
    fn resident_bytes_at(&self, elem: Option<u64>) -> u64 {
        let comps = self.components();
        self.resident_device_names()
            .iter()
            .filter_map(|(comp, name)| {
                let c = comps.iter().find(|(n, _)| n == comp)?.1;
                Some(c.bytes_of([name], elem))
            })
            .sum()
    }

    /// The VAE's decoder tensors, which every rank that decodes keeps on its device.
    pub fn decoder_names(&self) -> Vec<String> {
        self.vae_config.decoder_names()
    }
}

impl FamilyCheckpoint for WanCheckpoint {
    /// [`Self::resident_device_bytes`] once loaded at `elem` bytes per element.
    fn resident_stored_bytes(&self, elem: u64) -> u64 {
        self.resident_bytes_at(Some(elem))
    }
    /// [`Self::decoder_bytes`] once loaded at `elem` bytes per element.
    fn decoder_stored_bytes(&self, elem: u64) -> u64 {
        self.vae.bytes_of(self.decoder_names(), Some(elem))
    }

    /// Components with weights, in pipeline order.
    fn components(&self) -> Vec<(&'static str, &Component)> {
        let mut v = vec![
            ("text_encoder", &self.text_encoder),
            ("transformer", &self.transformer),
        ];
        if let Some(c) = &self.transformer_2 {
            v.push(("transformer_2", c));
        }
        v.push(("vae", &self.vae));
        v
    }
    /// The streamed groups, by group index ([`super::TEXT_ENCODER`], ...).
    fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        let mut v = vec![
            ("text_encoder", self.text_encoder_config.block_group()),
            ("transformer", self.transformer_config.block_group()),
        ];
        if self.transformer_2.is_some() {
            let mut g = self.transformer_config.block_group();
            g.name = "transformer_2".into();
            v.push(("transformer_2", g));
        }
        v
    }
    /// Bytes of [`Self::resident_device_names`].
    fn resident_device_bytes(&self) -> u64 {
        self.resident_bytes_at(None)
    }
    /// Bytes of [`Self::decoder_names`].
    fn decoder_bytes(&self) -> u64 {
        self.vae.bytes_of(self.decoder_names(), None)
    }
    /// WanPipeline's default output size, 832 × 480.
    fn native_size(&self) -> (usize, usize) {
        (832, 480)
    }
    /// The largest clip the transformer's rotary tables place: `rope_max_seq_len`
    /// positions per axis of the patch grid, so that many patches of (VAE upscale × patch)
    /// pixels across, and latent frames (each after the first `temporal_upscale` frames).
    fn limits(&self) -> crate::bounds::ModelLimits {
        let tr = &self.transformer_config;
        let positions = tr.rope_max_seq_len as u64;
        let (pt, ph, pw) = tr.patch();
        let up = self.vae_config.upscale() as u64;
        let tup = self.vae_config.temporal_upscale() as u64;
        let latent_frames = positions.saturating_mul(pt as u64);
        crate::bounds::ModelLimits {
            max_width: Some(positions.saturating_mul(up * pw as u64)),
            max_height: Some(positions.saturating_mul(up * ph as u64)),
            max_frames: Some((latent_frames.max(1) - 1).saturating_mul(tup).saturating_add(1)),
            reason: format!(
                "its rotary tables hold {positions} positions per axis: rope_max_seq_len in transformer/config.json"
            ),
        }
    }
    /// What a request costs in activations (f32), from the shapes the engine computes.
    fn decode_cost(&self) -> Option<crate::decode::DecodeCost> {
        Some(self.vae_config.decode_cost())
    }

    fn activation_cost(&self) -> ActivationCost {
        let tr = &self.transformer_config;
        let (d, ffn) = (tr.hidden() as u64, tr.ffn_dim as u64);
        let spatial = (self.vae_config.upscale() * tr.patch_size[1]) as u64;
        let base = self.vae_config.base_dim as u64;
        let te = &self.text_encoder_config;
        let (te_d, te_ff) = (te.d_model as u64, te.d_ff as u64);
        let (te_inner, te_heads) = (te.inner_dim() as u64, te.num_heads as u64);
        ActivationCost {
            pixels_per_token: spatial * spatial,
            // The block peaks in its feed-forward (measured: linear in the tokens, no
            // quadratic part, at the published widths; `engine/tests/memory_measured.rs`):
            // x, its modulated norm, the FFN's hidden, GELU's temporary and its output.
            bytes_per_token: 4 * (2 * d + 3 * ffn),
            // Or in its self-attention: x, norm(x), q, k, v, the rotated q and k and the
            // attention out, beside one query chunk's scores; whichever is larger.
            attention_bytes_per_token: 4 * 8 * d,
            // One chunk's scores and softmax, all heads, f32: what a sequence short
            // enough for a single chunk holds in place of the budget.
            bytes_per_token_pair: 8 * tr.num_attention_heads as u64,
            attention_bytes: crate::components::attention::ATTENTION_CHUNK_BYTES,
            // The decoder's first up block at full resolution: about three maps of its
            // width for each of the frames a chunk yields and the two it caches.
            vae_bytes_per_pixel: 4 * 3 * base * self.vae_config.dim_mult[0] as u64,
            frames_per_latent: self.vae_config.temporal_upscale() as u64,
            decoder_frames: self.vae_config.temporal_upscale() as u64 + 2,
            // Per prompt token and sample at the block's peak: the projected text [M, d]
            // kept for every block (its cross-attention keys and values are gone by the
            // feed-forward).
            bytes_per_text_token: 4 * d,
            template_tokens: 0,
            // A UMT5 layer peaks in its gated feed-forward (measured linear in the
            // prompt's tokens): x, its norm and the layer's output, the two projections,
            // GELU's temporary and their product.
            encoder_bytes_per_token: 4 * (3 * te_d + 4 * te_ff),
            // Or in its attention: hidden, its norm, q, k, v and attention out beside the
            // scores, their softmax and the layer's position bias, every head.
            encoder_attention_bytes_per_token: 4 * (2 * te_d + 4 * te_inner),
            encoder_bytes_per_token_pair: 4 * 3 * te_heads,
            // The prompt and the negative prompt go through as a batch of two.
            guidance_samples: 2,
            samples_in_turn: false,
            waiting_bytes_per_token: 0,
            waiting_bytes_per_text_token: 0,
            encoder_waiting_bytes_per_token: 0,
            // Under sequence parallelism: the self-attention's q, k, v and output, each
            // [tokens, d], alive in both layouts across an all-to-all.
            exchange_bytes_per_token: 4 * 4 * d,
            // A step cache's residuals are hidden states [tokens, d]; TaylorSeer keeps the
            // transformer's output, out channels × patch volume values a token; each
            // expert keeps its own.
            hidden_bytes_per_token: 4 * d,
            output_bytes_per_token: 4 * (tr.out() * tr.patch_volume()) as u64,
            cache_states: if self.transformer_2.is_some() { 2 } else { 1 },
        }
    }
    /// The text encoder's blocks ([`crate::components::umt5::flops::encoder_block`]) and
    /// each expert's ([`super::flops::transformer_block`]).
    fn group_compute(&self) -> Vec<layerwise_core::family::GroupCompute> {
        layerwise_core::family::default_group_compute(self)
            .into_iter()
            .map(|g| match g.component.as_str() {
                "text_encoder" => {
                    crate::components::umt5::flops::encoder_block(&self.text_encoder_config, g)
                }
                _ => super::flops::transformer_block(&self.transformer_config, g),
            })
            .collect()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
