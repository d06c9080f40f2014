//! The pass coordinator: a barrier at every pass boundary that makes the dp ranks take
//! the same decision there, whatever requests they hold.
//!
//! `Pipeline::pass(group, next, ..)` issues collectives (and, with `next`, prefetches the
//! first blocks of the next pass, gathers included), so every rank must agree on whether a
//! pass runs at all, over which group of blocks, and what follows it. Each rank brings its
//! own view (which group its request wants now and after this pass, is its source closed,
//! which arrival generation it saw before looking for work); the barrier combines them
//! into one [`Decision`].
//!
//! Which group runs: a group whose first blocks were prefetched is committed and runs
//! next. Otherwise the group wanted by the rank that has waited the most passes for its
//! group (ties: the group most ranks want, then the lowest index), so a request whose
//! group differs from its peers' (a new prompt to encode, the other expert) waits at most
//! one pass per rank ahead of it. The next pass is predicted by the same rule from what
//! every rank will want after this one, and committed when prefetched.
//!
//! What the pass computes is the union of the needs of the ranks it serves (a step cache
//! may skip a step whole, or decide after the first block, [`Need`]), and likewise for
//! the pass announced after it; a pass planned [`Need::Head`] meets again after block 0
//! ([`Coordinator::vote`]) so every rank gathers the rest, or none does.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::need::{Need, PassPlan};
use super::work::{Request, WorkKey};
use crate::error::Abandoned;
use crate::{Error, Result};

/// What a sequence-parallel group's leader hands its followers at a pass boundary: the
/// request it holds after taking work there (the followers start their share of it, or
/// drop one it no longer holds).
#[derive(Clone)]
pub struct Handoff {
    pub key: WorkKey,
    pub req: Arc<Request>,
}

/// One rank's view at a pass boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    /// The group this rank's request wants a pass over now (None: no work).
    pub want: Option<usize>,
    /// The group it will want after that pass (or that queued work would want first).
    pub then: Option<usize>,
    /// This rank's source will never hand out work again.
    pub closed: bool,
    /// The source's arrival generation this rank saw before it looked for work.
    pub generation: u64,
    /// The blocks its request computes in the pass over `want`, and in the one over
    /// `then` (queued work that has not started needs every block).
    pub need: Need,
    pub then_need: Need,
}

impl Flags {
    /// A sequence-parallel follower's view: it takes no work of its own (its leader's
    /// flags speak for its group), so it neither asks for a pass nor holds the others
    /// from pausing or exiting.
    pub fn following() -> Flags {
        Flags {
            want: None,
            then: None,
            closed: true,
            generation: u64::MAX,
            need: Need::Nothing,
            then_need: Need::Nothing,
        }
    }
}

/// What every rank does next; identical on every rank of the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Some rank has work (or a prefetched pass is due): everyone runs the pass over
    /// `group` (ranks whose request wants another group join without computing).
    pub run: bool,
    /// The group of blocks this pass runs over.
    pub group: usize,
    /// Another pass will follow over this group: prefetch its first blocks. Once
    /// announced, the next pass that runs is over this group.
    pub next: Option<usize>,
    /// Nobody has work and every source is closed: leave the loop.
    pub exit: bool,
    /// Nobody has work: pause until an arrival newer than this generation.
    pub generation: u64,
    /// The union of the needs of this pass's ranks, and of the next pass's.
    pub plan: PassPlan,
}

/// Picks the group for a pass from each rank's wanted group and how many passes it has
/// waited for it (see the module doc for the rule).
fn choose(wants: &[Option<usize>], waited: &[u64]) -> Option<usize> {
    let count = |g: usize| wants.iter().filter(|w| **w == Some(g)).count();
    wants
        .iter()
        .zip(waited)
        .filter_map(|(w, n)| w.map(|g| (*n, count(g), std::cmp::Reverse(g))))
        .max()
        .map(|(_, _, std::cmp::Reverse(g))| g)
}

impl Decision {
    /// Combines every rank's flags, given the group already committed by a prefetch and
    /// how many passes each rank has waited for its group (a pure function, so it can be
    /// tested alone). Returns the decision and the ranks' waits after it.
    pub fn combine(
        flags: &[Flags],
        committed: Option<usize>,
        waited: &[u64],
    ) -> (Decision, Vec<u64>) {
        let wants: Vec<Option<usize>> = flags.iter().map(|f| f.want).collect();
        let chosen = committed.or_else(|| choose(&wants, waited));
        let run = chosen.is_some();
        let group = chosen.unwrap_or(0);
        // Who wants what after this pass: a rank whose group ran moves on to `then`.
        let (mut after, mut waits) = (Vec::with_capacity(flags.len()), Vec::new());
        let (mut need, mut after_need) = (Need::Nothing, Vec::with_capacity(flags.len()));
        for (f, n) in flags.iter().zip(waited) {
            let served = run && f.want == Some(group);
            if served {
                need = need.union(f.need);
            }
            let moves_on = served || f.want.is_none();
            after.push(if moves_on { f.then } else { f.want });
            after_need.push(if moves_on { f.then_need } else { f.need });
            waits.push(match f.want {
                Some(_) if !served && run => n + 1,
                Some(_) if !served => *n,
                _ => 0,
            });
        }
        let next = if run { choose(&after, &waits) } else { None };
        let next_need = after
            .iter()
            .zip(&after_need)
            .filter(|(a, _)| next.is_some() && **a == next)
            .fold(Need::Nothing, |u, (_, &n)| u.union(n));
        let d = Decision {
            plan: PassPlan { need, next_need },
            run,
            group,
            next,
            exit: !run && flags.iter().all(|f| f.closed),
            generation: flags.iter().map(|f| f.generation).min().unwrap_or(0),
        };
        (d, waits)
    }
}

