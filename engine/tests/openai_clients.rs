//! OpenAI's official Python client (`openai` from PyPI, in a venv `engine/clients/venv`
//! makes) against two real `layerwise serve` processes, called as a new user would: images
//! from a class-conditional DiT server, a text-to-video Wan server and a text-to-image
//! Qwen-Image server, and the video calls (create, poll, download, list, delete) on the Wan
//! server. The MP4 it downloads is then
//! read by `ffprobe`.

mod common;

use std::path::Path;
use std::process::Command;

use common::process::spawn;

fn python() -> String {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/venv");
    let out = Command::new(&venv)
        .output()
        .expect("engine/clients/venv runs");
    assert!(
        out.status.success(),
        "engine/clients/venv could not make the client's venv (it installs `openai` from the package index):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .last()
        .expect("venv printed its python")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let dit_model = common::tiny(dir.path(), 2);
    let wan_model = common::wan_tiny(dir.path(), 2, 2);
    let bounds = [
        "--max-width",
        "64",
        "--max-height",
        "64",
        "--max-frames",
        "17",
    ];
    let common_args = ["--dp", "2", "--slots", "2", "--max-steps", "50"];
    let dit = spawn(
        &dit_model,
        &[
            &common_args[..],
            &bounds[..],
            &["--served-model-name", "dit-tiny"],
        ]
        .concat(),
    );
    let wan = spawn(&wan_model, &[&common_args[..], &bounds[..]].concat());
    let qwen_model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen-image-tiny");
    // An image family: one frame is all its position tables and VAE make.
    let qwen = spawn(
        &qwen_model,
        &[&common_args[..], &bounds[..4], &["--max-frames", "1"]].concat(),
    );
    dit.wait_ready().await;
    wan.wait_ready().await;
    qwen.wait_ready().await;

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/openai_check.py");
    let out_dir = dir.path().join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let py = python();
    let wan_name = wan_model.file_name().unwrap().to_str().unwrap().to_string();
    let out = tokio::task::spawn_blocking({
        let (dit_url, wan_url, qwen_url) = (dit.url(), wan.url(), qwen.url());
        let out_dir = out_dir.clone();
        move || {
            Command::new(py)
                .arg(script)
                .args([&dit_url, "dit-tiny", &wan_url, &wan_name])
                .args([&qwen_url, "qwen-image-tiny"])
                .arg(out_dir)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the openai client failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap()).unwrap();
    // seconds "1" at 8 fps: 8 frames, rounded up to Wan's 1 + 4k.
    assert_eq!(summary["frames"], 9, "{summary}");
    assert_eq!(common::ffprobe(&out_dir.join("video.mp4")), "h264,48,32,9");
}
