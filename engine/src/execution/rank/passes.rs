//! The boundary loop and the passes it runs: a rank loads its weights and pipeline, then
//! meets its peers at every pass boundary and runs the pass they decide, computing each
//! block of its request when the pass is over the group the request wants, and ends the
//! step after it (a failure ends the request, never the pass).

use std::time::Instant;

use super::intake::{cancel_error, cancelled};
use super::report::RankResult;
use super::state::{Placement, RankWork, Run, Tally};
use crate::execution::backend::{Backend, Collective};
use crate::execution::budget::DeviceBudget;
use crate::execution::lockstep::{Coordinator, Decision, Flags};
use crate::execution::need::PassWork;
use crate::execution::pipeline::{Pipeline, PipelineOptions};
use crate::execution::trace::Lane;
use crate::execution::work::PassReport;
use crate::{Error, Result};

impl Run<'_> {
    /// One rank's work: loads its weights and pipeline (left in `held`, for
    /// [`Run::rank_loop`] to drop after a failure), then meets its peers at every pass
    /// boundary and runs the pass they decide, until they decide to exit.
    pub(super) fn rank_body<B: Backend, C: Collective<B>>(
        &self,
        place: Placement<B, C>,
        coord: &Coordinator,
        held: &mut Option<Pipeline<B, C>>,
    ) -> Result<RankResult> {
        let Placement {
            backend,
            comm,
            capacity,
            slots,
            exchange,
        } = place;
        let opts = self.opts;
        let rank = comm.rank();
        let (group, member) = (rank / opts.sp, rank % opts.sp);
        let budget = DeviceBudget::new(rank, capacity);
        let dev = backend.device().clone();
        let _resident_alloc = budget.charge(
            "resident_outside_blocks",
            "prologues, epilogues and the decoder",
            self.outside,
        )?;
        // A group's leader returns its outputs, so only it decodes them.
        let model = self
            .family
            .load_rank(&dev, self.dtype, opts.decode && member == 0)?;
        let pipe = held.insert(Pipeline::new(
            backend,
            comm,
            self.streamed.clone(),
            &budget,
            PipelineOptions {
                strategy: opts.strategy,
                slots,
                hook: opts.hook.clone(),
                trace: opts.trace.clone(),
                dtype: self.dtype,
                staging: self.staging,
            },
        )?);
        if member == 0 {
            self.source.ready(group);
        }
        let mut work = RankWork {
            run: self,
            rank,
            group,
            member,
            exchange,
            model: &*model,
            pipe,
            budget: &budget,
            active: None,
            failed: None,
            tally: Tally::default(),
        };
        let leader = group * opts.sp;
        loop {
            let (flags, handoff) = if member == 0 {
                let flags = work.at_boundary()?;
                (flags, work.handoff())
            } else {
                (Flags::following(), None)
            };
            let (d, handoffs) = coord.sync_handing(rank, flags, handoff)?;
            if member > 0 {
                work.follow(handoffs[leader].clone());
            }
            if d.exit {
                break;
            }
            if !d.run {
                self.source.wait(group, d.generation)?;
                continue;
            }
            let busy = work.active.as_ref().and_then(|a| a.task.wants()) == Some(d.group);
            work.pass(&d, busy, coord)?;
        }
        work.finish(slots)
    }
}

