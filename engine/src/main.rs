//! `layerwise`: make synthetic checkpoints, profile them, generate images with blocks
//! streamed through a few device slots, benchmark the strategies side by side, serve the
//! HTTP API, draw pipeline traces and put load on a server.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Args, Parser, Subcommand};
use safetensors::Dtype;

use layerwise_engine::checkpoint::header::{encode_header, Header};
use layerwise_engine::checkpoint::Profile;
use layerwise_engine::runtime::cuda::DeviceChoice;
use layerwise_engine::runtime::engine::{EngineOptions, Model, Request, RunStats};
use layerwise_engine::runtime::image::write_png;
use layerwise_engine::runtime::synth::{synth, SynthOptions};
use layerwise_engine::runtime::trace::Trace;
use layerwise_engine::server::loadgen::LoadgenArgs;
use layerwise_engine::server::{serve, trace_svg, ServeArgs};
use layerwise_engine::Strategy;

#[derive(Parser)]
#[command(
    name = "layerwise",
    version,
    about = "Serve diffusion transformers larger than one accelerator by streaming their blocks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a complete DiT + VAE pipeline folder (diffusers layout) with seeded weights.
    Synth(SynthArgs),
    /// Print a checkpoint's profile, read from headers only.
    Inspect {
        /// The diffusers pipeline folder.
        #[arg(env = "LAYERWISE_MODEL")]
        dir: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long, env = "LAYERWISE_JSON")]
        json: bool,
    },
    /// Generate images.
    Generate(GenerateArgs),
    /// Run the same request under each strategy and compare step time, stalls and memory.
    Bench(BenchArgs),
    /// Serve the HTTP API (images, jobs, metrics) until SIGTERM.
    Serve(ServeArgs),
    /// Draw a pipeline trace (from `--trace`) as an SVG timeline, one lane per rank and stream.
    TraceSvg {
        /// The Chrome trace-event JSON file.
        #[arg(env = "LAYERWISE_TRACE")]
        trace: PathBuf,
        /// Output SVG (default: the trace's name with .svg).
        #[arg(long, env = "LAYERWISE_OUTPUT")]
        out: Option<PathBuf>,
    },
    /// Put closed-loop load on a server and print outputs/s and latency percentiles.
    Loadgen(LoadgenArgs),
}

#[derive(Args)]
struct SynthArgs {
    /// `tiny` (runs end to end in about a second) or `xl` (DiT-XL/2 shapes, ~3 GB).
    #[arg(long, env = "LAYERWISE_PRESET", default_value = "tiny")]
    preset: String,
    /// Output folder.
    #[arg(long, env = "LAYERWISE_OUT")]
    out: PathBuf,
    /// Override the number of transformer blocks.
    #[arg(long, env = "LAYERWISE_LAYERS")]
    layers: Option<usize>,
    /// Override the number of attention heads.
    #[arg(long, env = "LAYERWISE_HEADS")]
    heads: Option<usize>,
    /// Override the width of one attention head (hidden size = heads × head dim).
    #[arg(long, env = "LAYERWISE_HEAD_DIM")]
    head_dim: Option<usize>,
    /// Override the latent sample size the model is trained at.
    #[arg(long, env = "LAYERWISE_SAMPLE_SIZE")]
    sample_size: Option<usize>,
    /// Weight seed.
    #[arg(long, env = "LAYERWISE_SEED", default_value_t = 0)]
    seed: u64,
    /// Transformer weight dtype: f32, f16 or bf16.
    #[arg(long, env = "LAYERWISE_DTYPE", default_value = "f32")]
    dtype: String,
    /// Split the transformer into safetensors shards of at most this many MiB.
    #[arg(long, env = "LAYERWISE_MAX_SHARD_MIB")]
    max_shard_mib: Option<u64>,
    /// Write real headers over sparse files (weights read as zeros): 100+ GB without the disk.
    #[arg(long, env = "LAYERWISE_SPARSE")]
    sparse: bool,
}

