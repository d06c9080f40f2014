//! The executable's start on a machine where the CUDA library beside it cannot run: a
//! command that may use a GPU computes on the CPU for `--device auto` and fails for
//! `--device cuda`, both saying why, and the rest never looks for CUDA at all. The CUDA
//! library here is a placeholder named through LAYERWISE_CUDA_LIBRARY: on a machine
//! without a driver the executable stops at the driver; with one, at the placeholder.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn run(library: &Path, args: &[&str]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_layerwise"))
        .env("LAYERWISE_CUDA_LIBRARY", library)
        .env_remove("LAYERWISE_DEVICE")
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    (out, err)
}

fn generate<'a>(model: &'a Path, device: &'a str) -> Vec<&'a str> {
    vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--out",
        "/dev/null",
        "--steps",
        "1",
        "--device",
        device,
    ]
}

#[test]
fn a_cuda_library_that_cannot_run_means_the_cpu_or_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let library = d.path().join("liblayerwise_cuda.so");
    std::fs::write(&library, b"").unwrap();
    // Either there is no driver, or the placeholder does not load.
    let why = |err: &str| err.contains("no NVIDIA driver") || err.contains("cannot run");

    let (out, err) = run(&library, &generate(&m, "auto"));
    assert!(out.status.success(), "{err}");
    assert!(err.contains("no usable GPU") && why(&err), "{err}");

    let (out, err) = run(&library, &generate(&m, "cuda"));
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("invalid device: cuda:") && why(&err), "{err}");

    let (out, err) = run(&library, &generate(&m, "cpu"));
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("GPU") && !err.contains("NVIDIA"), "{err}");
}

#[test]
fn a_named_library_that_is_missing_is_named() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let missing = d.path().join("nowhere/liblayerwise_cuda.so");
    let (out, err) = run(&missing, &generate(&m, "cuda"));
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("LAYERWISE_CUDA_LIBRARY") && err.contains("nowhere"),
        "{err}"
    );
    // Commands that never compute do not look for it.
    let (out, err) = run(&missing, &["inspect", m.to_str().unwrap()]);
    assert!(out.status.success() && err.is_empty(), "{err}");
}
