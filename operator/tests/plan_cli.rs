//! `layerwise-operator plan` crossed with the operator: the built binary, run on the sparse
//! presets the operator's tests plan (`synth --preset ... --sparse`: published shapes,
//! headers only) with the documented DiffusionDeployments (docs/operations.md,
//! `crds/examples/`) and node shapes, prints the plan the operator records for the same
//! inputs: the planner called as the reconcile calls it ([`planner::plan_deployment`] on
//! the node as its agent reports it), and as the operator's plan tests call it
//! ([`planner::plan`] with the spec's overrides and allowances). Each plan also fits the
//! engine's own accounting of the run it starts, refusals carry the condition's reason and
//! message and exit 3, and bad input is refused naming what is wrong. docs/operations.md's
//! worked example is the command's output.

#[allow(dead_code)]
mod published;

use std::path::{Path, PathBuf};
use std::process::Command;

use crds::{DiffusionDeployment, Plan, Profile, Strategy, StrategyChoice};
use layerwise_engine::engine::Model;
use layerwise_operator::planner::{
    self, Candidate, Limits, NodeReport, NodeShape, Overrides, Recorded, Refusal, Shortage,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn doc() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"))
        .unwrap()
}

/// A node as a user describes it to the command, and as its agent reports it.
struct Node {
    flags: Vec<String>,
    report: NodeReport,
}

/// A node of `devices` × `product` with `device_mib` each, `host_gib` of host memory and a
/// fast peer link or none; its flags name the link only where `say_link` (else the
/// command takes the product's default, which must agree).
fn node(
    name: &str,
    product: &str,
    device_mib: u64,
    host_gib: u64,
    link: bool,
    say_link: bool,
) -> Node {
    let mut flags = vec![
        format!("--node-name={name}"),
        format!("--gpu={product}"),
        "--gpus=8".into(),
        format!("--device-memory={device_mib}Mi"),
        format!("--host-memory={host_gib}GiB"),
    ];
    if say_link {
        flags.push(format!("--link={}", if link { "nvlink" } else { "none" }));
    }
    Node {
        flags,
        report: NodeReport {
            name: name.into(),
            devices: 8,
            device_bytes: device_mib * MIB,
            product: product.into(),
            fast_peer_link: link,
            host_bytes: host_gib * GIB,
            warm: true,
        },
    }
}

/// The node shapes the operator's plan tests use (NVML's totals, as the agents report them).
fn a100() -> Node {
    node(
        "a100-80gb",
        "NVIDIA A100-SXM4-80GB",
        81_920,
        1000,
        true,
        false,
    )
}
fn l4() -> Node {
    node("l4-24gb", "NVIDIA L4", 23_034, 384, false, false)
}
fn h100() -> Node {
    node(
        "h100-80gb",
        "NVIDIA H100 80GB HBM3",
        81_559,
        1000,
        true,
        false,
    )
}
fn l40s() -> Node {
    node("l40s-48gb", "NVIDIA L40S", 46_068, 512, false, false)
}
fn g64() -> Node {
    node("accel-64gb", "accelerator", 65_536, 1536, true, true)
}

/// What the operator records for `dd` on `node`: the planner as the reconcile calls it,
/// checked equal to the planner as the operator's plan tests call it.
fn operator_plan(
    profile: &Profile,
    dd: &DiffusionDeployment,
    node: &Node,
) -> Result<Recorded, Refusal> {
    let spec = &dd.spec;
    let shape = NodeShape::for_spec(node.report.clone(), spec);
    let candidates = [Candidate {
        node: shape.clone(),
        profile,
    }];
    let recorded =
        planner::plan_deployment(spec, &candidates, &Overrides::of(spec), &Limits::default());
    let tests = planner::plan(
        profile,
        &[shape],
        &spec.workload,
        &Overrides::of(spec),
        &Limits::default().for_spec(spec),
    );
    assert_eq!(recorded.clone().map(|r| r.plan), tests);
    recorded
}