struct State {
    round: u64,
    arrived: Vec<Option<Flags>>,
    last: Option<Decision>,
    /// The group a prefetch has committed the next pass to.
    committed: Option<usize>,
    /// Passes each rank has waited for its group.
    waited: Vec<u64>,
    /// The first failure, which every round from then on gives up with.
    poisoned: Option<String>,
    /// Each rank's handoff of the round being gathered, and of the last one decided.
    handoffs: Vec<Option<Handoff>>,
    last_handoffs: Vec<Option<Handoff>>,
    /// The vote after a Head pass's block 0: its round, the ranks that have voted, the
    /// union so far and the last result.
    vote_round: u64,
    votes: usize,
    vote_any: bool,
    vote_last: bool,
}

/// The barrier of one group of ranks.
pub struct Coordinator {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Coordinator {
    pub fn new(size: usize, timeout: Duration) -> Self {
        Coordinator {
            size,
            timeout,
            state: Mutex::new(State {
                round: 0,
                arrived: vec![None; size],
                last: None,
                committed: None,
                waited: vec![0; size],
                poisoned: None,
                handoffs: vec![None; size],
                last_handoffs: vec![None; size],
                vote_round: 0,
                votes: 0,
                vote_any: false,
                vote_last: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Fails every current and future round (a rank died: `why` is its failure, naming
    /// it); the ranks waiting give up with an [`Abandoned`] quoting `why`.
    pub fn poison(&self, why: String) {
        let mut s = self.state.lock().expect("coordinator lock");
        s.poisoned.get_or_insert(why);
        self.cv.notify_all();
    }

    /// After block 0 of a pass planned [`Need::Head`]: rank `rank` votes `yes` when its
    /// request computes the other blocks; returns, once every rank has voted, whether
    /// any did.
    pub fn vote(&self, rank: usize, yes: bool) -> Result<bool> {
        let mut s = self.state.lock().expect("coordinator lock");
        let round = s.vote_round;
        s.votes += 1;
        s.vote_any |= yes;
        if s.votes == self.size {
            s.vote_last = s.vote_any;
            (s.votes, s.vote_any) = (0, false);
            s.vote_round += 1;
            self.cv.notify_all();
            return Ok(s.vote_last);
        }
        let s = self.wait_round(
            s,
            rank,
            round,
            |s| s.vote_round,
            |_| "for the other ranks' vote after a pass's first block".into(),
        )?;
        Ok(s.vote_last)
    }

    /// Waits, holding `s`, until `round_of` has moved past `round` (what the last rank
    /// to arrive does), and returns the lock; gives up when another rank poisoned the
    /// coordinator, or poisons it after the timeout, with `waiting` saying for what.
    fn wait_round<'s>(
        &self,
        mut s: std::sync::MutexGuard<'s, State>,
        rank: usize,
        round: u64,
        round_of: impl Fn(&State) -> u64,
        waiting: impl Fn(&State) -> String,
    ) -> Result<std::sync::MutexGuard<'s, State>> {
        let start = Instant::now();
        loop {
            if let Some(p) = &s.poisoned {
                return Err(Error::Abandoned(Abandoned {
                    rank,
                    what: "pass coordinator",
                    cause: p.clone(),
                }));
            }
            if round_of(&s) != round {
                return Ok(s);
            }
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let why = format!("rank {rank} waited {:?} {}", self.timeout, waiting(&s));
                s.poisoned = Some(why.clone());
                self.cv.notify_all();
                return Err(Error::Rank { rank, msg: why });
            }
            s = self.cv.wait_timeout(s, left).expect("coordinator lock").0;
        }
    }

    /// Rank `rank` arrives with `flags`; returns once every rank has arrived.
    pub fn sync(&self, rank: usize, flags: Flags) -> Result<Decision> {
        self.sync_handing(rank, flags, None).map(|(d, _)| d)
    }

    /// As [`Self::sync`], rank `rank` also handing `handoff` to its peers; returns the
    /// decision and every rank's handoff of this round.
    pub fn sync_handing(
        &self,
        rank: usize,
        flags: Flags,
        handoff: Option<Handoff>,
    ) -> Result<(Decision, Vec<Option<Handoff>>)> {
        let mut s = self.state.lock().expect("coordinator lock");
        let abandoned = |cause: &str| {
            Error::Abandoned(Abandoned {
                rank,
                what: "pass coordinator",
                cause: cause.to_string(),
            })
        };
        if let Some(p) = &s.poisoned {
            return Err(abandoned(p));
        }
        let round = s.round;
        s.arrived[rank] = Some(flags);
        s.handoffs[rank] = handoff;
        if s.arrived.iter().all(Option::is_some) {
            let all: Vec<Flags> = s
                .arrived
                .iter_mut()
                .map(|f| f.take().expect("arrived"))
                .collect();
            let (d, waited) = Decision::combine(&all, s.committed, &s.waited);
            if d.run {
                s.committed = d.next;
            }
            s.waited = waited;
            s.last = Some(d);
            s.last_handoffs = std::mem::replace(&mut s.handoffs, vec![None; self.size]);
            s.round += 1;
            self.cv.notify_all();
            return Ok((d, s.last_handoffs.clone()));
        }
        let size = self.size;
        let s = self.wait_round(
            s,
            rank,
            round,
            |s| s.round,
            |s| {
                let missing: Vec<usize> = (0..size).filter(|&q| s.arrived[q].is_none()).collect();
                format!("at a pass boundary (ranks not arrived: {missing:?})")
            },
        )?;
        // The next round cannot be decided before this rank arrives at it, so the last
        // decision and handoffs are this round's.
        Ok((s.last.expect("decided"), s.last_handoffs.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn f(want: Option<usize>, then: Option<usize>, closed: bool, generation: u64) -> Flags {
        Flags {
            want,
            then,
            closed,
            generation,
            need: Need::All,
            then_need: Need::All,
        }
    }

    fn combine(flags: &[Flags]) -> Decision {
        Decision::combine(flags, None, &vec![0; flags.len()]).0
    }

    #[test]
    fn any_work_runs_the_pass_for_everyone() {
        let d = combine(&[f(None, None, true, 5), f(Some(0), None, false, 3)]);
        assert!(d.run && d.next.is_none() && !d.exit);
        assert_eq!(d.generation, 3);
        let d = combine(&[f(None, Some(0), false, 1), f(Some(0), None, false, 1)]);
        assert_eq!(
            d.next,
            Some(0),
            "one rank expecting more work prefetches for all"
        );
        let d = combine(&[f(None, Some(0), false, 1), f(None, None, true, 1)]);
        assert!(
            !d.run && d.next.is_none() && !d.exit,
            "no prefetch when no pass runs"
        );
        assert!(combine(&[f(None, None, true, 0), f(None, None, true, 0)]).exit);
    }

    #[test]
    fn groups_take_turns_and_the_prefetched_group_is_committed() {
        // Rank 0 wants group 1 (say, the second expert), ranks 1 and 2 group 0.
        let flags = [
            f(Some(1), Some(1), false, 0),
            f(Some(0), Some(0), false, 0),
            f(Some(0), Some(0), false, 0),
        ];
        let (d, waited) = Decision::combine(&flags, None, &[0, 0, 0]);
        assert_eq!(
            (d.group, d.next),
            (0, Some(1)),
            "majority first, then the waiter"
        );
        assert_eq!(waited, vec![1, 0, 0]);
        let (d, waited) = Decision::combine(&flags, d.next, &waited);
        assert_eq!((d.group, d.next), (1, Some(0)));
        assert_eq!(waited, vec![0, 1, 1]);
        // A commitment holds even when nobody wants that group any more.
        let idle = [f(None, None, false, 0), f(Some(0), None, false, 0)];
        let (d, _) = Decision::combine(&idle, Some(1), &[0, 0]);
        assert!(d.run && d.group == 1 && d.next == Some(0));
    }

    #[test]
    fn every_rank_gets_the_same_decision() {
        let c = Arc::new(Coordinator::new(3, Duration::from_secs(10)));
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let c = c.clone();
                std::thread::spawn(move || {
                    (0..50)
                        .map(|i| {
                            let want = (r == i % 3).then_some(0);
                            let then = (r == 1).then_some(0);
                            c.sync(r, f(want, then, r == 2, r as u64)).unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let out: Vec<Vec<Decision>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(out.iter().all(|o| o == &out[0]));
        assert!(out[0]
            .iter()
            .all(|d| d.run && d.next == Some(0) && d.generation == 0));
    }

    #[test]
    fn a_missing_rank_times_out_and_names_it() {
        let c = Coordinator::new(2, Duration::from_millis(50));
        let e = c
            .sync(0, f(Some(0), None, false, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ranks not arrived: [1]"), "{e}");
        match c.sync(1, f(Some(0), None, false, 0)) {
            Err(Error::Abandoned(a)) => {
                assert_eq!((a.rank, a.what), (1, "pass coordinator"));
                assert!(a.cause.contains("rank 0 waited"), "{}", a.cause);
            }
            r => panic!(
                "not abandoned for the rest: {:?}",
                r.map_err(|e| e.to_string())
            ),
        }
    }
}
