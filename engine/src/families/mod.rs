//! Model families: what a family's checkpoint must contain (names, shapes), how each
//! component splits into prologue, blocks and epilogue, what its activations cost, and
//! (with the `runtime` feature) its math. Metadata is always built, without tensor math,
//! so the node agent can profile checkpoints.

#[cfg(feature = "runtime")]
pub mod checks;
pub mod cosmos3;
pub mod dit;
#[cfg(feature = "runtime")]
pub mod encode_once;
pub mod entry;
pub mod qwen_image;
pub mod registry;
pub mod wan;

pub use entry::{FamilyEntry, FamilyModel};
pub use layerwise_core::family::{BlockGroup, FamilyCheckpoint, TensorSpec};
pub use registry::{names, profile, Checkpoint, FAMILIES};
