//! The page cache seen from one file: how much of it is resident (`mincore`), dropping it
//! (`posix_fadvise(DONTNEED)`), and read-ahead hints. The only `unsafe` in the agent lives
//! here, each call small and explained.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Bytes of a file mapped at once for `mincore`, so a 100 GB file needs a 6 MB vector per
/// window, not 25 MB at once.
const WINDOW: u64 = 1 << 30;

/// The system page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions and only reads a constant.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Resident bytes of a window of `len` bytes, from `mincore`'s vector: one byte per page,
/// low bit set when resident. The last page may be partial.
pub fn resident_bytes(vec: &[u8], len: u64, page: u64) -> u64 {
    let mut bytes = 0;
    for (i, v) in vec.iter().enumerate() {
        if v & 1 == 1 {
            let start = i as u64 * page;
            bytes += page.min(len.saturating_sub(start));
        }
    }
    bytes
}

/// `resident` of `total` as a percentage (100 for an empty total).
pub fn percent(resident: u64, total: u64) -> f64 {
    if total == 0 {
        100.0
    } else {
        resident as f64 * 100.0 / total as f64
    }
}

/// Resident bytes and total bytes of a set of files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Residency {
    pub resident: u64,
    pub total: u64,
}

impl Residency {
    pub fn percent(&self) -> f64 {
        percent(self.resident, self.total)
    }

    pub fn plus(self, o: Residency) -> Residency {
        Residency {
            resident: self.resident + o.resident,
            total: self.total + o.total,
        }
    }
}

/// Measures how much of `path` is in the page cache.
pub fn residency(path: &Path) -> Result<Residency> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let page = page_size();
    let mut resident = 0;
    let mut off = 0;
    while off < len {
        let n = WINDOW.min(len - off);
        resident += window_residency(&file, off, n, page).map_err(|e| Error::io(path, e))?;
        off += n;
    }
    Ok(Residency {
        resident,
        total: len,
    })
}

/// Residency of a set of files, summed.
pub fn residency_of(paths: &[PathBuf]) -> Result<Residency> {
    paths
        .iter()
        .try_fold(Residency::default(), |acc, p| Ok(acc.plus(residency(p)?)))
}

fn window_residency(file: &File, off: u64, len: u64, page: u64) -> std::io::Result<u64> {
    // SAFETY: a fresh shared read-only mapping of an open file; nothing dereferences it, it
    // is only handed to mincore and unmapped below. `off` is a multiple of WINDOW, itself a
    // multiple of the page size, as mmap requires.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            off as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let mut vec = vec![0u8; len.div_ceil(page) as usize];
    // SAFETY: `addr` is a live mapping of `len` bytes and `vec` holds one byte per page of it.
    let rc = unsafe { libc::mincore(addr, len as usize, vec.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: unmaps exactly the mapping made above, which nothing else refers to.
    unsafe { libc::munmap(addr, len as usize) };
    if rc != 0 {
        return Err(err);
    }
    Ok(resident_bytes(&vec, len, page))
}

/// Read-ahead and eviction hints (`posix_fadvise`).
#[derive(Debug, Clone, Copy)]
pub enum Advice {
    Sequential,
    WillNeed,
    DontNeed,
}

/// Gives the kernel `advice` for `len` bytes of `file` at `off` (`len` 0: to the end).
pub fn advise(file: &File, off: u64, len: u64, advice: Advice) -> std::io::Result<()> {
    let a = match advice {
        Advice::Sequential => libc::POSIX_FADV_SEQUENTIAL,
        Advice::WillNeed => libc::POSIX_FADV_WILLNEED,
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
    };
    // SAFETY: posix_fadvise only reads its integer arguments; a bad fd is an error return.
    let rc =
        unsafe { libc::posix_fadvise(file.as_raw_fd(), off as libc::off_t, len as libc::off_t, a) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}

/// Drops `path`'s clean pages from the page cache (tests and benchmarks start cold with it).
pub fn evict(path: &Path) -> Result<()> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    advise(&file, 0, 0, Advice::DontNeed).map_err(|e| Error::io(path, e))
}

/// What identifies a file's content without reading it: a file replaced or rewritten while
/// it is warmed changes one of these, and gets warmed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl Identity {
    pub fn of(path: &Path) -> Result<Identity> {
        let m = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        Ok(Identity::from_metadata(&m))
    }

    pub fn from_metadata(m: &std::fs::Metadata) -> Identity {
        Identity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn residency_math_counts_partial_last_page() {
        assert_eq!(resident_bytes(&[1, 0, 1], 4096 * 2 + 100, 4096), 4096 + 100);
        assert_eq!(resident_bytes(&[0, 0], 8192, 4096), 0);
        // Other bits of mincore's byte are reserved: only the low bit counts.
        assert_eq!(resident_bytes(&[2, 3], 8192, 4096), 4096);
        assert_eq!(percent(0, 0), 100.0);
        assert_eq!(percent(1, 4), 25.0);
    }

    #[test]
    fn written_file_is_resident_and_evict_drops_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let r = residency(&path).unwrap();
        assert_eq!(r.total, 1 << 20);
        assert_eq!(r.resident, 1 << 20, "just-written pages are cached");
        evict(&path).unwrap();
        let r = residency(&path).unwrap();
        assert!(r.resident < r.total / 10, "after DONTNEED: {r:?}");
    }

    #[test]
    fn empty_file_is_fully_resident_and_identity_tracks_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e");
        File::create(&path).unwrap();
        assert_eq!(
            residency(&path).unwrap(),
            Residency {
                resident: 0,
                total: 0
            }
        );
        let a = Identity::of(&path).unwrap();
        std::fs::write(&path, b"x").unwrap();
        assert_ne!(a, Identity::of(&path).unwrap());
    }
}
