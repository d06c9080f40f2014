//! Broken checkpoints of every kind: each must give an error that names the file and the
//! tensor (or config field) at fault, and the CLI must exit non-zero without a panic. Bad
//! `--slots` and `--host-memory` values are named the same way.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use layerwise_engine::checkpoint::header::{encode_header, Header};
use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::memory::Placement;
use layerwise_engine::slots::DeviceNeeds;
use layerwise_engine::Strategy;
use safetensors::Dtype;

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn weights(model: &Path) -> PathBuf {
    model.join("transformer/diffusion_pytorch_model.safetensors")
}

fn read_entries(path: &Path) -> Vec<Entry> {
    let h = Header::read(path).unwrap();
    let bytes = fs::read(path).unwrap();
    h.tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                bytes[t.offset as usize..(t.offset + t.len) as usize].to_vec(),
            )
        })
        .collect()
}

fn write_entries(path: &Path, entries: &[Entry]) {
    let specs: Vec<_> = entries
        .iter()
        .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
        .collect();
    let (mut out, _) = encode_header(&specs).unwrap();
    for (_, _, _, data) in entries {
        out.extend_from_slice(data);
    }
    fs::write(path, out).unwrap();
}

/// Rewrites the raw header JSON of a safetensors file, keeping its data section.
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut json);
    let mut text = serde_json::to_vec(&json).unwrap();
    while text.len() < n {
        text.push(b' ');
    }
    assert_eq!(text.len(), n, "edited header must keep its length");
    let mut out = bytes.clone();
    out[8..8 + n].copy_from_slice(&text);
    fs::write(path, out).unwrap();
}

fn expect_error(model: &Path, needles: &[&str]) -> String {
    let e = match Model::open(model) {
        Ok(_) => panic!("{} opened despite the damage", model.display()),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(e.contains(n), "error `{e}` does not mention `{n}`");
    }
    // The header-only profile fails the same way.
    assert!(layerwise_engine::families::profile(model).is_err());
    e
}

const Q: &str = "transformer_blocks.1.attn1.to_q.weight";

#[test]
fn truncated_file() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 3);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(weights(&m))
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 1000).unwrap();
    expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            "truncated",
            "tensor `",
        ],
    );
    // A file too short to hold even its header length.
    f.set_len(5).unwrap();
    expect_error(&m, &["diffusion_pytorch_model.safetensors", "too short"]);
}

#[test]
fn offsets_past_the_end() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 3);
    edit_header(&weights(&m), |j| {
        let o = j[Q]["data_offsets"].as_array().unwrap().clone();
        let (s, e) = (
            o[0].as_u64().unwrap() + 10_000_000,
            o[1].as_u64().unwrap() + 10_000_000,
        );
        j[Q]["data_offsets"] = serde_json::json!([s, e]);
    });
    expect_error(
        &m,
        &["diffusion_pytorch_model.safetensors", Q, "past the end"],
    );
}

#[test]
fn overlapping_tensors() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 3);
    let k = "transformer_blocks.1.attn1.to_k.weight";
    edit_header(&weights(&m), |j| {
        j[k]["data_offsets"] = j[Q]["data_offsets"].clone();
    });
    expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            "overlap",
            "attn1.to_",
        ],
    );
}

#[test]
fn missing_extra_misshapen_and_mistyped_tensors() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 3);
    let w = weights(&m);
    let orig = read_entries(&w);

    write_entries(
        &w,
        &orig
            .iter()
            .filter(|e| e.0 != Q)
            .cloned()
            .collect::<Vec<_>>(),
    );
    expect_error(&m, &[Q, "missing", "transformer"]);

    let mut extra = orig.clone();
    extra.push((
        "transformer_blocks.0.mystery.weight".into(),
        Dtype::F32,
        vec![4],
        vec![0; 16],
    ));
    write_entries(&w, &extra);
    expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            "transformer_blocks.0.mystery.weight",
            "unexpected",
        ],
    );

    let mut wrong = orig.clone();
    let e = wrong.iter_mut().find(|e| e.0 == Q).unwrap();
    e.2 = vec![64, 32];
    e.3.truncate(64 * 32 * 4);
    write_entries(&w, &wrong);
    expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            Q,
            "[64, 32]",
            "[64, 64]",
        ],
    );

    let mut typed = orig.clone();
    typed.iter_mut().find(|e| e.0 == Q).unwrap().1 = Dtype::I32;
    write_entries(&w, &typed);
    expect_error(&m, &[Q, "I32"]);

    write_entries(&w, &orig);
    Model::open(&m).expect("restored checkpoint opens");
}

