//! One thread per rank: [`Run::spawn`] starts them and picks the root cause when some fail;
//! each thread catches its rank's panic as a failure and, before its pipeline and
//! communicator drop, poisons the collectives and the coordinator so its peers stop
//! instead of waiting.

use super::failure::first_cause;
use super::report::RankResult;
use super::state::{Placement, RankParts, Run};
use crate::execution::backend::{Backend, Collective};
use crate::execution::lockstep::Coordinator;
use crate::{Error, Result};

impl Run<'_> {
    /// Runs one thread per rank on its backend and communicator (with the device budget
    /// capacity each has), and gathers their results. `poison` fails the collective
    /// group when a rank fails, so its peers stop instead of waiting.
    pub(super) fn spawn<B: Backend, C: Collective<B>>(
        &self,
        ranks: Vec<RankParts<B, C>>,
        poison: &(dyn Fn(String) + Sync),
    ) -> Result<Vec<RankResult>> {
        let coord = Coordinator::new(self.opts.dp * self.opts.sp, self.opts.timeout);
        let results: Vec<Result<RankResult>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|(backend, comm, capacity, exchange)| {
                    let coord = &coord;
                    let span = tracing::info_span!("rank", rank = comm.rank());
                    std::thread::Builder::new()
                        .name(format!("rank-{}", comm.rank()))
                        .spawn_scoped(scope, move || {
                            let _g = span.enter();
                            let rank = comm.rank();
                            let place = Placement {
                                backend,
                                comm,
                                capacity,
                                slots: self.slots,
                                exchange,
                            };
                            // Poisons the collective group (which aborts every
                            // communicator) and the coordinator. Called by the failing
                            // rank *before* its pipeline and communicator drop: a
                            // communicator destroyed while peers wait in collectives, or
                            // with its own still queued, blocks forever.
                            let fail = |e: &Error| {
                                if matches!(e, Error::Abandoned(_)) {
                                    tracing::warn!(rank, error = %e, "rank gave up");
                                } else {
                                    tracing::error!(rank, error = %e, "rank failed");
                                }
                                let cause = first_cause(rank, e);
                                poison(cause.clone());
                                coord.poison(cause);
                            };
                            let r = self.rank_loop(place, coord, &fail);
                            if let Err(e) = &r {
                                self.source.failed(rank / self.opts.sp, e);
                            }
                            r
                        })
                        .expect("spawn rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank threads catch their panics"))
                .collect()
        });
        let mut ranks = Vec::new();
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(x) => ranks.push(x),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            let root = errors
                .iter()
                .position(|e| !matches!(e, Error::Abandoned(_)))
                .unwrap_or(0);
            return Err(errors.swap_remove(root));
        }
        Ok(ranks)
    }

    /// One rank from start to exit. On failure (an error or a panic, which is a rank
    /// failure like any other) `fail` runs while the rank's pipeline — its streams, slots
    /// and communicator — is still alive, and only then is it dropped.
    fn rank_loop<B: Backend, C: Collective<B>>(
        &self,
        place: Placement<B, C>,
        coord: &Coordinator,
        fail: &dyn Fn(&Error),
    ) -> Result<RankResult> {
        let rank = place.comm.rank();
        let mut held = None;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.rank_body(place, coord, &mut held)
        }))
        .unwrap_or_else(|p| {
            Err(Error::Rank {
                rank,
                msg: format!("panicked: {}", crate::error::panic_message(p.as_ref())),
            })
        });
        if let Err(e) = &r {
            fail(e);
        }
        drop(held);
        r
    }
}
