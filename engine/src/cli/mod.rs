//! The `layerwise` command line: make synthetic checkpoints, profile them, generate images
//! with blocks streamed through a few device slots, benchmark the strategies side by side,
//! serve the HTTP API, draw pipeline traces and put load on a server.
//!
//! It lives in the library so that two binaries run the same commands: the `layerwise`
//! executable, which links no CUDA, and the CUDA library it hands device commands to
//! when a GPU driver is present (see [`crate::launch`]).

mod args;
mod bench;
mod commands;

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use safetensors::Dtype;

use crate::contract::{self, RootsArgs};
use crate::execution::cuda::DeviceChoice;
use crate::server::{serve, ServeArgs};
use crate::tools::loadgen::LoadgenArgs;
use crate::tools::soak::SoakArgs;
use crate::tools::synth::{synth, SynthOptions};
use args::GenerateArgs;
use bench::{BenchArgs, RatesArgs};

#[derive(Parser)]
#[command(
    name = "layerwise",
    version,
    about = "Serve diffusion transformers larger than one accelerator by streaming their blocks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    roots: RootsArgs,
    #[command(flatten)]
    log: crate::logging::LogArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a complete DiT + VAE pipeline folder (diffusers layout) with seeded weights.
    Synth(SynthArgs),
    /// Print a checkpoint's profile, read from headers only.
    Inspect {
        /// The diffusers pipeline folder.
        #[arg(env = contract::ENV_MODEL)]
        dir: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long, env = "LAYERWISE_JSON")]
        json: bool,
    },
    /// Write a copy of a pipeline folder with its transformers' streamed linear weights in
    /// fp8 (F8_E4M3, one F32 `<prefix>.weight_scale` per tensor: absmax / 448): half the
    /// bytes of bf16 streamed per step.
    Quantize {
        /// The diffusers pipeline folder to read (f32, f16 or bf16 weights).
        input: PathBuf,
        /// The folder to write (must not exist).
        output: PathBuf,
        /// Store the streamed linear weights as F8_E4M3 with a per-tensor scale (the one
        /// format `quantize` writes; required).
        #[arg(long)]
        fp8: bool,
    },
    /// Generate images.
    Generate(GenerateArgs),
    /// Run the same request under each strategy and number of blocks kept on the device,
    /// and compare step time, stalls, bytes moved per step and memory.
    Bench(BenchArgs),
    /// Measure this machine's rates (a matmul's FLOP/s, copy rates) or render rates measured
    /// elsewhere, and print them as the DiffusionDeployment's `spec.accelerator.rates`.
    Rates(RatesArgs),
    /// Serve the HTTP API (images, jobs, metrics) until SIGTERM.
    #[command(name = contract::SERVE_COMMAND)]
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
    /// Soak a running server with valid, invalid and cancelled requests above its capacity;
    /// print what was accepted, refused and failed after acceptance, and its memory and
    /// descriptors before, at the peak and after.
    Soak(SoakArgs),
}

#[derive(Args)]
pub(crate) struct SynthArgs {
    /// `tiny` (a DiT that runs end to end in about a second), `xl` (DiT-XL/2 shapes,
    /// ~3 GB), `wan-tiny` (a two-expert Wan that runs in seconds), or the published Wan
    /// shapes `wan2.1-1.3b`, `wan2.1-14b`, `wan2.2-a14b` (bf16; use `--sparse`).
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
    /// Override the width of the transformer's feed-forward layer (Wan presets).
    #[arg(long, env = "LAYERWISE_FFN_DIM")]
    ffn_dim: Option<usize>,
    /// Override the latent sample size the model is trained at.
    #[arg(long, env = "LAYERWISE_SAMPLE_SIZE")]
    sample_size: Option<usize>,
    /// Weight seed.
    #[arg(long, env = "LAYERWISE_SEED", default_value_t = 0)]
    seed: u64,
    /// Weight dtype of the streamed components: f32, f16 or bf16 (default: the preset's).
    #[arg(long, env = "LAYERWISE_DTYPE")]
    dtype: Option<String>,
    /// Split the transformer into safetensors shards of at most this many MiB.
    #[arg(long, env = "LAYERWISE_MAX_SHARD_MIB")]
    max_shard_mib: Option<u64>,
    /// Write real headers over sparse files (weights read as zeros): 100+ GB without the disk.
    #[arg(long, env = "LAYERWISE_SPARSE")]
    sparse: bool,
}

