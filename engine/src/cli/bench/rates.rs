//! This machine's rates, measured, in the form `spec.accelerator.rates` takes: the FLOP/s of
//! a square matmul in the compute dtype, the copy rate from a mapped checkpoint into a
//! block-sized buffer (what a rank's host-to-device copy does on the CPU backend) and the
//! rate between two buffers (what the all-gather does there). `bench` ends with them, and
//! `layerwise rates` prints them alone, or renders figures measured elsewhere
//! (`engine/gpu-check` measures a GPU's with PyTorch) through the same type
//! ([`AcceleratorRates`], the CRD's), so the snippet a user pastes parses as the CRD does.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;

use crate::timing::AcceleratorRates;

/// `layerwise rates`.
#[derive(Args)]
pub(crate) struct RatesArgs {
    /// A pipeline folder whose largest file the copy rates read from (the page cache's
    /// copy of a checkpoint, as a rank's copies read it); without one, a buffer in memory.
    #[arg(long, env = "LAYERWISE_MODEL")]
    pub model: Option<PathBuf>,
    /// The dtype the matmul computes in: `f32` (the CPU backend's), `bf16` or `f16`.
    #[arg(long, env = "LAYERWISE_RATES_DTYPE", default_value = "f32")]
    pub dtype: String,
    /// Dense TFLOP/s measured elsewhere (a GPU's, by `engine/gpu-check`): printed as given
    /// in place of the CPU's matmul.
    #[arg(long, env = "LAYERWISE_RATES_DEVICE_TFLOPS")]
    pub device_tflops: Option<f64>,
    /// Host-to-device GB/s measured elsewhere, printed as given.
    #[arg(long, env = "LAYERWISE_RATES_HOST_TO_DEVICE_GBPS")]
    pub host_to_device_gbps: Option<f64>,
    /// Peer GB/s measured elsewhere, printed as given; `0` where the machine has no peers
    /// (the snippet then leaves the figure out).
    #[arg(long, env = "LAYERWISE_RATES_PEER_GBPS")]
    pub peer_gbps: Option<f64>,
}

/// What one measurement found, in the units the host measured.
pub(crate) struct Measured {
    pub device_flops: f64,
    pub host_to_device: f64,
    pub peer: Option<f64>,
}

/// `layerwise rates`: measures what was not given, prints what was measured and the snippet.
pub(crate) fn rates(a: RatesArgs) -> Result<()> {
    for (flag, v) in [
        ("--device-tflops", a.device_tflops),
        ("--host-to-device-gbps", a.host_to_device_gbps),
    ] {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0) {
                bail!("{flag} {v}: expected a positive number");
            }
        }
    }
    if let Some(p) = a.peer_gbps {
        if !(p.is_finite() && p >= 0.0) {
            bail!("--peer-gbps {p}: expected a positive number, or 0 for no peers");
        }
    }
    let dtype = dtype(&a.dtype)?;
    let device_flops = match a.device_tflops {
        Some(t) => t * 1e12,
        None => matmul_flops(dtype)?,
    };
    let (host_to_device, peer) = match (a.host_to_device_gbps, a.peer_gbps) {
        (Some(h), Some(p)) => (h * 1e9, p * 1e9),
        (h, p) => {
            let (from_file, between) = copy_rates(a.model.as_deref(), 64 << 20)?;
            (
                h.map_or(from_file, |h| h * 1e9),
                p.map_or(between, |p| p * 1e9),
            )
        }
    };
    let m = Measured {
        device_flops,
        host_to_device,
        peer: (peer > 0.0).then_some(peer),
    };
    print!("{}", report(&m, &format!("{dtype:?}").to_lowercase()));
    Ok(())
}

/// What `bench` prints at its end: this machine's CPU backend rates, measured in `dtype`,
/// the copies read from `model`'s checkpoint.
pub(crate) fn print_measured(model: &Path, dtype: DType) -> Result<()> {
    let device_flops = matmul_flops(dtype)?;
    let (host_to_device, peer) = copy_rates(Some(model), 64 << 20)?;
    let m = Measured {
        device_flops,
        host_to_device,
        peer: Some(peer),
    };
    println!();
    print!("{}", report(&m, &format!("{dtype:?}").to_lowercase()));
    Ok(())
}

/// The figures in words, then the snippet.
fn report(m: &Measured, dtype: &str) -> String {
    let snippet = AcceleratorRates::measured(m.device_flops, m.host_to_device, m.peer).snippet();
    format!(
        "measured rates: {:.3} TFLOP/s ({dtype} matmul), {:.2} GB/s host to device, {}\nto time plans with them, set in the DiffusionDeployment:\n{snippet}",
        m.device_flops / 1e12,
        m.host_to_device / 1e9,
        m.peer
            .map_or("no peers".into(), |p| format!("{:.2} GB/s between peers", p / 1e9)),
    )
}

fn dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other:?}: expected f32, bf16 or f16"),
    })
}

/// FLOP/s of a 1024² matmul on the CPU in `dtype` (2n³ FLOPs), the best of five after a
/// warm-up: the ceiling a block's linear layers approach.
pub(crate) fn matmul_flops(dtype: DType) -> Result<f64> {
    const N: usize = 1024;
    let dev = Device::Cpu;
    let a = Tensor::rand(-1f32, 1f32, (N, N), &dev)?.to_dtype(dtype)?;
    let b = Tensor::rand(-1f32, 1f32, (N, N), &dev)?.to_dtype(dtype)?;
    let mut best = f64::INFINITY;
    for i in 0..6 {
        let t = Instant::now();
        let c = a.matmul(&b).context("measuring the matmul rate")?;
        std::hint::black_box(&c);
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (N as f64).powi(3) / best.max(1e-9))
}

