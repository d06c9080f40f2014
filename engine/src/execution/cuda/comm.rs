//! NCCL all-gather for the dp ranks of one process. The communicators of all ranks are
//! created together in-process (`ncclCommInitAll`); each rank thread then drives its own
//! on the pipeline's gather stream. Shards move as bytes, so dtype groups need no
//! per-type calls, and the offload-sharded gather runs in place (NCCL's in-place form:
//! the send buffer is the rank's own region of the receive buffer).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, TryLockError};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};
use candle_core::cuda_backend::cudarc::nccl::{result as nccl, sys as nccl_sys};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use super::backend::{buffer, slot_mut, CudaBackend, CudaStream};
use super::host::cuda;
use crate::error::Abandoned;
use crate::execution::backend::{Collective, GatherSource};
use crate::execution::fault::Fault;
use crate::Result;

/// What every rank of the group shares: the first failure, and every communicator, so
/// that a failure aborts them all.
#[derive(Default)]
pub struct NcclGroup {
    poisoned: AtomicBool,
    why: Mutex<Option<String>>,
    /// Every rank's communicator, set once at init.
    handles: OnceLock<Handles>,
    /// Set once, by the first poison, before the communicators are aborted.
    aborted: AtomicBool,
    /// Held shared by a rank while it checks the poison and enqueues a collective
    /// (shared, because NCCL's first collective may block until every rank has entered
    /// it), exclusively by the abort, so that no rank enqueues on an aborted communicator.
    gate: RwLock<()>,
}

struct Handles(Vec<nccl_sys::ncclComm_t>);

// SAFETY: the handles are aborted once by `poison` (behind the exclusive gate when it can
// be had), used for enqueues by their own rank's thread behind the shared gate, and
// destroyed once by their owner only when not aborted.
unsafe impl Send for Handles {}
unsafe impl Sync for Handles {}

impl NcclGroup {
    /// Creates one communicator per context, rank i on `contexts[i]`, after granting every
    /// device access to its peers' memory pools ([`grant_peer_access`]).
    pub fn init(contexts: &[Arc<CudaContext>]) -> Result<(Arc<NcclGroup>, Vec<NcclComm>)> {
        grant_peer_access(contexts)?;
        let n = contexts.len();
        let ordinals: Vec<i32> = contexts.iter().map(|c| c.ordinal() as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for `n` handles and `ordinals` names `n` devices.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, ordinals.as_ptr()) }
            .map_err(|e| cuda(&format!("ncclCommInitAll over devices {ordinals:?}"), e))?;
        let group = Arc::new(NcclGroup::default());
        let _ = group.handles.set(Handles(comms.clone()));
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

    /// Communicators for strategies that never gather (`resident`, `offload`): no NCCL
    /// at all, so no NCCL initialisation cost, memory or failure mode; a collective on
    /// them is an error.
    pub fn without_collectives(contexts: &[Arc<CudaContext>]) -> (Arc<NcclGroup>, Vec<NcclComm>) {
        let group = Arc::new(NcclGroup::default());
        let n = contexts.len();
        let comms = contexts
            .iter()
            .enumerate()
            .map(|(rank, ctx)| NcclComm {
                comm: std::ptr::null_mut(),
                rank,
                size: n,
                ctx: ctx.clone(),
                group: group.clone(),
            })
            .collect();
        (group, comms)
    }

    /// A rank died: fails every later collective of every rank, then aborts every
    /// communicator (`ncclCommAbort`), which ends the collectives already queued —
    /// peers' gathers waiting for the dead rank would otherwise never finish, and a
    /// later `ncclCommDestroy` or stream synchronisation would block forever. The rank
    /// loop calls this before any pipeline or communicator is dropped.
    pub fn poison(&self, why: String) {
        self.why.lock().expect("group lock").get_or_insert(why);
        self.poisoned.store(true, Ordering::SeqCst);
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        // An enqueue stuck inside NCCL (a first collective waiting for the dead rank)
        // would hold the shared gate for ever: after a second, abort without it.
        let start = Instant::now();
        let _gate = loop {
            match self.gate.try_write() {
                Ok(g) => break Some(g),
                Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if start.elapsed() < Duration::from_secs(1) => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(TryLockError::WouldBlock) => {
                    tracing::warn!("a rank is inside an NCCL call: aborting without waiting");
                    break None;
                }
            }
        };
        for (rank, &c) in self
            .handles
            .get()
            .map_or(&[][..], |h| &h.0)
            .iter()
            .enumerate()
        {
            // SAFETY: created by ncclCommInitAll and aborted once (the flag above); no
            // rank enqueues on it afterwards (enqueues check the poison, set above,
            // behind the gate), and its NcclComm skips ncclCommDestroy.
            if let Err(e) = unsafe { nccl::comm_abort(c) } {
                tracing::error!(rank, error = ?e, "ncclCommAbort failed");
            }
        }
        tracing::warn!("aborted every NCCL communicator of the group");
    }

