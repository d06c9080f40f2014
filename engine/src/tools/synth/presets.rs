//! Finding a preset by name among the registered families' and writing a pipeline folder.

use std::path::Path;
use std::time::Instant;

use super::pipeline::{SynthOptions, SynthReport};
use super::write::mkdir;
use crate::checkpoint::header::dtype_size;
use crate::families::FAMILIES;
use crate::{Error, Result};

/// The presets `synth --preset` takes: every registered family's, in registry order.
pub fn preset_names() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.presets.iter().map(|p| p.name))
        .collect()
}

impl SynthOptions {
    /// A named preset, as its family lists it: `tiny` (a DiT that runs end to end in about
    /// a second), `xl` (DiT-XL/2), `wan-tiny` (a two-expert Wan that runs in seconds), or
    /// the published Wan shapes `wan2.1-1.3b`, `wan2.1-14b`, `wan2.2-a14b` (bf16; with
    /// `sparse` for the large ones), `cosmos3-tiny` (the parity fixture's shapes over a
    /// byte-level tokenizer) and the published Cosmos3 shapes `cosmos3-nano`,
    /// `cosmos3-super` (bf16), `qwen-image-tiny` (the parity fixture's shapes over a
    /// byte-level tokenizer) and the published Qwen-Image shapes `qwen-image` (bf16; 58 GB,
    /// so with `sparse`).
    pub fn preset(name: &str) -> Result<Self> {
        let found = FAMILIES
            .iter()
            .flat_map(|f| f.presets)
            .find(|p| p.name == name);
        let Some(preset) = found else {
            return Err(Error::invalid(
                "preset",
                format!("`{name}`: expected one of {}", preset_names().join(", ")),
            ));
        };
        let (model, dtype) = (preset.make)();
        Ok(SynthOptions::of(model, dtype))
    }
}

/// Writes a complete pipeline folder at `out`.
pub fn synth(out: &Path, opts: &SynthOptions) -> Result<SynthReport> {
    let start = Instant::now();
    if dtype_size(opts.dtype).is_none()
        || !crate::checkpoint::check::WEIGHT_DTYPES.contains(&opts.dtype)
    {
        return Err(Error::invalid(
            "dtype",
            format!("{:?}: expected F32, F16 or BF16", opts.dtype),
        ));
    }
    mkdir(out)?;
    let (bytes, files) = opts.model.write(out, opts)?;
    Ok(SynthReport {
        bytes,
        files,
        seconds: start.elapsed().as_secs_f64(),
    })
}
