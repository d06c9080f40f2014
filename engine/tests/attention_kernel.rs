//! The fused CUDA attention kernel's source, checked on the CPU: the test compiles
//! `kernels/attention.cu` with the host C++ compiler through `kernels/emulate.h` (a thread
//! per CUDA thread, a barrier for `__syncthreads`), runs it on seeded cases and compares
//! it with the engine's chunked attention on the CPU. Every shape the kernel handles
//! differently is here: lengths that are not multiples of its tiles, Sq ≠ Sk, head dims
//! from 3 to 128 (not all multiples of 4), Dv ≠ D, several samples and heads, and scores
//! large enough that exp would overflow without the running maximum, growing from tile to
//! tile so every tile rescales what came before.
//!
//! Needs a C++20 compiler (`CXX`, default `c++`); without one the test fails saying so.
#![cfg(feature = "runtime")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use layerwise_engine::components::attention::attention;
use layerwise_engine::execution::weights::seeded_noise;

fn kernels() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/execution/cuda/kernels")
}

/// Builds the host driver (kernel + emulation) into `dir`.
fn build_host(dir: &Path) -> PathBuf {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exe = dir.join("attention_host");
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing"])
        .args(["-Wall", "-Wextra", "-Wno-unknown-pragmas"])
        .arg("-o")
        .arg(&exe)
        .arg(kernels().join("attention_host.cpp"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the C++ compiler `{cxx}` ({e}): this test checks the CUDA attention \
                 kernel on the CPU and needs a C++20 compiler (install one, or set CXX)"
            )
        });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "`{cxx}` could not build the emulated kernel ({}):\n{stderr}",
        out.status
    );
    assert!(
        stderr.trim().is_empty(),
        "the emulated kernel builds with warnings:\n{stderr}"
    );
    exe
}

struct Case {
    name: &'static str,
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    scale: f64,
    /// Queries and keys of at most a few bits (multiples of 1/4), keys growing with their
    /// position, and a power-of-two scale: every score is exact in f32, whatever the order
    /// of its sum, so large scores compare without the rounding of their own inputs.
    exact_growing: bool,
}

const fn case(name: &'static str, dims: [usize; 6], scale: f64, exact_growing: bool) -> Case {
    let [b, h, sq, sk, d, dv] = dims;
    Case {
        name,
        b,
        h,
        sq,
        sk,
        d,
        dv,
        scale,
        exact_growing,
    }
}

fn inputs(c: &Case, seed: u64) -> (Tensor, Tensor, Tensor) {
    let q = seeded_noise(seed, &[c.b, c.h, c.sq, c.d]).unwrap();
    let k = seeded_noise(seed + 1, &[c.b, c.h, c.sk, c.d]).unwrap();
    let v = seeded_noise(seed + 2, &[c.b, c.h, c.sk, c.dv]).unwrap();
    if !c.exact_growing {
        // Scores of a few units: a softmax far from uniform.
        return ((q * 2.0).unwrap(), k, v);
    }
    let quarters = |t: Tensor| ((t * 4.0).unwrap().round().unwrap() / 4.0).unwrap();
    // Keys × 1, 2, 3, ... every 16 positions: each tile's maximum beats the last one's.
    let growth: Vec<f32> = (0..c.sk).map(|j| (1 + j / 16) as f32).collect();
    let growth = Tensor::from_vec(growth, (1, 1, c.sk, 1), &Device::Cpu).unwrap();
    let k = quarters(k).broadcast_mul(&growth).unwrap();
    (quarters(q), k, v)
}

