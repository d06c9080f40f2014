//! `dlopen` for the two places that look for CUDA before touching it: the executable's
//! launcher, which hands a command to the CUDA library only once the driver loads, and
//! that library's own probe. Both say "no GPU" in the same words. Feature-free: the
//! executable that does the looking links no CUDA library.

use std::ffi::{c_void, CStr};

/// The driver's shared library, as the NVIDIA container runtime injects it.
pub const LIBCUDA: &CStr = c"libcuda.so.1";

/// An open shared library. Never closed: what it holds stays loaded for the life of the
/// process, as CUDA expects.
#[derive(Debug)]
pub struct Library(*mut c_void);

impl Library {
    /// Opens `name` (a file name for the loader's search, or a path) with every symbol
    /// bound now; `global` makes its symbols visible to libraries opened later.
    pub fn open(name: &CStr, global: bool) -> Result<Library, String> {
        let scope = if global {
            libc::RTLD_GLOBAL
        } else {
            libc::RTLD_LOCAL
        };
        // SAFETY: dlopen with a valid NUL-terminated name; running the library's
        // initialisers is what loading it means.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | scope) };
        if handle.is_null() {
            return Err(last_error(name));
        }
        Ok(Library(handle))
    }

    /// The address of the symbol `name`.
    pub fn symbol(&self, name: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: a live handle from dlopen and a valid NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, name.as_ptr()) };
        if p.is_null() {
            return Err(last_error(name));
        }
        Ok(p)
    }
}

/// Opens the NVIDIA driver library, or says in one sentence why there is no GPU.
pub fn open_driver(global: bool) -> Result<Library, String> {
    Library::open(LIBCUDA, global).map_err(|why| format!("no NVIDIA driver: {why}"))
}

fn last_error(name: &CStr) -> String {
    // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            format!("{}: not found", name.to_string_lossy())
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_sentence_naming_it() {
        let e = Library::open(c"liblayerwise-no-such-library.so.7", false).unwrap_err();
        assert!(e.contains("liblayerwise-no-such-library.so.7"), "{e}");
    }

    #[test]
    fn symbols_of_a_loaded_library() {
        let libc = Library::open(c"libc.so.6", false).unwrap();
        assert!(libc.symbol(c"malloc").is_ok());
        let e = libc.symbol(c"layerwise_no_such_symbol").unwrap_err();
        assert!(e.contains("layerwise_no_such_symbol"), "{e}");
    }
}
