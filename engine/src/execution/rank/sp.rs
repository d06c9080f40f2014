//! A sequence-parallel group (`sp` > 1): its leader hands each request to its followers at
//! the boundary, each member computes its share of the sequence through the group's
//! exchange, and a request that fails on one member stops the others waiting for it.

use super::state::{Active, RankWork};
use crate::execution::backend::{Backend, Collective};
use crate::execution::lockstep::Handoff;
use crate::execution::seq::Split;
use crate::execution::work::WorkKey;
use crate::Error;

impl<B: Backend, C: Collective<B>> RankWork<'_, B, C> {
    /// This rank's share of request `key`: the whole of it without sequence parallelism.
    pub(super) fn split(&self, key: WorkKey) -> Split {
        match &self.exchange {
            Some(x) => Split::member(x.clone(), self.member, key),
            None => Split::whole(),
        }
    }

    /// The request a leader holds, for its followers.
    pub(super) fn handoff(&self) -> Option<Handoff> {
        let a = self.active.as_ref()?;
        Some(Handoff {
            key: a.key,
            req: a.req.clone()?,
        })
    }

    /// A follower at a pass boundary: holds the request its leader holds (`handoff`),
    /// starting its share of a new one and dropping one the leader finished, cancelled
    /// or failed.
    pub(super) fn follow(&mut self, handoff: Option<Handoff>) {
        if self.active.as_ref().map(|a| a.key) == handoff.as_ref().map(|h| h.key) {
            return;
        }
        self.active = None;
        let Some(h) = handoff else { return };
        if self.failed == Some(h.key) {
            return;
        }
        match self.model.start((*h.req).clone(), self.split(h.key)) {
            Ok(task) => {
                self.active = Some(Active {
                    key: h.key,
                    task,
                    cancel: None,
                    req: None,
                })
            }
            Err(e) => self.fail_request(h.key, &e),
        }
    }

    /// Request `key` failed on this rank with `e`: its group's other ranks stop waiting
    /// for it (their exchanges fail, quoting `e`); a follower remembers not to restart it.
    pub(super) fn fail_request(&mut self, key: WorkKey, e: &Error) {
        if let Some(x) = &self.exchange {
            x.abort(key, self.member, &e.to_string());
        }
        if self.member > 0 {
            tracing::debug!(rank = self.rank, %key, error = %e, "request failed on this rank of its group");
            self.failed = Some(key);
        }
    }
}
