//! Measured memory: what a rank really holds while it encodes a prompt, runs a denoising
//! pass and decodes, set beside what the memory model reserves for the same phase. On the
//! CPU backend tensors live in heap `Vec`s, so a counting global allocator ([`alloc`])
//! sees every byte; on CUDA the device's stream-ordered memory pool keeps its own
//! high-water mark (`cuda`). A [`Phase`] turns either into "the peak above what was
//! live when the phase began", and [`PhasePeaks`] carries the figures into `--stats`,
//! `bench` and the server's metrics. Here rather than in `execution` because the binary
//! and test binaries install the allocator without the compute runtime's types.

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod peaks;
pub mod phase;

pub use alloc::CountingAlloc;
pub use peaks::{PhaseKind, PhasePeaks};
pub use phase::{DevicePeak, Phase};
