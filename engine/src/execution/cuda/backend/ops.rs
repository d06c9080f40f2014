//! The [`Backend`] operations on a GPU: streams and events that carry failures along, the
//! compute stream's waits for weights (timed on the device, bounded on the host), the
//! copies into slots, and host functions run when a stream reaches them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{DType, Device, Tensor};

use super::copy::{CopyIn, CopyStaged};
use super::device::CudaBackend;
use super::stream::{CudaEvent, CudaStream, EventInner};
use super::timing::{harvest, TIMING_PAIRS};
use super::watchdog::HOST_AHEAD;
use crate::checkpoint::Mapped;
use crate::execution::backend::Backend;
use crate::execution::cuda::host::{alloc_pinned, cuda};
use crate::execution::fault::Fault;
use crate::execution::host_buffer::{HostBuffer, Staged};
use crate::layout::Piece;
use crate::{Error, Result};

/// `cuLaunchHostFunc` trampoline: runs and frees one boxed closure.
unsafe extern "C" fn run_host_fn(arg: *mut std::ffi::c_void) {
    // SAFETY: `arg` came from Box::into_raw in `host_fn` and the driver calls us once.
    let f = unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) };
    // A panic must not unwind into the driver's thread.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

impl Backend for CudaBackend {
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn device(&self) -> &Device {
        &self.device
    }

    fn phase(&self) -> crate::measure::Phase {
        crate::measure::cuda::pool_phase(&self.ctx)
    }

    fn new_stream(&self, name: &str) -> Result<CudaStream> {
        let inner = self
            .ctx
            .new_stream()
            .map_err(|e| cuda(&format!("create stream {name}"), e))?;
        Ok(CudaStream {
            name: name.to_string(),
            inner,
            error: Arc::default(),
        })
    }

    fn new_event(&self) -> CudaEvent {
        let ev = self
            .ctx
            .new_event(None)
            .map_err(|e| format!("create event: {e:?}"));
        CudaEvent(Arc::new(EventInner {
            ev,
            error: Mutex::default(),
        }))
    }

    fn record(&self, stream: &CudaStream, event: &CudaEvent) {
        if let Some(e) = stream.error() {
            return event.fail(e);
        }
        if let Ok(ev) = &event.0.ev {
            if let Err(e) = ev.record(&stream.inner) {
                let why = Fault::Failed(format!("{}: event record: {e:?}", stream.name));
                stream.poison(why.clone());
                event.fail(why);
            }
        }
    }

    fn wait(&self, stream: &CudaStream, event: &CudaEvent) {
        if let Some(e) = event.error() {
            return stream.poison(e);
        }
        if let Ok(ev) = &event.0.ev {
            if let Err(e) = stream.inner.wait(ev) {
                stream.poison(Fault::Failed(format!("{}: event wait: {e:?}", stream.name)));
            }
        }
    }

