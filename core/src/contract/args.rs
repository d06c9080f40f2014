//! The contract's flags as clap arguments, in groups by who takes them: [`RunArgs`] every
//! command that runs a model (`generate`, `bench`, `serve`), [`KeptArgs`] those that run
//! one configuration (`generate`, `serve`), [`BoundsArgs`] and [`EngineContract`] the
//! server. Doc comments are the engine's `--help`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use super::names::{
    ENV_DP, ENV_LISTEN, ENV_MODEL, ENV_MODEL_ROOTS, ENV_SLOTS, ENV_SP, ENV_STRATEGY,
};
use super::values::{BlocksByComponent, ResidentBlocks, SlotsChoice};
use crate::bounds::{self, Dimension, ModelLimits, RequestBounds, DEFAULT_MAX_PROMPT_TOKENS};
use crate::decode::{self, DecodeChoice};
use crate::{Error, Result, Strategy};

/// The model and how its ranks hold it: what every command that runs a model takes.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct RunArgs {
    /// The diffusers pipeline folder.
    #[arg(long, env = ENV_MODEL)]
    pub model: PathBuf,
    /// Requests served at once: data-parallel groups of `--sp` ranks (threads of this
    /// process, one device each). The process uses dp × sp devices.
    #[arg(long, env = ENV_DP, default_value_t = 1)]
    pub dp: usize,
    /// Ranks per request (Ulysses sequence parallelism): each computes its share of the
    /// request's latent tokens, and all-to-alls around attention give each rank every
    /// token of its share of the heads. The weights stream over all dp × sp ranks. For
    /// the video families (wan, cosmos3), at most their attention (key/value) heads.
    #[arg(long, env = ENV_SP, default_value_t = 1)]
    pub sp: usize,
    /// Device slots per rank: K ≥ 2, or `auto` (as many as fit: on a GPU in its free
    /// memory, on the CPU in `--device-memory-mib`, which auto then needs).
    #[arg(long, env = ENV_SLOTS, default_value = "2")]
    pub slots: SlotsChoice,
    /// Device memory per rank in MiB for everything: weights, the activations of the
    /// largest request (`serve`: at its bounds) and `--device-overhead-mib`. The engine
    /// refuses to start when the memory model needs more (the CPU backend enforces it as
    /// a GPU would).
    #[arg(long, env = bounds::ENV_DEVICE_MEMORY_MIB)]
    pub device_memory_mib: Option<u64>,
    /// Device memory per rank in MiB kept for the runtime (context, kernels, allocator
    /// slack), out of `--device-memory-mib`.
    #[arg(long, env = bounds::ENV_DEVICE_OVERHEAD_MIB, default_value_t = 0)]
    pub device_overhead_mib: u64,
    /// Components whose blocks stay whole on every device under a streaming strategy
    /// (comma-separated, e.g. `text_encoder`): copied once at start, never streamed. The
    /// operator passes the plan's choice.
    #[arg(long, env = bounds::ENV_RESIDENT_COMPONENTS, value_delimiter = ',')]
    pub resident_components: Vec<String>,
}

/// `--resident-blocks` of the commands that run one configuration (`generate`, `serve`);
/// `bench` takes a list of them instead, one row each.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct KeptArgs {
    /// Blocks of each streamed group that stay on every device, spread evenly through the
    /// group, copied once and never streamed: a number, or `auto` (as many as
    /// `--device-memory-mib` holds after the slots, the activations and the overhead).
    #[arg(long, env = bounds::ENV_RESIDENT_BLOCKS, default_value = "0")]
    pub resident_blocks: ResidentBlocks,
    /// Blocks kept of each group of the components named, in place of
    /// `--resident-blocks` for them: `component=n` pairs, comma-separated (e.g.
    /// `transformer=20,text_encoder=0`, what the operator's plan writes). A component the
    /// model does not stream is refused.
    #[arg(long, env = bounds::ENV_RESIDENT_BLOCKS_BY_COMPONENT, default_value = "")]
    pub resident_blocks_by_component: BlocksByComponent,
}

/// The size bounds a server takes when its flags name none (each lowered to the model's own
/// limit where that is smaller).
pub const DEFAULT_MAX_SIDE: u64 = 1280;
pub const DEFAULT_MAX_FRAMES: u64 = 81;

