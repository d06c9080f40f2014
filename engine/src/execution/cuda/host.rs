//! How weights reach the device from the mapped checkpoint. DMA needs page-locked host
//! memory; there are two ways to get it without a copy per rank:
//!
//! - **registered**: the checkpoint's mappings themselves are page-locked with
//!   `cuMemHostRegister(READ_ONLY)`, so copies read straight from the page cache. Only
//!   where the device reports read-only registration support.
//! - **pinned**: one `cuMemHostAlloc` copy of the bytes each rank streams (its shards for
//!   offload-sharded, shared by all ranks for offload), without write-combining since the
//!   host writes it once and the DMA engine reads it.
//!
//! `auto` tries registration and falls back to the pinned copy, saying why. Pageable
//! copies are the last resort for bytes outside the streamed set (one-time loads).
//!
//! `--host-memory pageable` streams from pageable memory and gives up the overlap the
//! pipeline is built for: the driver stages a pageable `cuMemcpyHtoDAsync` through its
//! own pinned buffer and returns only once the source has been read, so the copy stream's
//! host thread (and with it the issue of later blocks) waits for each copy, and the link
//! runs at the staging rate. It exists to measure that difference and as a fallback where
//! neither registration nor pinning is allowed, not for serving.

use std::fmt;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};

use super::plan::{Extents, HostMode};
use crate::checkpoint::Mapped;
use crate::execution::pipeline::Streamed;
use crate::{Error, Result, Strategy};

/// What was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostPath {
    Registered,
    Pinned,
    Pageable,
}

impl fmt::Display for HostPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostPath::Registered => "registered page cache",
            HostPath::Pinned => "pinned copy",
            HostPath::Pageable => "pageable",
        })
    }
}

/// One page-locked copy of a set of checkpoint runs.
pub struct PinnedCopy {
    ptr: *mut u8,
    extents: Extents,
}

// SAFETY: the buffer is written once, before the copy is shared, and only read after;
// the raw pointer is owned by this value and freed once, in Drop.
unsafe impl Send for PinnedCopy {}
// SAFETY: as above: shared access is read-only.
unsafe impl Sync for PinnedCopy {}

impl PinnedCopy {
    fn new(ctx: &Arc<CudaContext>, mapped: &Mapped, extents: Extents) -> Result<PinnedCopy> {
        let bytes = extents.total() as usize;
        ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let mut p = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes a pointer to `bytes` page-locked bytes (or fails);
        // PORTABLE makes it page-locked for every rank's context. No write-combining.
        let r = unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) };
        r.result()
            .map_err(|e| cuda(&format!("cuMemHostAlloc of {bytes} bytes"), e))?;
        let ptr = p as *mut u8;
        for &(file, src, len, off) in extents.runs() {
            let from = mapped.range(file, src, len);
            // SAFETY: `off + len ≤ total` by construction of the extents, and the fresh
            // allocation does not overlap the mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(from.as_ptr(), ptr.add(off as usize), len as usize)
            };
        }
        Ok(PinnedCopy { ptr, extents })
    }

    /// The page-locked address of `[src, src + len)` of `file`, if this copy holds it.
    pub fn locate(&self, file: usize, src: u64, len: u64) -> Option<*const u8> {
        // SAFETY: `locate` only answers for ranges inside the allocation.
        self.extents
            .locate(file, src, len)
            .map(|off| unsafe { self.ptr.add(off as usize) } as *const u8)
    }

    pub fn bytes(&self) -> u64 {
        self.extents.total()
    }
}

impl Drop for PinnedCopy {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; no copy reads it any
        // more (the pipelines that used it have been dropped and their streams drained).
        unsafe {
            let _ = sys::cuMemFreeHost(self.ptr as *mut _);
        }
    }
}

/// The process's host memory for weights: registration of the mappings, or one pinned
/// copy per distinct set of streamed bytes.
pub struct HostMemory {
    pub path: HostPath,
    /// Why the path was chosen (for the startup log).
    pub reason: String,
    registered: Vec<(usize, usize)>,
    /// Per rank, per streamed group (shared when ranks stream the same bytes).
    pinned: Vec<Vec<Arc<PinnedCopy>>>,
    /// Each streamed group's mapping.
    mapped: Vec<Mapped>,
}

/// Whether `a` and `b` are the same mapping (not merely the same files).
fn same_mapping(a: &Mapped, b: &Mapped) -> bool {
    a.component.files.len() == b.component.files.len()
        && (a.component.files.is_empty() || a.range(0, 0, 0).as_ptr() == b.range(0, 0, 0).as_ptr())
}