impl<B: Backend, C: Collective<B>> RankWork<'_, B, C> {
    /// Runs the pass `d` decided, computing when `busy` (this rank's request wants its
    /// group), and reports it.
    fn pass(&mut self, d: &Decision, busy: bool, coord: &Coordinator) -> Result<()> {
        let t0 = Instant::now();
        let stall_before = self.pipe.stats().stall;
        let phase = busy.then(|| self.pipe.phase());
        let failure = self.compute(d, busy, coord)?;
        let t = &mut self.tally;
        let switched = t.last_group.is_some_and(|g| g != d.group);
        t.last_group = Some(d.group);
        t.last_busy = busy;
        if busy {
            let stalled = self.pipe.stats().stall - stall_before;
            t.stall += stalled;
            if switched {
                t.switch_stall += stalled;
                t.switch_time += t0.elapsed();
            }
            self.end_step(failure, t0);
            // The step's end (the sampler's update) belongs to the pass's peak.
            if let Some(bytes) = phase.and_then(|p| p.peak()) {
                let kind = self.run.phase_of(d.group);
                self.tally.measured.record(kind, bytes);
            }
        }
        if self.member == 0 {
            self.run.source.pass_done(
                self.group,
                &PassReport {
                    busy,
                    elapsed: t0.elapsed(),
                    pipeline: self.pipe.stats(),
                    device_bytes: self.budget.used(),
                    phase_peaks: &self.tally.measured,
                },
            );
        }
        Ok(())
    }

    /// The pass through the pipeline, with this rank's request computing each block when
    /// `busy` (and its step cache wants it). A request's own failure ends that request,
    /// never the pass: the rank keeps joining the collectives so its peers are not
    /// disturbed. Returns that failure.
    fn compute(&mut self, d: &Decision, busy: bool, coord: &Coordinator) -> Result<Option<Error>> {
        let key = self.active.as_ref().map(|a| a.key);
        let cancel = self.active.as_ref().and_then(|a| a.cancel.clone());
        let mut task = self.active.as_mut().filter(|_| busy).map(|a| &mut a.task);
        let mut failure = None;
        if let Some(t) = task.as_mut() {
            if let Err(e) = t.begin() {
                failure = Some(e);
            }
        }
        let mut work = BlockWork {
            task,
            failure,
            exchange: self.exchange.as_deref(),
            key,
            member: self.member,
            rank: self.rank,
            trace: self.run.opts.trace.as_deref(),
            coord,
            cancel,
            computed: 0,
        };
        if let Some(e) = &work.failure {
            work.abort(e.to_string());
        }
        self.pipe.pass(d.group, d.next, d.plan, &mut work)?;
        if busy {
            let blocks = self.run.streamed.layouts[d.group].blocks.len() as u64;
            self.tally.blocks_saved += blocks.saturating_sub(work.computed);
            self.tally.blocks_computed += work.computed;
        }
        Ok(work.failure)
    }

    /// After a busy pass (started at `t0`): the request's failure in it, or its own at
    /// the step's end, ends the request; a step it completed is reported.
    fn end_step(&mut self, failure: Option<Error>, t0: Instant) {
        let (rank, source) = (self.group, self.run.source);
        let mut a = self.active.take().expect("busy has a task");
        let ended = match failure {
            Some(e) => Err(e),
            None => a.task.end(),
        };
        let took = t0.elapsed();
        self.tally.busy_time += took;
        match ended {
            Err(e) => {
                // A failure in a block has aborted the request already (a repeat is a
                // no-op); one in `end` has not.
                self.fail_request(a.key, &e);
                if self.member == 0 {
                    source.finished(rank, a.key, Err(e));
                }
            }
            Ok(step) => {
                if let Some((step, total)) = step {
                    self.tally.step_time += took;
                    self.tally.steps += 1;
                    if self.member == 0 {
                        source.step_done(rank, a.key, step, total, took);
                    }
                }
                self.active = Some(a);
            }
        }
    }
}

/// One rank's compute in a pass ([`PassWork`]): its request's blocks, while it has not
/// failed, and its vote on the rest of a Head pass.
struct BlockWork<'a> {
    task: Option<&'a mut Box<dyn crate::execution::family::Task>>,
    failure: Option<Error>,
    exchange: Option<&'a dyn crate::execution::seq::SeqExchange>,
    key: Option<crate::execution::work::WorkKey>,
    member: usize,
    rank: usize,
    trace: Option<&'a crate::execution::trace::Trace>,
    coord: &'a Coordinator,
    /// Set when the scheduler gave up on the request (cancelled, or out of grace at
    /// shutdown).
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Blocks its request computed.
    computed: u64,
}

impl BlockWork<'_> {
    /// A failure stops this rank's share at once; its group's others stop waiting.
    fn abort(&self, why: String) {
        if let (Some(x), Some(k)) = (self.exchange, self.key) {
            x.abort(k, self.member, &why);
        }
    }
}

impl PassWork for BlockWork<'_> {
    fn block(&mut self, index: usize, w: &dyn crate::execution::weights::Weights) -> Result<()> {
        // A request the scheduler gave up on stops at the next block: the pass still
        // streams every block in lockstep with the peers, but computes nothing more of it,
        // so a long step ends in the time the transfers take.
        if let (Some(k), None, true) = (self.key, &self.failure, self.task.is_some()) {
            if cancelled(&self.cancel) {
                let e = cancel_error(k);
                self.abort(e.to_string());
                self.failure = Some(e);
            }
        }
        let (Some(t), None) = (self.task.as_mut(), &self.failure) else {
            return Ok(());
        };
        if !t.runs_block(index) {
            return Ok(());
        }
        let start = self.trace.map(|t| t.now_us());
        self.computed += 1;
        if let Err(e) = t.block(index, w) {
            self.abort(e.to_string());
            self.failure = Some(e);
        }
        if let (Some(t), Some(s)) = (self.trace, start) {
            t.record(self.rank, Lane::Compute, index, s);
        }
        Ok(())
    }

    fn rest(&mut self) -> Result<bool> {
        let mine = match (&self.task, &self.failure) {
            (Some(t), None) => t.runs_block(1),
            _ => false,
        };
        self.coord.vote(self.rank, mine)
    }
}
