//! The sequence-parallel exchange on CUDA ([`crate::execution::seq`]): each group's
//! members meet at the host rendezvous first (so a request that failed on one member
//! fails on the others before any of them enqueues), then run one NCCL group of sends and
//! receives on the compute stream. Each group has communicators of its own, apart from the
//! weights' all-gather, which runs on the gather stream.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::Tensor;

use super::{NcclComm, NcclGroup};
use crate::execution::seq::{check_parts, Rendezvous, SeqExchange};
use crate::execution::work::WorkKey;
use crate::{Error, Result};

/// One group's exchange: the rendezvous and each member's communicator.
pub struct NcclExchange {
    meet: Arc<Rendezvous>,
    group: Arc<NcclGroup>,
    /// Member m's communicator, used by member m's thread alone.
    comms: Vec<Mutex<NcclComm>>,
}

impl NcclExchange {
    /// The exchange of the group whose members compute on `contexts`, in member order.
    pub fn init(contexts: &[Arc<CudaContext>], timeout: Duration) -> Result<Arc<NcclExchange>> {
        let (group, comms) = NcclGroup::init(contexts)?;
        Ok(Arc::new(NcclExchange {
            meet: Rendezvous::new(contexts.len(), timeout),
            group,
            comms: comms.into_iter().map(Mutex::new).collect(),
        }))
    }
}

impl SeqExchange for NcclExchange {
    fn size(&self) -> usize {
        self.meet.size()
    }

    fn all_to_all(
        &self,
        key: WorkKey,
        index: u64,
        member: usize,
        parts: Vec<Tensor>,
        recv: &[Vec<usize>],
    ) -> Result<Vec<Tensor>> {
        check_parts(self.size(), &parts, recv)?;
        self.meet.meet(key, index, member, None)?;
        let mine = &parts[member];
        let (dtype, device) = (mine.dtype(), mine.device().clone());
        let elem = dtype.size_in_bytes();
        // Sends need whole buffers: a part that is a view gets its own.
        let parts = parts
            .into_iter()
            .map(|p| {
                if p.layout().start_offset() == 0 && p.is_contiguous() {
                    Ok(p)
                } else {
                    Ok(p.copy()?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        // One receive buffer for every other member's part, back to back.
        let mut at = 0;
        let places: Vec<(usize, usize)> = recv
            .iter()
            .enumerate()
            .map(|(q, shape)| {
                let len = if q == member {
                    0
                } else {
                    shape.iter().product::<usize>() * elem
                };
                at += len;
                (at - len, len)
            })
            .collect();
        let into = Tensor::zeros((at / elem).max(1), dtype, &device)?;
        self.comms[member]
            .lock()
            .map_err(|_| Error::bug("sequence-parallel communicator lock poisoned"))?
            .exchange(&parts, &into, &places)?;
        recv.iter()
            .zip(places)
            .enumerate()
            .map(|(q, (shape, (at, len)))| {
                if q == member {
                    return Ok(parts[member].clone());
                }
                Ok(into
                    .narrow(0, at / elem, len / elem)?
                    .reshape(shape.as_slice())?)
            })
            .collect()
    }

    fn abort(&self, key: WorkKey, member: usize, why: &str) {
        self.meet.abort(key, member, why)
    }

    fn poison(&self, why: String) {
        self.meet.poison(why.clone());
        self.group.poison(why);
    }
}
