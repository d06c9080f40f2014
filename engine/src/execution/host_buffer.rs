//! Host memory a backend stages weights in: the buffer (page-locked on a GPU, page-aligned
//! on the CPU backend) and the runs a copy takes out of it. The staging ring
//! ([`super::staging`]) fills these buffers; the backends copy out of them.

use crate::{Error, Result};

/// One host→device run out of a staging buffer: `len` bytes at `at` in the buffer land at
/// byte `dst` of the device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    pub at: u64,
    pub dst: u64,
    pub len: u64,
}

/// A host buffer the backend allocated for staging (page-locked on a GPU), freed by the
/// backend's own release function when the last reference drops.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    release: Option<Box<dyn FnOnce(*mut u8) + Send + Sync>>,
}

// SAFETY: the buffer is plain memory owned by this value; who writes and who reads it, and
// when, is ordered by the ring's events (a fill and a copy of one buffer never overlap).
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Takes ownership of `len` bytes at `ptr`, released by `release`.
    ///
    /// # Safety
    /// `ptr` must point at `len` writable bytes that stay valid until `release` runs.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        release: Box<dyn FnOnce(*mut u8) + Send + Sync>,
    ) -> HostBuffer {
        HostBuffer {
            ptr,
            len,
            release: Some(release),
        }
    }

    /// Page-aligned host memory from the global allocator (the CPU backend's staging).
    pub fn page_aligned(len: usize) -> Result<HostBuffer> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::internal(format!("a {len}-byte staging buffer"), e))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::bug(format!(
                "cannot allocate a {len}-byte staging buffer"
            )));
        }
        // SAFETY: `ptr` holds `len` bytes from `alloc_zeroed` and is freed once, below,
        // with the same layout.
        Ok(unsafe {
            HostBuffer::from_raw(ptr, len, Box::new(move |p| std::alloc::dealloc(p, layout)))
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's address (for a backend's copy out of it).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Bytes `[at, at + len)`, for a copy out of the buffer.
    ///
    /// # Safety
    /// No fill of this buffer may run while the slice lives (the ring's `filled` and
    /// `consumed` events order them).
    pub unsafe fn read(&self, at: u64, len: u64) -> Option<&[u8]> {
        let end = at.checked_add(len)?;
        (end <= self.len as u64)
            // SAFETY: inside the allocation; exclusive of writers by the caller's promise.
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr.add(at as usize), len as usize) })
    }

    /// Copies `from` to `at`.
    ///
    /// # Safety
    /// No copy out of this buffer may run meanwhile (ordered by the ring's events).
    pub(super) unsafe fn write(&self, at: u64, from: &[u8]) {
        assert!(
            at as usize + from.len() <= self.len,
            "staging write past the end"
        );
        // SAFETY: in bounds (asserted); the mapping and the buffer do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(from.as_ptr(), self.ptr.add(at as usize), from.len())
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r(self.ptr)
        }
    }
}