#[test]
fn config_that_disagrees_with_the_weights() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 3);
    let cfg_path = m.join("transformer/config.json");
    let orig: serde_json::Value = serde_json::from_slice(&fs::read(&cfg_path).unwrap()).unwrap();
    let write = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut c = orig.clone();
        edit(&mut c);
        fs::write(&cfg_path, serde_json::to_vec(&c).unwrap()).unwrap();
    };
    write(&|c| c["num_layers"] = 5.into());
    expect_error(&m, &["config.json", "num_layers", "3 blocks"]);
    write(&|c| c["num_attention_heads"] = 8.into());
    expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            "tensor `",
            "disagrees with the config",
        ],
    );
    write(&|c| c["norm_type"] = "layer_norm".into());
    expect_error(&m, &["config.json", "norm_type"]);
    fs::write(&cfg_path, b"{ not json").unwrap();
    expect_error(&m, &["config.json"]);
}

#[test]
fn broken_shard_index() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny_with(d.path(), 3, |o| o.max_shard_bytes = Some(150_000));
    let idx = m.join("transformer/diffusion_pytorch_model.safetensors.index.json");
    let text = fs::read_to_string(&idx).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shard = v["weight_map"]["pos_embed.proj.weight"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        shard.starts_with("diffusion_pytorch_model-00001-of-"),
        "{shard}"
    );
    v["weight_map"]["transformer_blocks.0.ghost.weight"] = shard.clone().into();
    fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
    expect_error(
        &m,
        &[
            "index.json",
            "transformer_blocks.0.ghost.weight",
            "not found",
        ],
    );
    fs::write(&idx, text).unwrap();
    fs::remove_file(m.join("transformer").join(&shard)).unwrap();
    expect_error(&m, &["index.json", &shard, "missing"]);
}

