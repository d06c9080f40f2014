//! Synthetic checkpoints: a complete DiT + VAE pipeline folder in the diffusers layout
//! with seeded random weights (or, with `sparse`, real headers over sparse files that
//! read as zeros). Tests and benchmarks make their models with this, never download.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::checkpoint::header::{dtype_size, encode_header};
use crate::families::autoencoder_kl::VaeConfig;
use crate::families::dit::DitConfig;
use crate::families::TensorSpec;
use crate::samplers::ddim::DdimConfig;
use crate::{Error, Result};

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub dit: DitConfig,
    pub vae: VaeConfig,
    pub seed: u64,
    /// Weight dtype of the transformer (the VAE is always f32, as diffusers ships it).
    pub dtype: Dtype,
    /// Split the transformer into files of at most this many bytes (with an index).
    pub max_shard_bytes: Option<u64>,
    /// Write headers over sparse files instead of weights.
    pub sparse: bool,
}

impl SynthOptions {
    /// A named preset: `tiny` (runs end to end in about a second) or `xl` (DiT-XL/2).
    pub fn preset(name: &str) -> Result<Self> {
        let (dit, vae) = match name {
            "tiny" => (DitConfig::tiny(), VaeConfig::tiny()),
            "xl" => (DitConfig::xl(), VaeConfig::sd()),
            other => {
                return Err(Error::invalid(
                    "preset",
                    format!("`{other}`: expected tiny or xl"),
                ))
            }
        };
        Ok(SynthOptions {
            dit,
            vae,
            seed: 0,
            dtype: Dtype::F32,
            max_shard_bytes: None,
            sparse: false,
        })
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub bytes: u64,
    pub files: usize,
    pub seconds: f64,
}

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
fn write_component(
    dir: &Path,
    specs: &[TensorSpec],
    dtype: Dtype,
    max_shard: Option<u64>,
    seed: u64,
    sparse: bool,
) -> Result<(u64, usize)> {
    let esz = dtype_size(dtype).expect("float dtype") as u64;
    let mut shards: Vec<Vec<(String, Dtype, Vec<usize>)>> = vec![Vec::new()];
    let mut size = 0u64;
    for s in specs {
        let len = s.numel() as u64 * esz;
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
    let stem = "diffusion_pytorch_model";
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

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("JSON serialises");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

fn mkdir(p: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
    Ok(p.to_path_buf())
}

/// Writes a complete DiT pipeline folder at `out`.
pub fn synth(out: &Path, opts: &SynthOptions) -> Result<SynthReport> {
    let start = Instant::now();
    opts.dit.validate(Path::new("synth options"))?;
    opts.vae.validate(Path::new("synth options"))?;
    if dtype_size(opts.dtype).is_none()
        || !crate::checkpoint::check::WEIGHT_DTYPES.contains(&opts.dtype)
    {
        return Err(Error::invalid(
            "dtype",
            format!("{:?}: expected F32, F16 or BF16", opts.dtype),
        ));
    }
    mkdir(out)?;
    write_json(
        &out.join("model_index.json"),
        &serde_json::json!({
            "_class_name": "DiTPipeline",
            "_diffusers_version": "0.30.0",
            "scheduler": ["diffusers", "DDIMScheduler"],
            "transformer": ["diffusers", "DiTTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        }),
    )?;
    let tdir = mkdir(&out.join("transformer"))?;
    write_json(&tdir.join("config.json"), &opts.dit.to_json())?;
    let (tb, tf) = write_component(
        &tdir,
        &opts.dit.all_specs(),
        opts.dtype,
        opts.max_shard_bytes,
        opts.seed,
        opts.sparse,
    )?;
    let vdir = mkdir(&out.join("vae"))?;
    write_json(&vdir.join("config.json"), &opts.vae.to_config_json())?;
    let (vb, vf) = write_component(
        &vdir,
        &opts.vae.tensor_specs(),
        Dtype::F32,
        None,
        opts.seed.wrapping_add(1),
        opts.sparse,
    )?;
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(
        &sdir.join("scheduler_config.json"),
        &DdimConfig::dit().to_json(),
    )?;
    Ok(SynthReport {
        bytes: tb + vb,
        files: tf + vf,
        seconds: start.elapsed().as_secs_f64(),
    })
}
