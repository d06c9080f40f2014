//! The Wan family's entry in the registry: its name, the pipeline class it answers to,
//! how its folder is opened and (with `runtime`) its synth presets and the runtime its
//! checkpoint starts. Kept out of the family's `mod.rs` so the root only declares and
//! re-exports.

crate::families::entry::family_entry! {
    /// The Wan family in the registry ([`crate::families::FAMILIES`]).
    name: "wan",
    pipelines: ["WanPipeline"],
    opens: wan::WanCheckpoint => WanRuntime,
}