/// Whether the command `args` asks for may compute on a GPU: `generate`, `bench` and
/// `serve` unless `--device cpu`. The launcher loads the CUDA library only for these, so
/// `--help`, `synth` or `inspect` never pay for loading it. Arguments that do not parse
/// answer no, and the in-process CLI reports them.
pub fn may_use_gpu(args: &[OsString]) -> bool {
    let device = match Cli::try_parse_from(args) {
        Ok(Cli {
            cmd: Cmd::Generate(a),
            ..
        }) => a.engine.backend.device,
        Ok(Cli {
            cmd: Cmd::Bench(a), ..
        }) => a.engine.backend.device,
        Ok(Cli {
            cmd: Cmd::Serve(a), ..
        }) => a.backend.device,
        _ => return false,
    };
    device != DeviceChoice::Cpu
}

/// Runs the command line `args` (the program name first) and returns the exit code:
/// 0, 1 with `Error: ...` on stderr when the command failed, 2 for bad usage.
pub fn main(args: Vec<OsString>) -> i32 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    // The executable and the CUDA library each hold their own subscriber; whichever runs
    // the command sets it up once.
    let _ = crate::logging::init(cli.log.log_format, "warn");
    let confined = match cli.roots.model_roots.as_slice() {
        [] => Ok(()),
        roots => crate::checkpoint::confine(roots),
    };
    if let Err(e) = confined {
        eprintln!("Error: --model-roots: {e}");
        return 1;
    }
    match run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {}", report(&e));
            1
        }
    }
}

/// An error and its causes on one line, `outer: inner`, each cause once: the engine's
/// internal and device errors already name their cause in their own message.
fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run(cmd: Cmd) -> Result<i32> {
    match cmd {
        Cmd::Synth(a) => synth_cmd(a)?,
        Cmd::Inspect { dir, json } => commands::inspect(&dir, json)?,
        Cmd::Quantize { input, output, fp8 } => {
            if !fp8 {
                bail!("quantize: say which format to write: --fp8 (the one it writes)");
            }
            let t = std::time::Instant::now();
            let r = crate::tools::quantize::quantize_fp8(&input, &output)?;
            println!(
                "wrote {}: {} linear weights in fp8, weights {} → {} bytes, in {:.2}s",
                output.display(),
                r.tensors,
                r.bytes_before,
                r.bytes_after,
                t.elapsed().as_secs_f64()
            );
        }
        Cmd::Generate(a) => commands::generate(a)?,
        Cmd::Bench(a) => bench::bench(a)?,
        Cmd::Rates(a) => bench::rates(a)?,
        Cmd::Serve(a) => return Ok(serve(a)?),
        Cmd::TraceSvg { trace, out } => commands::trace_svg(&trace, out)?,
        Cmd::Loadgen(a) => commands::loadgen(&a)?,
        Cmd::Soak(a) => commands::soak(&a)?,
    }
    Ok(0)
}

