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
    assert!(
        err.contains("device: --device cuda: no usable GPU") && why(&err),
        "{err}"
    );

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

/// `gpu-check --dry-run` lists every command it would run on a GPU machine and the
/// table's columns, runs nothing, and its commands are ones this executable accepts: the
/// CPU reference runs it lists (and the synths they need) are run here as printed.
#[test]
fn gpu_check_dry_run_prints_commands_this_executable_runs() {
    let work = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_layerwise");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-check");
    let out = Command::new("bash")
        .arg(&script)
        .args(["--dry-run", bin])
        .env("LAYERWISE_GPU_CHECK_DIR", work.path())
        .env("LAYERWISE_GPU_CHECK_STEPS", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("table columns: check model strategy dp K N dtype host_path result vs_cpu"),
        "{text}"
    );
    for col in [
        "copied_MiB_step",
        "gathered_MiB_step",
        "h2d_GBps",
        "h2d_peak_GBps",
        "h2d_of_peak",
        "pinned_GiB",
    ] {
        assert!(text.contains(col), "no column {col} in\n{text}");
    }
    let commands: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("  $ "))
        .collect();
    for want in [
        "--host-memory auto",
        "--host-memory register",
        "--host-memory pin",
        "--host-memory pageable",
        "--dp 2",
        "--strategy offload-sharded",
        "--compute-dtype bf16",
    ] {
        assert!(
            commands.iter().any(|c| c.contains(want)),
            "no `{want}` in\n{text}"
        );
    }
    // The kept-blocks matrix: offload and offload-sharded, each with N = 0, auto and L/2.
    for s in ["offload", "offload-sharded"] {
        for n in ["0", "auto", "14"] {
            let want = format!("--strategy {s} ");
            let kept = format!("--resident-blocks {n} --device-memory-mib ");
            assert!(
                commands
                    .iter()
                    .any(|c| c.contains(&want) && c.contains(&kept)),
                "no {s} with N = {n} in\n{text}"
            );
        }
    }
    // Nothing ran: the work folder holds no model and no run.
    assert!(!work.path().join("tiny-f32").exists());
    // The synths and CPU runs, as printed, succeed here (Wan's is the slow one: skipped).
    let mut ran = 0;
    for c in &commands {
        let cpu = c.contains("--device cpu") && !c.contains("wan");
        let synth = c.contains(" synth ") && c.contains("tiny") && !c.contains("wan");
        if !(cpu || synth) {
            continue;
        }
        std::fs::create_dir_all(work.path().join("runs")).unwrap();
        let o = Command::new("bash").arg("-c").arg(c).output().unwrap();
        assert!(
            o.status.success(),
            "{c}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        ran += 1;
    }
    assert_eq!(ran, 4, "two synths and two CPU references");
    assert!(work.path().join("runs/cpu-bf16.safetensors").is_file());
}
