//! The record a search returns of what it tried and why it kept or refused each thing: the
//! options that fell short ([`Miss`]), and of the option kept, its memory, the copies of the
//! model it holds, the step-time model's verdict on each component and on the blocks and
//! slots kept ([`Account`]), and of each sp tried, its outcome ([`SpAccount`]). Data only:
//! [`super::explain`] writes the plan's reasons from it, so the search builds no text.

use crds::Workload;
use layerwise_core::decode::DecodeSite;
use layerwise_core::timing::{Prediction, Rates, RatesFrom, Work};

use super::candidates::Option_;
use super::need::Need;
use super::refusal::{Refusal, Shortage};

/// A failed check: the resource `option` fell short of on `node`, and by how much.
#[derive(Debug, Clone)]
pub(super) struct Miss {
    pub shortage: Shortage,
    pub node: String,
    pub needed: u64,
    pub available: u64,
    pub option: Option_,
}

impl Miss {
    /// This miss as a refusal.
    pub fn refusal(&self) -> Refusal {
        Refusal {
            shortage: self.shortage,
            node: Some(self.node.clone()),
            needed: self.needed,
            available: self.available,
            option: self.option.to_string(),
        }
    }

    /// How much is missing.
    pub fn shortfall(&self) -> u64 {
        self.needed.saturating_sub(self.available)
    }
}

/// What one search (one sp, the pods decoding at one site) kept, and what it tried on the
/// way.
#[derive(Debug, Clone)]
pub(super) struct Account {
    /// The option kept.
    pub option: Option_,
    /// What it needs on the node that needs the most: the plan's figures.
    pub need: Need,
    /// Where the pods decode.
    pub decode: DecodeSite,
    /// Each size of the model's copy the nodes it fits report, the smallest first, with
    /// the first node reporting it.
    pub copies: Vec<(u64, String)>,
    /// The node whose need the plan holds.
    pub largest: String,
    /// For `sharded` with dp left to the planner: the fewest groups that fit too.
    pub fewer_groups_fit: Option<u32>,
    /// Where the rates the step-time model timed the option with come from, on the node
    /// it was chosen on: the product's row, or a fallback's for a product the table lacks.
    pub rates_from: RatesFrom,
    /// What the step-time model said, where the option streams.
    pub streaming: Option<Streaming>,
    /// The slots, where the option streams and the spec left them to the planner.
    pub slots: Option<Slots>,
    /// The nodes the option fits, and how many were candidates.
    pub fits: Vec<String>,
    pub candidates: usize,
    /// Whether the spec fixed strategy, dp, sp or slots.
    pub fixed: bool,
    /// Every option that fell short during the search.
    pub misses: Vec<Miss>,
    /// Where the pods decode on the host because nothing fit with the decoder on the
    /// device: the refusal of that search.
    pub device_decode_refused: Option<Refusal>,
}

/// The slots a streaming option got: K, the planner's floor and its cap.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slots {
    pub k: u32,
    pub min: u32,
    pub cap: u32,
}

/// What the step-time model predicts of a streaming option on the node it was chosen on.
#[derive(Debug, Clone)]
pub(super) struct Streaming {
    pub prediction: Prediction,
    pub rates: Rates,
    /// Where `rates` come from.
    pub rates_from: RatesFrom,
    /// The request at the bounds, split over `sp` ranks.
    pub work: Work,
    pub sp: u32,
    /// Per component the option may keep whole: whether it does, and against what.
    pub components: Vec<ComponentVerdict>,
    /// Per streamed component: the blocks kept, and the time with one fewer and one more.
    pub kept: Vec<KeptBlocks>,
}

/// Why a component stays whole or streams under the option kept.
#[derive(Debug, Clone)]
pub(super) struct ComponentVerdict {
    pub component: String,
    /// Whether the option keeps it whole on the device.
    pub whole: bool,
    /// The option's predicted request time.
    pub request: f64,
    /// The best option found that does the other with it, if any fit.
    pub other: Option<Alternative>,
    /// Where none that keeps it whole fits: what that needed and the device has.
    pub short: Option<(u64, u64)>,
}

/// The best option that treats a component the other way.
#[derive(Debug, Clone, Copy)]
pub(super) struct Alternative {
    /// Its predicted request time.
    pub request: f64,
    /// Its device bytes beyond the kept option's (0 where it needs fewer).
    pub extra_device_bytes: u64,
}

/// The blocks a streamed component keeps, and the request time around that count.
#[derive(Debug, Clone)]
pub(super) struct KeptBlocks {
    pub component: String,
    pub kept: u64,
    /// The blocks of the component's largest group.
    pub blocks: usize,
    /// The predicted request time as kept, with one fewer, and with one more where that
    /// fits.
    pub request: f64,
    pub fewer: Option<f64>,
    pub more: Option<f64>,
}

/// What the planner found of each sp it tried, and which it planned.
#[derive(Debug, Clone)]
pub(super) struct SpAccount {
    pub family: String,
    /// Whether the family splits a request's sequence over ranks.
    pub splits: bool,
    pub workload: Workload,
    /// Whether the spec fixed sp.
    pub fixed: bool,
    /// The plan's sp and predicted latency, and whether it meets the bound (true where
    /// the workload sets none).
    pub sp: u32,
    pub latency: f64,
    pub bound_met: bool,
    /// Activation bytes of the largest request on one rank, and per rank at `sp`.
    pub one: Option<u64>,
    pub per_rank: Option<u64>,
    /// Each sp tried, in order.
    pub tried: Vec<SpTry>,
}

/// One sp tried: activation bytes per rank and the predicted latency, or why nothing fit.
#[derive(Debug, Clone)]
pub(super) struct SpTry {
    pub sp: u32,
    pub activations: Option<u64>,
    pub outcome: Result<f64, Refusal>,
}
