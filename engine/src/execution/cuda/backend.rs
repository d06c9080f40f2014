//! The CUDA backend of one rank: candle's stream is the compute stream, the pipeline's
//! copy and gather streams are CUDA streams of the same context, and every ordering
//! between them is a CUDA event (`cuStreamWaitEvent`), never a device synchronisation.
//!
//! Copies and gathers write into slot tensors in place through candle's `InplaceOp1`,
//! which hands out the slot's `CudaSlice`; cudarc's event tracking then records the
//! slot's last writer and readers, which agrees with (and never loosens) the pipeline's
//! own events. A failure while enqueueing poisons the stream: every event recorded on it
//! afterwards carries the error (a [`Fault`], typed, so an abandoned all-gather stays one),
//! so whoever waits learns of it instead of hanging, as on the CPU backend.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{
    self as cu, sys, CudaContext, DevicePtr, DevicePtrMut, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

use super::host::{alloc_pinned, cuda, HostMemory};
use crate::checkpoint::Mapped;
use crate::execution::backend::Backend;
use crate::execution::fault::Fault;
use crate::execution::host_buffer::{HostBuffer, Staged};
use crate::layout::Piece;
use crate::{Error, Result};

/// A CUDA stream with the first error of any work enqueued on it.
pub struct CudaStream {
    name: String,
    pub(super) inner: Arc<cu::CudaStream>,
    error: Arc<Mutex<Option<Fault>>>,
}

impl CudaStream {
    pub(super) fn poison(&self, why: Fault) {
        tracing::error!(stream = %self.name, error = %why, "stream failed");
        self.error.lock().expect("stream lock").get_or_insert(why);
    }
    fn error(&self) -> Option<Fault> {
        self.error.lock().expect("stream lock").clone()
    }
    pub fn name(&self) -> &str {
        &self.name
    }
}

struct EventInner {
    ev: std::result::Result<cu::CudaEvent, String>,
    error: Mutex<Option<Fault>>,
}

/// A CUDA event plus the error of the stream that last recorded it.
#[derive(Clone)]
pub struct CudaEvent(Arc<EventInner>);

impl CudaEvent {
    fn fail(&self, why: Fault) {
        self.0.error.lock().expect("event lock").get_or_insert(why);
    }
    fn error(&self) -> Option<Fault> {
        if let Err(e) = &self.0.ev {
            return Some(Fault::Failed(e.clone()));
        }
        self.0.error.lock().expect("event lock").clone()
    }
}

/// Device-side stall measurement: a ring of timing-event pairs recorded around each
/// compute-stream wait, read back once they have completed (so the figure lags by a few
/// blocks but never blocks the host). Allocated once.
struct Timing {
    pairs: Vec<(cu::CudaEvent, cu::CudaEvent, bool)>,
    next: usize,
}

/// Timing pairs in flight per rank.
const TIMING_PAIRS: usize = 32;

/// How many blocks' weight waits the host may queue on the compute stream before it waits
/// for the oldest itself. The device already orders each block's kernels after its
/// weights (`cuStreamWaitEvent`); the host only keeps itself from running unboundedly
/// ahead (and the queue of launches from growing), so a few slots' worth suffices.
const HOST_AHEAD: usize = 8;

/// Weight waits the compute stream has been given and the host has not seen complete,
/// oldest first, with when each was queued; the watchdog's view of device progress.
#[derive(Default)]
struct Pending {
    waits: std::collections::VecDeque<(CudaEvent, Instant)>,
    /// Set once the watchdog has fired.
    expired: Option<String>,
}

/// What the watchdog calls when the device has made no progress for the timeout (the
/// setup gives it the NCCL group's poison, which aborts the communicators, so the
/// device work stuck on a dead peer ends).
pub type OnStall = Box<dyn Fn(String) + Send + Sync>;