#[derive(Args, Clone)]
struct RunArgs {
    /// The diffusers pipeline folder.
    #[arg(long, env = "LAYERWISE_MODEL")]
    model: PathBuf,
    /// Data-parallel ranks (threads of this process, one device each).
    #[arg(long, env = "LAYERWISE_DP", default_value_t = 1)]
    dp: usize,
    /// Device slots per rank (K ≥ 2).
    #[arg(long, env = "LAYERWISE_SLOTS", default_value_t = 2)]
    slots: usize,
    /// Device memory per rank in MiB (the CPU backend enforces it as a GPU would).
    #[arg(long, env = "LAYERWISE_DEVICE_MEMORY_MIB")]
    device_memory_mib: Option<u64>,
    /// Seconds any rank may wait on a transfer or a peer before failing.
    #[arg(long, env = "LAYERWISE_TIMEOUT_SECONDS", default_value_t = 120)]
    timeout_seconds: u64,
    /// Where ranks compute: `cpu`, `cuda` (GPUs 0..dp; needs a build with the `cuda`
    /// feature) or `auto` (CUDA when usable, else the CPU, saying why).
    #[arg(long, env = "LAYERWISE_DEVICE", default_value = "auto")]
    device: DeviceChoice,
    /// ImageNet class to draw (0..999 for DiT-XL/2).
    #[arg(long, env = "LAYERWISE_CLASS_LABEL", default_value_t = 207)]
    class_label: u32,
    /// Noise seed of the first image (image i uses seed + i).
    #[arg(long, env = "LAYERWISE_SEED", default_value_t = 0)]
    seed: u64,
    /// Denoising steps.
    #[arg(long, env = "LAYERWISE_STEPS", default_value_t = 25)]
    steps: usize,
    /// Classifier-free guidance scale (≤ 1 disables guidance).
    #[arg(long, env = "LAYERWISE_GUIDANCE", default_value_t = 4.0)]
    guidance: f32,
    /// Image size in pixels: `N` or `WxH` (default: the model's native size).
    #[arg(long, env = "LAYERWISE_SIZE")]
    size: Option<String>,
    /// Number of images (dealt to the ranks round-robin).
    #[arg(long, short = 'n', env = "LAYERWISE_N", default_value_t = 1)]
    n: usize,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
    /// resident, sharded, offload or offload-sharded.
    #[arg(long, env = "LAYERWISE_STRATEGY", default_value = "offload-sharded")]
    strategy: String,
    /// Output PNG (with n > 1, `-<i>` is added before the extension).
    #[arg(long, env = "LAYERWISE_OUTPUT")]
    out: PathBuf,
    /// Start from these latents (safetensors, tensor `latents`, [n, C, h, w]).
    #[arg(long, env = "LAYERWISE_INIT_LATENTS")]
    init_latents: Option<PathBuf>,
    /// Write the final latents before the VAE (safetensors, tensor `latents`).
    #[arg(long, env = "LAYERWISE_SAVE_LATENTS")]
    save_latents: Option<PathBuf>,
    /// Write run figures as JSON.
    #[arg(long, env = "LAYERWISE_STATS")]
    stats: Option<PathBuf>,
    /// Record every copy, gather and compute span as a Chrome trace (Perfetto) here.
    #[arg(long, env = "LAYERWISE_TRACE")]
    trace: Option<PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Strategies to compare (comma-separated); `resident` is the reference.
    #[arg(
        long,
        env = "LAYERWISE_STRATEGIES",
        default_value = "resident,sharded,offload,offload-sharded",
        value_delimiter = ','
    )]
    strategies: Vec<String>,
    /// Rounds over all strategies; each strategy's best round is reported.
    #[arg(long, env = "LAYERWISE_ROUNDS", default_value_t = 2)]
    rounds: usize,
}

fn parse_size(s: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| {
        x.trim()
            .parse::<usize>()
            .with_context(|| format!("size `{s}`: expected N or WxH"))
    };
    Ok(match s.split_once(['x', 'X']) {
        Some((w, h)) => (parse(w)?, parse(h)?),
        None => (parse(s)?, parse(s)?),
    })
}

impl RunArgs {
    fn options(&self, strategy: Strategy) -> EngineOptions {
        EngineOptions {
            strategy,
            dp: self.dp,
            slots: self.slots,
            device_memory: self.device_memory_mib.map_or(u64::MAX, |m| m << 20),
            timeout: Duration::from_secs(self.timeout_seconds),
            device: self.device,
            ..EngineOptions::default()
        }
    }

    fn requests(&self, model: &Model, init: Option<Tensor>) -> Result<Vec<Request>> {
        let native = model.config().sample_size * model.upscale();
        let (width, height) = self
            .size
            .as_deref()
            .map(parse_size)
            .transpose()?
            .unwrap_or((native, native));
        (0..self.n)
            .map(|i| {
                Ok(Request {
                    class_label: self.class_label,
                    seed: self.seed + i as u64,
                    steps: self.steps,
                    guidance: self.guidance,
                    width,
                    height,
                    init_latents: init.as_ref().map(|t| t.narrow(0, i, 1)).transpose()?,
                })
            })
            .collect()
    }
}

