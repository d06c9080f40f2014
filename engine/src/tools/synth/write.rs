//! Writing a synthesized folder's files: safetensors files of seeded random weights (or
//! real headers over sparse files), split into shards with an index when asked, and the
//! JSON and text files beside them. Every family's synth writer uses these, so a
//! synthesized folder is laid out as diffusers and transformers save one whatever its
//! family.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use layerwise_core::family::TensorSpec;
use memmap2::MmapMut;
use rayon::prelude::*;
use safetensors::Dtype;

use super::pipeline::SynthOptions;
use crate::checkpoint::header::{dtype_size, encode_header};
use crate::{Error, Result};

/// Weight files of diffusers' models and of transformers' (the text encoder).
pub const DIFFUSERS_STEM: &str = "diffusion_pytorch_model";
pub const TRANSFORMERS_STEM: &str = "model";

/// Where synthesized configs are checked from, for the errors' sake.
pub const HERE: &str = "synth options";

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// (centre, half-width) of the uniform init for a tensor: unit-variance-preserving for
/// projections, small for biases and adaLN modulation, about one for norm scales.
fn init_range(name: &str, shape: &[usize]) -> (f32, f32) {
    let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
    let unit = (3.0 / fan_in as f32).sqrt();
    if name.ends_with(".bias") {
        (0.0, 0.02)
    } else if shape.len() == 1 {
        (1.0, 0.1)
    } else if name.contains("embedding_table") {
        (0.0, 0.5)
    } else if name.contains("norm1.linear") || name.contains("proj_out_1") {
        (0.0, 0.5 * unit)
    } else {
        (0.0, unit)
    }
}

fn fill(out: &mut [u8], name: &str, shape: &[usize], dtype: Dtype, seed: u64) {
    let (centre, half) = init_range(name, shape);
    let mut state = seed ^ name_hash(name);
    let mut next = || {
        let u = (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
        centre + half * (2.0 * u - 1.0)
    };
    match dtype {
        Dtype::F32 => out
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&next().to_le_bytes())),
        Dtype::F16 => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&half::f16::from_f32(next()).to_le_bytes())),
        Dtype::BF16 => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&half::bf16::from_f32(next()).to_le_bytes())),
        _ => unreachable!("synth writes float dtypes only"),
    }
}

/// Writes one safetensors file holding `tensors`; returns its size.
fn write_file(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>)],
    seed: u64,
    sparse: bool,
) -> Result<u64> {
    let (header, offsets) = encode_header(tensors)?;
    let data: u64 = tensors
        .iter()
        .map(|(_, d, s)| s.iter().product::<usize>() as u64 * dtype_size(*d).unwrap_or(1) as u64)
        .sum();
    let total = header.len() as u64 + data;
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    file.set_len(total).map_err(|e| Error::io(path, e))?;
    if total == 0 {
        return Ok(0);
    }
    // SAFETY: we created and sized the file above and nothing else maps it.
    let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| Error::io(path, e))?;
    map[..header.len()].copy_from_slice(&header);
    if !sparse {
        let mut rest = &mut map[header.len()..];
        let mut parts = Vec::with_capacity(tensors.len());
        let mut at = 0u64;
        for ((name, dtype, shape), &off) in tensors.iter().zip(&offsets) {
            let len =
                shape.iter().product::<usize>() as u64 * dtype_size(*dtype).unwrap_or(1) as u64;
            debug_assert_eq!(off, at);
            let (head, tail) = rest.split_at_mut(len as usize);
            parts.push((head, name, shape, *dtype));
            rest = tail;
            at += len;
        }
        parts
            .into_par_iter()
            .for_each(|(buf, name, shape, dtype)| fill(buf, name, shape, dtype, seed));
    }
    map.flush().map_err(|e| Error::io(path, e))?;
    Ok(total)
}

/// Writes a component's weights, split into shards when they exceed `max_shard`.
pub fn write_component(
    dir: &Path,
    stem: &str,
    specs: &[TensorSpec],
    dtype: &dyn Fn(&str) -> Dtype,
    max_shard: Option<u64>,
    seed: u64,
    sparse: bool,
) -> Result<(u64, usize)> {
    let mut shards: Vec<Vec<(String, Dtype, Vec<usize>)>> = vec![Vec::new()];
    let mut size = 0u64;
    for s in specs {
        let dtype = dtype(&s.name);
        let len = s.numel() as u64 * dtype_size(dtype).expect("float dtype") as u64;
        if let Some(max) = max_shard {
            if size > 0 && size + len > max {
                shards.push(Vec::new());
                size = 0;
            }
        }
        size += len;
        shards
            .last_mut()
            .expect("one shard")
            .push((s.name.clone(), dtype, s.shape.clone()));
    }
    if shards.len() == 1 {
        let bytes = write_file(
            &dir.join(format!("{stem}.safetensors")),
            &shards[0],
            seed,
            sparse,
        )?;
        return Ok((bytes, 1));
    }
    let n = shards.len();
    let mut map = serde_json::Map::new();
    let mut bytes = 0;
    let mut data = 0u64;
    for (i, tensors) in shards.iter().enumerate() {
        let file = format!("{stem}-{:05}-of-{n:05}.safetensors", i + 1);
        bytes += write_file(&dir.join(&file), tensors, seed, sparse)?;
        for (name, d, s) in tensors {
            map.insert(name.clone(), file.clone().into());
            data += s.iter().product::<usize>() as u64 * dtype_size(*d).unwrap_or(1) as u64;
        }
    }
    let index = serde_json::json!({ "metadata": { "total_size": data }, "weight_map": map });
    write_json(&dir.join(format!("{stem}.safetensors.index.json")), &index)?;
    Ok((bytes, n))
}

