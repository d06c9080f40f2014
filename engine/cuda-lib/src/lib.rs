//! liblayerwise_cuda.so: the `layerwise` commands with the CUDA backend, entered through a
//! plain C ABI by the `layerwise` executable once the NVIDIA driver loads. The contract
//! (symbol names, signatures, the ABI string) lives in `layerwise_engine::launch`.

use std::ffi::{c_char, c_int};

/// Runs one `layerwise` command line and returns its exit code.
///
/// # Safety
///
/// `argv` points to `argc` valid NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn layerwise_cuda_main(argc: c_int, argv: *const *const c_char) -> c_int {
    // SAFETY: the caller's promise, passed on.
    unsafe { layerwise_engine::launch::library_main(argc, argv) }
}

/// The engine version and entry contract this library was built with.
#[no_mangle]
pub extern "C" fn layerwise_cuda_abi() -> *const c_char {
    layerwise_engine::launch::ABI.as_ptr()
}