/// One rank's GPU.
pub struct CudaBackend {
    rank: usize,
    device: Device,
    ctx: Arc<CudaContext>,
    compute: Arc<cu::CudaStream>,
    host: Arc<HostMemory>,
    timeout: Duration,
    timing: Mutex<Timing>,
    /// Bytes copied from pageable memory (outside the registered set).
    pageable_bytes: AtomicU64,
    pending: Arc<Mutex<Pending>>,
    on_stall: Arc<OnceLock<OnStall>>,
    /// Stops the watchdog thread when the backend drops.
    watchdog_stop: Arc<AtomicBool>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.watchdog_stop.store(true, Ordering::SeqCst);
        // Copies still queued read the registered host memory, which is unregistered
        // when the last backend's `host` drops, right after this:
        // let every stream of this device finish first. (After a failure the group has
        // aborted NCCL, so nothing here waits on a dead peer.)
        let _ = self.ctx.bind_to_thread();
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!(rank = self.rank, error = ?e, "synchronise before releasing host memory");
        }
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal` for `rank` with its own compute stream.
    pub fn new(
        rank: usize,
        ordinal: usize,
        host: Arc<HostMemory>,
        timeout: Duration,
    ) -> Result<Self> {
        let device = Device::new_cuda_with_stream(ordinal)?;
        let compute = device.as_cuda_device()?.cuda_stream();
        let ctx = compute.context().clone();
        let mut pairs = Vec::with_capacity(TIMING_PAIRS);
        for _ in 0..TIMING_PAIRS {
            let t = || {
                ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| cuda("timing event", e))
            };
            pairs.push((t()?, t()?, false));
        }
        let be = CudaBackend {
            rank,
            device,
            ctx,
            compute,
            host,
            timeout,
            timing: Mutex::new(Timing { pairs, next: 0 }),
            pageable_bytes: AtomicU64::new(0),
            pending: Arc::default(),
            on_stall: Arc::default(),
            watchdog_stop: Arc::default(),
        };
        be.spawn_watchdog()?;
        Ok(be)
    }

    /// What to do when the device makes no progress for the timeout (set once, by the
    /// setup, once the NCCL group exists).
    pub fn set_on_stall(&self, f: OnStall) {
        let _ = self.on_stall.set(f);
    }

    /// The watchdog: a thread that looks at the oldest weight wait the compute stream
    /// holds and, when it has not completed within the timeout, records the failure and
    /// calls `on_stall`. The host no longer waits on every block's event, so without it
    /// a dead peer would surface only as a hang in some later synchronising read.
    fn spawn_watchdog(&self) -> Result<()> {
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

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// (free, total) device memory now.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| cuda("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    pub fn host(&self) -> &Arc<HostMemory> {
        &self.host
    }

    pub fn pageable_bytes(&self) -> u64 {
        self.pageable_bytes.load(Ordering::Relaxed)
    }

    /// Adds up the stalls of completed timing pairs.
    fn harvest(t: &mut Timing) -> Duration {
        let mut sum = Duration::ZERO;
        for (a, b, busy) in t.pairs.iter_mut().filter(|p| p.2) {
            if b.try_is_complete().unwrap_or(true) {
                if let Ok(ms) = a.elapsed_ms(b) {
                    sum += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
                }
                *busy = false;
            }
        }
        sum
    }

    /// Polls `ev` until it completes or the timeout passes (a dead peer or a hung copy
    /// must become an error, not a hang).
    fn host_wait(&self, ev: &cu::CudaEvent) -> std::result::Result<(), String> {
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

/// The device address, byte length and write guard of a whole slot buffer.
pub(super) fn slot_mut<'a>(
    s: &'a mut CudaStorage,
    layout: &Layout,
    stream: &'a cu::CudaStream,
) -> std::result::Result<(sys::CUdeviceptr, usize, SyncOnDrop<'a>), String> {
    whole(layout)?;
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::F16(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::BF16(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::F8E4M3(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

/// The device address, byte length and read guard of a whole buffer.
pub(super) fn buffer<'a>(
    s: &'a CudaStorage,
    layout: &Layout,
    stream: &'a cu::CudaStream,
) -> std::result::Result<(sys::CUdeviceptr, usize, SyncOnDrop<'a>), String> {
    whole(layout)?;
    Ok(match &s.slice {
        CudaStorageSlice::F32(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::F16(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::BF16(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::F8E4M3(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

fn with_len(
    p: (sys::CUdeviceptr, SyncOnDrop<'_>),
    n: usize,
) -> (sys::CUdeviceptr, usize, SyncOnDrop<'_>) {
    (p.0, n, p.1)
}

pub(super) fn whole(layout: &Layout) -> std::result::Result<(), String> {
    if layout.start_offset() != 0 || !layout.is_contiguous() {
        return Err("device buffers must be whole contiguous allocations".into());
    }
    Ok(())
}

/// Host→device copy of mapped checkpoint runs, enqueued on the copy stream.
struct CopyIn<'a> {
    backend: &'a CudaBackend,
    stream: &'a CudaStream,
    src: &'a Mapped,
    runs: Vec<Piece>,
}

impl CopyIn<'_> {
    fn run(&self, storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<(), String> {
        let be = self.backend;
        be.ctx
            .bind_to_thread()
            .map_err(|e| format!("bind context: {e:?}"))?;
        let stream = &self.stream.inner;
        let (base, n, _written) = slot_mut(storage, layout, stream)?;
        for p in &self.runs {
            let (d, len) = (p.dst as usize, p.len as usize);
            if d + len > n {
                return Err(format!(
                    "copy of {len} bytes at {d} overruns a {n}-byte buffer"
                ));
            }
            let host = match be.host.source(self.src, p.file, p.src, p.len) {
                Some(h) => h,
                None => {
                    be.pageable_bytes.fetch_add(p.len, Ordering::Relaxed);
                    self.src.range(p.file, p.src, p.len).as_ptr()
                }
            };
            // SAFETY: `base + d .. + len` is inside the slot (checked above) and the slot
            // stays alive while the copy runs (the pipeline owns it until its streams
            // drain); `host` points at `len` readable bytes that outlive the copy (the
            // mapping, its registration or the pinned copy live as long as the process's
            // pipelines). A pageable source is staged by the driver before this returns.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    base + d as u64,
                    host as *const _,
                    len,
                    stream.cu_stream(),
                )
            };
            r.result()
                .map_err(|e| format!("cuMemcpyHtoDAsync of {len} bytes: {e:?}"))?;
        }
        Ok(())
    }
}

impl InplaceOp1 for CopyIn<'_> {
    fn name(&self) -> &'static str {
        "layerwise-copy-in"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the CUDA backend's copy ran on a CPU tensor")
    }
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(storage, layout).map_err(candle_core::Error::msg)
    }
}

/// Host→device copy out of a staging buffer, enqueued on the copy stream.
struct CopyStaged<'a> {
    backend: &'a CudaBackend,
    stream: &'a CudaStream,
    src: &'a HostBuffer,
    runs: Vec<Staged>,
}

impl CopyStaged<'_> {
    fn run(&self, storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<(), String> {
        self.backend
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("bind context: {e:?}"))?;
        let stream = &self.stream.inner;
        let (base, n, _written) = slot_mut(storage, layout, stream)?;
        for r in &self.runs {
            let (d, len) = (r.dst as usize, r.len as usize);
            if d + len > n {
                return Err(format!(
                    "copy of {len} bytes at {d} overruns a {n}-byte buffer"
                ));
            }
            if r.at + r.len > self.src.len() as u64 {
                return Err(format!(
                    "staged run of {len} bytes at {} overruns a {}-byte staging buffer",
                    r.at,
                    self.src.len()
                ));
            }
            // SAFETY: the destination is inside the slot (checked above), which lives
            // until the pipeline's streams drain; the source is inside the page-locked
            // staging buffer (checked above), which the ring keeps until the pipeline
            // drops (and cuMemFreeHost synchronises first). The copy stream waited for the
            // buffer's fill; the fill stream waits for the event recorded after this copy.
            let res = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    base + d as u64,
                    self.src.as_ptr().add(r.at as usize) as *const _,
                    len,
                    stream.cu_stream(),
                )
            };
            res.result()
                .map_err(|e| format!("cuMemcpyHtoDAsync of {len} staged bytes: {e:?}"))?;
        }
        Ok(())
    }
}

impl InplaceOp1 for CopyStaged<'_> {
    fn name(&self) -> &'static str {
        "layerwise-copy-staged"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the CUDA backend's copy ran on a CPU tensor")
    }
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(storage, layout).map_err(candle_core::Error::msg)
    }
}

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
        let stalled = Self::harvest(&mut t);
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
        Ok(Self::harvest(&mut t))
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
