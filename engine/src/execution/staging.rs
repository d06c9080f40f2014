//! The bounded staging ring of `--host-memory pin`: a few page-locked buffers per rank,
//! each one block's worth of what the rank copies ([`crate::memory::staging_buffer_bytes`]),
//! filled from the mapped checkpoint by a fill stream (a host thread) in the order the
//! pipeline issues its copies, and copied to the device from there. Pinned host memory is
//! the ring, whatever the model's depth; never a pinned copy of the model.
//!
//! Ownership moves with events, as everywhere in the pipeline: the fill stream fills
//! buffer j only after the copy that last read it has recorded `consumed`, and the copy
//! stream reads it only after the fill has recorded `filled`. On a GPU both waits are
//! stream waits captured at enqueue, so each refers to the use it was issued for; on the
//! CPU backend the same events order the same threads, so an ordering bug shows as a
//! difference in outputs there too.

use std::sync::Arc;

use super::backend::Backend;
use super::host_buffer::{HostBuffer, Staged};
use crate::checkpoint::Mapped;
use crate::layout::Piece;
use crate::{Error, Result};

struct Buffer<E> {
    host: Arc<HostBuffer>,
    /// The fill of this buffer's latest use has landed.
    filled: E,
    /// The copy out of this buffer's latest use has finished reading it.
    consumed: E,
}

/// One rank's ring.
pub struct Ring<B: Backend> {
    fill: B::Stream,
    buffers: Vec<Buffer<B::Event>>,
    next: usize,
    bytes: u64,
}

impl<B: Backend> Ring<B> {
    /// `depth` buffers of `size` bytes each, filled by a stream called `name`.
    pub fn new(backend: &B, name: &str, depth: usize, size: u64) -> Result<Ring<B>> {
        if depth == 0 {
            return Err(Error::invalid(
                "staging-buffers",
                "the staging ring needs at least one buffer",
            ));
        }
        let mut buffers = Vec::with_capacity(depth);
        for _ in 0..depth {
            buffers.push(Buffer {
                host: Arc::new(backend.alloc_staging(size)?),
                filled: backend.new_event(),
                consumed: backend.new_event(),
            });
        }
        Ok(Ring {
            fill: backend.new_stream(name)?,
            bytes: buffers.iter().map(|b| b.host.len() as u64).sum(),
            buffers,
            next: 0,
        })
    }

    /// Host bytes the ring holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// One buffer's bytes.
    pub fn buffer_bytes(&self) -> u64 {
        self.buffers[0].host.len() as u64
    }

    /// Fills the next buffer of the ring with `regions` (per device buffer, the runs of
    /// the mapping that land in it): enqueues the fill on the fill stream, once the copy
    /// that last read the buffer is done, and on `copy` the wait for the fill. The caller
    /// checked at start that a block's runs fit one buffer; [`Ring::copy`] then enqueues
    /// the copies out of it.
    pub fn fill(
        &mut self,
        backend: &B,
        copy: &B::Stream,
        src: &Mapped,
        regions: &[Vec<Piece>],
    ) -> Filled {
        let j = self.next;
        self.next = (j + 1) % self.buffers.len();
        let buf = &self.buffers[j];
        let mut at = 0u64;
        let mut fills: Vec<(usize, u64, u64, u64)> = Vec::new();
        let mut staged = Vec::with_capacity(regions.len());
        for runs in regions {
            staged.push(
                runs.iter()
                    .map(|p| {
                        fills.push((p.file, p.src, p.len, at));
                        let s = Staged {
                            at,
                            dst: p.dst,
                            len: p.len,
                        };
                        at += p.len;
                        s
                    })
                    .collect(),
            );
        }
        let (host, mapped) = (buf.host.clone(), src.clone());
        backend.wait(&self.fill, &buf.consumed);
        backend.host_fn(
            &self.fill,
            Box::new(move || {
                for (file, off, len, at) in fills {
                    // SAFETY: the fill stream waited for `consumed`, so no copy reads this
                    // buffer until `filled` is recorded below.
                    unsafe { host.write(at, mapped.range(file, off, len)) };
                }
            }),
        );
        backend.record(&self.fill, &buf.filled);
        backend.wait(copy, &buf.filled);
        Filled { buffer: j, staged }
    }

    /// Enqueues on `copy` the copies out of a filled buffer, region i into `dsts[i]`, and
    /// the record that frees the buffer for its next fill.
    pub fn copy(
        &self,
        backend: &B,
        copy: &B::Stream,
        filled: Filled,
        dsts: &[&candle_core::Tensor],
    ) {
        let buf = &self.buffers[filled.buffer];
        for (dst, staged) in dsts.iter().zip(filled.staged) {
            backend.copy_staged(copy, dst, buf.host.clone(), staged);
        }
        backend.record(copy, &buf.consumed);
    }
}

/// A buffer whose fill is enqueued: which one, and per region the runs to copy out of it.
pub struct Filled {
    buffer: usize,
    staged: Vec<Vec<Staged>>,
}

/// The bytes rank `rank` copies of one block under `offload-sharded` (its shards) or
/// `offload` (the whole block): what one staging buffer must hold.
pub fn block_copy_bytes(block: &crate::layout::BlockLayout, sharded: bool, rank: usize) -> u64 {
    block
        .regions
        .iter()
        .map(|reg| {
            let runs = if sharded {
                reg.shard_pieces(rank)
            } else {
                reg.pieces.clone()
            };
            runs.iter().map(|p| p.len).sum::<u64>()
        })
        .sum()
}
