//! The pass coordinator: a barrier at every pass boundary that makes the dp ranks take
//! the same decision there, whatever requests they hold.
//!
//! `Pipeline::pass(next_pass, ..)` issues collectives (and, with `next_pass`, prefetches the
//! next pass's first blocks, gathers included), so every rank must agree on whether a pass
//! runs at all and on `next_pass`. Each rank brings its own view (do I have work now, will
//! I still have work after this pass, is my source closed, which arrival generation did I
//! see before looking for work); the barrier ORs and ANDs them into one [`Decision`].

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// One rank's view at a pass boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    /// This rank has a request to step in this pass.
    pub has_work: bool,
    /// This rank will still have work after this pass (or work is queued).
    pub more: bool,
    /// This rank's source will never hand out work again.
    pub closed: bool,
    /// The source's arrival generation this rank saw before it looked for work.
    pub generation: u64,
}

/// What every rank does next; identical on every rank of the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Some rank has work: everyone runs the pass (idle ranks join without computing).
    pub run: bool,
    /// Another pass will follow: prefetch its first blocks.
    pub next_pass: bool,
    /// Nobody has work and every source is closed: leave the loop.
    pub exit: bool,
    /// Nobody has work: pause until an arrival newer than this generation.
    pub generation: u64,
}

impl Decision {
    /// Combines every rank's flags (a pure function, so it can be tested alone).
    pub fn combine(flags: &[Flags]) -> Decision {
        let run = flags.iter().any(|f| f.has_work);
        Decision {
            run,
            next_pass: run && flags.iter().any(|f| f.more),
            exit: !run && flags.iter().all(|f| f.closed),
            generation: flags.iter().map(|f| f.generation).min().unwrap_or(0),
        }
    }
}

struct State {
    round: u64,
    arrived: Vec<Option<Flags>>,
    last: Option<Decision>,
    poisoned: Option<String>,
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
                poisoned: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Fails every current and future round (a rank died).
    pub fn poison(&self, why: String) {
        let mut s = self.state.lock().expect("coordinator lock");
        s.poisoned.get_or_insert(why);
        self.cv.notify_all();
    }

    /// Rank `rank` arrives with `flags`; returns once every rank has arrived.
    pub fn sync(&self, rank: usize, flags: Flags) -> Result<Decision> {
        let mut s = self.state.lock().expect("coordinator lock");
        let fail = |s: &State| Error::Rank {
            rank,
            msg: format!(
                "pass coordinator abandoned: {}",
                s.poisoned.as_deref().unwrap_or("")
            ),
        };
        if s.poisoned.is_some() {
            return Err(fail(&s));
        }
        let round = s.round;
        s.arrived[rank] = Some(flags);
        if s.arrived.iter().all(Option::is_some) {
            let all: Vec<Flags> = s
                .arrived
                .iter_mut()
                .map(|f| f.take().expect("arrived"))
                .collect();
            let d = Decision::combine(&all);
            s.last = Some(d);
            s.round += 1;
            self.cv.notify_all();
            return Ok(d);
        }
        let start = Instant::now();
        loop {
            if s.poisoned.is_some() {
                return Err(fail(&s));
            }
            if s.round != round {
                return Ok(s.last.expect("decided"));
            }
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing: Vec<usize> =
                    (0..self.size).filter(|&q| s.arrived[q].is_none()).collect();
                let why = format!(
                    "rank {rank} waited {:?} at a pass boundary (ranks not arrived: {missing:?})",
                    self.timeout
                );
                s.poisoned = Some(why.clone());
                self.cv.notify_all();
                return Err(Error::Rank { rank, msg: why });
            }
            s = self.cv.wait_timeout(s, left).expect("coordinator lock").0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn f(has_work: bool, more: bool, closed: bool, generation: u64) -> Flags {
        Flags {
            has_work,
            more,
            closed,
            generation,
        }
    }

    #[test]
    fn any_work_runs_the_pass_for_everyone() {
        let d = Decision::combine(&[f(false, false, true, 5), f(true, false, false, 3)]);
        assert!(d.run && !d.next_pass && !d.exit);
        assert_eq!(d.generation, 3);
        let d = Decision::combine(&[f(false, true, false, 1), f(true, false, false, 1)]);
        assert!(
            d.next_pass,
            "one rank expecting more work prefetches for all"
        );
        let d = Decision::combine(&[f(false, true, false, 1), f(false, false, true, 1)]);
        assert!(
            !d.run && !d.next_pass && !d.exit,
            "no prefetch when no pass runs"
        );
        assert!(Decision::combine(&[f(false, false, true, 0), f(false, false, true, 0)]).exit);
    }

    #[test]
    fn every_rank_gets_the_same_decision() {
        let c = Arc::new(Coordinator::new(3, Duration::from_secs(10)));
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let c = c.clone();
                std::thread::spawn(move || {
                    (0..50)
                        .map(|i| c.sync(r, f(r == i % 3, r == 1, r == 2, r as u64)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let out: Vec<Vec<Decision>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(out.iter().all(|o| o == &out[0]));
        assert!(out[0]
            .iter()
            .all(|d| d.run && d.next_pass && d.generation == 0));
    }

    #[test]
    fn a_missing_rank_times_out_and_names_it() {
        let c = Coordinator::new(2, Duration::from_millis(50));
        let e = c.sync(0, f(true, false, false, 0)).unwrap_err().to_string();
        assert!(e.contains("ranks not arrived: [1]"), "{e}");
        assert!(
            c.sync(1, f(true, false, false, 0)).is_err(),
            "poisoned for the rest"
        );
    }
}
