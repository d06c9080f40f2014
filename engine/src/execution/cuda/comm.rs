//! NCCL all-gather for the dp ranks of one process. The communicators of all ranks are
//! created together in-process (`ncclCommInitAll`); each rank thread then drives its own
//! on the pipeline's gather stream. Shards move as bytes, so dtype groups need no
//! per-type calls, and the offload-sharded gather runs in place (NCCL's in-place form:
//! the send buffer is the rank's own region of the receive buffer).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::cuda_backend::cudarc::nccl::{result as nccl, sys as nccl_sys};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use super::backend::{buffer, slot_mut, CudaBackend, CudaStream};
use super::host::cuda;
use crate::execution::backend::{Collective, GatherSource};
use crate::Result;

/// What every rank of the group shares: the first failure.
#[derive(Default)]
pub struct NcclGroup {
    poisoned: AtomicBool,
    why: Mutex<Option<String>>,
}

impl NcclGroup {
    /// Creates one communicator per context, rank i on `contexts[i]`.
    pub fn init(contexts: &[Arc<CudaContext>]) -> Result<(Arc<NcclGroup>, Vec<NcclComm>)> {
        let n = contexts.len();
        let ordinals: Vec<i32> = contexts.iter().map(|c| c.ordinal() as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for `n` handles and `ordinals` names `n` devices.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, ordinals.as_ptr()) }
            .map_err(|e| cuda(&format!("ncclCommInitAll over devices {ordinals:?}"), e))?;
        let group = Arc::new(NcclGroup::default());
        let comms = comms
            .into_iter()
            .zip(contexts)
            .enumerate()
            .map(|(rank, (comm, ctx))| NcclComm {
                comm,
                rank,
                size: n,
                ctx: ctx.clone(),
                group: group.clone(),
            })
            .collect();
        Ok((group, comms))
    }

    /// Fails every later collective of every rank (a rank died). Collectives already
    /// queued are left to the waiters' timeouts.
    pub fn poison(&self, why: String) {
        self.why.lock().expect("group lock").get_or_insert(why);
        self.poisoned.store(true, Ordering::SeqCst);
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.poisoned.load(Ordering::SeqCst) {
            let why = self
                .why
                .lock()
                .expect("group lock")
                .clone()
                .unwrap_or_default();
            return Err(format!("all-gather abandoned: {why}"));
        }
        Ok(())
    }
}

/// One rank's communicator.
pub struct NcclComm {
    comm: nccl_sys::ncclComm_t,
    rank: usize,
    size: usize,
    ctx: Arc<CudaContext>,
    group: Arc<NcclGroup>,
}

// SAFETY: a communicator may move between threads; it is used by one thread at a time
// (its rank's), which NCCL requires and `&self` methods here never share across ranks.
unsafe impl Send for NcclComm {}

impl NcclComm {
    pub fn group(&self) -> &Arc<NcclGroup> {
        &self.group
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitAll and destroyed once; the pipeline that issued
        // collectives on it has been dropped, and destroy waits for them to finish.
        unsafe {
            let _ = nccl::comm_destroy(self.comm);
        }
    }
}

struct GatherOp<'a> {
    comm: &'a NcclComm,
    stream: &'a CudaStream,
    shard: usize,
    src: GatherSource,
}

impl GatherOp<'_> {
    fn run(&self, storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<(), String> {
        let c = self.comm;
        c.group.check()?;
        c.ctx
            .bind_to_thread()
            .map_err(|e| format!("bind context: {e:?}"))?;
        let stream = &self.stream.inner;
        let (size, shard, rank) = (c.size, self.shard, c.rank);
        let (base, n, _written) = slot_mut(storage, layout, stream)?;
        if n < size * shard {
            return Err(format!(
                "all-gather of {size}×{shard} bytes into a {n}-byte slot"
            ));
        }
        let guard;
        let _read;
        let send = match &self.src {
            GatherSource::InPlace => base + (rank * shard) as u64,
            GatherSource::Buffer { tensor, offset } => {
                guard = tensor.storage_and_layout();
                let Storage::Cuda(cs) = &*guard.0 else {
                    return Err("shard store is not on the GPU".into());
                };
                let (p, m, r) = buffer(cs, guard.1, stream)?;
                _read = r;
                let o = *offset as usize;
                if o + shard > m {
                    return Err(format!("shard at {o}+{shard} past a {m}-byte store"));
                }
                p + o as u64
            }
        };
        // SAFETY: send and receive ranges are inside live device buffers (checked above);
        // the in-place form has send == recv + rank × shard, as NCCL requires; every rank
        // issues the same sequence of collectives (the pipeline's lockstep contract).
        unsafe {
            nccl::all_gather(
                send as *const _,
                base as *mut _,
                shard,
                nccl_sys::ncclDataType_t::ncclUint8,
                c.comm,
                stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(|e| format!("ncclAllGather: {e:?}"))
    }
}

impl InplaceOp1 for GatherOp<'_> {
    fn name(&self) -> &'static str {
        "layerwise-all-gather"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the NCCL all-gather ran on a CPU tensor")
    }
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(storage, layout).map_err(candle_core::Error::msg)
    }
}

impl Collective<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, stream: &CudaStream, dst: &Tensor, shard: u64, src: GatherSource) {
        let op = GatherOp {
            comm: self,
            stream,
            shard: shard as usize,
            src,
        };
        if let Err(e) = dst.inplace_op1(&op) {
            let msg = format!("all-gather: {e}");
            self.group.poison(msg.clone());
            stream.poison(msg);
        }
    }
}
