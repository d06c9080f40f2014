//! A rank that panics is a rank failure like any other: its peers stop, the work source
//! hears which rank failed and why (the server fails every request in flight with it and
//! exits non-zero), and the engine returns the error instead of its thread dying. The
//! peers stop with [`Error::Abandoned`], which quotes the failure; the engine returns the
//! failure itself.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::error::Abandoned;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::{Output, Taken, Work, WorkKey, WorkSource};
use layerwise_engine::{Error, Result, Strategy};

/// Rank 1 panics when it first asks for work; rank 0 finds the source closed.
#[derive(Default)]
struct PanicOnRank1 {
    failed: Mutex<Vec<String>>,
}

impl WorkSource for PanicOnRank1 {
    fn take(&self, rank: usize) -> Result<Taken> {
        if rank == 1 {
            panic!("injected fault on rank 1");
        }
        Ok(Taken {
            work: None,
            generation: 0,
            closed: true,
        })
    }
    fn pending(&self, _rank: usize) -> bool {
        false
    }
    fn wait(&self, _rank: usize, _generation: u64) -> Result<()> {
        Ok(())
    }
    fn finished(&self, _rank: usize, _key: WorkKey, _out: Result<Output>) {}
    fn failed(&self, rank: usize, error: &Error) {
        self.failed
            .lock()
            .unwrap()
            .push(format!("rank {rank}: {error}"));
    }
}

#[test]
fn a_rank_that_panics_fails_the_run_and_tells_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 2)).unwrap());
    let opts = EngineOptions {
        strategy: Strategy::OffloadSharded,
        dp: 2,
        slots: SlotsChoice::Fixed(2),
        decode: false,
        timeout: Duration::from_secs(30),
        ..EngineOptions::default()
    };
    let source = PanicOnRank1::default();
    let err = match model.drive(&opts, &source) {
        Ok(_) => panic!("a panicking rank went unnoticed"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("panicked: injected fault on rank 1"), "{err}");
    let failed = source.failed.lock().unwrap().clone();
    assert!(
        failed
            .iter()
            .any(|f| f.starts_with("rank 1:") && f.contains("injected fault")),
        "{failed:?}"
    );
}

/// What a work source heard of one rank's failure.
#[derive(Debug)]
struct Heard {
    rank: usize,
    error: String,
    /// The error, when it was a peer giving up.
    abandoned: Option<Abandoned>,
}

/// Rank 0 works on one 4-step request; rank 1, idle, joins the collectives and panics
/// when it asks for work the third time, with gathers already issued on its
/// communicator. Any other rank stays idle.
#[derive(Default)]
struct MidRunFault {
    given: Mutex<bool>,
    asked: Mutex<usize>,
    failed: Mutex<Vec<Heard>>,
}

impl WorkSource for MidRunFault {
    fn take(&self, rank: usize) -> Result<Taken> {
        if rank == 1 {
            let mut n = self.asked.lock().unwrap();
            *n += 1;
            if *n == 3 {
                panic!("injected fault on rank 1 mid-run");
            }
            return Ok(Taken {
                work: None,
                generation: 0,
                closed: false,
            });
        }
        let mut given = self.given.lock().unwrap();
        let work = (!*given).then(|| Work {
            key: WorkKey { id: 1, index: 0 },
            req: common::request(3, 4, 1.0),
            cancel: None,
        });
        *given = true;
        Ok(Taken {
            work,
            generation: 0,
            closed: false,
        })
    }
    fn pending(&self, _rank: usize) -> bool {
        false
    }
    fn wait(&self, _rank: usize, _generation: u64) -> Result<()> {
        Ok(())
    }
    fn finished(&self, _rank: usize, _key: WorkKey, _out: Result<Output>) {}
    fn failed(&self, rank: usize, error: &Error) {
        self.failed.lock().unwrap().push(Heard {
            rank,
            error: error.to_string(),
            abandoned: match error {
                Error::Abandoned(a) => Some(a.clone()),
                _ => None,
            },
        });
    }
}

#[test]
fn a_rank_failing_mid_run_poisons_the_group_before_its_communicator_drops() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 3)).unwrap());
    for strategy in [Strategy::OffloadSharded, Strategy::Sharded] {
        let opts = EngineOptions {
            strategy,
            dp: 2,
            slots: SlotsChoice::Fixed(2),
            decode: false,
            timeout: Duration::from_secs(30),
            ..EngineOptions::default()
        };
        let source = MidRunFault::default();
        let err = match model.drive(&opts, &source) {
            Ok(_) => panic!("{strategy}: a panicking rank went unnoticed"),
            Err(e) => e.to_string(),
        };
        // The engine checks the CPU group's record of the order: a communicator dropped
        // before the poison would turn the error into an ordering-bug report.
        assert!(
            err.contains("injected fault on rank 1 mid-run") && !err.contains("ordering bug"),
            "{strategy}: {err}"
        );
        let failed = source.failed.lock().unwrap();
        assert!(failed.iter().any(|f| f.rank == 0), "{failed:?}");
    }
}

#[test]
fn a_peers_failure_is_the_root_cause_and_the_others_abandon_quoting_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&common::tiny(dir.path(), 3)).unwrap());
    for strategy in [Strategy::OffloadSharded, Strategy::Sharded] {
        let opts = EngineOptions {
            strategy,
            dp: 3,
            slots: SlotsChoice::Fixed(2),
            decode: false,
            timeout: Duration::from_secs(30),
            ..EngineOptions::default()
        };
        let source = MidRunFault::default();
        let cause = "rank 1 failed: panicked: injected fault on rank 1 mid-run";
        // The caller gets rank 1's own failure, whichever rank's thread ended first.
        match model.drive(&opts, &source) {
            Err(Error::Rank { rank: 1, msg }) => {
                assert_eq!(
                    msg, "panicked: injected fault on rank 1 mid-run",
                    "{strategy}"
                )
            }
            Err(e) => panic!("{strategy}: not rank 1's failure: {e}"),
            Ok(_) => panic!("{strategy}: a panicking rank went unnoticed"),
        }
        // The source hears every rank: rank 1 failed, ranks 0 and 2 gave up (in a gather
        // or at the pass barrier, wherever the failure found them), quoting rank 1.
        let mut failed = std::mem::take(&mut *source.failed.lock().unwrap());
        failed.sort_by_key(|f| f.rank);
        assert_eq!(
            failed.iter().map(|f| f.rank).collect::<Vec<_>>(),
            [0, 1, 2],
            "{strategy}: {failed:?}"
        );
        assert!(failed[1].abandoned.is_none(), "{strategy}: {failed:?}");
        for f in [&failed[0], &failed[2]] {
            let a = f.abandoned.as_ref().unwrap_or_else(|| {
                panic!("{strategy}: rank {} did not abandon: {}", f.rank, f.error)
            });
            assert_eq!(a.rank, f.rank);
            assert!(
                ["all-gather", "pass coordinator"].contains(&a.what),
                "{strategy}: {}",
                f.error
            );
            assert_eq!(a.cause, cause, "{strategy}");
            assert_eq!(
                f.error,
                format!("rank {}: {} abandoned: {cause}", f.rank, a.what)
            );
        }
    }
}
