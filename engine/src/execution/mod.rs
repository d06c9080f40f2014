//! Execution: how weights move and compute runs, whatever the family. Device memory
//! accounting, the backends (CPU always; CUDA behind the `cuda` feature) and their
//! streams, the block pipeline, the rank loop and the lockstep coordinator between ranks.

pub mod backend;
pub mod budget;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod family;
pub mod fault;
pub mod host_buffer;
pub mod lockstep;
pub mod need;
pub mod pipeline;
pub mod rank;
pub mod rss;
pub mod seq;
pub mod staging;
pub mod stream;
pub mod trace;
pub mod weights;
pub mod work;
