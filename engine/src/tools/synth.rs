//! Synthetic checkpoints: a complete pipeline folder in the diffusers layout (DiT: a
//! transformer, a VAE, a scheduler; Wan: a tokenizer, a UMT5 text encoder, one or two
//! expert transformers, the Wan VAE, a flow scheduler) with seeded random weights (or,
//! with `sparse`, real headers over sparse files that read as zeros). Tests and
//! benchmarks make their models with this, never download.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::checkpoint::header::{dtype_size, encode_header};
use crate::components::autoencoder_kl::VaeConfig;
use crate::components::qwen2_5_vl::synth::{synth_tokenizer_files, SYNTH_VOCAB};
use crate::components::qwen2_5_vl::{Qwen25VlConfig, TensorPrefix};
use crate::components::umt5::{synth_tokenizer_config, synth_tokenizer_json, Umt5Config};
use crate::components::wan_vae::WanVaeConfig;
use crate::families::cosmos3::Cosmos3Config;
use crate::families::dit::DitConfig;
use crate::families::qwen_image::transformer::QwenImageTransformerConfig;
use crate::families::wan::transformer::WanTransformerConfig;
use crate::families::TensorSpec;
use crate::samplers::ddim::DdimConfig;
use crate::samplers::flow::{FlowMatchEulerConfig, FlowScheduler, UniPcConfig};
use crate::{Error, Result};

/// A Wan pipeline to write.
#[derive(Debug, Clone)]
pub struct WanSynth {
    pub text_encoder: Umt5Config,
    pub transformer: WanTransformerConfig,
    /// Wan 2.2: a second expert of the same shape, taking the steps below this boundary.
    pub boundary_ratio: Option<f64>,
    pub vae: WanVaeConfig,
    /// The UniPC scheduler's flow shift (3.0 for 480p, 5.0 for 720p).
    pub flow_shift: f64,
}

/// A Cosmos3 pipeline to write.
#[derive(Debug, Clone)]
pub struct Cosmos3Synth {
    pub transformer: Cosmos3Config,
    pub vae: WanVaeConfig,
    /// The UniPC scheduler's flow shift.
    pub flow_shift: f64,
}

/// A Qwen-Image pipeline to write.
#[derive(Debug, Clone)]
pub struct QwenImageSynth {
    pub text_encoder: Qwen25VlConfig,
    pub transformer: QwenImageTransformerConfig,
    pub vae: WanVaeConfig,
}

/// Which family's pipeline to write.
#[derive(Debug, Clone)]
pub enum SynthModel {
    Dit {
        dit: Box<DitConfig>,
        vae: Box<VaeConfig>,
    },
    Wan(Box<WanSynth>),
    Cosmos3(Box<Cosmos3Synth>),
    QwenImage(Box<QwenImageSynth>),
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub model: SynthModel,
    pub seed: u64,
    /// Weight dtype of the streamed components (the VAE is always f32, as diffusers ships
    /// it; Wan's bf16 transformers keep what diffusers keeps in f32).
    pub dtype: Dtype,
    /// Split each streamed component into files of at most this many bytes (with an index).
    pub max_shard_bytes: Option<u64>,
    /// Write headers over sparse files instead of weights.
    pub sparse: bool,
}

/// The presets `synth --preset` takes.
pub const PRESETS: [&str; 11] = [
    "tiny",
    "xl",
    "wan-tiny",
    "wan2.1-1.3b",
    "wan2.1-14b",
    "wan2.2-a14b",
    "cosmos3-tiny",
    "cosmos3-nano",
    "cosmos3-super",
    "qwen-image-tiny",
    "qwen-image",
];

