//! The Qwen-Image family's entry in the registry: its name, the pipeline class it answers to,
//! how its folder is opened and (with `runtime`) its synth presets and the runtime its
//! checkpoint starts. Kept out of the family's `mod.rs` so the root only declares and
//! re-exports.

crate::families::entry::family_entry! {
    /// The Qwen-Image family in the registry ([`crate::families::FAMILIES`]).
    name: "qwen-image",
    pipelines: [super::checkpoint::CLASS_NAME],
    opens: qwen_image::QwenImageCheckpoint => QwenImageRuntime,
}