pub fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("JSON serialises");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

pub fn mkdir(p: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
    Ok(p.to_path_buf())
}

/// One component folder to write: its `config.json` and its weights.
pub struct ComponentFiles<'a> {
    /// The folder's name under the pipeline folder (`transformer`, `vae`).
    pub name: &'a str,
    pub config: serde_json::Value,
    /// [`DIFFUSERS_STEM`] or [`TRANSFORMERS_STEM`].
    pub stem: &'a str,
    pub specs: Vec<TensorSpec>,
    /// Each tensor's dtype, by its name.
    pub dtype: &'a dyn Fn(&str) -> Dtype,
    /// Whether the options' shard size applies (the VAE is always one file).
    pub sharded: bool,
    /// Added to the options' seed, so that no two components draw the same weights.
    pub seed_offset: u64,
}

/// Writes `c` under `out`; returns its (bytes, files).
pub fn write_folder(out: &Path, opts: &SynthOptions, c: ComponentFiles) -> Result<(u64, usize)> {
    let dir = mkdir(&out.join(c.name))?;
    write_json(&dir.join("config.json"), &c.config)?;
    write_component(
        &dir,
        c.stem,
        &c.specs,
        c.dtype,
        if c.sharded {
            opts.max_shard_bytes
        } else {
            None
        },
        opts.seed.wrapping_add(c.seed_offset),
        opts.sparse,
    )
}

/// The dtype of every tensor of a VAE, as diffusers ships it.
fn f32_weights(_: &str) -> Dtype {
    Dtype::F32
}

impl<'a> ComponentFiles<'a> {
    /// The text encoder's folder, `text_encoder`, as transformers saves it (sharded).
    pub fn text_encoder(
        config: serde_json::Value,
        specs: Vec<TensorSpec>,
        dtype: &'a dyn Fn(&str) -> Dtype,
    ) -> Self {
        ComponentFiles {
            name: "text_encoder",
            config,
            stem: TRANSFORMERS_STEM,
            specs,
            dtype,
            sharded: true,
            seed_offset: 2,
        }
    }

    /// A transformer's folder `name`, as diffusers saves it (sharded), its weights drawn
    /// with `seed_offset` (the second expert's differ from the first's).
    pub fn transformer(
        name: &'a str,
        config: serde_json::Value,
        specs: Vec<TensorSpec>,
        dtype: &'a dyn Fn(&str) -> Dtype,
        seed_offset: u64,
    ) -> Self {
        ComponentFiles {
            name,
            config,
            stem: DIFFUSERS_STEM,
            specs,
            dtype,
            sharded: true,
            seed_offset,
        }
    }

    /// The VAE's folder, `vae`: its f32 weights in one file.
    pub fn vae(config: serde_json::Value, specs: Vec<TensorSpec>) -> Self {
        ComponentFiles {
            name: "vae",
            config,
            stem: DIFFUSERS_STEM,
            specs,
            dtype: &f32_weights,
            sharded: false,
            seed_offset: 1,
        }
    }
}

/// Writes each of `folders` under `out`, in order, then `scheduler/scheduler_config.json`:
/// the weights and configs of a pipeline folder; returns the weight files' bytes and how
/// many weight files were written.
pub fn write_components(
    out: &Path,
    opts: &SynthOptions,
    folders: Vec<ComponentFiles>,
    scheduler: &serde_json::Value,
) -> Result<(u64, usize)> {
    let (mut bytes, mut files) = (0, 0);
    for c in folders {
        let (b, f) = write_folder(out, opts, c)?;
        bytes += b;
        files += f;
    }
    write_scheduler(out, scheduler)?;
    Ok((bytes, files))
}

/// Writes `scheduler/scheduler_config.json`.
pub fn write_scheduler(out: &Path, config: &serde_json::Value) -> Result<()> {
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(&sdir.join("scheduler_config.json"), config)
}

/// Writes text files (a tokenizer's) into the folder `name` under `out`.
pub fn write_texts<S: AsRef<str>>(out: &Path, name: &str, files: &[(&str, S)]) -> Result<()> {
    let dir = mkdir(&out.join(name))?;
    for (file, text) in files {
        std::fs::write(dir.join(file), text.as_ref()).map_err(|e| Error::io(dir.join(file), e))?;
    }
    Ok(())
}

/// The dtype of a tensor of a model whose `keeps_f32` tensors diffusers holds in f32 beside
/// weights of `dtype` (its `_keep_in_fp32_modules`).
pub fn keeping_f32(dtype: Dtype, keeps_f32: fn(&str) -> bool) -> impl Fn(&str) -> Dtype {
    move |name| {
        if dtype != Dtype::F32 && keeps_f32(name) {
            Dtype::F32
        } else {
            dtype
        }
    }
}
