//! The CUDA backend of one rank: candle's stream is the compute stream, the pipeline's
//! copy and gather streams are CUDA streams of the same context, and every ordering
//! between them is a CUDA event (`cuStreamWaitEvent`), never a device synchronisation.
//!
//! Copies and gathers write into slot tensors in place through candle's `InplaceOp1`,
//! which hands out the slot's `CudaSlice`; cudarc's event tracking then records the
//! slot's last writer and readers, which agrees with (and never loosens) the pipeline's
//! own events. A failure while enqueueing poisons the stream: every event recorded on it
//! afterwards carries the error (a [`Fault`](crate::execution::fault::Fault), typed, so
//! an abandoned all-gather stays one), so whoever waits learns of it instead of hanging,
//! as on the CPU backend.
//!
//! Its parts, one a module: the streams and events that carry a failure along
//! ([`stream`]); the GPU a rank opens and what it holds ([`device`]); the `Backend`
//! operations enqueued on it ([`ops`]); the device-side stall timing ([`timing`]); the
//! watchdog that turns a device making no progress into an error ([`watchdog`]); the
//! host-to-device copies written into slots in place ([`copy`]); and the raw views of a
//! whole device buffer that the copies and NCCL write through ([`buffers`]). This file only
//! declares them and re-exports what the rest of the CUDA backend uses.

mod buffers;
mod copy;
mod device;
mod ops;
mod stream;
mod timing;
mod watchdog;

pub(super) use buffers::{buffer, slot_mut};
pub use device::CudaBackend;
pub use stream::{CudaEvent, CudaStream};
