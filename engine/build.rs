//! Compiles the engine's CUDA kernels (src/execution/cuda/kernels/*.cu) to PTX, which the
//! `cuda` feature embeds and loads through candle. Builds without the feature need no CUDA
//! toolkit, and this script does nothing for them.
//!
//! nvcc comes from `NVCC`, else `bin/nvcc` under `CUDA_ROOT`, `CUDA_PATH` or `CUDA_HOME`,
//! else the `PATH` (engine/cuda-check installs a toolkit and sets `NVCC` and `CUDA_ROOT`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernels, by file stem: `kernels/<stem>.cu` becomes `$OUT_DIR/<stem>.ptx`.
const KERNELS: [&str; 1] = ["attention"];

/// A virtual architecture, so the PTX is compiled for the GPU at hand by the driver when
/// the module loads (once per process): one file runs on every compute capability the CUDA
/// build supports, A100 (8.0), L4 and L40S (8.9), H100 and H200 (9.0), B200 (10.0) and
/// whatever comes after, where a cubin would run on one capability only. The kernels use
/// nothing newer than 8.0.
const ARCH: &str = "compute_80";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in [
        "NVCC",
        "CUDA_ROOT",
        "CUDA_PATH",
        "CUDA_HOME",
        "NVCC_PREPEND_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let nvcc = nvcc();
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dir = Path::new("src/execution/cuda/kernels");
    for stem in KERNELS {
        let src = dir.join(format!("{stem}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{stem}.ptx"));
        let run = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("--gpu-architecture={ARCH}"))
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        if !run.status.success() {
            panic!(
                "{} failed on {} ({}):\n{}{}",
                nvcc.display(),
                src.display(),
                run.status,
                String::from_utf8_lossy(&run.stdout),
                String::from_utf8_lossy(&run.stderr)
            );
        }
    }
}

/// The nvcc to run, or a panic that says where it was looked for.
fn nvcc() -> PathBuf {
    if let Some(path) = env::var_os("NVCC") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            panic!(
                "the `cuda` feature compiles CUDA kernels: NVCC={} is not a file",
                path.display()
            );
        }
        return path;
    }
    let mut tried = vec!["NVCC (unset)".to_string()];
    for var in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"] {
        match env::var_os(var) {
            Some(root) => {
                let path = Path::new(&root).join("bin/nvcc");
                if path.is_file() {
                    return path;
                }
                tried.push(format!("{var}: no {}", path.display()));
            }
            None => tried.push(format!("{var} (unset)")),
        }
    }
    let on_path = env::var_os("PATH")
        .iter()
        .flat_map(env::split_paths)
        .map(|dir| dir.join("nvcc"))
        .find(|p| p.is_file());
    if let Some(path) = on_path {
        return path;
    }
    tried.push("no nvcc on PATH".into());
    panic!(
        "the `cuda` feature compiles CUDA kernels with nvcc, which was not found ({}); \
         set NVCC to nvcc or CUDA_ROOT to a CUDA toolkit (engine/cuda-check installs one)",
        tried.join(", ")
    );
}
