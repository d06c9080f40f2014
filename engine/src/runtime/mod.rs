//! Everything that computes: device memory accounting, streams, backends, the block
//! pipeline, the model families' math, the sampler and the run driver.

pub mod backend;
pub mod budget;
pub mod cpu;
pub mod cuda;
pub mod ddim;
pub mod dit;
pub mod engine;
pub mod image;
pub mod lockstep;
pub mod pipeline;
pub mod rank;
pub mod rss;
pub mod stream;
pub mod synth;
pub mod trace;
pub mod vae;
pub mod weights;