    fn aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Refuses `rank`'s next collective once the group is poisoned, quoting the first
    /// failure.
    fn check(&self, rank: usize) -> std::result::Result<(), Abandoned> {
        if self.poisoned.load(Ordering::SeqCst) {
            let cause = self
                .why
                .lock()
                .expect("group lock")
                .clone()
                .unwrap_or_default();
            return Err(Abandoned {
                rank,
                what: "all-gather",
                cause,
            });
        }
        Ok(())
    }
}

/// Lets every device read and write the memory pool of every other device it can reach
/// over a peer link.
///
/// Why: slots and the shard store are candle tensors, which cudarc allocates with
/// `cuMemAllocAsync` from the device's current stream-ordered memory pool. Unlike
/// `cuMemAlloc` memory, pool memory is not accessible to peer devices until the *pool*
/// grants access (`cuMemPoolSetAccess`; `cuCtxEnablePeerAccess` does not cover pools). NCCL
/// with every rank in one process uses its P2P transport with direct pointers: for large
/// messages the peer's kernel reads and writes this rank's user buffer itself. Without the
/// grant, the first large all-gather (dp ≥ 2, sharded strategies) is an illegal memory
/// access. We grant rather than allocate slots outside the pool (that would bypass
/// candle's allocator and its event tracking) or set NCCL_P2P_DIRECT_DISABLE (an extra
/// copy through NCCL's staging buffers on every gather). Pairs without a peer link are
/// left alone: NCCL then moves data through host memory and never touches peer buffers.
pub fn grant_peer_access(contexts: &[Arc<CudaContext>]) -> Result<()> {
    if contexts.len() < 2 {
        return Ok(());
    }
    for owner in contexts {
        if !owner.has_async_alloc() {
            // No pools: cudarc falls back to cuMemAlloc, which NCCL maps itself.
            continue;
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device handle is the context's.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, owner.cu_device()) }
            .result()
            .map_err(|e| cuda(&format!("cuDeviceGetMemPool of GPU {}", owner.ordinal()), e))?;
        let mut access = Vec::new();
        for peer in contexts.iter().filter(|c| c.ordinal() != owner.ordinal()) {
            let mut can = 0;
            // SAFETY: `can` is a valid out-pointer; both handles are live devices.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer.cu_device(), owner.cu_device()) }
                .result()
                .map_err(|e| cuda("cuDeviceCanAccessPeer", e))?;
            tracing::info!(
                owner = owner.ordinal(),
                peer = peer.ordinal(),
                p2p = can != 0,
                "memory pool peer access"
            );
            if can != 0 {
                // The CUDA 13.0 layout of CUmemLocation (cuda-check pins the toolkit).
                access.push(sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: peer.cu_device(),
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                });
            }
        }
        if access.is_empty() {
            continue;
        }
        // SAFETY: `access` holds `access.len()` initialised descriptors of live devices.
        unsafe { sys::cuMemPoolSetAccess(pool, access.as_ptr(), access.len()) }
            .result()
            .map_err(|e| {
                cuda(
                    &format!("cuMemPoolSetAccess on GPU {}'s pool", owner.ordinal()),
                    e,
                )
            })?;
    }
    Ok(())
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
        if self.comm.is_null() || self.group.aborted() {
            // No NCCL, or ncclCommAbort has freed it.
            return;
        }
        // SAFETY: created by ncclCommInitAll and destroyed once; the pipeline that issued
        // collectives on it has been dropped, and destroy waits for them to finish (they
        // do: no rank failed, or the group would have been aborted).
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

impl NcclComm {
    /// Before enqueueing `what` on this communicator: the gate, held until the collective
    /// is enqueued (a concurrent poison aborts the communicators either before, and the
    /// check fails, or after), the poison check, and this rank's context on the thread.
    fn enter(&self, what: &str) -> std::result::Result<std::sync::RwLockReadGuard<'_, ()>, Fault> {
        let gate = self.group.gate.read().unwrap_or_else(|p| p.into_inner());
        self.group.check(self.rank)?;
        if self.comm.is_null() {
            return Err(Fault::Failed(format!(
                "{what} on a group created without NCCL (a strategy that never gathers)"
            )));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("bind context: {e:?}"))?;
        Ok(gate)
    }
}

