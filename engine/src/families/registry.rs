//! What reads a pipeline folder through a list of families: [`Checkpoint`] picks the family
//! its `model_index.json` names. The list this build runs ([`super::FAMILIES`]) is written
//! once, in the families' `mod.rs`.

use layerwise_core::family::{BlockGroup, FamilyCheckpoint};

use super::entry::{FamilyEntry, FamilyModel};

/// A pipeline folder opened and checked from its headers and configs alone, whatever
/// its family: `model_index.json`'s `_class_name` chooses the family.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub root: std::path::PathBuf,
    /// The family's short name (one of [`super::names`]).
    pub family: &'static str,
    /// The family's checked folder.
    pub inner: std::sync::Arc<dyn FamilyModel>,
}

impl Checkpoint {
    /// Opens `root` as the family of `registry` its `model_index.json` names.
    /// A hub cache path naming its snapshot by a ref (`…/snapshots/main`) opens the snapshot
    /// that ref names ([`crate::checkpoint::hf_cache::resolve_model_path`]).
    pub fn open_in(root: &std::path::Path, registry: &[FamilyEntry]) -> crate::Result<Checkpoint> {
        let root = &crate::checkpoint::hf_cache::resolve_model_path(root)?;
        let folder = crate::checkpoint::ModelFolder::new(root)?;
        let entry = registry
            .iter()
            .find(|f| match folder.class_name.as_deref() {
                Some(class) => f.pipelines.contains(&class),
                None => f.unnamed,
            });
        let Some(entry) = entry else {
            let runs: Vec<&str> = registry
                .iter()
                .flat_map(|f| f.pipelines.iter().copied())
                .collect();
            return Err(crate::Error::config(
                root.join("model_index.json"),
                "_class_name",
                match folder.class_name.as_deref() {
                    Some(other) => format!(
                        "`{other}` is not a pipeline this engine runs (it runs {})",
                        runs.join(", ")
                    ),
                    None => format!(
                        "missing: name the pipeline (this engine runs {})",
                        runs.join(", ")
                    ),
                },
            ));
        };
        Ok(Checkpoint {
            root: root.to_path_buf(),
            family: entry.name,
            inner: (entry.open)(root)?,
        })
    }

    /// The family's short name (`dit`, `wan`): one of [`super::names`].
    pub fn name(&self) -> &'static str {
        self.family
    }

    /// Every component with weights, by its folder name, in pipeline order.
    pub fn components(&self) -> Vec<(&'static str, &crate::checkpoint::Component)> {
        self.inner.components()
    }

    /// The groups of blocks that stream, each with the name of the component it is in.
    pub fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        self.inner.groups()
    }

    /// [`FamilyCheckpoint::resident_device_bytes`].
    pub fn resident_device_bytes(&self) -> u64 {
        self.inner.resident_device_bytes()
    }

    /// [`FamilyCheckpoint::decoder_bytes`].
    pub fn decoder_bytes(&self) -> u64 {
        self.inner.decoder_bytes()
    }

    /// [`FamilyCheckpoint::decode_cost`].
    pub fn decode_cost(&self) -> Option<crate::decode::DecodeCost> {
        self.inner.decode_cost()
    }

    /// The size the model was trained at, `(width, height)` in pixels.
    pub fn native_size(&self) -> (usize, usize) {
        self.inner.native_size()
    }

    /// The largest request the model itself can run (its position tables), whatever the
    /// memory: what the server's bounds and the planner's workload are checked against.
    pub fn limits(&self) -> crate::bounds::ModelLimits {
        self.inner.limits()
    }

    /// What a request costs in activations: the formula the planner and the engine share.
    pub fn activation_cost(&self) -> crate::checkpoint::ActivationCost {
        self.inner.activation_cost()
    }

    /// [`FamilyCheckpoint::compute_dtypes`]: what its blocks compute in.
    pub fn compute_dtypes(&self) -> &'static [layerwise_core::compute_dtype::ComputeElement] {
        self.inner.compute_dtypes()
    }

    /// The family's own checkpoint type, when it is `T`.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.inner.as_any().downcast_ref()
    }

    /// The folder's profile: sizes, layouts and the activation cost, as the planner reads
    /// them.
    pub fn profile(&self) -> crate::Result<layerwise_core::profile::Profile> {
        let inner: &dyn FamilyCheckpoint = &*self.inner;
        Ok(layerwise_core::profile::Profile::of(self.family, inner)?)
    }

    /// Every weight byte in the folder.
    pub fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }

    /// The family's runtime over this folder, its components mapped.
    #[cfg(feature = "runtime")]
    pub fn runtime(&self) -> crate::Result<Box<dyn crate::execution::family::FamilyRuntime>> {
        self.inner.runtime()
    }
}