fn read_latents(path: &Path, n: usize) -> Result<Tensor> {
    let h = Header::read(path)?;
    let info = h
        .tensors
        .iter()
        .find(|t| t.name == "latents")
        .with_context(|| format!("{}: no tensor `latents`", path.display()))?;
    if info.dtype != Dtype::F32 {
        bail!(
            "{}: tensor `latents` is {:?}, expected F32",
            path.display(),
            info.dtype
        );
    }
    let bytes = std::fs::read(path)?;
    let data = &bytes[info.offset as usize..(info.offset + info.len) as usize];
    let mut t = Tensor::from_raw_buffer(data, candle_core::DType::F32, &info.shape, &Device::Cpu)?;
    if t.rank() == 3 {
        t = t.unsqueeze(0)?;
    }
    if t.dim(0)? < n {
        bail!(
            "{}: tensor `latents` holds {} samples but {n} images were asked for",
            path.display(),
            t.dim(0)?
        );
    }
    Ok(t)
}

fn write_latents(path: &Path, latents: &[Tensor]) -> Result<()> {
    let t = Tensor::cat(latents, 0)?.contiguous()?;
    let (header, _) = encode_header(&[("latents".to_string(), Dtype::F32, t.dims().to_vec())])?;
    let mut out = header;
    for v in t.flatten_all()?.to_vec1::<f32>()? {
        out.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

fn numbered(path: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    path.with_file_name(format!("{stem}-{i}{ext}"))
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

fn inspect(dir: &Path, json: bool) -> Result<()> {
    let t = std::time::Instant::now();
    let p = Profile::read(dir)?;
    let took = t.elapsed();
    if json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    println!("model            {}", dir.display());
    println!("family           {}", p.family);
    println!(
        "total            {} ({} bytes) in {} files",
        gib(p.total_bytes),
        p.total_bytes,
        p.files
    );
    println!(
        "transformer      {}; vae {}",
        gib(p.transformer_bytes),
        gib(p.vae_bytes)
    );
    println!(
        "blocks           {} (largest {} bytes)",
        p.blocks, p.largest_block_bytes
    );
    println!("outside blocks   {} bytes", p.outside_block_bytes);
    for (d, b) in &p.bytes_by_dtype {
        println!("dtype {d:<10} {b} bytes");
    }
    for dp in [1u64, 2, 4, 8] {
        println!("slot bytes dp={dp:<3} {}", p.slot_bytes(dp));
    }
    println!("native size      {}x{}", p.native_width, p.native_height);
    println!(
        "activations      {} at native size with guidance",
        gib(p
            .activation
            .bytes(p.native_width, p.native_height, 1, 1, true))
    );
    println!(
        "profiled in      {:.1} ms (headers only)",
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

fn generate(a: GenerateArgs) -> Result<()> {
    let strategy: Strategy = a.strategy.parse()?;
    let model = Model::open(&a.run.model)?;
    let init = a
        .init_latents
        .as_deref()
        .map(|p| read_latents(p, a.run.n))
        .transpose()?;
    let requests = a.run.requests(&model, init)?;
    let mut opts = a.run.options(strategy);
    opts.trace = a.trace.as_ref().map(|_| Trace::new(4_000_000));
    let (outputs, stats) = model.run(requests, &opts)?;
    if let (Some(t), Some(p)) = (&opts.trace, &a.trace) {
        t.write(p)?;
        println!("wrote trace {} ({} spans)", p.display(), t.len());
    }
    for (i, o) in outputs.iter().enumerate() {
        let path = numbered(&a.out, i, outputs.len());
        write_png(&path, o.image.as_ref().context("image was not decoded")?)?;
        println!("wrote {}", path.display());
    }
    if let Some(p) = &a.save_latents {
        write_latents(
            p,
            &outputs
                .iter()
                .map(|o| o.latents.clone())
                .collect::<Vec<_>>(),
        )?;
    }
    if let Some(p) = &a.stats {
        std::fs::write(p, serde_json::to_string_pretty(&stats)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    print_stats(&stats);
    Ok(())
}

fn print_stats(s: &RunStats) {
    println!(
        "{} dp={} K={}: {:.2}s wall, {:.3}s/step, stall {:.1}%, copied {}, gathered {}, peak device {}, peak anon RSS {} (checkpoint {})",
        s.strategy,
        s.dp,
        s.slots,
        s.wall_seconds,
        s.step_seconds,
        100.0 * s.stall_fraction,
        gib(s.bytes_copied),
        gib(s.bytes_gathered),
        gib(s.peak_device_bytes),
        gib(s.peak_anon_rss_bytes),
        gib(s.checkpoint_bytes),
    );
}

fn bench(a: BenchArgs) -> Result<()> {
    let strategies = a
        .strategies
        .iter()
        .map(|s| s.parse::<Strategy>())
        .collect::<Result<Vec<_>, _>>()?;
    let model = Model::open(&a.run.model)?;
    // Bring the checkpoint into the page cache first so no strategy pays the disk; read
    // through one small buffer, so the warm-up holds no copy of the model.
    let mut buf = vec![0u8; 8 << 20];
    for h in &model.checkpoint.transformer.files {
        let mut f = std::fs::File::open(&h.path)
            .with_context(|| format!("reading {}", h.path.display()))?;
        while std::io::Read::read(&mut f, &mut buf)? > 0 {}
    }
    let requests = a.run.requests(&model, None)?;
    let mut best: Vec<Option<(RunStats, Vec<Tensor>)>> = vec![None; strategies.len()];
    for round in 0..a.rounds.max(1) {
        for (i, s) in strategies.iter().enumerate() {
            let mut opts = a.run.options(*s);
            opts.decode = false;
            let (out, stats) = model.run(requests.clone(), &opts)?;
            eprintln!("round {round}: {s}: {:.3}s/step", stats.step_seconds);
            if best[i]
                .as_ref()
                .is_none_or(|(b, _)| stats.step_seconds < b.step_seconds)
            {
                best[i] = Some((stats, out.into_iter().map(|o| o.latents).collect()));
            }
        }
    }
    let best: Vec<(RunStats, Vec<Tensor>)> = best.into_iter().map(|b| b.expect("ran")).collect();
    let reference = best
        .iter()
        .position(|(s, _)| s.strategy == "resident")
        .unwrap_or(0);
    let ref_step = best[reference].0.step_seconds;
    let ref_latents = &best[reference].1;
    println!(
        "model {} ({}), dp={}, K={}, {} image(s) of {} steps, best of {} rounds",
        a.run.model.display(),
        gib(best[0].0.checkpoint_bytes),
        a.run.dp,
        a.run.slots,
        a.run.n,
        a.run.steps,
        a.rounds
    );
    println!(
        "{:<16} {:>10} {:>12} {:>8} {:>14} {:>14} {:>10}",
        "strategy", "s/step", "vs resident", "stall", "peak device", "anon RSS", "identical"
    );
    let mut all_same = true;
    for (s, lat) in &best {
        let same = lat.len() == ref_latents.len()
            && lat.iter().zip(ref_latents).all(|(x, y)| {
                x.flatten_all()
                    .and_then(|x| x.to_vec1::<f32>())
                    .ok()
                    .map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
                    == y.flatten_all()
                        .and_then(|y| y.to_vec1::<f32>())
                        .ok()
                        .map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
            });
        all_same &= same;
        println!(
            "{:<16} {:>10.3} {:>11.3}x {:>7.1}% {:>14} {:>14} {:>10}",
            s.strategy,
            s.step_seconds,
            s.step_seconds / ref_step,
            100.0 * s.stall_fraction,
            gib(s.peak_device_bytes),
            gib(s.peak_anon_rss_bytes),
            if same { "yes" } else { "NO" }
        );
    }
    if !all_same {
        bail!("strategies produced different latents");
    }
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LAYERWISE_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Synth(a) => {
            let mut o = SynthOptions::preset(&a.preset)?;
            if let Some(v) = a.layers {
                o.dit.num_layers = v;
            }
            if let Some(v) = a.heads {
                o.dit.num_attention_heads = v;
            }
            if let Some(v) = a.head_dim {
                o.dit.attention_head_dim = v;
            }
            if let Some(v) = a.sample_size {
                o.dit.sample_size = v;
            }
            o.seed = a.seed;
            o.sparse = a.sparse;
            o.max_shard_bytes = a.max_shard_mib.map(|m| m << 20);
            o.dtype = match a.dtype.to_ascii_lowercase().as_str() {
                "f32" => Dtype::F32,
                "f16" => Dtype::F16,
                "bf16" => Dtype::BF16,
                other => bail!("--dtype `{other}`: expected f32, f16 or bf16"),
            };
            let r = synth(&a.out, &o)?;
            println!(
                "wrote {} ({} bytes in {} files) in {:.2}s",
                a.out.display(),
                r.bytes,
                r.files,
                r.seconds
            );
        }
        Cmd::Inspect { dir, json } => inspect(&dir, json)?,
        Cmd::Generate(a) => generate(a)?,
        Cmd::Bench(a) => bench(a)?,
        Cmd::Serve(a) => {
            let code = serve(a)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Cmd::TraceSvg { trace, out } => {
            let json = std::fs::read_to_string(&trace)
                .with_context(|| format!("reading {}", trace.display()))?;
            let out = out.unwrap_or_else(|| trace.with_extension("svg"));
            std::fs::write(&out, trace_svg::render(&json)?)
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {}", out.display());
        }
        Cmd::Loadgen(a) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let r = rt.block_on(layerwise_engine::server::loadgen::run(&a))?;
            println!(
                "{} requests ({} ok, statuses {:?}) in {:.2}s: {:.3} outputs/s; latency p50 {:.3}s p90 {:.3}s p99 {:.3}s max {:.3}s",
                r.requests, r.ok, r.status_counts, r.wall_seconds, r.outputs_per_second, r.latency_p50, r.latency_p90, r.latency_p99, r.latency_max
            );
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(())
}