fn to_vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Runs the emulated kernel on one case: its output.
fn run_kernel(exe: &Path, dir: &Path, c: &Case, q: &Tensor, k: &Tensor, v: &Tensor) -> Vec<f32> {
    let mut bytes = Vec::new();
    for n in [c.b * c.h, c.sq, c.sk, c.d, c.dv] {
        bytes.extend_from_slice(&(n as u32).to_le_bytes());
    }
    bytes.extend_from_slice(&(c.scale as f32).to_le_bytes());
    for t in [q, k, v] {
        bytes.extend(to_vec(t).iter().flat_map(|x| x.to_le_bytes()));
    }
    let (input, output) = (
        dir.join(format!("{}.in", c.name)),
        dir.join(format!("{}.out", c.name)),
    );
    std::fs::write(&input, bytes).unwrap();
    let mut child = Command::new(exe)
        .arg(&input)
        .arg(&output)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A __syncthreads that not every thread reaches deadlocks the emulation.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!(
                "{}: the emulated kernel hangs (a barrier not every thread reaches?)",
                c.name
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(
        status.success(),
        "{}: the emulated kernel failed ({status}): {stderr}",
        c.name
    );
    let out = std::fs::read(&output).unwrap();
    assert_eq!(
        out.len(),
        4 * c.b * c.h * c.sq * c.dv,
        "{}: output size",
        c.name
    );
    out.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn fused_kernel_matches_chunked_attention() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let exe = build_host(dir.path());
    eprintln!("built the emulated kernel in {:.1?}", started.elapsed());
    let cases = [
        case("one query, one key", [1, 1, 1, 1, 4, 4], 0.5, false),
        case("d 4, dv 5, ragged", [2, 3, 37, 29, 4, 5], 0.5, false),
        case("d 3, dv 7", [1, 2, 45, 33, 3, 7], 0.6, false),
        case("d 16, dv 12", [1, 2, 70, 100, 16, 12], 0.25, false),
        case(
            "d 12 (wan-tiny)",
            [2, 2, 65, 31, 12, 12],
            1.0 / 12f64.sqrt(),
            false,
        ),
        case("d 64, dv 40", [2, 2, 33, 65, 64, 40], 0.125, false),
        case(
            "d 128",
            [1, 2, 50, 130, 128, 128],
            1.0 / 128f64.sqrt(),
            false,
        ),
        case(
            "d 128, dv 96, one block row",
            [1, 1, 32, 64, 128, 96],
            0.1,
            false,
        ),
        case(
            "d 128, many tiles",
            [2, 2, 130, 300, 128, 128],
            1.0 / 128f64.sqrt(),
            false,
        ),
        case("large scores, d 128", [1, 2, 40, 97, 128, 128], 0.5, true),
        case("growing scores, d 16", [2, 1, 47, 150, 16, 20], 0.125, true),
    ];
    let mut worst = 0f32;
    for (i, c) in cases.iter().enumerate() {
        let (q, k, v) = inputs(c, 100 + 10 * i as u64);
        let t = Instant::now();
        let ours = run_kernel(&exe, dir.path(), c, &q, &k, &v);
        let took = t.elapsed();
        let reference = to_vec(&attention(&q, &k, &v, c.scale).unwrap());
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * c.scale).unwrap();
        let max_score = scores.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let max_score = max_score.to_scalar::<f32>().unwrap();
        let top = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = ours
            .iter()
            .zip(&reference)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // NaN anywhere fails: f32::max ignores NaN, so check it apart.
        assert!(
            ours.iter().all(|x| x.is_finite()),
            "{}: non-finite output",
            c.name
        );
        let rel = diff / top;
        eprintln!(
            "{:<28} B {} H {} Sq {:>3} Sk {:>3} D {:>3} Dv {:>3}  max |score| {:>7.1}  \
             max |diff| / max |ref| {rel:.1e}  ({took:.1?})",
            c.name, c.b, c.h, c.sq, c.sk, c.d, c.dv, max_score
        );
        assert!(rel < 1e-5, "{}: relative error {rel}", c.name);
        if c.name.starts_with("large") {
            // What the case is for: exp of the raw scores would overflow f32.
            assert!(
                max_score > f32::MAX.ln(),
                "{}: max score {max_score}",
                c.name
            );
        }
        worst = worst.max(rel);
    }
    eprintln!("worst {worst:.1e}, all in {:.1?}", started.elapsed());
}
