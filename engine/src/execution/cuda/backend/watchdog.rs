//! Keeping a rank from hanging on a device that makes no progress: the host queues a
//! bounded number of weight waits ahead, waits itself (with the timeout) for the oldest
//! beyond that, and a watchdog thread fails the rank when the oldest has not completed
//! within the timeout, calling the setup's [`OnStall`] (the NCCL group's poison).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver as cu;

use super::device::{CudaBackend, OnStall};
use crate::{Error, Result};

/// How many blocks' weight waits the host may queue on the compute stream before it waits
/// for the oldest itself. The device already orders each block's kernels after its
/// weights (`cuStreamWaitEvent`); the host only keeps itself from running unboundedly
/// ahead (and the queue of launches from growing), so a few slots' worth suffices.
pub(super) const HOST_AHEAD: usize = 8;

impl CudaBackend {
    /// What to do when the device makes no progress for the timeout (set once, by the
    /// setup, once the NCCL group exists).
    pub fn set_on_stall(&self, f: OnStall) {
        let _ = self.on_stall.set(f);
    }

    /// The watchdog: a thread that looks at the oldest weight wait the compute stream
    /// holds and, when it has not completed within the timeout, records the failure and
    /// calls `on_stall`. The host no longer waits on every block's event, so without it
    /// a dead peer would surface only as a hang in some later synchronising read.
    pub(super) fn spawn_watchdog(&self) -> Result<()> {
        let (pending, on_stall, stop) = (
            self.pending.clone(),
            self.on_stall.clone(),
            self.watchdog_stop.clone(),
        );
        let (rank, timeout, ctx) = (self.rank, self.timeout, self.ctx.clone());
        std::thread::Builder::new()
            .name(format!("watchdog-r{rank}"))
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                let tick = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_secs(1));
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(tick);
                    let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                    while let Some((ev, _)) = p.waits.front() {
                        match &ev.0.ev {
                            Ok(e) if e.try_is_complete().unwrap_or(false) => {
                                p.waits.pop_front();
                            }
                            Err(_) => {
                                p.waits.pop_front();
                            }
                            Ok(_) => break,
                        }
                    }
                    let stuck = p
                        .waits
                        .front()
                        .is_some_and(|(_, since)| since.elapsed() >= timeout);
                    if stuck && p.expired.is_none() {
                        let why = format!(
                            "rank {rank}: the device made no progress for {timeout:?} (its weights never arrived: a stalled copy or a dead peer)"
                        );
                        tracing::error!(rank, "{why}");
                        p.expired = Some(why.clone());
                        drop(p);
                        if let Some(f) = on_stall.get() {
                            f(why);
                        }
                    }
                }
            })
            .map_err(|e| Error::Rank {
                rank: self.rank,
                msg: format!("cannot start the watchdog thread: {e}"),
            })?;
        Ok(())
    }

    /// Polls `ev` until it completes or the timeout passes (a dead peer or a hung copy
    /// must become an error, not a hang).
    pub(super) fn host_wait(&self, ev: &cu::CudaEvent) -> std::result::Result<(), String> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(5);
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(format!("event query: {e:?}")),
            }
            if start.elapsed() >= self.timeout {
                return Err(format!(
                    "no progress for {:?} (stalled stream or rank)",
                    self.timeout
                ));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_micros(200));
        }
    }
}
