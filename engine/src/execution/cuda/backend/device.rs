//! The GPU one rank computes on ([`CudaBackend`]): its device and context, candle's stream
//! as the compute stream, the registered host memory copies read from, and the state its
//! stall timing and watchdog keep; released only after every stream of the device drains.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{self as cu, sys, CudaContext};
use candle_core::Device;

use super::stream::CudaEvent;
use super::timing::{Timing, TIMING_PAIRS};
use crate::execution::cuda::host::{cuda, HostMemory};
use crate::Result;

/// Weight waits the compute stream has been given and the host has not seen complete,
/// oldest first, with when each was queued; the watchdog's view of device progress.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) waits: std::collections::VecDeque<(CudaEvent, Instant)>,
    /// Set once the watchdog has fired.
    pub(super) expired: Option<String>,
}

/// What the watchdog calls when the device has made no progress for the timeout (the
/// setup gives it the NCCL group's poison, which aborts the communicators, so the
/// device work stuck on a dead peer ends).
pub type OnStall = Box<dyn Fn(String) + Send + Sync>;

/// One rank's GPU.
pub struct CudaBackend {
    pub(super) rank: usize,
    pub(super) device: Device,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) compute: Arc<cu::CudaStream>,
    pub(super) host: Arc<HostMemory>,
    pub(super) timeout: Duration,
    pub(super) timing: Mutex<Timing>,
    /// Bytes copied from pageable memory (outside the registered set).
    pub(super) pageable_bytes: AtomicU64,
    pub(super) pending: Arc<Mutex<Pending>>,
    pub(super) on_stall: Arc<OnceLock<OnStall>>,
    /// Stops the watchdog thread when the backend drops.
    pub(super) watchdog_stop: Arc<AtomicBool>,
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
}