impl SynthOptions {
    /// A named preset: `tiny` (a DiT that runs end to end in about a second), `xl`
    /// (DiT-XL/2), `wan-tiny` (a two-expert Wan that runs in seconds), or the published
    /// Wan shapes `wan2.1-1.3b`, `wan2.1-14b`, `wan2.2-a14b` (bf16; with `sparse` for the
    /// large ones), `cosmos3-tiny` (the parity fixture's shapes over a byte-level
    /// tokenizer) and the published Cosmos3 shapes `cosmos3-nano`, `cosmos3-super` (bf16),
    /// `qwen-image-tiny` (the parity fixture's shapes over a byte-level tokenizer) and the
    /// published Qwen-Image shapes `qwen-image` (bf16; 58 GB, so with `sparse`).
    pub fn preset(name: &str) -> Result<Self> {
        let wan = |text_encoder, transformer, boundary_ratio, vae, flow_shift| {
            SynthModel::Wan(Box::new(WanSynth {
                text_encoder,
                transformer,
                boundary_ratio,
                vae,
                flow_shift,
            }))
        };
        let (model, dtype) = match name {
            "tiny" => (
                SynthModel::Dit {
                    dit: Box::new(DitConfig::tiny()),
                    vae: Box::new(VaeConfig::tiny()),
                },
                Dtype::F32,
            ),
            "xl" => (
                SynthModel::Dit {
                    dit: Box::new(DitConfig::xl()),
                    vae: Box::new(VaeConfig::sd()),
                },
                Dtype::F32,
            ),
            "wan-tiny" => (
                wan(
                    Umt5Config::tiny(),
                    WanTransformerConfig::tiny(),
                    Some(0.875),
                    WanVaeConfig::tiny(),
                    3.0,
                ),
                Dtype::F32,
            ),
            "wan2.1-1.3b" => (
                wan(
                    Umt5Config::umt5_xxl(),
                    WanTransformerConfig::wan21_1_3b(),
                    None,
                    WanVaeConfig::wan21(),
                    3.0,
                ),
                Dtype::BF16,
            ),
            "wan2.1-14b" => (
                wan(
                    Umt5Config::umt5_xxl(),
                    WanTransformerConfig::wan21_14b(),
                    None,
                    WanVaeConfig::wan21(),
                    5.0,
                ),
                Dtype::BF16,
            ),
            "wan2.2-a14b" => (
                wan(
                    Umt5Config::umt5_xxl(),
                    WanTransformerConfig::wan22_a14b(),
                    Some(0.875),
                    WanVaeConfig::wan21(),
                    12.0,
                ),
                Dtype::BF16,
            ),
            "cosmos3-tiny" | "cosmos3-nano" | "cosmos3-super" => {
                let (transformer, vae, dtype) = match name {
                    "cosmos3-tiny" => (
                        Cosmos3Config::tiny(SYNTH_VOCAB),
                        WanVaeConfig::tiny22(),
                        Dtype::F32,
                    ),
                    "cosmos3-nano" => (Cosmos3Config::nano(), WanVaeConfig::wan22(), Dtype::BF16),
                    _ => (Cosmos3Config::super_(), WanVaeConfig::wan22(), Dtype::BF16),
                };
                (
                    SynthModel::Cosmos3(Box::new(Cosmos3Synth {
                        transformer,
                        vae,
                        flow_shift: 5.0,
                    })),
                    dtype,
                )
            }
            "qwen-image-tiny" => {
                // The pipeline fixture's shapes: the tiny text encoder's width feeds the
                // tiny transformer, which reads the Wan VAE's 16 channels in 2×2 patches.
                let text_encoder = Qwen25VlConfig::tiny();
                let transformer = QwenImageTransformerConfig {
                    in_channels: 64,
                    out_channels: Some(16),
                    joint_attention_dim: text_encoder.hidden_size,
                    ..QwenImageTransformerConfig::tiny()
                };
                (
                    SynthModel::QwenImage(Box::new(QwenImageSynth {
                        text_encoder,
                        transformer,
                        vae: WanVaeConfig::tiny(),
                    })),
                    Dtype::F32,
                )
            }
            "qwen-image" => (
                SynthModel::QwenImage(Box::new(QwenImageSynth {
                    text_encoder: Qwen25VlConfig::qwen2_5_vl_7b(),
                    transformer: QwenImageTransformerConfig::published(),
                    vae: WanVaeConfig::wan21(),
                })),
                Dtype::BF16,
            ),
            other => {
                return Err(Error::invalid(
                    "preset",
                    format!("`{other}`: expected one of {}", PRESETS.join(", ")),
                ))
            }
        };
        Ok(SynthOptions {
            model,
            seed: 0,
            dtype,
            max_shard_bytes: None,
            sparse: false,
        })
    }

    /// Sets the depth of the (first) transformer, and of its twin expert.
    pub fn set_layers(&mut self, n: usize) {
        match &mut self.model {
            SynthModel::Dit { dit, .. } => dit.num_layers = n,
            SynthModel::Wan(w) => w.transformer.num_layers = n,
            SynthModel::Cosmos3(c) => c.transformer.num_hidden_layers = n,
            SynthModel::QwenImage(q) => q.transformer.num_layers = n,
        }
    }

