//! The host-to-device copies a rank enqueues on its copy stream, as candle in-place ops on
//! the slot tensor: from the mapped checkpoint (through registered host memory, or pageable
//! when a range is outside it) and from a page-locked staging buffer.

use std::sync::atomic::Ordering;

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout};

use super::buffers::slot_mut;
use super::device::CudaBackend;
use super::stream::CudaStream;
use crate::checkpoint::Mapped;
use crate::execution::host_buffer::{HostBuffer, Staged};
use crate::layout::Piece;

/// Host→device copy of mapped checkpoint runs, enqueued on the copy stream.
pub(super) struct CopyIn<'a> {
    pub(super) backend: &'a CudaBackend,
    pub(super) stream: &'a CudaStream,
    pub(super) src: &'a Mapped,
    pub(super) runs: Vec<Piece>,
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
pub(super) struct CopyStaged<'a> {
    pub(super) backend: &'a CudaBackend,
    pub(super) stream: &'a CudaStream,
    pub(super) src: &'a HostBuffer,
    pub(super) runs: Vec<Staged>,
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