    fn compute_wait(&self, event: &CudaEvent) -> Result<Duration> {
        let fail = |msg: String| Error::Rank {
            rank: self.rank,
            msg,
        };
        // A stream's fault: an abandoned all-gather keeps its type, a failure is this
        // rank's.
        let faulted = |f: Fault| f.into_error(fail);
        if let Some(e) = event.error() {
            return Err(faulted(e));
        }
        let Ok(ev) = &event.0.ev else {
            unreachable!("error checked above")
        };
        let mut t = self.timing.lock().expect("timing lock");
        let stalled = harvest(&mut t);
        let i = t.next;
        let timed = !t.pairs[i].2;
        if timed {
            t.pairs[i]
                .0
                .record(&self.compute)
                .map_err(|e| fail(format!("timing record: {e:?}")))?;
        }
        self.compute
            .wait(ev)
            .map_err(|e| fail(format!("compute wait: {e:?}")))?;
        if timed {
            t.pairs[i]
                .1
                .record(&self.compute)
                .map_err(|e| fail(format!("timing record: {e:?}")))?;
            t.pairs[i].2 = true;
            t.next = (i + 1) % TIMING_PAIRS;
        }
        drop(t);
        // The device orders compute after the event; the host goes on queueing kernels.
        // It waits itself only for the oldest of more than HOST_AHEAD outstanding waits
        // (bounded by the timeout), and the watchdog watches the oldest meanwhile, so a
        // failed peer or copy still surfaces as an error instead of a hang.
        let oldest = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(why) = &p.expired {
                return Err(fail(why.clone()));
            }
            p.waits.push_back((event.clone(), Instant::now()));
            if p.waits.len() > HOST_AHEAD {
                p.waits.pop_front()
            } else {
                None
            }
        };
        if let Some((old, _)) = oldest {
            if let Ok(ev) = &old.0.ev {
                self.host_wait(ev)
                    .map_err(|e| faulted(old.error().unwrap_or(Fault::Failed(e))))?;
            }
            if let Some(e) = old.error() {
                return Err(faulted(e));
            }
        }
        if let Some(e) = event.error() {
            return Err(faulted(e));
        }
        Ok(stalled)
    }

    fn drain_stall(&self) -> Result<Duration> {
        // The end of a run: every timing pair still in flight completes once compute
        // has, so wait for the compute stream and read them all.
        self.compute.synchronize().map_err(|e| Error::Rank {
            rank: self.rank,
            msg: format!("compute stream synchronise: {e:?}"),
        })?;
        let mut t = self.timing.lock().expect("timing lock");
        Ok(harvest(&mut t))
    }

    fn compute_record(&self, event: &CudaEvent) {
        if let Ok(ev) = &event.0.ev {
            if let Err(e) = ev.record(&self.compute) {
                event.fail(Fault::Failed(format!("compute: event record: {e:?}")));
            }
        }
    }

    fn alloc(&self, dtype: DType, bytes: u64) -> Result<Tensor> {
        let n = bytes as usize / dtype.size_in_bytes();
        Ok(Tensor::zeros(n, dtype, &self.device)?)
    }

    fn copy_to_device(&self, stream: &CudaStream, dst: &Tensor, src: &Mapped, runs: Vec<Piece>) {
        if stream.error().is_some() {
            return;
        }
        let op = CopyIn {
            backend: self,
            stream,
            src,
            runs,
        };
        if let Err(e) = dst.inplace_op1(&op) {
            stream.poison(Fault::Failed(format!("host-to-device copy: {e}")));
        }
    }

    fn alloc_staging(&self, bytes: u64) -> Result<HostBuffer> {
        alloc_pinned(&self.ctx, bytes)
    }

    fn copy_staged(
        &self,
        stream: &CudaStream,
        dst: &Tensor,
        src: Arc<HostBuffer>,
        runs: Vec<Staged>,
    ) {
        if stream.error().is_some() {
            return;
        }
        let op = CopyStaged {
            backend: self,
            stream,
            src: &src,
            runs,
        };
        if let Err(e) = dst.inplace_op1(&op) {
            stream.poison(Fault::Failed(format!(
                "host-to-device copy from the staging ring: {e}"
            )));
        }
    }

    fn host_fn(&self, stream: &CudaStream, f: Box<dyn FnOnce() + Send>) {
        if stream.error().is_some() {
            return;
        }
        let arg = Box::into_raw(Box::new(f)) as *mut std::ffi::c_void;
        // SAFETY: the trampoline takes back ownership of `arg` exactly once when the
        // stream reaches it; on a failed launch the driver never calls it, so we do.
        let r = unsafe { sys::cuLaunchHostFunc(stream.inner.cu_stream(), Some(run_host_fn), arg) };
        if let Err(e) = r.result() {
            // SAFETY: not launched, so still ours.
            drop(unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) });
            stream.poison(Fault::Failed(format!(
                "{}: cuLaunchHostFunc: {e:?}",
                stream.name
            )));
        }
    }
}
