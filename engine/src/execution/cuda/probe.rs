//! Is there a GPU? Asked before anything touches CUDA. Code built with the feature needs
//! the driver library loaded to run at all, which the executable checks before it loads
//! the CUDA library (see `crate::launch`); the `dlopen` here finds it so, and a failure
//! still reads as a sentence. `cuInit` failing (no device node, a driver too old) and a
//! driver that sees no device are the usual answers on a machine without a GPU. The
//! probe also reads the driver version and each device's compute capability, which
//! [`super::plan::gpus_usable`] judges before any kernel module loads.

use candle_core::cuda_backend::cudarc::driver::result;

use super::dl;

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No usable GPU, and why.
    Absent(String),
    Present {
        devices: usize,
        /// `cuDriverGetVersion` (13000 for CUDA 13.0).
        driver: i32,
        /// Compute capability (major, minor) of each device, by ordinal.
        capabilities: Vec<(i32, i32)>,
    },
}

/// Looks for the driver library, initialises it and counts devices.
pub fn probe() -> Probe {
    if let Err(why) = dl::open_driver(true) {
        return Probe::Absent(why);
    }
    if let Err(e) = result::init() {
        return Probe::Absent(format!(
            "the NVIDIA driver did not initialise (cuInit: {e:?})"
        ));
    }
    let driver = driver_version().unwrap_or(0);
    match result::device::get_count() {
        Ok(n) if n > 0 => match capabilities(n) {
            Ok(capabilities) => Probe::Present {
                devices: n as usize,
                driver,
                capabilities,
            },
            Err(why) => Probe::Absent(why),
        },
        Ok(_) => Probe::Absent("the NVIDIA driver reports no CUDA device".into()),
        Err(e) => Probe::Absent(format!("cannot count CUDA devices: {e:?}")),
    }
}

/// Compute capability of devices `0..n`.
fn capabilities(n: i32) -> Result<Vec<(i32, i32)>, String> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    (0..n)
        .map(|i| {
            let dev = result::device::get(i).map_err(|e| format!("cuDeviceGet({i}): {e:?}"))?;
            // SAFETY: `dev` is a live device handle from cuDeviceGet.
            let attr = |a| unsafe { result::device::get_attribute(dev, a) };
            let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .map_err(|e| format!("compute capability of GPU {i}: {e:?}"))?;
            let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                .map_err(|e| format!("compute capability of GPU {i}: {e:?}"))?;
            Ok((major, minor))
        })
        .collect()
}

fn driver_version() -> Option<i32> {
    let mut v = 0;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
    let r = unsafe { candle_core::cuda_backend::cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == candle_core::cuda_backend::cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
}
