//! The CUDA side of measured memory: candle allocates through cudarc with
//! `cuMemAllocAsync` from the device's current stream-ordered memory pool, and the pool
//! keeps the high-water mark of the bytes it has handed out (`USED_MEM_HIGH`, reset by
//! writing zero, which restarts it at what is in use). A phase reads what is in use when
//! it begins, resets the mark, and reports the mark less the start. One pool per device,
//! so ranks on different GPUs measure apart. A context without pools (cudarc then calls
//! `cuMemAlloc`) has no such mark: its phases go unmeasured.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};

use super::{DevicePeak, Phase};

struct PoolPeak {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    start: u64,
}

// SAFETY: a CUmemoryPool handle is a process-wide driver handle, valid on any thread once
// the device's context is bound, which `attribute` does before every use.
unsafe impl Send for PoolPeak {}

fn attribute(
    ctx: &CudaContext,
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Option<u64> {
    ctx.bind_to_thread().ok()?;
    let mut v: u64 = 0;
    // SAFETY: the used-memory attributes are cuuint64_t, which `v` is; `pool` is the
    // device's live pool.
    unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
        .result()
        .ok()?;
    Some(v)
}

impl DevicePeak for PoolPeak {
    fn peak_above_start(&self) -> Option<u64> {
        let high = attribute(
            &self.ctx,
            self.pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        )?;
        Some(high.saturating_sub(self.start))
    }
}

/// A phase measured by `ctx`'s device pool; unmeasured where the device has none.
pub fn pool_phase(ctx: &Arc<CudaContext>) -> Phase {
    if !ctx.has_async_alloc() || ctx.bind_to_thread().is_err() {
        return Phase::unmeasured();
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the device handle is the context's.
    if unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .is_err()
    {
        return Phase::unmeasured();
    }
    let Some(start) = attribute(
        ctx,
        pool,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    ) else {
        return Phase::unmeasured();
    };
    let mut zero: u64 = 0;
    // SAFETY: as in `attribute`; writing zero to USED_MEM_HIGH is the documented reset.
    let reset = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    };
    if reset.result().is_err() {
        return Phase::unmeasured();
    }
    Phase::device(Box::new(PoolPeak {
        ctx: ctx.clone(),
        pool,
        start,
    }))
}
