//! How weights reach the device from the mapped checkpoint. DMA needs page-locked host
//! memory; in order of preference:
//!
//! - **registered**: the checkpoint's mappings themselves are page-locked with
//!   `cuMemHostRegister(READ_ONLY)`, so copies read straight from the page cache. Only
//!   where the device reports read-only registration support.
//! - **registered-private**: where read-only registration is refused, a second, private
//!   writable mapping (`MAP_PRIVATE`, `PROT_READ | PROT_WRITE`) of the same files is
//!   registered without the flag. Nothing writes it, so its pages are the page cache's.
//! - **staging-ring**: else each rank stages its copies through a bounded ring of
//!   `cuMemHostAlloc` buffers (`crate::execution::staging`), a few shards, filled ahead of
//!   the copies by a host thread. Never a pinned copy of the whole model.
//!
//! `auto` tries them in this order and says which it took and why; `register` takes one of
//! the first two or fails; `pin` forces the ring. Pageable copies are the last resort for
//! bytes outside the registered set (one-time loads, and every load under the ring).
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

use super::plan::HostMode;
use crate::checkpoint::Mapped;
use crate::execution::host_buffer::HostBuffer;
use crate::execution::pipeline::Streamed;
use crate::{Error, Result, Strategy};

/// What was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostPath {
    /// The checkpoint's mappings, registered read-only.
    Registered,
    /// Private writable mappings of the same files, registered.
    RegisteredPrivate,
    /// A staging ring per rank.
    Staged,
    Pageable,
}

impl fmt::Display for HostPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One word first: engine/gpu-check reads the path from the log by it.
        f.write_str(match self {
            HostPath::Registered => "registered (the mapped page cache, read-only)",
            HostPath::RegisteredPrivate => "registered-private (a private writable mapping)",
            HostPath::Staged => "staging-ring (a few pinned shards per rank)",
            HostPath::Pageable => "pageable",
        })
    }
}

/// A page-locked staging buffer of `bytes` bytes in `ctx` (PORTABLE, without
/// write-combining: the host writes it and the DMA engine reads it).
pub fn alloc_pinned(ctx: &Arc<CudaContext>, bytes: u64) -> Result<HostBuffer> {
    let len = bytes as usize;
    ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
    let mut p = std::ptr::null_mut();
    // SAFETY: cuMemHostAlloc writes a pointer to `len` page-locked bytes (or fails).
    let r = unsafe { sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) };
    r.result()
        .map_err(|e| cuda(&format!("cuMemHostAlloc of {len} bytes"), e))?;
    let ctx = ctx.clone();
    let release = Box::new(move |p: *mut u8| {
        let _ = ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc above and freed once; cuMemFreeHost
        // synchronises with the device first, so no copy out of it is still running.
        let _ = unsafe { sys::cuMemFreeHost(p as *mut _) };
    });
    // SAFETY: `p` holds `len` bytes until `release` frees them, once, when the ring drops.
    Ok(unsafe { HostBuffer::from_raw(p as *mut u8, len, release) })
}

/// Private writable mappings of one component's files, registered.
struct PrivateMaps {
    maps: Vec<memmap2::MmapMut>,
}

/// The process's host memory for weights: registration of the mappings (or of private
/// mappings of the same files), or the ranks' staging rings, which each pipeline allocates
/// ([`crate::execution::staging`]).
pub struct HostMemory {
    pub path: HostPath,
    /// Why the path was chosen (for the startup log).
    pub reason: String,
    /// Registered (address, length) ranges.
    registered: Vec<(usize, usize)>,
    /// Each streamed group's mapping.
    mapped: Vec<Mapped>,
    /// Under `registered-private`, per streamed group, the registered private mappings.
    private: Vec<PrivateMaps>,
}

// SAFETY: the private mappings are only read (by the DMA engine and `source`) after setup.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

/// Whether `a` and `b` are the same mapping (not merely the same files).
fn same_mapping(a: &Mapped, b: &Mapped) -> bool {
    a.component.files.len() == b.component.files.len()
        && (a.component.files.is_empty() || a.range(0, 0, 0).as_ptr() == b.range(0, 0, 0).as_ptr())
}

