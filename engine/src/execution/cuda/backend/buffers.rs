//! Raw views of a whole device buffer (its address, byte length and candle's read or write
//! guard), through which the copies and the NCCL collectives write into slots in place.

use candle_core::cuda_backend::cudarc::driver as cu;
use candle_core::cuda_backend::cudarc::driver::{sys, DevicePtr, DevicePtrMut, SyncOnDrop};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::Layout;

/// The device address, byte length and write guard of a whole slot buffer.
pub(in crate::execution::cuda) fn slot_mut<'a>(
    s: &'a mut CudaStorage,
    layout: &Layout,
    stream: &'a cu::CudaStream,
) -> std::result::Result<(sys::CUdeviceptr, usize, SyncOnDrop<'a>), String> {
    whole(layout)?;
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::F16(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::BF16(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        CudaStorageSlice::F8E4M3(v) => {
            let n = v.num_bytes();
            let (p, g) = v.device_ptr_mut(stream);
            (p, n, g)
        }
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

/// The device address, byte length and read guard of a whole buffer.
pub(in crate::execution::cuda) fn buffer<'a>(
    s: &'a CudaStorage,
    layout: &Layout,
    stream: &'a cu::CudaStream,
) -> std::result::Result<(sys::CUdeviceptr, usize, SyncOnDrop<'a>), String> {
    whole(layout)?;
    Ok(match &s.slice {
        CudaStorageSlice::F32(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::F16(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::BF16(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        CudaStorageSlice::F8E4M3(v) => with_len(v.device_ptr(stream), v.num_bytes()),
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

fn with_len(
    p: (sys::CUdeviceptr, SyncOnDrop<'_>),
    n: usize,
) -> (sys::CUdeviceptr, usize, SyncOnDrop<'_>) {
    (p.0, n, p.1)
}

fn whole(layout: &Layout) -> std::result::Result<(), String> {
    if layout.start_offset() != 0 || !layout.is_contiguous() {
        return Err("device buffers must be whole contiguous allocations".into());
    }
    Ok(())
}