/// Bytes/s of copying from the largest file of `model` (mapped; a filled buffer without a
/// model) into a buffer of `block` bytes, and between two buffers: each the best of three
/// passes over at least 256 MiB.
pub(crate) fn copy_rates(model: Option<&Path>, block: usize) -> Result<(f64, f64)> {
    let other = vec![1u8; block.max(1)];
    let mut slot = vec![0u8; block.max(1)];
    let between = copy_rate(&other, &mut slot);
    let Some(dir) = model else {
        return Ok((between, between));
    };
    let largest = largest_file(dir)?;
    let file =
        std::fs::File::open(&largest).with_context(|| format!("reading {}", largest.display()))?;
    // SAFETY: the checkpoint's files are not written while the engine maps them (the
    // engine maps them the same way to run).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("mapping {}", largest.display()))?;
    let len = block.min(map.len()).max(1);
    let from_file = copy_rate(&map[..len.min(map.len())], &mut slot[..len]);
    Ok((from_file, between))
}

/// Bytes/s of copying `src` into `dst` (the same length), the best of three passes over
/// at least 256 MiB.
pub(crate) fn copy_rate(src: &[u8], dst: &mut [u8]) -> f64 {
    let len = src.len().max(1);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let mut moved = 0usize;
        while moved < (256 << 20).max(len) {
            dst.copy_from_slice(src);
            moved += len;
        }
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64() / moved as f64);
    }
    1.0 / best
}

/// The largest file under `dir` (a pipeline folder's largest shard).
fn largest_file(dir: &Path) -> Result<PathBuf> {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let e = e?;
            let meta = e.metadata()?;
            if meta.is_dir() {
                stack.push(e.path());
            } else if best.as_ref().is_none_or(|(b, _)| meta.len() > *b) {
                best = Some((meta.len(), e.path()));
            }
        }
    }
    best.map(|(_, p)| p)
        .with_context(|| format!("{} holds no file to copy from", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::AcceleratorRates;

    /// The snippet the command prints, parsed back through the CRD's type as a
    /// DiffusionDeployment's YAML holds it.
    fn parsed(out: &str) -> AcceleratorRates {
        let yaml = &out[out.find("spec:\n").expect("a snippet")..];
        let v: serde_json::Value = serde_yaml_like(yaml);
        serde_json::from_value(v["spec"]["accelerator"]["rates"].clone()).unwrap()
    }

    /// The snippet's three levels of keys and one of `key: number` lines, read without a
    /// YAML parser (the engine has none): enough to prove the names and numbers are the
    /// type's own. The crds crate parses it with a YAML parser too.
    fn serde_yaml_like(yaml: &str) -> serde_json::Value {
        let mut rates = serde_json::Map::new();
        for line in yaml.lines().skip(3) {
            let (k, v) = line.trim().split_once(": ").unwrap();
            rates.insert(k.into(), serde_json::from_str(v).unwrap());
        }
        serde_json::json!({"spec": {"accelerator": {"rates": rates}}})
    }

    #[test]
    fn the_measured_rates_are_real_and_print_in_the_crd_s_form() {
        let flops = matmul_flops(DType::F32).unwrap();
        // Any CPU this runs on does more than a GFLOP/s and less than a PFLOP/s of f32.
        assert!((1e9..1e15).contains(&flops), "{flops}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("small.bin"), vec![3u8; 1 << 10]).unwrap();
        std::fs::create_dir(dir.path().join("transformer")).unwrap();
        std::fs::write(dir.path().join("transformer/big.bin"), vec![7u8; 4 << 20]).unwrap();
        assert_eq!(
            largest_file(dir.path()).unwrap(),
            dir.path().join("transformer/big.bin")
        );
        let (from_file, between) = copy_rates(Some(dir.path()), 1 << 20).unwrap();
        assert!(from_file > 1e8 && between > 1e8, "{from_file} {between}");
        let m = Measured {
            device_flops: flops,
            host_to_device: from_file,
            peer: Some(between),
        };
        let out = report(&m, "f32");
        let r = parsed(&out);
        let close = |a: f64, b: f64| (a - b).abs() <= 0.006 * b;
        assert!(close(r.device_tflops.unwrap(), flops / 1e12), "{out}");
        assert!(
            close(r.host_to_device_gbps.unwrap(), from_file / 1e9),
            "{out}"
        );
        assert!(close(r.peer_gbps.unwrap(), between / 1e9), "{out}");
    }

    #[test]
    fn bad_figures_and_dtypes_are_refused_by_name() {
        let args = |t: Option<f64>, dtype: &str| RatesArgs {
            model: None,
            dtype: dtype.into(),
            device_tflops: t,
            host_to_device_gbps: Some(10.0),
            peer_gbps: Some(0.0),
        };
        let e = rates(args(Some(-1.0), "f32")).unwrap_err().to_string();
        assert!(e.contains("--device-tflops -1"), "{e}");
        let e = rates(args(Some(1.0), "f8")).unwrap_err().to_string();
        assert!(e.contains("--dtype \"f8\""), "{e}");
        assert!(largest_file(Path::new("/nonexistent/pipeline")).is_err());
    }
}