/// Runs `layerwise-operator plan` with `args`: its exit code, stdout and stderr.
fn run(args: &[String]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_layerwise-operator"))
        .arg("plan")
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The command's arguments for `model`, a deployment file (or none), `node` and `extra`
/// (each `--flag=value` of `extra` in place of `node`'s).
fn args(model: &Path, deployment: Option<&Path>, node: &Node, extra: &[&str]) -> Vec<String> {
    let mut a = vec![format!("--model={}", model.display())];
    if let Some(f) = deployment {
        a.push(format!("--deployment={}", f.display()));
    }
    let name = |f: &str| f.split('=').next().unwrap_or_default().to_string();
    let replaced: Vec<String> = extra.iter().map(|e| name(e)).collect();
    a.extend(
        node.flags
            .iter()
            .filter(|f| !replaced.contains(&name(f)))
            .cloned(),
    );
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Runs the command with `--json` and checks its record against the operator's plan of
/// `dd` on `node` (and, for a plan, against the engine's accounting of `model`'s run).
/// Returns the plan, or the refusal.
fn crossed(
    model: &Model,
    folder: &Path,
    profile: &Profile,
    file: Option<&Path>,
    extra: &[&str],
    dd: &DiffusionDeployment,
    node: &Node,
) -> Result<Plan, Refusal> {
    let (code, stdout, stderr) = run(&args(folder, file, node, &[extra, &["--json"]].concat()));
    let record: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    let expected = operator_plan(profile, dd, node);
    let label = format!("{} {extra:?} on {}", dd.spec.model.family, node.report.name);
    assert_eq!(
        record["workload"],
        serde_json::to_value(&dd.spec.workload).unwrap(),
        "{label}"
    );
    assert_eq!(
        record["node"]["deviceBytes"], node.report.device_bytes,
        "{label}"
    );
    assert_eq!(
        record["node"]["fastPeerLink"], node.report.fast_peer_link,
        "{label}"
    );
    match expected {
        Ok(r) => {
            assert_eq!(code, 0, "{label}: {stderr}");
            let plan: Plan = serde_json::from_value(record["plan"].clone()).unwrap();
            assert_eq!(plan, r.plan, "{label}");
            assert_eq!(
                record["plan"],
                serde_json::to_value(&r.plan).unwrap(),
                "{label}"
            );
            // The figure itself, to the last digits a JSON number carries.
            let printed = record["predictedStepSeconds"].as_f64().unwrap();
            assert!(
                (printed - r.step_seconds).abs() <= 1e-12 * r.step_seconds,
                "{label}: printed {printed}, planned {}",
                r.step_seconds
            );
            assert!(
                r.step_seconds > 0.0 && r.step_seconds < plan.predicted_latency_seconds.unwrap()
            );
            // What a node serves: its accelerators over the pod's, or its host memory.
            let pods = record["podsPerNode"].as_u64().unwrap();
            let by_devices = u64::from(node.report.devices / plan.devices());
            let by_host =
                (node.report.host_bytes - plan.host_bytes_per_node) / plan.host_bytes_per_pod;
            assert_eq!(pods, by_devices.min(by_host), "{label}");
            let per_hour = record["outputsPerHourPerNode"].as_f64().unwrap();
            let want =
                pods as f64 * f64::from(plan.dp) * dd.spec.workload.max_batch as f64 * 3600.0
                    / plan.predicted_latency_seconds.unwrap();
            assert!(
                (per_hour - want).abs() < 1e-9 * want,
                "{label}: {per_hour} vs {want}"
            );
            let shape = NodeShape::for_spec(node.report.clone(), &dd.spec);
            published::engine_fits(model, dd, &shape, &plan);
            println!(
                "{label}: {} dp {} sp {} K {}",
                plan.strategy.as_str(),
                plan.dp,
                plan.sp,
                plan.slots
            );
            Ok(plan)
        }
        Err(refusal) => {
            assert_eq!(
                code,
                layerwise_operator::plan_cli::REFUSED,
                "{label}: {stdout}"
            );
            let r = &record["refusal"];
            assert_eq!(r["reason"], refusal.shortage.reason(), "{label}");
            assert_eq!(
                r["message"],
                refusal.for_workload(&dd.spec.workload),
                "{label}"
            );
            assert_eq!(r["needed"], refusal.needed, "{label}");
            assert!(record.get("plan").is_none());
            Err(refusal)
        }
    }
}

/// `preset` written sparse under `dir`: the folder, the engine's model of it, its profile.
fn preset(dir: &Path, preset: &str) -> (PathBuf, Model, Profile) {
    let (out, profile) = published::published(dir, preset);
    let model = Model::open(&out).unwrap();
    (out, model, profile)
}

/// `dd`'s YAML written to a file under `dir`, as a user hands it to the command.
fn file(dir: &Path, name: &str, yaml: &str) -> PathBuf {
    let f = dir.join(name);
    std::fs::write(&f, yaml).unwrap();
    f
}

#[test]
fn the_wan_examples_plan_as_the_operator_records_them() {
    let doc = doc();
    let dir = tempfile::tempdir().unwrap();
    let (folder, model, profile) = preset(dir.path(), "wan2.2-a14b");
    let yaml = published::yaml_block(&doc, "family: wan\n");
    let f = file(dir.path(), "wan22.yaml", yaml);
    let dd: DiffusionDeployment = serde_saphyr::from_str(yaml).unwrap();
    let x = |file, extra: &[&str], dd: &DiffusionDeployment, node: &Node| {
        crossed(&model, &folder, &profile, file, extra, dd, node)
    };
    // The doc's table: sharded on the A100 node; on L4s a request split over 4 of them,
    // two such groups sharding the blocks.
    let p = x(Some(&f), &[], &dd, &a100()).unwrap();
    assert_eq!((p.strategy, p.dp, p.sp), (Strategy::Sharded, 2, 1));
    let p = x(Some(&f), &[], &dd, &l4()).unwrap();
    assert_eq!((p.strategy, p.dp, p.sp), (Strategy::Sharded, 2, 4));
    // The command's worked examples: 8 × H100 and 8 × L40S.
    x(Some(&f), &[], &dd, &h100()).unwrap();
    x(Some(&f), &[], &dd, &l40s()).unwrap();
    // 480p, by flags over the file; and with the strategy fixed.
    let mut p480 = dd.clone();
    (p480.spec.workload.max_width, p480.spec.workload.max_height) = (832, 480);
    let at480 = ["--max-width=832", "--max-height=480"];
    x(Some(&f), &at480, &p480, &a100()).unwrap();
    let mut sharded = p480.clone();
    sharded.spec.strategy = StrategyChoice::Fixed(Strategy::OffloadSharded);
    let p = x(
        Some(&f),
        &[&at480[..], &["--strategy=offload-sharded"]].concat(),
        &sharded,
        &l4(),
    )
    .unwrap();
    assert_eq!((p.strategy, p.dp), (Strategy::OffloadSharded, 8));
    // The workload by flags alone: a spec naming the profile's family, the CRD's defaults.
    let mut bare = dd.clone();
    bare.spec = serde_json::from_value(serde_json::json!({
        "model": { "family": "wan", "location": { "hostPath": "/models" } },
        "workload": { "maxWidth": 1280, "maxHeight": 720, "maxFrames": 81 }
    }))
    .unwrap();
    x(
        None,
        &["--max-width=1280", "--max-height=720", "--max-frames=81"],
        &bare,
        &h100(),
    )
    .unwrap();
    // A node too small in host memory for the model's copy and one pod: refused, named.
    let small = node("l40s-48gb", "NVIDIA L40S", 46_068, 64, false, false);
    let r = x(Some(&f), &[], &dd, &small).unwrap_err();
    assert_eq!(r.shortage, Shortage::HostMemory);
}

#[test]
fn the_sp_example_meets_its_latency_bound_as_the_operator_plans_it() {
    let doc = doc();
    let dir = tempfile::tempdir().unwrap();
    let (folder, model, profile) = preset(dir.path(), "wan2.1-14b");
    let yaml = published::yaml_block(&doc, "maxLatencySeconds:");
    let f = file(dir.path(), "wan21.yaml", yaml);
    let dd: DiffusionDeployment = serde_saphyr::from_str(yaml).unwrap();
    let p = crossed(&model, &folder, &profile, Some(&f), &[], &dd, &h100()).unwrap();
    assert!(p.latency_bound_met.is_some(), "{:?}", p.reasons);
    let bounded_sp = p.sp;
    // Without the bound, by a flag no file can unset: sp 1.
    let mut loose = dd.clone();
    loose.spec.workload.max_latency_seconds = Some(1e6);
    let p = crossed(
        &model,
        &folder,
        &profile,
        Some(&f),
        &["--max-latency-seconds=1000000"],
        &loose,
        &h100(),
    )
    .unwrap();
    assert!(
        p.sp <= bounded_sp && p.latency_bound_met == Some(true),
        "{:?}",
        p.reasons
    );
}

#[test]
fn the_cosmos3_and_qwen_image_examples_plan_as_the_operator_records_them() {
    let doc = doc();
    let dir = tempfile::tempdir().unwrap();
    let (folder, model, profile) = preset(dir.path(), "cosmos3-super");
    let yaml = published::yaml_block(&doc, "family: cosmos3\n");
    let f = file(dir.path(), "cosmos3.yaml", yaml);
    let dd: DiffusionDeployment = serde_saphyr::from_str(yaml).unwrap();
    let mut t2i = dd.clone();
    let w = &mut t2i.spec.workload;
    (w.max_width, w.max_height, w.max_frames) = (1024, 1024, 1);
    let t2i_flags = ["--max-width=1024", "--max-height=1024", "--max-frames=1"];
    for node in [g64(), a100()] {
        crossed(&model, &folder, &profile, Some(&f), &[], &dd, &node).unwrap();
        crossed(&model, &folder, &profile, Some(&f), &t2i_flags, &t2i, &node).unwrap();
    }

    let (folder, model, profile) = preset(dir.path(), "qwen-image");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/examples/qwen-image.yaml");
    let dd: DiffusionDeployment =
        serde_saphyr::from_str(&std::fs::read_to_string(&example).unwrap()).unwrap();
    let mut strategies = Vec::new();
    for node in [a100(), l40s(), l4()] {
        let p = crossed(&model, &folder, &profile, Some(&example), &[], &dd, &node).unwrap();
        strategies.push(p.strategy);
    }
    assert_eq!(
        strategies,
        [Strategy::Resident, Strategy::Sharded, Strategy::Sharded]
    );
}

#[test]
fn a_profile_json_plans_as_its_folder_and_the_text_says_every_term_and_reason() {
    let doc = doc();
    let dir = tempfile::tempdir().unwrap();
    let (folder, _, profile) = preset(dir.path(), "wan2.2-a14b");
    let yaml = published::yaml_block(&doc, "family: wan\n");
    let f = file(dir.path(), "wan22.yaml", yaml);
    let dd: DiffusionDeployment = serde_saphyr::from_str(yaml).unwrap();
    // What `layerwise inspect --json` prints: the engine's profile, pretty JSON.
    let json = dir.path().join("profile.json");
    let inspected = layerwise_engine::families::profile(&folder).unwrap();
    std::fs::write(&json, serde_json::to_string_pretty(&inspected).unwrap()).unwrap();
    for node in [h100(), l40s()] {
        let from = |m: &Path| {
            let (code, out, err) = run(&args(m, Some(&f), &node, &["--json"]));
            assert_eq!(code, 0, "{err}");
            let mut v: Value = serde_json::from_str(&out).unwrap();
            v["model"]["source"] = Value::Null;
            v
        };
        assert_eq!(from(&folder), from(&json));

        let plan = operator_plan(&profile, &dd, &node).unwrap().plan;
        let (code, text, err) = run(&args(&folder, Some(&f), &node, &[]));
        assert_eq!(code, 0, "{err}");
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / GIB as f64);
        let b = &plan.device_breakdown;
        let mut want: Vec<String> = plan
            .reasons
            .iter()
            .chain(&plan.rejected)
            .map(|r| format!("  - {r}"))
            .collect();
        want.push(format!(
            "plan       {} dp {} × sp {}, {} slots",
            plan.strategy.as_str(),
            plan.dp,
            plan.sp,
            plan.slots
        ));
        want.push(format!(
            "device     {} per rank",
            gib(plan.device_bytes_per_rank)
        ));
        for (term, bytes) in [
            ("activations", b.activations),
            ("slots", b.slots),
            ("decoder", b.decoder),
        ] {
            want.push(format!("{term:<14} {:>10}", gib(bytes)));
        }
        want.push(format!(
            "{:.3} s a request",
            plan.predicted_latency_seconds.unwrap()
        ));
        let missing: Vec<&String> = want.iter().filter(|w| !text.contains(w.as_str())).collect();
        assert!(missing.is_empty(), "{missing:?}\nin\n{text}");
        // docs/operations.md's worked example is this output.
        assert!(
            doc.contains(&text.replace(
                &folder.display().to_string(),
                "/models/Wan2.2-T2V-A14B-Diffusers"
            )),
            "docs/operations.md lacks the command's output:\n{text}"
        );
    }
}

#[test]
fn bad_input_is_refused_naming_what_is_wrong() {
    let doc = doc();
    let dir = tempfile::tempdir().unwrap();
    let (folder, _, _) = preset(dir.path(), "wan2.2-a14b");
    let f = file(
        dir.path(),
        "wan22.yaml",
        published::yaml_block(&doc, "family: wan\n"),
    );
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/examples/qwen-image.yaml");
    let not_dd = file(
        dir.path(),
        "node.yaml",
        "apiVersion: layerwise.dev/v1alpha1\nkind: DiffusionNode\n",
    );
    let typo = file(
        dir.path(),
        "typo.yaml",
        &published::yaml_block(&doc, "family: wan\n").replace("maxHeight", "maxHieght"),
    );
    let n = h100();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            args(&folder, Some(&f), &n, &["--device-memory=80 gigs"]),
            "--device-memory: `80 gigs`: an unknown unit",
        ),
        (
            args(&folder, Some(&f), &n, &["--host-memory=0"]),
            "--host-memory \"0\": must be more than 0 bytes",
        ),
        (
            args(&folder, Some(&f), &n, &["--gpus=0"]),
            "--gpus 0: at least 1",
        ),
        (
            args(&folder, Some(&f), &n, &["--max-width=4"]),
            "spec.workload.maxWidth: maxWidth must be between 8 and 16384 (got 4)",
        ),
        (
            args(&folder, Some(&f), &n, &["--slots=1"]),
            "spec.slots: slots must be between 2 and 16",
        ),
        (
            args(&folder, Some(&f), &n, &["--strategy=fastest"]),
            "spec.strategy: must be one of",
        ),
        (
            args(&folder, Some(&f), &n, &["--peer-gbps=-5"]),
            "spec.accelerator.rates.peerGBps: peerGBps must be positive",
        ),
        (
            args(&folder, Some(&typo), &n, &[]),
            "spec.workload.maxHieght: no such field",
        ),
        (
            args(&folder, Some(&qwen), &n, &[]),
            "names family `qwen-image`, but the checkpoint is a `wan` pipeline",
        ),
        (
            args(&folder, Some(&not_dd), &n, &[]),
            "holds a DiffusionNode, not a DiffusionDeployment",
        ),
        (
            args(&dir.path().join("missing"), Some(&f), &n, &[]),
            "neither a pipeline folder nor a readable profile JSON file",
        ),
        (args(&f, None, &n, &[]), "not JSON"),
    ];
    for (a, want) in cases {
        let (code, out, err) = run(&a);
        assert_eq!(code, 1, "{a:?}: {out}");
        assert!(err.contains(want), "{a:?}: expected {want:?} in\n{err}");
    }
    // Settings the planner refuses before it searches: InvalidSpec, exit 3.
    let (code, out, _) = run(&args(
        &folder,
        Some(&f),
        &n,
        &["--strategy=sharded", "--dp=1", "--sp=1"],
    ));
    assert_eq!(code, layerwise_operator::plan_cli::REFUSED, "{out}");
    assert!(out.contains("refused    InvalidSpec: cannot serve 1280x720x81 (batch 1) requests: invalid settings: strategy sharded needs dp × sp >= 2"), "{out}");
}

/// The operator's run stays the default: the chart and the image start the binary without
/// a command, and its flags parse as before.
#[test]
fn the_run_is_the_default_and_plan_is_a_command() {
    let help = Command::new(env!("CARGO_BIN_EXE_layerwise-operator"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for want in [
        "plan",
        "--engine-image",
        "--device-overhead-mib",
        "--leader-elect",
    ] {
        assert!(help.contains(want), "{want} in\n{help}");
    }
    let plan = Command::new(env!("CARGO_BIN_EXE_layerwise-operator"))
        .args(["plan", "--engine-image=x"])
        .output()
        .unwrap();
    assert_eq!(plan.status.code(), Some(2));
    assert!(String::from_utf8(plan.stderr)
        .unwrap()
        .contains("--engine-image"));
}
