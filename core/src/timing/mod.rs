//! The one step-time model: how long a request takes under a placement, from the bytes of
//! the streamed groups, what each group computes ([`GroupCompute`], declared by the family
//! and carried in the profile), the request at the workload's bounds ([`Work`]) and the
//! node's rates ([`Rates`]). The planner ranks the options that fit with it, and the
//! engine's `bench` predicts its `--resident-blocks plan` row with it, so both choose by
//! the same figures (`choose`).
//!
//! The model, and what it leaves out:
//! - a request is its per-request passes (a text encoder's, once per request) followed by
//!   its steps, each step one pass over every per-step group (two passes where guidance
//!   runs its samples one after the other); the experts of a two-expert model share the
//!   steps evenly, in pipeline order;
//! - a block computes for `flops(T, L) · S / F` seconds ([`GroupCompute::flops`]): T its
//!   tokens per sample (the prompt's for a text encoder, the latent's otherwise), L the
//!   prompt's tokens beside a latent group ([`Work::text_tokens`], the workload's
//!   `maxPromptTokens`), S the samples of a pass, F the device's sustained FLOP/s, and
//!   `flops(T, L) = a·T + b·T² + e·T·L + c·L + f·L² + g` for the family's declared
//!   linear (a), self-attention (b), cross-attention (e), prompt (c, f) and per-sample
//!   (g) terms;
//! - under sequence parallelism ([`crate::topology`], [`Work::sp`] ranks per request) a
//!   rank of a per-step group on the latent computes its largest share `t` of the tokens
//!   (`a·t + b·T·t + e·t·L`: its heads see every key; the prompt's and the per-sample
//!   terms whole on every rank), and
//!   each block adds the all-to-alls of the attention's q, k, v and output,
//!   `S · t · exchange_bytes_per_token · (sp−1)/sp` bytes at the peer rate, to its
//!   compute (attention waits for them); a per-request group (a text encoder, Cosmos3's
//!   understanding pathway) runs whole on every rank of the group, no faster;
//! - the weights shard over every rank of the process, `dp × sp` of them, which is what
//!   the placement's `dp` counts here (as in [`crate::memory`]): [`predict_for`] takes a
//!   [`Topology`] and sets both;
//! - a streamed block is copied in two stages on two queues, each serial: this rank's
//!   share from the host (`bytes/dp` under `offload-sharded`, `bytes` under `offload`)
//!   at the host-to-device rate, then the all-gather of the rest (`bytes·(dp−1)/dp`) at
//!   the peer rate; `sharded` only gathers, `resident` moves nothing; where copies share
//!   the compute's cores (the CPU backend), the part of a copy that cannot run beside
//!   compute ([`Rates::overlap`]) lengthens the block's compute instead;
//! - the copy of the j-th streamed block waits for a free slot (the compute of the
//!   (j−K)-th streamed block to end), and a block computes once the previous one has and
//!   its weights are in; copies run ahead across passes, as the engine prefetches across
//!   steps and groups. Kept blocks sit where the engine keeps them
//!   ([`crate::memory::resident_block_mask`]) and copy nothing;
//! - time outside the blocks (prologues, the sampler, the decode), launch gaps, and
//!   contention between the copy and the compute for memory bandwidth (or between the
//!   all-gather and the all-to-all for the peer link) are left out: the model compares
//!   placements, which they do not tell apart.
//!
//! A request's latency is its per-request passes plus its steps ([`Prediction::request`]):
//! what the planner holds against a latency bound.
//!
//! Identical steps are simulated three times and the rest extrapolated from the last,
//! which the pipeline's steady state makes exact.
//!
//! The model is split by concern: what a node sustains (`rates`, per product `products`), the request it times
//! (`work`, and `compute` for profiles without the families' declaration), the
//! two-queue pipeline it simulates (`pipe`), the prediction of one placement
//! (`predict`), and the choice of the blocks to keep (`choose`). This file only
//! declares them and re-exports their names, so `crate::timing::X` stays the one path.

mod choose;
mod compute;
mod figures;
mod pipe;
mod predict;
mod products;
mod rates;
mod work;

pub use crate::family::{experts, GroupCompute, Runs, Tokens};
pub use choose::{choose, pick, Choice, TIE_TOLERANCE};
pub use compute::default_compute;
pub use figures::AcceleratorRates;
pub use predict::{predict, predict_for, GroupTime, Prediction};
pub use products::{HostLink, Product, Published, PRODUCT_RATES};
pub use rates::{Rates, RatesFrom, FALLBACK_PRODUCT};
pub use work::Work;

#[cfg(test)]
mod tests;