#[test]
fn cli_exits_non_zero_without_panicking() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(weights(&m))
        .unwrap();
    f.set_len(f.metadata().unwrap().len() - 10).unwrap();
    let bin = env!("CARGO_BIN_EXE_layerwise");
    for args in [
        vec!["inspect", m.to_str().unwrap()],
        vec![
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--out",
            "/dev/null",
            "--steps",
            "1",
        ],
    ] {
        let out = Command::new(bin).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("truncated") && err.contains("diffusion_pytorch_model.safetensors"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let good = common::tiny(d.path(), 3);
    let out = Command::new(bin)
        .args([
            "generate",
            "--model",
            good.to_str().unwrap(),
            "--out",
            "/dev/null",
            "--steps",
            "1",
            "--size",
            "60",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("width") && err.contains("multiple of 16"),
        "{err}"
    );
}

#[test]
fn slots_auto_on_the_cpu_fills_the_budget_or_names_the_missing_flag() {
    let d = tempfile::tempdir().unwrap();
    let model = Model::open(&common::tiny(d.path(), 3)).unwrap();
    let strategy = Strategy::OffloadSharded;
    let outside = model.family.resident_bytes(true);
    let groups = model.group_bytes().unwrap();
    let needs = DeviceNeeds::of(
        &groups,
        &Placement::new(strategy, 1, 0, groups.len()),
        outside,
    );
    let opts = |device_memory| EngineOptions {
        strategy,
        slots: SlotsChoice::Auto,
        device_memory,
        ..EngineOptions::default()
    };
    let run = |device_memory| model.run(vec![common::request(3, 1, 1.0)], &opts(device_memory));
    let budget = needs.fixed + 3 * needs.slot + needs.slot / 2;
    let (_, stats) = run(budget).unwrap();
    assert_eq!(stats.slots, 3);
    assert!(stats.peak_device_bytes <= budget);
    let e = run(u64::MAX).err().unwrap().to_string();
    assert!(
        e.contains("--slots auto") && e.contains("--device-memory-mib"),
        "{e}"
    );
    let e = run(needs.fixed + needs.slot).err().unwrap().to_string();
    assert!(e.contains("at least 2 slots"), "{e}");
}

#[test]
fn cli_names_bad_slots_and_host_memory() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let bin = env!("CARGO_BIN_EXE_layerwise");
    let stats = d.path().join("stats.json");
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--out",
            "/dev/null",
            "--steps",
            "1",
            "--device",
            "cpu",
            "--stats",
            stats.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = Command::new(bin).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        (out.status.code(), err)
    };
    for (flag, value) in [
        ("--slots", "many"),
        ("--slots", "2.5"),
        ("--host-memory", "pinned"),
    ] {
        let (code, err) = generate(&[flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag) && err.contains(value), "{err}");
    }
    let (code, err) = generate(&["--slots", "auto"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--slots auto") && err.contains("--device-memory-mib"),
        "{err}"
    );
    for mode in ["register", "pageable"] {
        let (code, err) = generate(&["--host-memory", mode]);
        assert_eq!(code, Some(1), "{err}");
        assert!(
            err.contains(&format!("--host-memory {mode}")) && err.contains("CPU"),
            "{err}"
        );
    }
    let (code, err) = generate(&["--slots", "auto", "--device-memory-mib", "256"]);
    assert_eq!(code, Some(0), "{err}");
    let s: serde_json::Value = serde_json::from_slice(&fs::read(&stats).unwrap()).unwrap();
    let k = s["slots"].as_u64().unwrap();
    assert!((2..=8).contains(&k), "--slots auto chose {k}");
}

/// A scheduler config naming 2^40 training timesteps is refused when the model opens (it
/// used to pass readiness and allocate terabytes on the first request).
#[test]
fn absurd_scheduler_timesteps_are_refused_at_open() {
    let d = tempfile::tempdir().unwrap();
    let dit = common::tiny(d.path(), 2);
    let wan = common::wan_tiny(d.path(), 1, 1);
    for m in [dit, wan] {
        let path = m.join("scheduler/scheduler_config.json");
        let mut cfg: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        cfg["num_train_timesteps"] = serde_json::json!(1u64 << 40);
        fs::write(&path, cfg.to_string()).unwrap();
        let e = match Model::open(&m) {
            Ok(_) => panic!("{} opened", m.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("num_train_timesteps") && e.contains("scheduler_config.json"),
            "{e}"
        );
    }
}

/// Files of a model folder that are not regular files (a FIFO, a device) or are far too
/// large for what they are are refused at once, naming the file; nothing blocks or reads
/// without end.
#[test]
fn special_and_oversized_files_are_refused_without_reading_them() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let config = m.join("vae/config.json");
    let real = fs::read(&config).unwrap();
    // A FIFO: opening it for reading would block until a writer came.
    fs::remove_file(&config).unwrap();
    let status = Command::new("mkfifo").arg(&config).status().unwrap();
    assert!(status.success());
    let t = std::time::Instant::now();
    expect_error(&m, &["vae/config.json", "not a regular file"]);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    // A symlink to a device that never ends.
    fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &config).unwrap();
    expect_error(&m, &["vae/config.json", "not a regular file"]);
    // A config of 65 MiB (sparse: no disk).
    fs::remove_file(&config).unwrap();
    fs::write(&config, &real).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&config)
        .unwrap()
        .set_len(65 << 20)
        .unwrap();
    expect_error(&m, &["vae/config.json", "too large for a config"]);
    // The weights as a FIFO.
    fs::write(&config, &real).unwrap();
    let w = weights(&m);
    fs::remove_file(&w).unwrap();
    assert!(Command::new("mkfifo").arg(&w).status().unwrap().success());
    expect_error(
        &m,
        &["diffusion_pytorch_model.safetensors", "not a regular file"],
    );
}

/// A weights path that leads to some other file: the error says it is not a safetensors
/// file and never shows the file's first bytes (the header length field, as a number).
#[test]
fn errors_never_show_the_bytes_of_a_file_the_weights_path_leads_to() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let secret = d.path().join("secret.txt");
    fs::write(&secret, b"hunter2!and the rest of a private file").unwrap();
    let w = weights(&m);
    fs::remove_file(&w).unwrap();
    std::os::unix::fs::symlink(&secret, &w).unwrap();
    let e = expect_error(
        &m,
        &[
            "diffusion_pytorch_model.safetensors",
            "not a safetensors file",
        ],
    );
    let leaked = u64::from_le_bytes(*b"hunter2!").to_string();
    assert!(!e.contains(&leaked) && !e.contains("hunter2"), "{e}");
}

