//! The Qwen-Image family's entry in the registry: its name, the pipeline class it answers to,
//! how its folder is opened and (with `runtime`) its synth presets and the runtime its
//! checkpoint starts. Kept out of the family's `mod.rs` so the root only declares and
//! re-exports.

use super::checkpoint::QwenImageCheckpoint;
use crate::families::entry::{FamilyEntry, FamilyModel};

/// The Qwen-Image family in the registry ([`crate::families::FAMILIES`]).
pub const FAMILY: FamilyEntry = FamilyEntry {
    name: "qwen-image",
    pipelines: &[super::checkpoint::CLASS_NAME],
    unnamed: false,
    #[cfg(feature = "runtime")]
    presets: super::synth::PRESETS,
    open: |root| Ok(std::sync::Arc::new(QwenImageCheckpoint::open(root)?)),
};

/// The checkpoint's runtime lives here rather than beside the checkpoint, so that the
/// checkpoint (which the runtime reads) never names the runtime.
impl FamilyModel for QwenImageCheckpoint {
    #[cfg(feature = "runtime")]
    fn runtime(&self) -> crate::Result<Box<dyn crate::execution::family::FamilyRuntime>> {
        Ok(Box::new(super::runtime::QwenImageRuntime::new(
            self.clone(),
        )?))
    }
}