/// The request bounds a server enforces ([`RequestBounds`] as flags): the width, height and
/// frames unset where the model's own limits are to decide them.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct BoundsArgs {
    /// Largest output width in pixels [default: 1280, or the model's own limit where that
    /// is smaller]. A width beyond what the model runs (its position tables) is refused at
    /// start.
    #[arg(long, env = bounds::ENV_MAX_WIDTH)]
    pub max_width: Option<u64>,
    /// Largest output height in pixels [default: 1280, or the model's own limit where that
    /// is smaller]; refused at start beyond what the model runs.
    #[arg(long, env = bounds::ENV_MAX_HEIGHT)]
    pub max_height: Option<u64>,
    /// Most frames of one clip (1 serves images only) [default: 81, or the model's own limit
    /// where that is smaller]; refused at start beyond what the model runs.
    #[arg(long, env = bounds::ENV_MAX_FRAMES)]
    pub max_frames: Option<u64>,
    /// Most denoising steps per output.
    #[arg(long, env = bounds::ENV_MAX_STEPS, default_value_t = 250)]
    pub max_steps: u64,
    /// Most outputs per request.
    #[arg(long, env = bounds::ENV_MAX_N, default_value_t = 4)]
    pub max_n: u64,
    /// Whether requests may use classifier-free guidance (a scale above 1, which doubles
    /// the batch); `false` refuses such scales and runs requests unguided by default.
    #[arg(long, env = bounds::ENV_GUIDANCE_ALLOWED, default_value_t = true, action = clap::ArgAction::Set)]
    pub guidance_allowed: bool,
    /// Most tokens of a prompt (text families; a request's `max_sequence_length` may not
    /// exceed it).
    #[arg(long, env = bounds::ENV_MAX_PROMPT_TOKENS, default_value_t = DEFAULT_MAX_PROMPT_TOKENS)]
    pub max_prompt_tokens: u64,
}

impl From<RequestBounds> for BoundsArgs {
    /// Flags that set exactly `b`, whatever the model's limits.
    fn from(b: RequestBounds) -> Self {
        BoundsArgs {
            max_width: Some(b.max_width),
            max_height: Some(b.max_height),
            max_frames: Some(b.max_frames),
            max_steps: b.max_steps,
            max_n: b.max_n,
            guidance_allowed: b.guidance,
            max_prompt_tokens: b.max_prompt_tokens,
        }
    }
}

impl BoundsArgs {
    /// The bounds these flags set for a model that runs at most `limits`: what the server
    /// admits and the device memory it keeps. A size bound the flags give beyond the model's
    /// limits is refused, naming the flag; one they leave unset is the default, lowered to
    /// the limit.
    pub fn request_bounds(&self, limits: &ModelLimits) -> Result<RequestBounds> {
        let pick = |given: Option<u64>, default: u64, d: Dimension| -> Result<u64> {
            let Some(v) = given else {
                return Ok(limits.of(d).map_or(default, |m| m.min(default)));
            };
            match limits.beyond(&[(d, v)]) {
                None => Ok(v),
                Some(b) => Err(Error::invalid(
                    d.flag(),
                    format!("{b}; give --{} {} or less", d.flag(), b.max),
                )),
            }
        };
        Ok(RequestBounds {
            max_width: pick(self.max_width, DEFAULT_MAX_SIDE, Dimension::Width)?,
            max_height: pick(self.max_height, DEFAULT_MAX_SIDE, Dimension::Height)?,
            max_frames: pick(self.max_frames, DEFAULT_MAX_FRAMES, Dimension::Frames)?,
            max_steps: self.max_steps,
            max_n: self.max_n,
            guidance: self.guidance_allowed,
            max_prompt_tokens: self.max_prompt_tokens,
        })
    }
}

/// `--model-roots`: global to every `layerwise` command (each confines the model files it
/// reads), and part of what a plan tells the server.
#[derive(Args, Debug, Clone, PartialEq, Default)]
pub struct RootsArgs {
    /// Folders model files may be read from (comma-separated): a file of the model folder
    /// that leads outside them through a symlink is refused. The operator passes the
    /// model's mount. Unset: files may lead anywhere.
    #[arg(long, global = true, env = ENV_MODEL_ROOTS, value_delimiter = ',')]
    pub model_roots: Vec<PathBuf>,
}

/// Everything a plan tells an engine: the one description of a `layerwise serve` the
/// operator renders into a pod ([`Self::argv`], [`Self::env`]) and the engine's flags
/// parse into, so the two cannot drift.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct EngineContract {
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub kept: KeptArgs,
    /// resident, sharded, offload or offload-sharded.
    #[arg(long, env = ENV_STRATEGY, default_value_t = Strategy::default())]
    pub strategy: Strategy,
    #[command(flatten)]
    pub bounds: BoundsArgs,
    /// Where finished latents are decoded into pixels: `auto` (on each rank's GPU when the
    /// ranks compute on CUDA, on the host's CPU otherwise), `device` (each rank's device;
    /// on the CPU backend that is the CPU, counted in its budget) or `host`. On the device
    /// the decoder's weights and the decode of the largest output the bounds admit count
    /// in `--device-memory-mib`. The operator passes its plan's decision.
    #[arg(long, env = decode::ENV_DECODE, default_value = "auto")]
    pub decode: DecodeChoice,
    /// Bytes one decode may hold at its peak: each output is decoded a few latent frames
    /// at a time, in spatial tiles where needed, by the largest split within it
    /// (`layerwise_core::decode::DecodeCost::choose`); the plan charged exactly the split
    /// of the largest output. Default: 4 GiB.
    #[arg(long, env = decode::ENV_DECODE_BUDGET)]
    pub decode_budget: Option<u64>,
    #[command(flatten)]
    pub roots: RootsArgs,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, env = ENV_LISTEN, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
}
