//! Taking requests from the source at a pass boundary: a group's leader drops cancelled
//! work, returns what streams no more, takes new work when free, and tells the
//! coordinator what it wants next.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::failure::finite;
use super::state::{Active, RankWork};
use crate::execution::backend::{Backend, Collective};
use crate::execution::family::Task;
use crate::execution::lockstep::Flags;
use crate::execution::need::Need;
use crate::execution::work::{Output, WorkKey};
use crate::measure::PhaseKind;
use crate::{Error, Result};

/// Whether the scheduler has given up on a request (cancelled, failed, or out of grace at
/// shutdown): checked at pass boundaries and before each block of a pass.
pub(super) fn cancelled(flag: &Option<Arc<AtomicBool>>) -> bool {
    flag.as_ref().is_some_and(|c| c.load(Ordering::Relaxed))
}

/// What a rank reports for a request it stopped because the scheduler gave up on it (the
/// scheduler has already ended the job and drops the report).
pub(super) fn cancel_error(key: WorkKey) -> Error {
    Error::Conflict {
        what: format!("request {} was cancelled", key.id),
    }
}

impl<B: Backend, C: Collective<B>> RankWork<'_, B, C> {
    /// At a pass boundary: drops cancelled work, finishes what streams no more, then takes
    /// new work if free. Returns this rank's view for the coordinator.
    pub(super) fn at_boundary(&mut self) -> Result<Flags> {
        let (rank, source) = (self.group, self.run.source);
        if let Some(a) = self.active.take_if(|a| cancelled(&a.cancel)) {
            source.finished(rank, a.key, Err(cancel_error(a.key)));
        }
        if let Some(a) = self.active.take_if(|a| a.task.wants().is_none()) {
            let out = self.finish_task(a.task);
            source.finished(rank, a.key, out);
        }
        let (generation, closed) = self.take_work()?;
        let want = self.active.as_ref().and_then(|a| a.task.wants());
        let then = self
            .active
            .as_ref()
            .and_then(|a| a.task.wants_after())
            .or_else(|| source.pending(rank).then(|| self.run.family.first_group()));
        let task = self.active.as_ref().map(|a| &a.task);
        Ok(Flags {
            want,
            then,
            closed,
            generation,
            need: task.map_or(Need::Nothing, |t| t.needs()),
            // Queued work that has not started computes every block.
            then_need: task.map_or(Need::All, |t| t.needs_after()),
        })
    }

    /// A task's output; measured as a decode where this rank decodes its outputs.
    fn finish_task(&mut self, task: Box<dyn Task>) -> Result<Output> {
        let decodes = self.run.opts.decode && self.member == 0;
        let phase = decodes.then(|| self.pipe.phase());
        let out = finite(task.finish());
        if let Some(bytes) = phase.and_then(|p| p.peak()) {
            self.tally.measured.record(PhaseKind::Decode, bytes);
        }
        out
    }

    /// When free, takes requests until one wants a pass (one that wants none is finished
    /// at once, one that fails to start fails) or none is waiting. Returns the source's
    /// arrival generation and whether it is closed, as last seen (`u64::MAX` and open
    /// when busy, so it never asked).
    fn take_work(&mut self) -> Result<(u64, bool)> {
        let (rank, source) = (self.group, self.run.source);
        let (mut generation, mut closed) = (u64::MAX, false);
        while self.active.is_none() {
            let t = source.take(rank)?;
            (generation, closed) = (t.generation, t.closed);
            let Some(work) = t.work else { break };
            let key = work.key;
            let req = self.exchange.is_some().then(|| Arc::new(work.req.clone()));
            match self.model.start(work.req, self.split(key)) {
                Ok(task) if task.wants().is_some() => {
                    self.active = Some(Active {
                        key,
                        task,
                        cancel: work.cancel,
                        req,
                    })
                }
                Ok(task) => {
                    let out = self.finish_task(task);
                    source.finished(rank, key, out)
                }
                Err(e) => source.finished(rank, key, Err(e)),
            }
        }
        Ok((generation, closed))
    }
}