    /// Sets the transformer's attention heads and, if given, their width.
    pub fn set_heads(&mut self, heads: Option<usize>, head_dim: Option<usize>) {
        let (h, d) = match &mut self.model {
            SynthModel::Dit { dit, .. } => {
                (&mut dit.num_attention_heads, &mut dit.attention_head_dim)
            }
            SynthModel::Wan(w) => (
                &mut w.transformer.num_attention_heads,
                &mut w.transformer.attention_head_dim,
            ),
            SynthModel::Cosmos3(c) => (
                &mut c.transformer.num_attention_heads,
                &mut c.transformer.head_dim,
            ),
            SynthModel::QwenImage(q) => (
                &mut q.transformer.num_attention_heads,
                &mut q.transformer.attention_head_dim,
            ),
        };
        if let Some(v) = heads {
            *h = v;
        }
        if let Some(v) = head_dim {
            *d = v;
        }
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

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("JSON serialises");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

fn mkdir(p: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
    Ok(p.to_path_buf())
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
    let (bytes, files) = match &opts.model {
        SynthModel::Dit { dit, vae } => synth_dit(out, opts, dit, vae)?,
        SynthModel::Wan(w) => synth_wan(out, opts, w)?,
        SynthModel::Cosmos3(c) => synth_cosmos3(out, opts, c)?,
        SynthModel::QwenImage(q) => synth_qwen_image(out, opts, q)?,
    };
    Ok(SynthReport {
        bytes,
        files,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// ImageNet's names for the first classes (its synset glosses, as DiT checkpoints carry them
/// in `id2label`), so a synthesized class-conditional model can be asked for "goldfish".
const IMAGENET_FIRST_CLASSES: [&str; 16] = [
    "tench, Tinca tinca",
    "goldfish, Carassius auratus",
    "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias",
    "tiger shark, Galeocerdo cuvieri",
    "hammerhead, hammerhead shark",
    "electric ray, crampfish, numbfish, torpedo",
    "stingray",
    "cock",
    "hen",
    "ostrich, Struthio camelus",
    "brambling, Fringilla montifringilla",
    "goldfinch, Carduelis carduelis",
    "house finch, linnet, Carpodacus mexicanus",
    "junco, snowbird",
    "indigo bunting, indigo finch, indigo bird, Passerina cyanea",
    "robin, American robin, Turdus migratorius",
];

/// `id2label` for a model of `classes` classes: ImageNet's names where this project lists
/// them, the rest left unnamed (a request gives them by label).
fn imagenet_names(classes: usize) -> serde_json::Value {
    IMAGENET_FIRST_CLASSES
        .iter()
        .take(classes)
        .enumerate()
        .map(|(i, n)| (i.to_string(), serde_json::Value::from(*n)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn synth_dit(
    out: &Path,
    opts: &SynthOptions,
    dit: &DitConfig,
    vae: &VaeConfig,
) -> Result<(u64, usize)> {
    dit.validate(Path::new("synth options"))?;
    vae.validate(Path::new("synth options"))?;
    write_json(
        &out.join("model_index.json"),
        &serde_json::json!({
            "_class_name": "DiTPipeline",
            "_diffusers_version": "0.30.0",
            "id2label": imagenet_names(dit.num_classes()),
            "scheduler": ["diffusers", "DDIMScheduler"],
            "transformer": ["diffusers", "DiTTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        }),
    )?;
    let tdir = mkdir(&out.join("transformer"))?;
    write_json(&tdir.join("config.json"), &dit.to_json())?;
    let (tb, tf) = write_component(
        &tdir,
        DIFFUSERS_STEM,
        &dit.all_specs(),
        &|_| opts.dtype,
        opts.max_shard_bytes,
        opts.seed,
        opts.sparse,
    )?;
    let vdir = mkdir(&out.join("vae"))?;
    write_json(&vdir.join("config.json"), &vae.to_config_json())?;
    let (vb, vf) = write_component(
        &vdir,
        DIFFUSERS_STEM,
        &vae.tensor_specs(),
        &|_| Dtype::F32,
        None,
        opts.seed.wrapping_add(1),
        opts.sparse,
    )?;
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(
        &sdir.join("scheduler_config.json"),
        &DdimConfig::dit().to_json(),
    )?;
    Ok((tb + vb, tf + vf))
}

/// Weight files of diffusers' models and of transformers' (the text encoder).
const DIFFUSERS_STEM: &str = "diffusion_pytorch_model";
const TRANSFORMERS_STEM: &str = "model";

/// Whether diffusers keeps a Wan transformer tensor in f32 beside bf16 weights (its
/// `_keep_in_fp32_modules`: the time embedder, the modulation tables and `norm2`).
fn wan_keeps_f32(name: &str) -> bool {
    name.starts_with("condition_embedder.time_embedder.")
        || name.ends_with("scale_shift_table")
        || name.contains(".norm2.")
}

fn synth_wan(out: &Path, opts: &SynthOptions, w: &WanSynth) -> Result<(u64, usize)> {
    let here = Path::new("synth options");
    w.text_encoder.validate(here)?;
    w.transformer.validate(here)?;
    w.vae.validate(here)?;
    let two = w.boundary_ratio.is_some();
    write_json(
        &out.join("model_index.json"),
        &serde_json::json!({
            "_class_name": "WanPipeline",
            "_diffusers_version": "0.42.1",
            "boundary_ratio": w.boundary_ratio,
            "expand_timesteps": false,
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "transformer_2": if two { serde_json::json!(["diffusers", "WanTransformer3DModel"]) } else { serde_json::json!([null, null]) },
            "vae": ["diffusers", "AutoencoderKLWan"],
        }),
    )?;
    let tok = mkdir(&out.join("tokenizer"))?;
    for (file, text) in [
        ("tokenizer.json", synth_tokenizer_json(opts.seed)),
        ("tokenizer_config.json", synth_tokenizer_config()),
    ] {
        std::fs::write(tok.join(file), text).map_err(|e| Error::io(tok.join(file), e))?;
    }
    let te = mkdir(&out.join("text_encoder"))?;
    write_json(&te.join("config.json"), &w.text_encoder.to_json())?;
    let (mut bytes, mut files) = write_component(
        &te,
        TRANSFORMERS_STEM,
        &w.text_encoder.all_specs(),
        &|_| opts.dtype,
        opts.max_shard_bytes,
        opts.seed.wrapping_add(2),
        opts.sparse,
    )?;
    let experts: &[&str] = if two {
        &["transformer", "transformer_2"]
    } else {
        &["transformer"]
    };
    let dtype = |name: &str| {
        if opts.dtype != Dtype::F32 && wan_keeps_f32(name) {
            Dtype::F32
        } else {
            opts.dtype
        }
    };
    for (i, name) in experts.iter().enumerate() {
        let dir = mkdir(&out.join(name))?;
        write_json(&dir.join("config.json"), &w.transformer.to_json())?;
        let (b, f) = write_component(
            &dir,
            DIFFUSERS_STEM,
            &w.transformer.all_specs(),
            &dtype,
            opts.max_shard_bytes,
            opts.seed.wrapping_add(3 + i as u64),
            opts.sparse,
        )?;
        bytes += b;
        files += f;
    }
    let vdir = mkdir(&out.join("vae"))?;
    write_json(&vdir.join("config.json"), &w.vae.to_json())?;
    let (b, f) = write_component(
        &vdir,
        DIFFUSERS_STEM,
        &w.vae.tensor_specs(),
        &|_| Dtype::F32,
        None,
        opts.seed.wrapping_add(1),
        opts.sparse,
    )?;
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(
        &sdir.join("scheduler_config.json"),
        &FlowScheduler::UniPc(UniPcConfig::wan(w.flow_shift)).to_json(),
    )?;
    Ok((bytes + b, files + f))
}

/// Whether diffusers keeps a Cosmos3 transformer tensor in f32 beside bf16 weights (its
/// `_keep_in_fp32_modules`: the time embedder).
fn cosmos3_keeps_f32(name: &str) -> bool {
    name.starts_with("time_embedder.")
}

fn synth_cosmos3(out: &Path, opts: &SynthOptions, c: &Cosmos3Synth) -> Result<(u64, usize)> {
    let config = Path::new("synth options");
    let mut check = c.transformer.clone();
    check.class_name = crate::families::cosmos3::config::CLASS_NAME.into();
    write_json(
        &out.join("model_index.json"),
        &serde_json::json!({
            "_class_name": "Cosmos3OmniPipeline",
            "_diffusers_version": "0.42.1",
            "default_use_system_prompt": true,
            "enable_safety_checker": false,
            "safety_checker": [null, null],
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "sound_tokenizer": [null, null],
            "text_tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "Cosmos3OmniTransformer"],
            "use_native_flow_schedule": false,
            "vae": ["diffusers", "AutoencoderKLWan"],
        }),
    )?;
    c.vae.validate(config)?;
    let tok = mkdir(&out.join("text_tokenizer"))?;
    for (file, text) in synth_tokenizer_files() {
        std::fs::write(tok.join(file), text).map_err(|e| Error::io(tok.join(file), e))?;
    }
    let tdir = mkdir(&out.join("transformer"))?;
    write_json(&tdir.join("config.json"), &check.to_json())?;
    // What is written opens as diffusers would read it: the config's own checks first.
    Cosmos3Config::load(&tdir.join("config.json"))?;
    let dtype = |name: &str| {
        if opts.dtype != Dtype::F32 && cosmos3_keeps_f32(name) {
            Dtype::F32
        } else {
            opts.dtype
        }
    };
    let (mut bytes, mut files) = write_component(
        &tdir,
        DIFFUSERS_STEM,
        &check.all_specs(),
        &dtype,
        opts.max_shard_bytes,
        opts.seed.wrapping_add(3),
        opts.sparse,
    )?;
    let vdir = mkdir(&out.join("vae"))?;
    write_json(&vdir.join("config.json"), &c.vae.to_json())?;
    let (b, f) = write_component(
        &vdir,
        DIFFUSERS_STEM,
        &c.vae.tensor_specs(),
        &|_| Dtype::F32,
        None,
        opts.seed.wrapping_add(1),
        opts.sparse,
    )?;
    bytes += b;
    files += f;
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(
        &sdir.join("scheduler_config.json"),
        &FlowScheduler::UniPc(UniPcConfig::wan(c.flow_shift)).to_json(),
    )?;
    Ok((bytes, files))
}

/// The text encoder's language model as transformers saves it, with its (never read)
/// language head, so a synthesized folder weighs what a published one does but for the
/// vision tower.
fn qwen_text_encoder_specs(c: &Qwen25VlConfig) -> Vec<TensorSpec> {
    let mut specs = c.all_specs(TensorPrefix::Model);
    specs.push(TensorSpec::new(
        "lm_head.weight",
        &[c.vocab_size, c.hidden_size],
    ));
    specs
}

fn synth_qwen_image(out: &Path, opts: &SynthOptions, q: &QwenImageSynth) -> Result<(u64, usize)> {
    let here = Path::new("synth options");
    // What is written opens as transformers would read it: the config's own checks first.
    Qwen25VlConfig::from_json(&q.text_encoder.to_json(), here)?;
    q.transformer.validate(here)?;
    q.vae.validate(here)?;
    write_json(
        &out.join("model_index.json"),
        &serde_json::json!({
            "_class_name": crate::families::qwen_image::checkpoint::CLASS_NAME,
            "_diffusers_version": "0.42.1",
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
        }),
    )?;
    let tok = mkdir(&out.join("tokenizer"))?;
    for (file, text) in synth_tokenizer_files() {
        std::fs::write(tok.join(file), text).map_err(|e| Error::io(tok.join(file), e))?;
    }
    let te = mkdir(&out.join("text_encoder"))?;
    write_json(&te.join("config.json"), &q.text_encoder.to_json())?;
    let (mut bytes, mut files) = write_component(
        &te,
        TRANSFORMERS_STEM,
        &qwen_text_encoder_specs(&q.text_encoder),
        &|_| opts.dtype,
        opts.max_shard_bytes,
        opts.seed.wrapping_add(2),
        opts.sparse,
    )?;
    let tdir = mkdir(&out.join("transformer"))?;
    write_json(&tdir.join("config.json"), &q.transformer.to_json())?;
    let (b, f) = write_component(
        &tdir,
        DIFFUSERS_STEM,
        &q.transformer.all_specs(),
        &|_| opts.dtype,
        opts.max_shard_bytes,
        opts.seed.wrapping_add(3),
        opts.sparse,
    )?;
    bytes += b;
    files += f;
    let vdir = mkdir(&out.join("vae"))?;
    write_json(
        &vdir.join("config.json"),
        &crate::families::qwen_image::vae::to_json(&q.vae),
    )?;
    let (b, f) = write_component(
        &vdir,
        DIFFUSERS_STEM,
        &q.vae.tensor_specs(),
        &|_| Dtype::F32,
        None,
        opts.seed.wrapping_add(1),
        opts.sparse,
    )?;
    let sdir = mkdir(&out.join("scheduler"))?;
    write_json(
        &sdir.join("scheduler_config.json"),
        &FlowScheduler::Euler(FlowMatchEulerConfig::qwen_image()).to_json(),
    )?;
    Ok((bytes + b, files + f))
}
