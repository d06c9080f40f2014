//! What a family is to the engine: [`FamilyModel`] (its checkpoint and, with `runtime`, its
//! math) and [`FamilyEntry`] (its name, how its folders are recognised and opened, its synth
//! presets). Each family's own `entry` module builds one of these; the list of them lives in
//! `registry`, apart from these types, so that a family depends on the types without
//! depending on the list that names every family.

use layerwise_core::family::FamilyCheckpoint;

/// A family's checkpoint as the engine holds it: what [`FamilyCheckpoint`] reads of the
/// folder, and (with the `runtime` feature) the family's math over it. Each family
/// implements both for its own checkpoint type.
pub trait FamilyModel: FamilyCheckpoint {
    /// The family's runtime over this folder, its components mapped.
    #[cfg(feature = "runtime")]
    fn runtime(&self) -> crate::Result<Box<dyn crate::execution::family::FamilyRuntime>>;
}

/// One family as the registry knows it: its name and how its folders are recognised and
/// opened (and, with `runtime`, the synthetic folders it writes). Adding a family is one
/// module with one of these, listed in [`FAMILIES`](crate::families::FAMILIES).
#[derive(Clone, Copy)]
pub struct FamilyEntry {
    /// The short name a profile's `family` and a DiffusionDeployment's `model.family` use.
    pub name: &'static str,
    /// The `_class_name`s diffusers writes in `model_index.json` for its pipelines.
    pub pipelines: &'static [&'static str],
    /// Whether a folder whose `model_index.json` names no class is this family's (folders
    /// written before the class name was checked carry none: DiT's layout).
    pub unnamed: bool,
    /// Opens and checks a folder of this family.
    pub open: fn(&std::path::Path) -> crate::Result<std::sync::Arc<dyn FamilyModel>>,
    /// The folders `synth --preset` writes for this family, by name.
    #[cfg(feature = "runtime")]
    pub presets: &'static [crate::tools::synth::pipeline::SynthPreset],
}

impl std::fmt::Debug for FamilyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FamilyEntry")
            .field("name", &self.name)
            .field("pipelines", &self.pipelines)
            .finish()
    }
}

/// Writes a family's registry entry, `pub const FAMILY`, and its checkpoint's
/// [`FamilyModel`]. `opens: wan::WanCheckpoint => WanRuntime` says that the family's module
/// is `families::wan`, that its folder opens through `WanCheckpoint::open(root)`, and that
/// its runtime is `wan::runtime::WanRuntime::new` over a copy of the checkpoint; its synth
/// presets are `wan::synth::PRESETS`. `unnamed: true` marks the family that folders naming
/// no pipeline class are opened as (see [`FamilyEntry::unnamed`]).
///
/// The runtime is named here, in the family's `entry` module, rather than beside the
/// checkpoint, so that the checkpoint (which the runtime reads) never names the runtime.
macro_rules! family_entry {
    (
        $(#[$doc:meta])*
        name: $name:expr,
        pipelines: [$($pipeline:expr),+ $(,)?],
        $(unnamed: $unnamed:literal,)?
        opens: $family:ident::$checkpoint:ident => $runtime:ident $(,)?
    ) => {
        $(#[$doc])*
        pub const FAMILY: $crate::families::FamilyEntry = $crate::families::FamilyEntry {
            name: $name,
            pipelines: &[$($pipeline),+],
            unnamed: false $(|| $unnamed)?,
            #[cfg(feature = "runtime")]
            presets: $crate::families::$family::synth::PRESETS,
            open: |root| Ok(std::sync::Arc::new($crate::families::$family::$checkpoint::open(root)?)),
        };

        impl $crate::families::FamilyModel for $crate::families::$family::$checkpoint {
            #[cfg(feature = "runtime")]
            fn runtime(
                &self,
            ) -> $crate::Result<Box<dyn $crate::execution::family::FamilyRuntime>> {
                Ok(Box::new($crate::families::$family::runtime::$runtime::new(self.clone())?))
            }
        }
    };
}
pub(crate) use family_entry;
