//! The state a run's rank threads share and each rank holds: the [`Run`] every thread reads,
//! the [`Placement`] a thread starts with, and the [`RankWork`] a rank carries from its start
//! to its exit (its request, its pipeline, its [`Tally`]). Defined apart from the code that
//! moves them (the threads, the passes, the intake, the sequence-parallel group), which
//! each adds its own methods, so that those modules depend on this one and not on each other.

use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;

use super::options::EngineOptions;
use crate::execution::backend::{Backend, Collective};
use crate::execution::budget::DeviceBudget;
use crate::execution::family::{FamilyRuntime, RankModel, Task};
use crate::execution::pipeline::{Pipeline, Streamed};
use crate::execution::seq::SeqExchange;
use crate::execution::work::{Request, WorkKey, WorkSource};

/// What every rank thread of one run shares.
pub(super) struct Run<'a> {
    pub(super) family: &'a dyn FamilyRuntime,
    pub(super) streamed: Streamed,
    pub(super) source: &'a dyn WorkSource,
    pub(super) opts: &'a EngineOptions,
    pub(super) slots: usize,
    /// Device bytes each rank keeps outside the slots (what it charges for them).
    pub(super) outside: u64,
    /// The dtype blocks compute in.
    pub(super) dtype: DType,
    /// Buffers of each rank's staging ring, when copies stage through one.
    pub(super) staging: Option<usize>,
}

impl Run<'_> {
    /// The measured phase a pass over `group` is: a text encoder's (a group that reads
    /// the prompt's tokens) or a transformer's.
    pub(super) fn phase_of(&self, group: usize) -> crate::measure::PhaseKind {
        let text = self
            .family
            .checkpoint()
            .group_compute()
            .get(group)
            .is_some_and(|g| g.tokens == layerwise_core::family::Tokens::Text);
        if text {
            crate::measure::PhaseKind::TextEncoder
        } else {
            crate::measure::PhaseKind::Transformer
        }
    }
}

/// Where one rank computes: its backend, its communicator, its device memory and K, and
/// its sequence-parallel group's exchange (none when `sp` is 1).
pub(super) struct Placement<B: Backend, C: Collective<B>> {
    pub(super) backend: Arc<B>,
    pub(super) comm: C,
    pub(super) capacity: u64,
    pub(super) slots: usize,
    pub(super) exchange: Option<Arc<dyn SeqExchange>>,
}

/// One rank's backend, communicator, device memory capacity and group exchange, as
/// [`Run::spawn`] takes them.
pub(super) type RankParts<B, C> = (Arc<B>, C, u64, Option<Arc<dyn SeqExchange>>);

/// A request a rank is working on.
pub(super) struct Active {
    pub(super) key: WorkKey,
    pub(super) task: Box<dyn Task>,
    pub(super) cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The request, kept by a sequence-parallel group's leader to hand its followers.
    pub(super) req: Option<Arc<Request>>,
}

/// What one rank measures of its passes, for its [`RankResult`](super::RankResult).
#[derive(Default)]
pub(super) struct Tally {
    /// Compute waiting for weights, counted only in passes where this rank computes: an
    /// idle rank also waits on its gathers, but nothing of its own is held up.
    pub(super) stall: Duration,
    pub(super) step_time: Duration,
    pub(super) steps: usize,
    pub(super) busy_time: Duration,
    pub(super) switch_stall: Duration,
    pub(super) switch_time: Duration,
    /// The group of the last pass that ran (busy or not): a different group next is a
    /// switch, whose first blocks only a prefetch keeps from stalling.
    pub(super) last_group: Option<usize>,
    pub(super) last_busy: bool,
    /// The peaks its busy passes and decodes held above their starts.
    pub(super) measured: crate::measure::PhasePeaks,
    /// Blocks of its busy passes its request did not compute (a step cache skipped them).
    pub(super) blocks_saved: u64,
    /// Blocks its requests computed.
    pub(super) blocks_computed: u64,
}

/// One rank between its start and its exit: the request it works on, its pipeline, and
/// what it measures.
pub(super) struct RankWork<'r, B: Backend, C: Collective<B>> {
    pub(super) run: &'r Run<'r>,
    pub(super) rank: usize,
    /// The group this rank serves requests in (what the source calls a rank), and its
    /// place there (0 leads: it alone talks to the source).
    pub(super) group: usize,
    pub(super) member: usize,
    /// The group's exchange, when requests split their sequence (`sp` > 1).
    pub(super) exchange: Option<Arc<dyn SeqExchange>>,
    pub(super) model: &'r dyn RankModel,
    pub(super) pipe: &'r mut Pipeline<B, C>,
    pub(super) budget: &'r DeviceBudget,
    pub(super) active: Option<Active>,
    /// A follower's request that failed here: not started again when its leader, which
    /// learns of it at its next exchange, still hands it over.
    pub(super) failed: Option<WorkKey>,
    pub(super) tally: Tally,
}