impl HostMemory {
    /// Chooses and sets up the host path for the process's ranks. Call once per process,
    /// with the first rank's context (registrations are PORTABLE).
    pub fn setup(
        ctx: &Arc<CudaContext>,
        streamed: &Streamed,
        strategy: Strategy,
        mode: HostMode,
    ) -> Result<HostMemory> {
        let mut hm = HostMemory {
            path: HostPath::Pageable,
            reason: String::new(),
            registered: Vec::new(),
            mapped: streamed.mapped.clone(),
            private: Vec::new(),
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
            HostMode::Pin => {
                hm.path = HostPath::Staged;
                hm.reason = "asked for".into();
                return Ok(hm);
            }
            HostMode::Auto | HostMode::Register => {}
        }
        let read_only = match hm.register_read_only(ctx) {
            Ok(()) => {
                hm.path = HostPath::Registered;
                hm.reason = "the device supports read-only registration".into();
                return Ok(hm);
            }
            Err(why) => why,
        };
        let private = match hm.register_private(ctx) {
            Ok(()) => {
                hm.path = HostPath::RegisteredPrivate;
                hm.reason = format!(
                    "read-only registration unavailable ({read_only}); registered a private writable mapping of the same files, which nothing writes"
                );
                return Ok(hm);
            }
            Err(why) => why,
        };
        if mode == HostMode::Register {
            return Err(Error::device(
                "--host-memory register: cannot register the checkpoint",
                format!("read-only: {read_only}; private writable mapping: {private}"),
            ));
        }
        hm.path = HostPath::Staged;
        hm.reason = format!(
            "registration unavailable (read-only: {read_only}; private writable mapping: {private}); staging through a ring per rank"
        );
        Ok(hm)
    }

    /// Whether the ranks stage their copies through rings.
    pub fn stages(&self) -> bool {
        self.path == HostPath::Staged
    }

    /// Registers `len` bytes at `p` with `flags`, or says why not.
    fn register_range(
        &mut self,
        p: usize,
        len: usize,
        flags: u32,
        what: &std::path::Path,
    ) -> std::result::Result<(), String> {
        // SAFETY: `p .. p + len` is a live mapping that `self` keeps alive until Drop
        // unregisters it; READ_ONLY is only passed for a read-only mapping.
        let r = unsafe { sys::cuMemHostRegister_v2(p as *mut _, len, flags) };
        r.result().map_err(|e| {
            format!(
                "cuMemHostRegister of {} ({len} bytes): {e:?}",
                what.display()
            )
        })?;
        self.registered.push((p, len));
        Ok(())
    }

    fn register_read_only(&mut self, ctx: &Arc<CudaContext>) -> std::result::Result<(), String> {
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
        for m in &all {
            for (file, h) in m.component.files.iter().enumerate() {
                let r = m.range(file, 0, h.file_len);
                let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE;
                if let Err(e) = self.register_range(r.as_ptr() as usize, r.len(), flags, &h.path) {
                    self.unregister();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Maps every streamed file again, privately and writable, and registers that.
    fn register_private(&mut self, ctx: &Arc<CudaContext>) -> std::result::Result<(), String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let all = self.mapped.clone();
        for m in &all {
            let mut maps = Vec::with_capacity(m.component.files.len());
            for h in &m.component.files {
                let f = std::fs::File::open(&h.path)
                    .map_err(|e| format!("open {}: {e}", h.path.display()))?;
                // SAFETY: a copy-on-write mapping: writes (there are none) would stay
                // private, and the checkpoint files are not modified while the engine runs
                // (the same promise the read-only mapping relies on).
                let map = unsafe { memmap2::MmapOptions::new().map_copy(&f) }
                    .map_err(|e| format!("map {} privately: {e}", h.path.display()))?;
                maps.push(map);
            }
            let regs: Vec<(usize, usize, std::path::PathBuf)> = maps
                .iter()
                .zip(&m.component.files)
                .map(|(map, h)| (map.as_ptr() as usize, map.len(), h.path.clone()))
                .collect();
            self.private.push(PrivateMaps { maps });
            for (p, n, path) in regs {
                if let Err(e) = self.register_range(p, n, sys::CU_MEMHOSTREGISTER_PORTABLE, &path) {
                    self.unregister();
                    self.private.clear();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn unregister(&mut self) {
        for (p, _) in self.registered.drain(..) {
            // SAFETY: `p` was registered by `register_range` and is unregistered once.
            unsafe {
                let _ = sys::cuMemHostUnregister(p as *mut _);
            }
        }
    }

    /// The page-locked source for `[off, off + len)` of file `file` of `src`, or None (the
    /// copy is pageable: bytes outside the registered set, or the path registers nothing).
    pub fn source(&self, src: &Mapped, file: usize, off: u64, len: u64) -> Option<*const u8> {
        match self.path {
            HostPath::Registered => {
                let host = src.range(file, off, len).as_ptr();
                let (a, n) = (host as usize, len as usize);
                self.registered
                    .iter()
                    .any(|&(p, m)| a >= p && a + n <= p + m)
                    .then_some(host)
            }
            HostPath::RegisteredPrivate => {
                let g = self.mapped.iter().position(|m| same_mapping(m, src))?;
                let map = self.private.get(g)?.maps.get(file)?;
                let end = off.checked_add(len)? as usize;
                // SAFETY: inside the private mapping of the same file, which lives as
                // long as `self`.
                (end <= map.len()).then(|| unsafe { map.as_ptr().add(off as usize) })
            }
            HostPath::Staged | HostPath::Pageable => None,
        }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        self.unregister();
    }
}

pub(super) fn cuda(what: &str, e: impl fmt::Debug) -> Error {
    Error::device(what.to_string(), format!("{e:?}"))
}
