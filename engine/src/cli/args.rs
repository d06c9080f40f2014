//! The request and `generate` flags of the `layerwise` command line, apart from the
//! commands that read them, so `commands` and `bench` take them from a sibling and the
//! command line's root only declares.

use std::path::PathBuf;

use clap::Args;

use crate::contract::{self, KeptArgs};
use crate::execution::work::DEFAULT_MAX_SEQUENCE_LENGTH;
use crate::options::EngineArgs;
use crate::Strategy;

/// What to generate: the request flags of `generate` and `bench`.
#[derive(Args, Clone)]
pub(crate) struct RequestArgs {
    /// Class-conditional families: the class to draw (0..999 for DiT-XL/2; default 207).
    #[arg(long, env = "LAYERWISE_CLASS_LABEL", conflicts_with = "prompt")]
    pub(crate) class_label: Option<u32>,
    /// Text-conditioned families (Wan): what to draw.
    #[arg(long, env = "LAYERWISE_PROMPT")]
    pub(crate) prompt: Option<String>,
    /// Text-conditioned families: what to steer away from (under guidance). Left out, each
    /// family does as its diffusers pipeline: Wan and Cosmos3 guide against an empty
    /// prompt, Qwen-Image runs unguided (its true CFG needs a negative prompt).
    #[arg(long, env = "LAYERWISE_NEGATIVE_PROMPT", requires = "prompt")]
    pub(crate) negative_prompt: Option<String>,
    /// Frames of a clip: 4k + 1 for Wan (81 is five seconds at 16 fps); 1 is an image.
    #[arg(long, env = "LAYERWISE_FRAMES", default_value_t = 1)]
    pub(crate) frames: usize,
    /// Guidance of the second expert of a two-expert model (Wan 2.2; default: --guidance).
    #[arg(long, env = "LAYERWISE_GUIDANCE_2")]
    pub(crate) guidance_2: Option<f32>,
    /// Text-conditioned families: tokens prompts are padded to; a longer prompt is refused.
    #[arg(long, env = "LAYERWISE_MAX_SEQUENCE_LENGTH", default_value_t = DEFAULT_MAX_SEQUENCE_LENGTH)]
    pub(crate) max_sequence_length: usize,
    /// Noise seed of the first output (output i uses seed + i).
    #[arg(long, env = "LAYERWISE_SEED", default_value_t = 0)]
    pub(crate) seed: u64,
    /// Denoising steps (default: the family's, 25 for DiT, 50 for Wan as diffusers).
    #[arg(long, env = "LAYERWISE_STEPS")]
    pub(crate) steps: Option<usize>,
    /// Classifier-free guidance scale, ≤ 1 disables guidance (default: the family's, 4.0 for
    /// DiT, 5.0 for Wan).
    #[arg(long, env = "LAYERWISE_GUIDANCE")]
    pub(crate) guidance: Option<f32>,
    /// Image size in pixels: `N` or `WxH` (default: the model's native size).
    #[arg(long, env = "LAYERWISE_SIZE")]
    pub(crate) size: Option<String>,
    /// Number of images (dealt to the ranks round-robin).
    #[arg(long, short = 'n', env = "LAYERWISE_N", default_value_t = 1)]
    pub(crate) n: usize,
    /// A step cache (off by default): a kind with diffusers' defaults (`first_block`,
    /// `mag`, `taylorseer`), or its JSON setting, e.g.
    /// `{"kind":"first_block","threshold":0.1}` or `{"kind":"mag","ratios":[1.0,0.98,..]}`
    /// (`mag` alone calibrates: it runs every step and prints the ratios to pass).
    #[arg(long, env = layerwise_core::step_cache::ENV_CACHE, value_parser = crate::cache::StepCache::parse_flag)]
    pub(crate) cache: Option<crate::cache::StepCache>,
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    pub(crate) kept: KeptArgs,
    #[command(flatten)]
    pub(crate) request: RequestArgs,
    /// resident, sharded, offload or offload-sharded.
    #[arg(long, env = contract::ENV_STRATEGY, default_value_t = Strategy::default())]
    pub(crate) strategy: Strategy,
    /// Output file: `.png` (an image, or a clip's first frame), or for clips `.mp4`
    /// (H.264), `.gif` or `.webp` (animations). With n > 1, `-<i>` is added before the
    /// extension.
    #[arg(long, env = "LAYERWISE_OUTPUT")]
    pub(crate) out: PathBuf,
    /// Frames per second of a clip (default: the family's, Wan 16, Cosmos3 24): the rate it
    /// is written at, and what a family that conditions on it (Cosmos3) is told.
    #[arg(long, env = "LAYERWISE_FPS")]
    pub(crate) fps: Option<f64>,
    /// Start from these latents (safetensors, tensor `latents`: [n, C, h, w], or for clips
    /// [n, C, T, h, w]).
    #[arg(long, env = "LAYERWISE_INIT_LATENTS")]
    pub(crate) init_latents: Option<PathBuf>,
    /// Write the final latents before the VAE (safetensors, tensor `latents`), and for text
    /// families the text embeddings (`prompt_embeds`, `negative_prompt_embeds`) and the
    /// decoded frames (`frames`, [F, H, W, 3] in [0, 1]).
    #[arg(long, env = "LAYERWISE_SAVE_LATENTS")]
    pub(crate) save_latents: Option<PathBuf>,
    /// Write run figures as JSON.
    #[arg(long, env = "LAYERWISE_STATS")]
    pub(crate) stats: Option<PathBuf>,
    /// Record every copy, gather and compute span as a Chrome trace (Perfetto) here.
    #[arg(long, env = "LAYERWISE_TRACE")]
    pub(crate) trace: Option<PathBuf>,
}
