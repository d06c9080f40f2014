//! The simulator: streamed blocks through a ring of K slots, each block's copy in two
//! serial stages on two queues (from the host, then the all-gather), its compute once the
//! previous block's is done and its weights are in, carried across passes as the engine
//! prefetches across steps and groups.

/// One block in the simulated sequence.
#[derive(Clone, Copy)]
pub(super) struct Block {
    /// Seconds of compute, with the part of its copy that cannot run beside it.
    pub(super) compute: f64,
    /// Seconds of the two copy stages that run beside compute; `None` for a kept block.
    pub(super) copy: Option<(f64, f64)>,
    /// Seconds of its copy, the slower stage, all of it.
    pub(super) full_copy: f64,
}

/// The two-queue pipeline with a ring of `k` slots, carried across passes.
pub(super) struct Pipe {
    k: usize,
    host_free: f64,
    gather_free: f64,
    compute_end: f64,
    /// Compute end of the streamed blocks, the last `k` of them.
    streamed_ends: std::collections::VecDeque<f64>,
}

impl Pipe {
    pub(super) fn new(k: usize) -> Pipe {
        Pipe {
            k: k.max(1),
            host_free: 0.0,
            gather_free: 0.0,
            compute_end: 0.0,
            streamed_ends: Default::default(),
        }
    }

    /// Runs `b`; its compute's end.
    fn run(&mut self, b: Block) -> f64 {
        let mut ready = self.compute_end;
        if let Some((host, gather)) = b.copy {
            let slot_free = if self.streamed_ends.len() >= self.k {
                self.streamed_ends[self.streamed_ends.len() - self.k]
            } else {
                0.0
            };
            let host_done = self.host_free.max(slot_free) + host;
            self.host_free = host_done;
            let gathered = self.gather_free.max(host_done) + gather;
            self.gather_free = gathered;
            ready = ready.max(gathered);
        }
        self.compute_end = ready + b.compute;
        if b.copy.is_some() {
            self.streamed_ends.push_back(self.compute_end);
            if self.streamed_ends.len() > self.k {
                self.streamed_ends.pop_front();
            }
        }
        self.compute_end
    }

    /// Runs a pass over `blocks`; its duration from the end of the previous pass.
    pub(super) fn pass(&mut self, blocks: &[Block]) -> f64 {
        let start = self.compute_end;
        for b in blocks {
            self.run(*b);
        }
        self.compute_end - start
    }
}
