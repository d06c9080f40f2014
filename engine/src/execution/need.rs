//! Which blocks of a pass a rank's request computes, as known at the pass boundary: a
//! step cache that skips a whole step on a schedule (MagCache from given ratios,
//! TaylorSeer's interval) needs [`Need::Nothing`]; one that decides after the first block
//! (First-Block Cache) needs [`Need::Head`] and votes on the rest after block 0. The
//! ranks of a pod take the union at the boundary ([`crate::execution::lockstep`]) and the
//! pipeline copies and gathers only what it holds, so the collectives stay in step.

/// A pass's need of its group's blocks, ordered so that the union is the largest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Need {
    /// No block: the step is skipped whole.
    #[default]
    Nothing,
    /// Block 0, then the rest if some rank's request votes for them after it.
    Head,
    /// Every block.
    All,
}

impl Need {
    pub fn union(self, other: Need) -> Need {
        self.max(other)
    }

    /// Whether block `index` is needed before any vote.
    pub fn covers(self, index: usize) -> bool {
        match self {
            Need::Nothing => false,
            Need::Head => index == 0,
            Need::All => true,
        }
    }
}

/// What a pass computes, per the ranks' union: this pass's need and the one of the pass
/// announced after it (what its prefetch may bring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassPlan {
    pub need: Need,
    pub next_need: Need,
}

impl PassPlan {
    pub const ALL: PassPlan = PassPlan {
        need: Need::All,
        next_need: Need::All,
    };
}

/// One rank's compute in a pass, called by the pipeline for the blocks the pass computes.
pub trait PassWork {
    /// Block `index`, with its weights.
    fn block(
        &mut self,
        index: usize,
        w: &dyn crate::execution::weights::Weights,
    ) -> crate::Result<()>;
    /// After block 0 of a pass planned [`Need::Head`]: whether any rank of the pod
    /// computes the rest. Every rank is asked at the same point and must return the same
    /// answer (a vote among them).
    fn rest(&mut self) -> crate::Result<bool>;
}
