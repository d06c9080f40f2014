//! Model families: what a family's checkpoint must contain (names, shapes), how each
//! component splits into prologue, blocks and epilogue, what its activations cost, and
//! (with the `runtime` feature) its math. Metadata is always built, without tensor math,
//! so the node agent can profile checkpoints.

#[cfg(feature = "runtime")]
pub mod checks;
#[cfg(feature = "runtime")]
pub mod encode_once;
pub mod entry;
pub mod registry;
#[cfg(feature = "runtime")]
pub mod steps;

pub use entry::{FamilyEntry, FamilyModel};
pub use layerwise_core::family::{BlockGroup, FamilyCheckpoint, TensorSpec};
pub use registry::Checkpoint;

/// Declares each family's folder and lists its `FAMILY` entry in [`FAMILIES`], in the order
/// written: the registry is this one list, so a new family's one change outside its folder
/// is one line in it (its entry carries its `synth` presets too).
macro_rules! registry {
    ($(pub mod $family:ident;)+) => {
        $(pub mod $family;)+

        /// The families this build runs, in the order a `model_index.json`'s class is
        /// matched against them. The node agent profiles exactly these.
        pub const FAMILIES: &[FamilyEntry] = &[$($family::FAMILY),+];
    };
}

registry! {
    pub mod dit;
    pub mod wan;
    pub mod cosmos3;
    pub mod qwen_image;
}

/// The short names of [`FAMILIES`], in order.
pub fn names() -> Vec<&'static str> {
    FAMILIES.iter().map(|f| f.name).collect()
}

/// Profiles the pipeline folder at `root` as the family of [`FAMILIES`] it names, reading
/// headers and configs only: what the node agent publishes.
pub fn profile(root: &std::path::Path) -> crate::Result<layerwise_core::profile::Profile> {
    Checkpoint::open(root)?.profile()
}

impl Checkpoint {
    /// Opens `root` as the family of [`FAMILIES`] its `model_index.json` names.
    pub fn open(root: &std::path::Path) -> crate::Result<Checkpoint> {
        Self::open_in(root, FAMILIES)
    }
}
