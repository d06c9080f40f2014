//! The CPU backend: "device" memory is host memory charged to a budget, each stream is a
//! thread, and the dp ranks' all-gather is an in-process exchange between rank threads.
//! It runs the same pipeline code, with the same ordering, as the CUDA backend.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor};

use super::backend::{Backend, Collective, GatherSource};
use super::fault::Fault;
use super::host_buffer::{HostBuffer, Staged};
use super::stream::{CpuStream, Event};
use crate::checkpoint::Mapped;
use crate::error::Abandoned;
use crate::layout::Piece;
use crate::{Error, Result};

/// Threads-as-streams backend.
pub struct CpuBackend {
    device: Device,
    /// Longest any stream or compute waits before declaring a stall.
    pub timeout: Duration,
}

impl CpuBackend {
    pub fn new(timeout: Duration) -> Self {
        CpuBackend {
            device: Device::Cpu,
            timeout,
        }
    }
}

fn bytes_mut(s: &mut CpuStorage) -> Result<&mut [u8], String> {
    Ok(match s {
        CpuStorage::F32(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F8E4M3(v) => bytemuck::cast_slice_mut(v),
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

fn bytes_of(s: &CpuStorage) -> Result<&[u8], String> {
    Ok(match s {
        CpuStorage::F32(v) => bytemuck::cast_slice(v),
        CpuStorage::F16(v) => bytemuck::cast_slice(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice(v),
        CpuStorage::F8E4M3(v) => bytemuck::cast_slice(v),
        _ => return Err("device buffers hold F32, F16, BF16 or F8E4M3 only".into()),
    })
}

fn whole(layout: &Layout) -> Result<(), String> {
    if layout.start_offset() != 0 || !layout.is_contiguous() {
        return Err("device buffers must be whole contiguous allocations".into());
    }
    Ok(())
}

/// Host→device copy of mapped checkpoint runs.
struct CopyIn {
    src: Mapped,
    runs: Vec<Piece>,
}

impl InplaceOp1 for CopyIn {
    fn name(&self) -> &'static str {
        "layerwise-copy-in"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        whole(layout).map_err(candle_core::Error::msg)?;
        let dst = bytes_mut(storage).map_err(candle_core::Error::msg)?;
        for p in &self.runs {
            let (d, n) = (p.dst as usize, p.len as usize);
            let Some(out) = dst.get_mut(d..d + n) else {
                candle_core::bail!(
                    "copy of {n} bytes at {d} overruns a {}-byte buffer",
                    dst.len()
                );
            };
            out.copy_from_slice(self.src.range(p.file, p.src, p.len));
        }
        Ok(())
    }
}

/// Host→device copy out of a staging buffer.
struct CopyStaged {
    src: Arc<HostBuffer>,
    runs: Vec<Staged>,
}

impl InplaceOp1 for CopyStaged {
    fn name(&self) -> &'static str {
        "layerwise-copy-staged"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        whole(layout).map_err(candle_core::Error::msg)?;
        let dst = bytes_mut(storage).map_err(candle_core::Error::msg)?;
        for r in &self.runs {
            let (d, n) = (r.dst as usize, r.len as usize);
            let Some(out) = dst.get_mut(d..d + n) else {
                candle_core::bail!(
                    "copy of {n} bytes at {d} overruns a {}-byte buffer",
                    dst.len()
                );
            };
            // SAFETY: the copy stream waited for the buffer's `filled` event and the fill
            // stream waits for the `consumed` event recorded after this copy.
            let Some(from) = (unsafe { self.src.read(r.at, r.len) }) else {
                candle_core::bail!(
                    "staged run of {n} bytes at {} overruns a {}-byte staging buffer",
                    r.at,
                    self.src.len()
                );
            };
            out.copy_from_slice(from);
        }
        Ok(())
    }
}

impl Backend for CpuBackend {
    type Stream = CpuStream;
    type Event = Event;

    fn device(&self) -> &Device {
        &self.device
    }
    fn new_stream(&self, name: &str) -> Result<CpuStream> {
        CpuStream::new(name, self.timeout)
            .map_err(|e| Error::internal(format!("cannot start stream thread {name}"), e))
    }
    fn new_event(&self) -> Event {
        Event::new()
    }
    fn record(&self, stream: &CpuStream, event: &Event) {
        stream.record(event)
    }
    fn wait(&self, stream: &CpuStream, event: &Event) {
        stream.wait(event)
    }
    fn compute_wait(&self, event: &Event) -> Result<Duration> {
        event
            .synchronize(self.timeout)
            .map_err(|f| f.into_error(Error::Transfer))
    }
    fn compute_record(&self, event: &Event) {
        event.record_now()
    }
    fn alloc(&self, dtype: DType, bytes: u64) -> Result<Tensor> {
        let n = bytes as usize / dtype.size_in_bytes();
        Ok(Tensor::zeros(n, dtype, &self.device)?)
    }
    fn copy_to_device(&self, stream: &CpuStream, dst: &Tensor, src: &Mapped, runs: Vec<Piece>) {
        let (dst, op) = (
            dst.clone(),
            CopyIn {
                src: src.clone(),
                runs,
            },
        );
        stream.enqueue(Box::new(move || {
            dst.inplace_op1(&op)
                .map_err(|e| Fault::Failed(format!("host-to-device copy: {e}")))
        }));
    }
    fn alloc_staging(&self, bytes: u64) -> Result<HostBuffer> {
        HostBuffer::page_aligned(bytes as usize)
    }
    fn copy_staged(
        &self,
        stream: &CpuStream,
        dst: &Tensor,
        src: Arc<HostBuffer>,
        runs: Vec<Staged>,
    ) {
        let (dst, op) = (dst.clone(), CopyStaged { src, runs });
        stream.enqueue(Box::new(move || {
            dst.inplace_op1(&op).map_err(|e| {
                Fault::Failed(format!("host-to-device copy from the staging ring: {e}"))
            })
        }));
    }
    fn host_fn(&self, stream: &CpuStream, f: Box<dyn FnOnce() + Send>) {
        stream.enqueue(Box::new(move || {
            f();
            Ok(())
        }));
    }
}

#[derive(Default)]
struct Round {
    /// Which collective call (in issue order) the group is serving now.
    seq: u64,
    /// Address of each rank's shard, published for the round.
    addrs: Vec<Option<usize>>,
    published: usize,
    finished: usize,
    /// The first failure, which every collective from then on gives up with.
    poisoned: Option<String>,
    /// Ranks whose communicator was dropped, after issuing collectives, while the group
    /// was not poisoned.
    dropped_unpoisoned: Vec<usize>,
}

/// The rendezvous of the dp rank threads of one process.
pub struct LocalGroup {
    size: usize,
    timeout: Duration,
    state: Mutex<Round>,
    cv: Condvar,
}

impl LocalGroup {
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(LocalGroup {
            size,
            timeout,
            state: Mutex::new(Round {
                addrs: vec![None; size],
                ..Round::default()
            }),
            cv: Condvar::new(),
        })
    }

    /// One communicator per rank.
    pub fn comms(self: &Arc<Self>) -> Vec<LocalComm> {
        (0..self.size)
            .map(|rank| LocalComm {
                group: self.clone(),
                rank,
                issued: AtomicU64::new(0),
            })
            .collect()
    }

    /// The first rank that dropped its communicator, after issuing collectives, while the
    /// group was not poisoned. After a failed run there must be none: a failing rank
    /// poisons the group before its pipeline and communicator drop, because on a GPU
    /// destroying an NCCL communicator with collectives still queued, or while peers
    /// wait in them, blocks forever (the CUDA backend's poison aborts every
    /// communicator). The CPU backend cannot hang that way, so it records the order for
    /// the engine to check.
    pub fn dropped_before_poison(&self) -> Option<usize> {
        self.state
            .lock()
            .expect("group lock")
            .dropped_unpoisoned
            .first()
            .copied()
    }

    /// Fails every current and future collective (a rank died: `why` is its failure,
    /// naming it); wakes all waiters, which give up with an [`Abandoned`] quoting `why`.
    pub fn poison(&self, why: String) {
        let mut s = self.state.lock().expect("group lock");
        s.poisoned.get_or_insert(why);
        self.cv.notify_all();
    }

    fn wait_until<'a>(
        &'a self,
        mut s: std::sync::MutexGuard<'a, Round>,
        rank: usize,
        what: &str,
        done: impl Fn(&Round) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, Round>, Fault> {
        let start = Instant::now();
        loop {
            if let Some(p) = &s.poisoned {
                return Err(Fault::Abandoned(Abandoned {
                    rank,
                    what: "all-gather",
                    cause: p.clone(),
                }));
            }
            if done(&s) {
                return Ok(s);
            }
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing: Vec<usize> =
                    (0..self.size).filter(|&q| s.addrs[q].is_none()).collect();
                let why = format!(
                    "rank {rank} waited {:?} for {what} (ranks not arrived: {missing:?})",
                    self.timeout
                );
                s.poisoned = Some(why.clone());
                self.cv.notify_all();
                return Err(Fault::Failed(why));
            }
            s = self.cv.wait_timeout(s, left).expect("group lock").0;
        }
    }

    /// Publishes `addr` for call `seq`, runs `copy` with every rank's address once all
    /// have published, and returns once every rank has finished copying (so no shard is
    /// overwritten while a peer still reads it).
    fn exchange(
        &self,
        rank: usize,
        seq: u64,
        addr: usize,
        copy: impl FnOnce(&[usize]),
    ) -> Result<(), Fault> {
        let s = self.state.lock().expect("group lock");
        let mut s = self.wait_until(s, rank, "the previous all-gather to drain", |r| {
            r.seq == seq
        })?;
        s.addrs[rank] = Some(addr);
        s.published += 1;
        self.cv.notify_all();
        let s = self.wait_until(s, rank, "peers' shards", |r| r.published == self.size)?;
        let addrs: Vec<usize> = s.addrs.iter().map(|a| a.expect("all published")).collect();
        drop(s);
        copy(&addrs);
        let mut s = self.state.lock().expect("group lock");
        s.finished += 1;
        if s.finished == self.size {
            s.seq += 1;
            s.published = 0;
            s.finished = 0;
            s.addrs.iter_mut().for_each(|a| *a = None);
            self.cv.notify_all();
            return Ok(());
        }
        self.wait_until(s, rank, "peers to finish reading", |r| r.seq != seq)
            .map(drop)
    }
}

/// One rank's handle on a [`LocalGroup`].
pub struct LocalComm {
    group: Arc<LocalGroup>,
    rank: usize,
    /// Collectives issued by this rank so far; every rank issues them in the same order.
    issued: AtomicU64,
}

impl LocalComm {
    pub fn group(&self) -> &Arc<LocalGroup> {
        &self.group
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        if self.issued.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut s = self.group.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.poisoned.is_none() {
            s.dropped_unpoisoned.push(self.rank);
        }
    }
}

struct GatherOp {
    group: Arc<LocalGroup>,
    rank: usize,
    seq: u64,
    shard: usize,
    src: GatherSource,
}

impl GatherOp {
    fn run(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<(), Fault> {
        whole(layout)?;
        let (size, shard, rank) = (self.group.size, self.shard, self.rank);
        let dst = bytes_mut(storage)?;
        if dst.len() < size * shard {
            return Err(Fault::Failed(format!(
                "all-gather of {size}×{shard} bytes into a {}-byte slot",
                dst.len()
            )));
        }
        // From here on the slot is touched only through `base`: each region is written
        // by exactly one party (its owner's copy here, or the copy stage before), and
        // this rank's own region is only read, by peers, until `exchange` returns.
        let base = dst.as_mut_ptr();
        let guard;
        let own: *const u8 = match &self.src {
            // SAFETY: in bounds, checked above.
            GatherSource::InPlace => unsafe { base.add(rank * shard) },
            GatherSource::Buffer { tensor, offset } => {
                guard = tensor.storage_and_layout();
                let Storage::Cpu(cpu) = &*guard.0 else {
                    return Err(Fault::Failed("shard store is not on the CPU".into()));
                };
                let b = bytes_of(cpu)?;
                let (o, n) = (*offset as usize, shard);
                b.get(o..o + n)
                    .ok_or_else(|| format!("shard at {o}+{n} past a {}-byte store", b.len()))?
                    .as_ptr()
            }
        };
        self.group.exchange(rank, self.seq, own as usize, |addrs| {
            for (q, &a) in addrs.iter().enumerate() {
                if q == rank && matches!(self.src, GatherSource::InPlace) {
                    continue;
                }
                // SAFETY: every published address points at `shard` readable bytes that
                // its owner keeps alive and unmodified until all ranks have finished this
                // exchange (the owner is blocked inside `exchange` holding them); the
                // destination region q is inside our slot (checked) and written by no
                // one else during the exchange.
                unsafe {
                    std::ptr::copy_nonoverlapping(a as *const u8, base.add(q * shard), shard)
                };
            }
        })
    }
}

impl InplaceOp1 for GatherOp {
    fn name(&self) -> &'static str {
        "layerwise-all-gather"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(storage, layout).map_err(Fault::into_candle)
    }
}

impl Collective<CpuBackend> for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.group.size
    }
    fn all_gather(&self, stream: &CpuStream, dst: &Tensor, shard: u64, src: GatherSource) {
        let op = GatherOp {
            group: self.group.clone(),
            rank: self.rank,
            seq: self.issued.fetch_add(1, Ordering::SeqCst),
            shard: shard as usize,
            src,
        };
        let (dst, group) = (dst.clone(), self.group.clone());
        stream.enqueue(Box::new(move || {
            dst.inplace_op1(&op).map_err(|e| {
                let fault = Fault::from_candle(e, "all-gather");
                // This rank's own failure fails its peers' collectives too; an abandoned
                // one found the group poisoned already.
                if let Fault::Failed(msg) = &fault {
                    group.poison(msg.clone());
                }
                fault
            })
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_in_place_and_from_buffers() {
        let t = Duration::from_secs(10);
        let be = Arc::new(CpuBackend::new(t));
        for dp in 1..=3 {
            let group = LocalGroup::new(dp, t);
            let comms = group.comms();
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let be = be.clone();
                    std::thread::spawn(move || {
                        let r = comm.rank();
                        let s = be.new_stream("gather").unwrap();
                        // In place: rank r wrote its shard (values r+1) into region r.
                        let mut v = vec![0f32; 64 * dp];
                        v[r * 64..(r + 1) * 64]
                            .iter_mut()
                            .for_each(|x| *x = r as f32 + 1.0);
                        let slot = Tensor::from_vec(v, 64 * dp, &Device::Cpu).unwrap();
                        comm.all_gather(&s, &slot, 256, GatherSource::InPlace);
                        // From a store: shard at byte offset 256 holds values 10(r+1).
                        let store =
                            Tensor::from_vec(vec![10.0 * (r as f32 + 1.0); 128], 128, &Device::Cpu)
                                .unwrap();
                        let slot2 = be.alloc(DType::F32, 256 * dp as u64).unwrap();
                        comm.all_gather(
                            &s,
                            &slot2,
                            256,
                            GatherSource::Buffer {
                                tensor: store,
                                offset: 256,
                            },
                        );
                        let done = be.new_event();
                        be.record(&s, &done);
                        be.compute_wait(&done).unwrap();
                        (
                            slot.to_vec1::<f32>().unwrap(),
                            slot2.to_vec1::<f32>().unwrap(),
                        )
                    })
                })
                .collect();
            for h in handles {
                let (a, b) = h.join().unwrap();
                for q in 0..dp {
                    assert!(
                        a[q * 64..(q + 1) * 64].iter().all(|&x| x == q as f32 + 1.0),
                        "dp={dp}"
                    );
                    assert!(b[q * 64..(q + 1) * 64]
                        .iter()
                        .all(|&x| x == 10.0 * (q as f32 + 1.0)));
                }
            }
        }
    }

    #[test]
    fn a_failed_gather_abandons_its_peers_with_the_first_cause() {
        let t = Duration::from_secs(10);
        let be = CpuBackend::new(t);
        let group = LocalGroup::new(2, t);
        let comms = group.comms();
        let gather = |rank: usize, bytes: u64| {
            let s = be.new_stream("gather").unwrap();
            let slot = be.alloc(DType::F32, bytes).unwrap();
            comms[rank].all_gather(&s, &slot, 256, GatherSource::InPlace);
            let done = be.new_event();
            be.record(&s, &done);
            be.compute_wait(&done).unwrap_err()
        };
        // Rank 1's slot is too small: its own failure, which poisons the group.
        let e = gather(1, 256);
        assert!(matches!(e, Error::Transfer(_)), "{e}");
        // (Starts with: candle appends a backtrace when RUST_BACKTRACE asks for one.)
        let cause = "all-gather: all-gather of 2×256 bytes into a 256-byte slot";
        let e = e.to_string();
        assert!(
            e.starts_with(&format!("weight transfer failed: {cause}")),
            "{e}"
        );
        // Rank 0 gives up, typed, quoting it.
        match gather(0, 512) {
            Error::Abandoned(a) => {
                assert_eq!((a.rank, a.what), (0, "all-gather"));
                assert!(a.cause.starts_with(cause), "{}", a.cause);
            }
            e => panic!("not abandoned: {e}"),
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_a_clear_error() {
        let t = Duration::from_millis(100);
        let be = CpuBackend::new(Duration::from_secs(5));
        let group = LocalGroup::new(2, t);
        let comms = group.comms();
        let s = be.new_stream("gather").unwrap();
        let slot = be.alloc(DType::F32, 512).unwrap();
        comms[0].all_gather(&s, &slot, 256, GatherSource::InPlace);
        let done = be.new_event();
        be.record(&s, &done);
        let e = be.compute_wait(&done).unwrap_err().to_string();
        assert!(e.contains("ranks not arrived: [1]"), "{e}");
    }
}
