//! What the `layerwise` subcommands do, past parsing.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use safetensors::Dtype;

use super::args::{GenerateArgs, RequestArgs};
use crate::checkpoint::header::{encode_header, Header};
use crate::checkpoint::RequestShape;
use crate::engine::{Model, RunStats};
use crate::execution::trace::Trace;
use crate::execution::work::Output;
use crate::execution::work::{Condition, Request, DEFAULT_MAX_SEQUENCE_LENGTH};
use crate::media::image::write_png;
use crate::media::video::{self, Clip, VideoFormat};
use crate::tools::loadgen::LoadgenArgs;
use crate::tools::soak::SoakArgs;
use crate::tools::trace_svg as svg;

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

impl RequestArgs {
    pub(super) fn requests(&self, model: &Model, init: Option<Tensor>) -> Result<Vec<Request>> {
        let (width, height) = self
            .size
            .as_deref()
            .map(parse_size)
            .transpose()?
            .unwrap_or(model.family.native_size());
        let (steps, guidance) = model.family.defaults();
        (0..self.n)
            .map(|i| {
                let condition = match &self.prompt {
                    Some(p) => Condition::Prompt {
                        prompt: p.clone(),
                        negative: self.negative_prompt.clone(),
                    },
                    None => Condition::Class(self.class_label.unwrap_or(207)),
                };
                Ok(Request {
                    seed: self.seed + i as u64,
                    steps: self.steps.unwrap_or(steps),
                    guidance: self.guidance.unwrap_or(guidance),
                    guidance_2: self.guidance_2,
                    frames: self.frames,
                    max_sequence_length: self.max_sequence_length,
                    init_latents: init.as_ref().map(|t| t.narrow(0, i, 1)).transpose()?,
                    cache: self.cache.clone(),
                    ..Request::image(condition, width, height)
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

/// Writes f32 tensors as one safetensors file.
fn write_tensors(path: &Path, tensors: &[(&str, Tensor)]) -> Result<()> {
    let specs: Vec<(String, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), Dtype::F32, t.dims().to_vec()))
        .collect();
    let (mut out, _) = encode_header(&specs)?;
    for (_, t) in tensors {
        for v in t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?
        {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// The `--save-latents` file: final latents, and what a text family adds (the text
/// embeddings the outputs were conditioned on, the decoded frames in [0, 1]).
fn save_outputs(path: &Path, outputs: &[Output]) -> Result<()> {
    let cat = |f: &dyn Fn(&Output) -> Option<Tensor>| -> Result<Option<Tensor>> {
        let v: Option<Vec<Tensor>> = outputs.iter().map(f).collect();
        Ok(match v {
            Some(v) if !v.is_empty() => Some(Tensor::cat(&v, 0)?),
            _ => None,
        })
    };
    let mut tensors = vec![(
        "latents",
        cat(&|o| Some(o.latents.clone()))?.context("no outputs")?,
    )];
    let prompt = cat(&|o| {
        o.text_embeddings
            .as_ref()
            .and_then(|t| t.narrow(0, 0, 1).ok())
    })?;
    let negative = cat(&|o| {
        let t = o.text_embeddings.as_ref()?;
        (t.dim(0).ok()? > 1)
            .then(|| t.narrow(0, 1, 1).ok())
            .flatten()
    })?;
    tensors.extend(prompt.map(|t| ("prompt_embeds", t)));
    tensors.extend(negative.map(|t| ("negative_prompt_embeds", t)));
    let frames = outputs
        .iter()
        .map(|o| {
            let Some(img) = &o.image else { return Ok(None) };
            // [3, H, W] or [F, 3, H, W] in [-1, 1] → [F, H, W, 3] in [0, 1].
            let v = if img.rank() == 3 {
                img.unsqueeze(0)?
            } else {
                img.clone()
            };
            Ok(Some(
                ((v.permute((0, 2, 3, 1))? + 1.0)? / 2.0)?.clamp(0f32, 1f32)?,
            ))
        })
        .collect::<Result<Option<Vec<Tensor>>>>()?;
    if let Some(f) = frames.filter(|f| !f.is_empty()) {
        let t = if f.len() == 1 {
            f[0].clone()
        } else {
            Tensor::stack(&f, 0)?
        };
        tensors.push(("frames", t));
    }
    write_tensors(path, &tensors)
}

/// Writes one output ([3, H, W] or [F, 3, H, W] in [-1, 1]) by the extension: PNG (an
/// image, or a clip's first frame), or a video of its frames.
fn write_output(path: &Path, image: &Tensor, fps: f64) -> Result<()> {
    let image = if image.rank() == 3 {
        image.unsqueeze(0)?
    } else {
        image.clone()
    };
    let frames = image.dim(0)?;
    if VideoFormat::from_path(path).is_none() {
        write_png(path, &image.get(0)?)?;
        if frames > 1 {
            println!("(a clip of {frames} frames: {} holds its first frame; write .mp4, .gif or .webp for all)", path.display());
        }
        return Ok(());
    }
    let (_, _, h, w) = image.dims4()?;
    let rgb = video::rgb8(&image)?;
    let clip = Clip {
        width: w,
        height: h,
        fps,
        frames: rgb.iter().map(Vec::as_slice).collect(),
    };
    Ok(video::write(path, &clip)?)
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

pub(super) fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

pub(super) fn inspect(dir: &Path, json: bool) -> Result<()> {
    let t = std::time::Instant::now();
    // Opened as `serve` opens it: the family's runtime loads and checks the tokenizer, the
    // chat template and the scheduler beside the headers, so a folder `inspect` passes is
    // one `serve` starts on (weights are mapped, not read).
    let model = crate::engine::Model::open(dir)?;
    let p = model.checkpoint.profile()?;
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
    for c in &p.components {
        if c.blocks > 0 {
            println!(
                "{:<16} {} in {} streamed blocks (largest {} bytes)",
                c.name,
                gib(c.bytes),
                c.blocks,
                c.largest_block_bytes
            );
        } else {
            println!("{:<16} {} (not streamed)", c.name, gib(c.bytes));
        }
    }
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
    if let (Some(w), Some(h)) = (p.limits.max_width, p.limits.max_height) {
        let frames = p
            .limits
            .max_frames
            .map_or(String::new(), |f| format!(", {f} frames"));
        println!("largest request  {w}x{h}{frames} ({})", p.limits.reason);
    }
    // A text family's prompt at the default padded length (the formula's text terms are
    // zero for one that reads none).
    let a = &p.activation;
    let text_tokens = if a.bytes_per_text_token > 0 || a.encoder_bytes_per_token > 0 {
        DEFAULT_MAX_SEQUENCE_LENGTH as u64
    } else {
        0
    };
    println!(
        "activations      {} at native size with guidance{}",
        gib(p.activation.bytes(&RequestShape {
            width: p.native_width,
            height: p.native_height,
            frames: 1,
            batch: 1,
            guidance: true,
            text_tokens,
            cache: Default::default(),
        })),
        if text_tokens > 0 {
            format!(" and a {text_tokens}-token prompt")
        } else {
            String::new()
        }
    );
    println!(
        "checked in       {:.1} ms (headers, configs, tokenizer, template, scheduler)",
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

pub(super) fn generate(a: GenerateArgs) -> Result<()> {
    let strategy = a.strategy;
    // Before any compute: an output the run could not write (no extension: PNG).
    let ext = a
        .out
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if !matches!(ext.as_deref(), None | Some("png")) && VideoFormat::from_path(&a.out).is_none() {
        bail!(
            "--out {}: write .png (an image or a clip's first frame), .mp4, .gif or .webp",
            a.out.display()
        );
    }
    let model = Model::open(&a.engine.run.model)?;
    let init = a
        .init_latents
        .as_deref()
        .map(|p| read_latents(p, a.request.n))
        .transpose()?;
    let mut requests = a.request.requests(&model, init)?;
    let fps = a
        .fps
        .unwrap_or_else(|| model.family.video().map_or(16.0, |v| v.default_fps));
    let fps = crate::bounds::check_fps("fps", fps)?;
    for r in &mut requests {
        r.fps = Some(fps);
    }
    let mut opts = a.engine.options(strategy, a.kept.resident_blocks);
    opts.resident_blocks_by_component = a.kept.resident_blocks_by_component.0.clone();
    opts.activations = model.reserved_activations(&requests, &opts)?;
    opts.trace = a.trace.as_ref().map(|_| Trace::new(4_000_000));
    let (outputs, stats) = model.run(requests, &opts)?;
    if let (Some(t), Some(p)) = (&opts.trace, &a.trace) {
        t.write(p)?;
        println!("wrote trace {} ({} spans)", p.display(), t.len());
    }
    for (i, o) in outputs.iter().enumerate() {
        let path = numbered(&a.out, i, outputs.len());
        write_output(
            &path,
            o.image.as_ref().context("output was not decoded")?,
            fps,
        )?;
        println!("wrote {}", path.display());
    }
    if let Some(p) = &a.save_latents {
        save_outputs(p, &outputs)?;
    }
    if let Some(p) = &a.stats {
        std::fs::write(p, serde_json::to_string_pretty(&stats)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    print_stats(&stats);
    for (i, r) in outputs
        .iter()
        .enumerate()
        .filter_map(|(i, o)| Some((i, o.cache.as_ref()?)))
    {
        println!("output {i}: {}", r.summary());
    }
    Ok(())
}

fn print_stats(s: &RunStats) {
    println!(
        "{} dp={} sp={} K={}: {:.2}s wall, {:.3}s/step, stall {:.1}% ({:.1}% across group switches), copied {}, gathered {}, peak device {}, pinned host {} per rank, peak anon RSS {} (checkpoint {})",
        s.strategy,
        s.dp,
        s.sp,
        s.slots,
        s.wall_seconds,
        s.step_seconds,
        100.0 * s.stall_fraction,
        100.0 * s.switch_stall_fraction,
        gib(s.bytes_copied),
        gib(s.bytes_gathered),
        gib(s.peak_device_bytes),
        gib(s.peak_pinned_host_bytes),
        gib(s.peak_anon_rss_bytes),
        gib(s.checkpoint_bytes),
    );
    println!("memory by phase: {}", phases_line(s));
}

/// Each phase's measured peak beside what the memory model reserves for it
/// (`text_encoder 1.2 MiB measured / 1.3 MiB reserved (1.08x)`), as `--stats` and `bench`
/// print them.
pub(super) fn phases_line(s: &RunStats) -> String {
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    s.phase_table()
        .into_iter()
        .map(|(k, measured, reserved)| match measured {
            Some(m) => format!(
                "{} {} measured / {} reserved ({:.2}x)",
                k.name(),
                mib(m),
                mib(reserved),
                reserved as f64 / m.max(1) as f64
            ),
            None => format!("{} not measured / {} reserved", k.name(), mib(reserved)),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn trace_svg(trace: &Path, out: Option<PathBuf>) -> Result<()> {
    let json =
        std::fs::read_to_string(trace).with_context(|| format!("reading {}", trace.display()))?;
    let out = out.unwrap_or_else(|| trace.with_extension("svg"));
    std::fs::write(&out, svg::render(&json)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

pub(super) fn soak(a: &SoakArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(crate::tools::soak::run(a))?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "soak: seconds={:.0} requests={} accepted={} succeeded={} cancelled={} refused={} invalid_refused={} failed_after_accept={} server_errors={}",
        r.seconds, r.requests, r.accepted, r.succeeded, r.cancelled, r.refused, r.invalid_refused, r.failed_after_accept, r.server_errors
    );
    println!(
        "soak: rss_mib before={:.1} peak={:.1} after={:.1}; open_fds before={} peak={} after={}",
        mib(r.before.rss_bytes),
        mib(r.peak.rss_bytes),
        mib(r.after.rss_bytes),
        r.before.open_fds,
        r.peak.open_fds,
        r.after.open_fds
    );
    for f in &r.failures {
        println!("soak: failure: {f}");
    }
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

pub(super) fn loadgen(a: &LoadgenArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(crate::tools::loadgen::run(a))?;
    println!(
        "{} requests ({} ok, statuses {:?}) in {:.2}s: {:.3} outputs/s; latency p50 {:.3}s p90 {:.3}s p99 {:.3}s max {:.3}s",
        r.requests, r.ok, r.status_counts, r.wall_seconds, r.outputs_per_second, r.latency_p50, r.latency_p90, r.latency_p99, r.latency_max
    );
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
