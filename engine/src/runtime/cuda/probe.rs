//! Is there a GPU? Asked before anything touches CUDA: the driver library is opened with
//! `dlopen` first, so a machine without it gets a sentence instead of cudarc's panic, and
//! `cuInit` failing (no device node, a stub library, a driver too old) is an answer too.

use std::ffi::CStr;

use candle_core::cuda_backend::cudarc::driver::result;

/// The driver's shared library, as the NVIDIA container runtime injects it.
const LIBCUDA: &CStr = c"libcuda.so.1";

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No usable GPU, and why.
    Absent(String),
    Present {
        devices: usize,
        driver: i32,
    },
}

/// Looks for the driver library, initialises it and counts devices.
pub fn probe() -> Probe {
    // SAFETY: dlopen with a valid NUL-terminated name; the handle is deliberately never
    // closed (the driver stays loaded for the life of the process, as CUDA expects).
    let handle = unsafe { libc::dlopen(LIBCUDA.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "not found".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Probe::Absent(format!(
            "no NVIDIA driver: cannot load {}: {why}",
            LIBCUDA.to_string_lossy()
        ));
    }
    if let Err(e) = result::init() {
        return Probe::Absent(format!(
            "the NVIDIA driver did not initialise (cuInit: {e:?})"
        ));
    }
    let driver = driver_version().unwrap_or(0);
    match result::device::get_count() {
        Ok(n) if n > 0 => Probe::Present {
            devices: n as usize,
            driver,
        },
        Ok(_) => Probe::Absent("the NVIDIA driver reports no CUDA device".into()),
        Err(e) => Probe::Absent(format!("cannot count CUDA devices: {e:?}")),
    }
}

fn driver_version() -> Option<i32> {
    let mut v = 0;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
    let r = unsafe { candle_core::cuda_backend::cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == candle_core::cuda_backend::cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
}