fn synth_cmd(a: SynthArgs) -> Result<()> {
    let mut o = SynthOptions::preset(&a.preset)?;
    if let Some(v) = a.layers {
        o.set_layers(v);
    }
    o.set_heads(a.heads, a.head_dim);
    if let Some(v) = a.ffn_dim {
        match o.model.ffn_dim() {
            Some(f) => *f = v,
            None => {
                bail!("--ffn-dim applies to Wan and Cosmos3 presets (DiT's and Qwen-Image's are 4 × hidden)")
            }
        }
    }
    if let Some(v) = a.sample_size {
        match o.model.sample_size() {
            Some(s) => *s = v,
            None => bail!("--sample-size applies to DiT presets"),
        }
    }
    o.seed = a.seed;
    o.sparse = a.sparse;
    o.max_shard_bytes = a.max_shard_mib.map(|m| m << 20);
    if let Some(d) = &a.dtype {
        o.dtype = match d.to_ascii_lowercase().as_str() {
            "f32" => Dtype::F32,
            "f16" => Dtype::F16,
            "bf16" => Dtype::BF16,
            other => bail!("--dtype `{other}`: expected f32, f16 or bf16"),
        };
    }
    let r = synth(&a.out, &o)?;
    println!(
        "wrote {} ({} bytes in {} files) in {:.2}s",
        a.out.display(),
        r.bytes,
        r.files,
        r.seconds
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::SlotsChoice;
    use crate::execution::cuda::HostMode;
    use crate::options::EngineArgs;

    fn args(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn parse(v: &[&str]) -> std::result::Result<Cli, String> {
        Cli::try_parse_from(args(v)).map_err(|e| e.to_string())
    }

    /// An internal error's cause shows once, after the context the CLI added.
    #[test]
    fn a_report_names_each_cause_once() {
        let io = std::io::Error::other("no threads left");
        let e =
            anyhow::Error::from(crate::Error::internal("cannot start tokio", io)).context("serve");
        assert_eq!(report(&e), "serve: cannot start tokio: no threads left");
        let plain = anyhow::Error::from(crate::Error::invalid("dp", "must be at least 1"));
        assert_eq!(report(&plain), "invalid dp: must be at least 1");
    }

    fn run_args(v: &[&str]) -> EngineArgs {
        let mut all = vec!["layerwise", "generate", "--model", "m", "--out", "o.png"];
        all.extend_from_slice(v);
        match parse(&all).unwrap() {
            Cli {
                cmd: Cmd::Generate(a),
                ..
            } => a.engine,
            _ => unreachable!(),
        }
    }

    #[test]
    fn slots_and_host_memory_parse() {
        let a = run_args(&[]);
        assert_eq!(
            (a.run.slots, a.backend.host_memory),
            (SlotsChoice::Fixed(2), HostMode::Auto)
        );
        let a = run_args(&["--slots", "auto", "--host-memory", "pin"]);
        assert_eq!(
            (a.run.slots, a.backend.host_memory),
            (SlotsChoice::Auto, HostMode::Pin)
        );
        let a = run_args(&["--slots", "5", "--host-memory", "register"]);
        assert_eq!(
            (a.run.slots, a.backend.host_memory),
            (SlotsChoice::Fixed(5), HostMode::Register)
        );
        let o = a.options(crate::Strategy::Offload, Default::default());
        assert_eq!(
            (o.slots, o.host),
            (SlotsChoice::Fixed(5), HostMode::Register)
        );
    }

    /// `--model-roots` reaches `serve`'s contract and the confinement every command does,
    /// before the subcommand or after it.
    #[test]
    fn model_roots_reach_serve_in_either_place() {
        for argv in [
            [
                "layerwise",
                "--model-roots",
                "/a,/b",
                "serve",
                "--model",
                "m",
            ],
            [
                "layerwise",
                "serve",
                "--model-roots",
                "/a,/b",
                "--model",
                "m",
            ],
        ] {
            let cli = parse(&argv).unwrap();
            let roots = [PathBuf::from("/a"), PathBuf::from("/b")];
            assert_eq!(cli.roots.model_roots, roots, "{argv:?}");
            let Cmd::Serve(a) = cli.cmd else {
                unreachable!()
            };
            assert_eq!(a.contract.roots.model_roots, roots, "{argv:?}");
        }
    }

    #[test]
    fn bad_values_name_the_flag() {
        let base = ["layerwise", "generate", "--model", "m", "--out", "o.png"];
        for (flag, value, expect) in [
            ("--slots", "many", "expected a number ≥ 2 or `auto`"),
            ("--slots", "2.5", "expected a number ≥ 2 or `auto`"),
            (
                "--host-memory",
                "pinned",
                "expected auto, register, pin or pageable",
            ),
            ("--device", "tpu", "expected cpu, cuda or auto"),
        ] {
            let mut v = base.to_vec();
            v.extend_from_slice(&[flag, value]);
            let e = parse(&v)
                .err()
                .unwrap_or_else(|| panic!("{flag} {value} parsed"));
            assert!(
                e.contains(flag) && e.contains(value) && e.contains(expect),
                "{e}"
            );
        }
        let e = parse(&["layerwise", "serve", "--model", "m", "--slots", "x"])
            .err()
            .unwrap();
        assert!(e.contains("--slots") && e.contains("`auto`"), "{e}");
        let e = parse(&["layerwise", "serve", "--model", "m", "--host-memory", "x"])
            .err()
            .unwrap();
        assert!(e.contains("--host-memory"), "{e}");
    }

    #[test]
    fn only_device_commands_may_use_a_gpu() {
        let yes = |v: &[&str]| may_use_gpu(&args(v));
        assert!(yes(&[
            "layerwise",
            "generate",
            "--model",
            "m",
            "--out",
            "o.png"
        ]));
        assert!(yes(&[
            "layerwise",
            "bench",
            "--model",
            "m",
            "--device",
            "cuda"
        ]));
        assert!(yes(&["layerwise", "serve", "--model", "m"]));
        assert!(!yes(&[
            "layerwise",
            "serve",
            "--model",
            "m",
            "--device",
            "cpu"
        ]));
        assert!(!yes(&["layerwise", "synth", "--out", "d"]));
        assert!(!yes(&["layerwise", "inspect", "d"]));
        assert!(!yes(&["layerwise", "--help"]));
        assert!(!yes(&["layerwise", "generate", "--slots", "x"]));
    }
}