/// Weights holding NaN: the request fails naming it, instead of succeeding with a black
/// image.
#[test]
fn nan_weights_fail_the_request_instead_of_a_black_image() {
    let d = tempfile::tempdir().unwrap();
    let m = common::tiny(d.path(), 2);
    let mut entries = read_entries(&weights(&m));
    let q = entries.iter_mut().find(|e| e.0 == Q).unwrap();
    assert_eq!(q.1, Dtype::F32);
    q.3 = f32::NAN
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(q.3.len())
        .collect();
    write_entries(&weights(&m), &entries);
    let model = Model::open(&m).unwrap();
    let opts = EngineOptions {
        strategy: Strategy::Resident,
        dp: 1,
        ..EngineOptions::default()
    };
    let e = match model.run(vec![common::request(1, 2, 4.0)], &opts) {
        Ok(_) => panic!("NaN weights gave an output"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("NaN") && e.contains("weights"), "{e}");
}

/// Under `--model-roots` (the operator passes the model's mount), a file of the model
/// folder that leads outside the roots through a symlink is refused by name, without
/// showing its bytes or where it points; a link that stays inside the roots is followed,
/// and without roots the same outside link is read as before.
#[test]
fn symlinks_out_of_the_model_roots_are_refused_without_showing_bytes() {
    let d = tempfile::tempdir().unwrap();
    let roots = d.path().join("models");
    let outside = d.path().join("elsewhere");
    fs::create_dir_all(&roots).unwrap();
    fs::create_dir_all(&outside).unwrap();
    let m = common::tiny(&roots, 2);
    let bin = env!("CARGO_BIN_EXE_layerwise");
    let inspect = |confined: bool| {
        let mut c = Command::new(bin);
        c.env_remove("LAYERWISE_MODEL_ROOTS").arg("inspect").arg(&m);
        if confined {
            c.arg("--model-roots").arg(&roots);
        }
        c.output().unwrap()
    };
    // The VAE's config moved to a shared folder inside the roots: followed.
    let config = m.join("vae/config.json");
    let shared = roots.join("shared-vae-config.json");
    fs::rename(&config, &shared).unwrap();
    std::os::unix::fs::symlink(&shared, &config).unwrap();
    let out = inspect(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same config outside the roots: refused when confined, read when not.
    let moved = outside.join("vae-config.json");
    fs::rename(&shared, &moved).unwrap();
    fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink(&moved, &config).unwrap();
    assert!(inspect(false).status.success());
    let out = inspect(true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("vae/config.json")
            && err.contains("leads outside the model roots")
            && !err.contains("elsewhere"),
        "{err}"
    );
    // Weights that lead to a private file outside: refused before a byte is read.
    fs::remove_file(&config).unwrap();
    fs::rename(&moved, &config).unwrap();
    let secret = outside.join("secret.txt");
    fs::write(&secret, b"hunter2!and the rest of a private file").unwrap();
    let w = weights(&m);
    fs::remove_file(&w).unwrap();
    std::os::unix::fs::symlink(&secret, &w).unwrap();
    let out = Command::new(bin)
        .env("LAYERWISE_MODEL_ROOTS", &roots)
        .args(["generate", "--out", "/dev/null", "--steps", "1", "--model"])
        .arg(&m)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let leaked = u64::from_le_bytes(*b"hunter2!").to_string();
    assert!(
        !out.status.success()
            && err.contains("diffusion_pytorch_model.safetensors")
            && err.contains("leads outside the model roots")
            && !err.contains("hunter2")
            && !err.contains(&leaked)
            && !err.contains("secret.txt"),
        "{err}"
    );
}

/// Every integer of every config a pipeline folder holds (transformer, text encoder, VAE,
/// scheduler, tokenizer, pipeline index), set to an absurd 10^9 in turn: opening the model
/// (what `inspect` and `serve` do first) answers at once, refusing the value with an error
/// that names the field and its bound (or the tensor whose shape it contradicts, with the
/// shape it implies), or taking it where 10^9 is harmless. It used to hang on
/// `num_layers: 1000000000` (E2 of the outside test), and on a VAE's blocks per level.
#[test]
fn absurd_config_values_are_refused_at_once_naming_the_field() {
    let d = tempfile::tempdir().unwrap();
    let dit = common::tiny(d.path(), 2);
    let wan = common::wan_tiny(d.path(), 1, 1);
    let cosmos3 = common::cosmos3_tiny(d.path(), 1);
    let qwen_image = common::qwen_image_tiny(d.path(), 1);
    // Values 10^9 cannot hurt: a count of training timesteps the scheduler may name (its own
    // bound is larger), a distance in the position buckets, and so on.
    let harmless: &[&str] = HARMLESS_AT_1E9;
    let (mut accepted, mut faults) = (Vec::new(), Vec::new());
    for (family, model) in [
        ("dit", dit),
        ("wan", wan),
        ("cosmos3", cosmos3),
        ("qwen-image", qwen_image),
    ] {
        for config in json_configs(&model) {
            let text = fs::read_to_string(&config).unwrap();
            let original: serde_json::Value = serde_json::from_str(&text).unwrap();
            for (path, key) in integer_leaves(&original) {
                let mut v = original.clone();
                *v.pointer_mut(&path).unwrap() = serde_json::json!(1_000_000_000u64);
                fs::write(&config, v.to_string()).unwrap();
                let rel = config.strip_prefix(&model).unwrap().display().to_string();
                let (tx, rx) = std::sync::mpsc::channel();
                let m = model.clone();
                std::thread::spawn(move || {
                    let r = Model::open(&m).map(drop).map_err(|e| e.to_string());
                    let _ = tx.send(r);
                });
                match rx.recv_timeout(std::time::Duration::from_secs(20)) {
                    Err(_) => faults.push(format!("{rel} {path}: opening the model hangs")),
                    Ok(Ok(())) => accepted.push(format!("{family}:{rel}:{path}")),
                    // Named as a config field, or shown in the shape it would give a tensor.
                    Ok(Err(e))
                        if !(e.contains(&key) || e.contains("disagrees with the config")) =>
                    {
                        faults.push(format!("{rel} {path}: the error does not name it: {e}"))
                    }
                    Ok(Err(_)) => {}
                }
                fs::write(&config, &text).unwrap();
            }
        }
    }
    let unexpected: Vec<_> = accepted
        .iter()
        .filter(|a| {
            !harmless
                .iter()
                .any(|h| a.ends_with(&format!(":{h}")) || a.starts_with(h))
        })
        .collect();
    assert!(
        unexpected.is_empty() && faults.is_empty(),
        "taken at 10^9: {unexpected:#?}\n{faults:#?}"
    );
}

/// Config values no code sizes anything by: DiT's `norm_num_groups` (its blocks have no
/// group norm), the VAE's `sample_size` (the decoder takes any latent), UniPC's order (a
/// step uses at most the outputs it has) and `steps_offset` (flow schedules do not read it),
/// the encoder-decoder fields of an encoder-only text model, the position buckets' distance
/// (a log scale), and the tokenizer's bookkeeping (prompts are bounded by the server's own
/// `max_sequence_length`), and Cosmos3's count of action domains (only an action head,
/// which a picture never reads, is sized by it; its tensors are checked against it), and
/// Qwen-Image's longest sequence the shift line is drawn to (a longer line only flattens it).
const HARMLESS_AT_1E9: &[&str] = &[
    "transformer/config.json:/norm_num_groups",
    "vae/config.json:/sample_size",
    "scheduler/scheduler_config.json:/solver_order",
    "wan:scheduler/scheduler_config.json:/steps_offset",
    "cosmos3:scheduler/scheduler_config.json:/steps_offset",
    "cosmos3:transformer/config.json:/num_embodiment_domains",
    "qwen-image:scheduler/scheduler_config.json:/max_image_seq_len",
    "text_encoder/config.json:/decoder_start_token_id",
    "text_encoder/config.json:/eos_token_id",
    "text_encoder/config.json:/num_decoder_layers",
    "text_encoder/config.json:/pad_token_id",
    "text_encoder/config.json:/relative_attention_max_distance",
    "tokenizer/tokenizer_config.json:/extra_ids",
    "tokenizer/tokenizer_config.json:/model_max_length",
];

/// The JSON configs of a pipeline folder (not the tokenizer's vocabulary).
fn json_configs(model: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![model.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "json")
                && p.file_name().is_some_and(|n| n != "tokenizer.json")
                && !p.to_string_lossy().ends_with(".index.json")
            {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// JSON pointers of every non-negative integer in `v`, with the top-level key each is under.
fn integer_leaves(v: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(v: &serde_json::Value, path: String, key: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Number(n) if n.is_u64() => out.push((path, key.to_string())),
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, format!("{path}/{i}"), key, out);
                }
            }
            serde_json::Value::Object(o) => {
                for (k, x) in o {
                    let key = if path.is_empty() { k.as_str() } else { key };
                    walk(x, format!("{path}/{k}"), key, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), "", &mut out);
    out
}