impl GatherOp<'_> {
    fn run(&self, storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<(), Fault> {
        let c = self.comm;
        let _gate = c.enter("all-gather")?;
        let stream = &self.stream.inner;
        let (size, shard, rank) = (c.size, self.shard, c.rank);
        let (base, n, _written) = slot_mut(storage, layout, stream)?;
        if n < size * shard {
            return Err(Fault::Failed(format!(
                "all-gather of {size}×{shard} bytes into a {n}-byte slot"
            )));
        }
        let guard;
        let _read;
        let send = match &self.src {
            GatherSource::InPlace => base + (rank * shard) as u64,
            GatherSource::Buffer { tensor, offset } => {
                guard = tensor.storage_and_layout();
                let Storage::Cuda(cs) = &*guard.0 else {
                    return Err(Fault::Failed("shard store is not on the GPU".into()));
                };
                let (p, m, r) = buffer(cs, guard.1, stream)?;
                _read = r;
                let o = *offset as usize;
                if o + shard > m {
                    return Err(Fault::Failed(format!(
                        "shard at {o}+{shard} past a {m}-byte store"
                    )));
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
        .map_err(|e| Fault::Failed(format!("ncclAllGather: {e:?}")))
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
        self.run(storage, layout).map_err(Fault::into_candle)
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
            let fault = Fault::from_candle(e, "all-gather");
            // This rank's own failure aborts its peers' collectives too; an abandoned one
            // found the group poisoned already.
            if let Fault::Failed(msg) = &fault {
                self.group.poison(msg.clone());
            }
            stream.poison(fault);
        }
    }
}

/// One member's sends and receives of a sequence-parallel all-to-all
/// ([`crate::execution::seq`]), enqueued as one NCCL group on the compute stream of the
/// device the parts are on: `parts[q]` goes to member q (not this one), and member q's
/// part lands at `recv[q]` (a byte offset and length) of the buffer the op runs on.
struct ExchangeOp<'a> {
    comm: &'a NcclComm,
    parts: &'a [Tensor],
    recv: &'a [(usize, usize)],
}

impl ExchangeOp<'_> {
    fn run(&self, storage: &mut CudaStorage, layout: &Layout) -> std::result::Result<(), Fault> {
        let c = self.comm;
        let _gate = c.enter("sequence-parallel exchange")?;
        let stream = storage.device.cuda_stream();
        let (base, n, _written) = slot_mut(storage, layout, &stream)?;
        // Every send's storage stays borrowed until the group is enqueued.
        let guards: Vec<_> = self.parts.iter().map(|t| t.storage_and_layout()).collect();
        let mut sends = Vec::with_capacity(guards.len());
        for (q, g) in guards.iter().enumerate() {
            if q == c.rank {
                continue;
            }
            let Storage::Cuda(cs) = &*g.0 else {
                return Err(Fault::Failed(format!(
                    "part for member {q} is not on the GPU"
                )));
            };
            sends.push((q, buffer(cs, g.1, &stream)?));
        }
        for (q, &(at, len)) in self.recv.iter().enumerate() {
            if q != c.rank && at + len > n {
                return Err(Fault::Failed(format!(
                    "member {q}'s part of {len} bytes at {at} overruns a {n}-byte buffer"
                )));
            }
        }
        let cu = stream.cu_stream() as _;
        nccl::group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
        let mut enqueued = Ok(());
        for (q, (ptr, bytes, _)) in &sends {
            // SAFETY: the pointer and length are a live, whole device buffer (checked by
            // `buffer`), borrowed until the group ends.
            enqueued = enqueued.and(
                unsafe {
                    nccl::send(
                        *ptr as *const _,
                        *bytes,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        *q as i32,
                        c.comm,
                        cu,
                    )
                }
                .map(drop)
                .map_err(|e| format!("ncclSend to member {q}: {e:?}")),
            );
        }
        for (q, &(at, len)) in self.recv.iter().enumerate() {
            if q == c.rank {
                continue;
            }
            // SAFETY: `at + len` is inside the receive buffer (checked above).
            enqueued = enqueued.and(
                unsafe {
                    nccl::recv(
                        (base + at as u64) as *mut _,
                        len,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        q as i32,
                        c.comm,
                        cu,
                    )
                }
                .map(drop)
                .map_err(|e| format!("ncclRecv from member {q}: {e:?}")),
            );
        }
        // The group is ended whatever was enqueued: NCCL requires the pair.
        let ended = nccl::group_end()
            .map(drop)
            .map_err(|e| format!("ncclGroupEnd: {e:?}"));
        enqueued.and(ended).map_err(Fault::Failed)
    }
}

impl InplaceOp1 for ExchangeOp<'_> {
    fn name(&self) -> &'static str {
        "layerwise-sequence-exchange"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the NCCL exchange ran on a CPU tensor")
    }
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(storage, layout).map_err(Fault::into_candle)
    }
}

impl NcclComm {
    /// This member's share of an all-to-all among its sequence-parallel group (see
    /// [`ExchangeOp`]): `into` receives every other member's part at `recv`.
    pub fn exchange(&self, parts: &[Tensor], into: &Tensor, recv: &[(usize, usize)]) -> Result<()> {
        let op = ExchangeOp {
            comm: self,
            parts,
            recv,
        };
        into.inplace_op1(&op).map_err(|e| {
            let fault = Fault::from_candle(e, "sequence-parallel exchange");
            if let Fault::Failed(msg) = &fault {
                self.group.poison(msg.clone());
            }
            match fault {
                Fault::Failed(msg) => crate::Error::Rank {
                    rank: self.rank,
                    msg,
                },
                Fault::Abandoned(a) => crate::Error::Abandoned(a),
            }
        })
    }
}