impl HostMemory {
    /// Chooses and sets up the host path for `dp` ranks. Call once per process, with the
    /// first rank's context (registrations and allocations are PORTABLE).
    pub fn setup(
        ctx: &Arc<CudaContext>,
        streamed: &Streamed,
        strategy: Strategy,
        mode: HostMode,
    ) -> Result<HostMemory> {
        let dp = streamed.dp();
        let mut hm = HostMemory {
            path: HostPath::Pageable,
            reason: String::new(),
            registered: Vec::new(),
            pinned: vec![Vec::new(); dp],
            mapped: streamed.mapped.clone(),
        };
        if !matches!(strategy, Strategy::Offload | Strategy::OffloadSharded) {
            hm.reason = format!("{strategy} copies from the host only at start");
            return Ok(hm);
        }
        match mode {
            HostMode::Pageable => {
                hm.reason = "asked for".into();
                return Ok(hm);
            }
            HostMode::Pin => hm.reason = "asked for".into(),
            HostMode::Auto | HostMode::Register => match hm.register(ctx) {
                Ok(()) => {
                    hm.path = HostPath::Registered;
                    hm.reason = "the device supports read-only registration".into();
                    return Ok(hm);
                }
                Err(why) if mode == HostMode::Register => {
                    return Err(Error::invalid(
                        "host-memory",
                        format!("cannot register the checkpoint: {why}"),
                    ))
                }
                Err(why) => hm.reason = format!("registration unavailable ({why}); fell back"),
            },
        }
        for (g, layout) in streamed.layouts.iter().enumerate() {
            let mut shared: Option<Arc<PinnedCopy>> = None;
            for rank in 0..dp {
                let copy = match (&shared, strategy) {
                    (Some(c), Strategy::Offload) => c.clone(),
                    _ => Arc::new(PinnedCopy::new(
                        ctx,
                        &streamed.mapped[g],
                        // Blocks kept on the device are copied once at start: nothing
                        // of them to pin.
                        Extents::for_rank(layout, strategy, rank, &streamed.kept(strategy, g)),
                    )?),
                };
                shared = Some(copy.clone());
                hm.pinned[rank].push(copy);
            }
        }
        hm.path = HostPath::Pinned;
        Ok(hm)
    }

    fn register(&mut self, ctx: &Arc<CudaContext>) -> std::result::Result<(), String> {
        let supported = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
            )
            .map_err(|e| format!("attribute query failed: {e:?}"))?;
        if supported == 0 {
            return Err("the device does not support read-only host registration".into());
        }
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let all = self.mapped.clone();
        for (file, h, mapped) in all.iter().flat_map(|m| {
            m.component
                .files
                .iter()
                .enumerate()
                .map(move |(f, h)| (f, h, m))
        }) {
            let m = mapped.range(file, 0, h.file_len);
            let (p, n) = (m.as_ptr() as usize, m.len());
            let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE;
            // SAFETY: registers a live, read-only mapping that `self.mapped` keeps alive
            // until Drop unregisters it; READ_ONLY matches the mapping's protection.
            let r = unsafe { sys::cuMemHostRegister_v2(p as *mut _, n, flags) };
            if let Err(e) = r.result() {
                self.unregister();
                return Err(format!(
                    "cuMemHostRegister of {} ({n} bytes): {e:?}",
                    h.path.display()
                ));
            }
            self.registered.push((p, n));
        }
        Ok(())
    }

    fn unregister(&mut self) {
        for (p, _) in self.registered.drain(..) {
            // SAFETY: `p` was registered by `register` and is unregistered once.
            unsafe {
                let _ = sys::cuMemHostUnregister(p as *mut _);
            }
        }
    }

    /// Rank `rank`'s page-locked source for `[off, off + len)` of file `file` of `src`, or
    /// None (the copy is pageable: bytes outside the streamed set, or another mapping).
    pub fn source(
        &self,
        rank: usize,
        src: &Mapped,
        file: usize,
        off: u64,
        len: u64,
    ) -> Option<*const u8> {
        let host = src.range(file, off, len).as_ptr();
        match self.path {
            HostPath::Registered => {
                let (a, n) = (host as usize, len as usize);
                self.registered
                    .iter()
                    .any(|&(p, m)| a >= p && a + n <= p + m)
                    .then_some(host)
            }
            HostPath::Pinned => {
                let g = self.mapped.iter().position(|m| same_mapping(m, src))?;
                self.pinned.get(rank)?.get(g)?.locate(file, off, len)
            }
            HostPath::Pageable => None,
        }
    }

    /// Page-locked bytes held for rank `rank` (0 when registered: the page cache is it).
    pub fn pinned_bytes(&self, rank: usize) -> u64 {
        self.pinned
            .get(rank)
            .map_or(0, |p| p.iter().map(|c| c.bytes()).sum())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        self.unregister();
    }
}

pub(super) fn cuda(what: &str, e: impl fmt::Debug) -> Error {
    Error::invalid("cuda", format!("{what}: {e:?}"))
}
