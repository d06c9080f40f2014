//! `layerwise bench` as a person runs it: one row per strategy and number of blocks kept
//! on the device, `resident` once as the reference, bytes moved per step cut by N/L, and
//! the values it cannot honour refused before anything runs.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn bench(model: &Path, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_layerwise"))
        .arg("bench")
        .arg("--model")
        .arg(model)
        .args(["--device", "cpu", "--steps", "2", "--rounds", "1"])
        .args(args)
        .env_remove("LAYERWISE_RESIDENT_BLOCKS")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    out
}

fn json(model: &Path, args: &[&str]) -> Vec<Value> {
    let mut all = args.to_vec();
    all.push("--json");
    let out = bench(model, &all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["rows"].as_array().unwrap().clone()
}

fn row<'a>(rows: &'a [Value], strategy: &str, asked: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["strategy"] == strategy && r["resident_blocks_asked"] == asked)
        .unwrap_or_else(|| panic!("no row {strategy} N={asked} in {rows:#?}"))
}

fn per_step(r: &Value, key: &str) -> u64 {
    r[key].as_u64().unwrap()
}

#[test]
fn one_row_per_strategy_and_kept_blocks_with_copies_cut_by_n_over_l() {
    let dir = tempfile::tempdir().unwrap();
    let layers = 6u64;
    let model = common::tiny(dir.path(), layers as usize);

    // dp = 1: resident once, offload for N = 0 and N = L/2 = 3.
    let rows = json(
        &model,
        &[
            "--strategies",
            "resident,offload",
            "--resident-blocks",
            "0,L/2",
        ],
    );
    assert_eq!(rows.len(), 3, "{rows:#?}");
    let reference = row(&rows, "resident", "-");
    assert_eq!(reference["vs_resident"], 1.0);
    assert_eq!(reference["vs_resident_paired"], 1.0);
    assert_eq!(per_step(reference, "bytes_copied_per_step"), 0);
    let none = row(&rows, "offload", "0");
    let half = row(&rows, "offload", "L/2");
    assert_eq!(
        (
            none["resident_blocks"].as_u64(),
            half["resident_blocks"].as_u64()
        ),
        (Some(0), Some(3))
    );
    let (c0, c3) = (
        per_step(none, "bytes_copied_per_step"),
        per_step(half, "bytes_copied_per_step"),
    );
    // Every block streamed once per step with none kept; L − N of them with N kept.
    assert_eq!(
        c0,
        layers * none["largest_padded_block_bytes"].as_u64().unwrap()
    );
    assert_eq!(c3 * layers, c0 * (layers - 3), "{c0} → {c3}");
    for r in &rows {
        assert_eq!(r["identical"], true, "{r:#}");
        assert_eq!(per_step(r, "bytes_gathered_per_step"), 0);
        assert!(r["step_seconds"].as_f64().unwrap() > 0.0);
    }
    // Kept blocks are device bytes: N = 3 holds three blocks more than N = 0.
    let kept = |r: &Value| r["peak_device_bytes_by_kind"]["resident_blocks"].as_u64();
    assert_eq!(kept(none), None);
    assert_eq!(kept(half), Some(3 * c0 / layers));

    // dp = 2, offload-sharded: each rank copies its half and gathers the other, both cut
    // by N/L; `auto` keeps what the device memory holds after K = 2 slots.
    let two = json(
        &model,
        &[
            "--strategies",
            "resident,offload-sharded",
            "--resident-blocks",
            "0,2,auto",
            "--dp",
            "2",
            "-n",
            "2",
            "--device-memory-mib",
            "64",
        ],
    );
    assert_eq!(two.len(), 4, "{two:#?}");
    let none = row(&two, "offload-sharded", "0");
    let two_kept = row(&two, "offload-sharded", "2");
    let auto = row(&two, "offload-sharded", "auto");
    let (c0, g0) = (
        per_step(none, "bytes_copied_per_step"),
        per_step(none, "bytes_gathered_per_step"),
    );
    assert!(c0 > 0 && g0 > 0, "{none:#}");
    assert_eq!(per_step(two_kept, "bytes_copied_per_step") * layers, c0 * 4);
    assert_eq!(
        per_step(two_kept, "bytes_gathered_per_step") * layers,
        g0 * 4
    );
    // 64 MiB holds every block but one: auto keeps L − 1, one block streams.
    assert_eq!(auto["resident_blocks"].as_u64(), Some(layers - 1));
    assert_eq!(per_step(auto, "bytes_copied_per_step") * layers, c0);
    assert!(two.iter().all(|r| r["identical"] == true), "{two:#?}");

    // The table: a header with the gathered column at dp = 2, one line per row, and what
    // auto resolved to beside it.
    let out = bench(
        &model,
        &[
            "--strategies",
            "resident,offload-sharded",
            "--resident-blocks",
            "0,auto",
            "--dp",
            "2",
            "-n",
            "2",
            "--device-memory-mib",
            "64",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    // The table (a title, the header, a row a configuration), each configuration's memory
    // by phase (measured beside reserved), then the measured rates after a blank line.
    let (lines, memory): (Vec<&str>, Vec<&str>) = text
        .lines()
        .take_while(|l| !l.is_empty())
        .partition(|l| !l.starts_with("memory by phase"));
    assert_eq!(lines.len(), 5, "{text}");
    assert_eq!(memory.len(), 3, "{text}");
    for (m, row) in memory.iter().zip([
        "resident N=-",
        "offload-sharded N=0",
        "offload-sharded N=auto",
    ]) {
        assert!(
            m.contains(row) && m.contains("measured") && m.contains("reserved"),
            "{text}"
        );
    }
    assert!(text.contains("measured rates:"), "{text}");
    for col in [
        "strategy",
        "N",
        "vs resident",
        "paired med",
        "copied/step",
        "gathered/step",
        "stall",
        "peak device",
        "pinned host",
        "host",
    ] {
        assert!(lines[1].contains(col), "no column {col}: {text}");
    }
    let words = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
    assert_eq!(words(lines[2])[..2], ["resident", "-"]);
    assert_eq!(words(lines[3])[..2], ["offload-sharded", "0"]);
    assert_eq!(words(lines[4])[..2], ["offload-sharded", "auto=5"]);
    assert!(lines[2..].iter().all(|l| l.ends_with("yes")), "{text}");
}

#[test]
fn kept_blocks_it_cannot_honour_are_refused_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 4);
    for (value, expect) in [
        ("4", "would stream nothing"),
        ("L/1", "would stream nothing"),
        ("L/0", "L/k with k ≥ 1"),
        ("half", "expected a number of blocks, `auto`, L/k"),
    ] {
        let out = bench(
            &model,
            &["--strategies", "offload", "--resident-blocks", value],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value} ran");
        assert!(
            err.contains(expect) && err.contains(value),
            "{value}: {err}"
        );
        assert!(!err.contains("round 0"), "{value} ran a round: {err}");
    }
    // auto without a device budget: the engine's own error, naming the flag it needs.
    let out = bench(
        &model,
        &["--strategies", "offload", "--resident-blocks", "auto"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--device-memory-mib"),
        "{err}"
    );
}
