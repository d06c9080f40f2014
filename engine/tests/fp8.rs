//! fp8 weights: `quantize --fp8` writes F8_E4M3 linear weights with F32 scales; an fp8
//! model streams half the bytes of its bf16 twin, gives bit-identical outputs under every
//! strategy and the same bits as its dequantized weights run resident; bad fp8 layouts
//! are refused naming the tensor.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use layerwise_engine::checkpoint::header::encode_header;
use layerwise_engine::checkpoint::{Component, Mapped};
use layerwise_engine::contract::SlotsChoice;
use layerwise_engine::engine::Model;
use layerwise_engine::execution::dtype::ComputeDtype;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::execution::work::Request;
use layerwise_engine::families::Checkpoint;
use layerwise_engine::memory::{self, Placement};
use layerwise_engine::tools::quantize::quantize_fp8;
use layerwise_engine::Strategy;
use safetensors::Dtype;

fn opts(strategy: Strategy, dp: usize, slots: usize) -> EngineOptions {
    EngineOptions {
        strategy,
        dp,
        slots: SlotsChoice::Fixed(slots),
        decode: false,
        timeout: Duration::from_secs(60),
        ..EngineOptions::default()
    }
}

fn quantized(src: &Path) -> PathBuf {
    let out = src.with_file_name(format!(
        "{}-fp8",
        src.file_name().unwrap().to_string_lossy()
    ));
    quantize_fp8(src, &out).unwrap();
    out
}

/// A tensor as (dtype, shape, bytes).
type Entry = (Dtype, Vec<usize>, Vec<u8>);

/// Every tensor of the transformer's single weight file.
fn read_transformer(model: &Path) -> BTreeMap<String, Entry> {
    let c = Component::open(&model.join("transformer")).unwrap();
    let m = Mapped::map(c.clone()).unwrap();
    let mut out = BTreeMap::new();
    for t in c.files.iter().flat_map(|h| h.tensors.iter()) {
        let bytes = m.bytes(&t.name).unwrap().to_vec();
        out.insert(t.name.clone(), (t.dtype, t.shape.clone(), bytes));
    }
    out
}

/// A copy of the folder `model` (at `to`) whose transformer holds `tensors`.
fn with_transformer(model: &Path, to: &Path, tensors: &BTreeMap<String, Entry>) -> PathBuf {
    copy_dir(model, to);
    let list: Vec<(String, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, (d, s, _))| (n.clone(), *d, s.clone()))
        .collect();
    let (mut file, _) = encode_header(&list).unwrap();
    for (_, _, b) in tensors.values() {
        file.extend_from_slice(b);
    }
    let dir = to.join("transformer");
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.to_string_lossy().contains(".safetensors") {
            std::fs::remove_file(p).unwrap();
        }
    }
    std::fs::write(dir.join("diffusion_pytorch_model.safetensors"), file).unwrap();
    to.to_path_buf()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn f8(b: u8) -> f32 {
    float8::F8E4M3::from_bits(b).to_f32()
}

fn scale(bytes: &[u8]) -> f32 {
    f32::from_le_bytes(bytes.try_into().unwrap())
}

/// The fp8 model's weights dequantized, `f32(w) × scale`, stored as F32 (scales dropped).
fn dequantized(fp8: &Path, to: &Path) -> PathBuf {
    let t = read_transformer(fp8);
    let mut out = BTreeMap::new();
    for (name, (d, shape, bytes)) in &t {
        if name.ends_with(".weight_scale") {
            continue;
        }
        if *d != Dtype::F8_E4M3 {
            out.insert(name.clone(), (*d, shape.clone(), bytes.clone()));
            continue;
        }
        let s = scale(&t[&name.replace(".weight", ".weight_scale")].2);
        let v: Vec<u8> = bytes
            .iter()
            .flat_map(|&b| (f8(b) * s).to_le_bytes())
            .collect();
        out.insert(name.clone(), (Dtype::F32, shape.clone(), v));
    }
    with_transformer(fp8, to, &out)
}

fn latents(model: &Model, requests: &[Request], o: &EngineOptions) -> Vec<Vec<u32>> {
    let (out, _) = model.run(requests.to_vec(), o).unwrap();
    out.iter().map(|o| common::bits(&o.latents)).collect()
}

/// PSNR (dB) of decoded images in [-1, 1] against `reference`.
fn psnr(a: &Model, reference: &Model, requests: &[Request]) -> f64 {
    let mut o = opts(Strategy::Resident, 1, 2);
    o.decode = true;
    let img = |m: &Model| -> Vec<f32> {
        let (out, _) = m.run(requests.to_vec(), &o).unwrap();
        out.iter()
            .flat_map(|o| {
                o.image
                    .as_ref()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    };
    let (x, y) = (img(a), img(reference));
    let mse = x
        .iter()
        .zip(&y)
        .map(|(p, q)| ((p - q) as f64).powi(2))
        .sum::<f64>()
        / x.len() as f64;
    10.0 * (4.0 / mse).log10()
}

#[test]
fn quantize_writes_fp8_linear_weights_with_scales_and_inspect_shows_bytes_per_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let src = common::tiny(dir.path(), 3);
    let fp8 = quantized(&src);
    let (before, after) = (read_transformer(&src), read_transformer(&fp8));
    let mut n = 0;
    for (name, (d, shape, bytes)) in &before {
        let linear_in_block = name.starts_with("transformer_blocks.")
            && name.ends_with(".weight")
            && shape.len() == 2
            && !name.contains("embedding");
        let (qd, qshape, q) = &after[name];
        assert_eq!(qshape, shape, "{name}");
        if !linear_in_block {
            assert_eq!((qd, q), (d, bytes), "{name} is copied as it is");
            continue;
        }
        n += 1;
        assert_eq!(*qd, Dtype::F8_E4M3, "{name}");
        let (sd, sshape, s) = &after[&name.replace(".weight", ".weight_scale")];
        assert_eq!((*sd, sshape.as_slice()), (Dtype::F32, &[][..]), "{name}");
        // absmax / 448, and the largest element lands on ±448.
        let w: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let absmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(scale(s), absmax / 448.0, "{name}");
        assert!(q.iter().any(|&b| f8(b).abs() == 448.0), "{name}");
        // Each element is within half a step of E4M3 of its value.
        for (&b, &x) in q.iter().zip(&w) {
            let back = f8(b) * scale(s);
            assert!(
                (back - x).abs() <= x.abs() / 16.0 + scale(s) / 512.0,
                "{name}: {x} → {back}"
            );
        }
    }
    // Per block: timestep embedder (2), norm1.linear, q, k, v, out, two feed-forward.
    assert_eq!(n, 3 * 9);
    assert_eq!(after.len(), before.len() + n);
    // The profile and `inspect` show bytes per dtype.
    let p = layerwise_engine::families::profile(&fp8).unwrap();
    let f8_bytes: u64 = after
        .values()
        .filter(|(d, _, _)| *d == Dtype::F8_E4M3)
        .map(|(_, _, b)| b.len() as u64)
        .sum();
    assert_eq!(p.bytes_by_dtype["F8_E4M3"], f8_bytes);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"))
        .args(["inspect"])
        .arg(&fp8)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("dtype F8_E4M3") && l.contains(&format!(" {f8_bytes} bytes"))),
        "{text}"
    );
    assert!(text.lines().any(|l| l.starts_with("dtype F32")), "{text}");
    // The CLI: --fp8 is required and the output must be new.
    let cli = |args: &[&Path]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"))
            .arg("quantize")
            .args(args)
            .output()
            .unwrap()
    };
    let r = cli(&[&src, &dir.path().join("x")]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("--fp8"));
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_layerwise"));
    let r = c
        .args(["quantize", "--fp8"])
        .arg(&src)
        .arg(&fp8)
        .output()
        .unwrap();
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("exists"));
    // A transformer split into shards keeps its files and gets an index naming the scales.
    let sharded = common::tiny_with(dir.path(), 4, |o| o.max_shard_bytes = Some(64 << 10));
    let q = quantized(&sharded);
    let files = |m: &Path| Component::open(&m.join("transformer")).unwrap().files.len();
    assert!(files(&sharded) > 1);
    assert_eq!(files(&q), files(&sharded));
    let p = layerwise_engine::families::profile(&q).unwrap();
    assert!(p.bytes_by_dtype["F8_E4M3"] > 0);
}

#[test]
fn an_fp8_model_is_bit_identical_across_strategies_and_to_its_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    let src = common::tiny(dir.path(), 4);
    let fp8 = quantized(&src);
    let deq = dequantized(&fp8, &dir.path().join("dequantized"));
    let (model, plain) = (Model::open(&fp8).unwrap(), Model::open(&deq).unwrap());
    let requests = vec![common::request(1, 3, 4.0), common::request(2, 2, 1.0)];
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let mut o = opts(Strategy::Resident, 1, 2);
        o.compute_dtype = dtype;
        let reference = latents(&plain, &requests, &o);
        for strategy in Strategy::ALL {
            for (dp, k) in [(1, 2), (2, 3)] {
                let mut o = opts(strategy, dp, k);
                o.compute_dtype = dtype;
                o.hook = Some(common::jitter(dp as u64 * 10 + k as u64));
                assert_eq!(
                    latents(&model, &requests, &o),
                    reference,
                    "{dtype}: {strategy} dp={dp} K={k}"
                );
            }
        }
    }
    // Against the unquantized model: the same picture, not the same bits.
    let db = psnr(&model, &Model::open(&src).unwrap(), &requests);
    println!("tiny DiT, fp8 vs f32 weights: PSNR {db:.1} dB");
    assert!(db.is_finite() && db > 20.0, "PSNR {db}");
}

#[test]
fn an_fp8_model_copies_half_the_bytes_of_its_bf16_twin_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = common::tiny_with(dir.path(), 4, |o| o.dtype = Dtype::BF16);
    let fp8 = quantized(&bf16);
    // Expected bytes per block pass, from the tensors: each linear weight's bf16 bytes
    // become its element count in fp8 plus a 4-byte scale; norms and biases stay bf16.
    let in_blocks = |t: &BTreeMap<String, Entry>| -> u64 {
        t.iter()
            .filter(|(n, _)| n.starts_with("transformer_blocks."))
            .map(|(_, (_, _, b))| b.len() as u64)
            .sum()
    };
    let (tb, tq) = (read_transformer(&bf16), read_transformer(&fp8));
    let (bf16_bytes, fp8_bytes) = (in_blocks(&tb), in_blocks(&tq));
    let (mut linear_elems, mut linears) = (0u64, 0u64);
    for (name, (d, shape, _)) in &tq {
        if *d == Dtype::F8_E4M3 {
            linear_elems += shape.iter().product::<usize>() as u64;
            linears += 1;
            assert_eq!(tb[name].0, Dtype::BF16);
        }
    }
    assert_eq!(fp8_bytes, bf16_bytes - linear_elems + 4 * linears);
    let requests = vec![common::request(1, 2, 4.0)];
    let per_step = |m: &Path| {
        let model = Model::open(m).unwrap();
        let (_, stats) = model
            .run(requests.clone(), &opts(Strategy::Offload, 1, 2))
            .unwrap();
        (stats.bytes_copied_per_step, model)
    };
    let ((b, _), (q, model)) = (per_step(&bf16), per_step(&fp8));
    // One pass over the blocks per step (guidance batches the two halves).
    assert_eq!(b, bf16_bytes, "bf16 twin");
    assert_eq!(q, fp8_bytes, "fp8");
    println!(
        "bytes copied per step: bf16 {b}, fp8 {q} ({:.4} of bf16; linear weights alone 0.5000)",
        q as f64 / b as f64
    );
    // The memory model accounts for the fp8 model to the byte: a budget of exactly its
    // figure starts and is what the run peaks at.
    let groups = model.group_bytes().unwrap();
    let outside = model.family.resident_bytes(false);
    let need = memory::device_bytes(
        &groups,
        &Placement::new(Strategy::Offload, 1, 2, groups.len()),
        outside,
        0,
        0,
    )
    .weights();
    let mut o = opts(Strategy::Offload, 1, 2);
    o.device_memory = need;
    let (_, stats) = model.run(requests.clone(), &o).unwrap();
    assert_eq!(stats.peak_device_bytes, need);
    let profile = layerwise_engine::families::profile(&fp8).unwrap();
    assert_eq!(
        profile.groups, groups,
        "the profile and the engine lay fp8 out alike"
    );
    o.device_memory = need - 1;
    assert!(
        model.run(requests, &o).is_err(),
        "one byte short must not start"
    );
}

#[test]
fn bad_fp8_layouts_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let fp8 = quantized(&common::tiny(dir.path(), 2));
    let good = read_transformer(&fp8);
    let w = "transformer_blocks.0.attn1.to_q.weight";
    let ws = "transformer_blocks.0.attn1.to_q.weight_scale";
    let sw = "transformer_blocks.0.attn1.to_q.scale_weight";
    let edit = |label: &str, f: &dyn Fn(&mut BTreeMap<String, Entry>)| -> String {
        let mut t = good.clone();
        f(&mut t);
        let m = with_transformer(&fp8, &dir.path().join(label), &t);
        Checkpoint::open(&m)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = edit("no-scale", &|t| {
        t.remove(ws);
    });
    assert!(e.contains(w) && e.contains("without its scale"), "{e}");
    let e = edit("f16-scale", &|t| {
        t.insert(ws.into(), (Dtype::F16, vec![], vec![0, 0x3c]));
    });
    assert!(e.contains(ws) && e.contains("one F32 element"), "{e}");
    let e = edit("long-scale", &|t| {
        t.insert(ws.into(), (Dtype::F32, vec![2], vec![0; 8]));
    });
    assert!(e.contains(ws) && e.contains("one F32 element"), "{e}");
    let e = edit("two-scales", &|t| {
        let s = t[ws].clone();
        t.insert(sw.into(), s);
    });
    assert!(e.contains(w) && e.contains("two scales"), "{e}");
    let bias = "transformer_blocks.0.attn1.to_q.bias";
    let e = edit("fp8-bias", &|t| {
        let n = t[bias].1[0];
        t.insert(bias.into(), (Dtype::F8_E4M3, vec![n], vec![0x38; n]));
    });
    assert!(
        e.contains(bias) && e.contains("not a linear layer's weight"),
        "{e}"
    );
    let e = edit("stray-scale", &|t| {
        t.insert(
            "pos_embed.proj.weight_scale".into(),
            (Dtype::F32, vec![], 1f32.to_le_bytes().to_vec()),
        );
    });
    assert!(
        e.contains("pos_embed.proj.weight_scale") && e.contains("not stored F8_E4M3"),
        "{e}"
    );
    // The other published spelling of the scale loads, and computes the same.
    let mut t = good.clone();
    let s = t.remove(ws).unwrap();
    t.insert(sw.into(), s);
    let other = with_transformer(&fp8, &dir.path().join("scale-weight"), &t);
    let requests = vec![common::request(3, 2, 4.0)];
    let o = opts(Strategy::Offload, 1, 2);
    assert_eq!(
        latents(&Model::open(&other).unwrap(), &requests, &o),
        latents(&Model::open(&fp8).unwrap(), &requests, &o)
    );
}

#[test]
fn a_wan_model_quantizes_and_runs_identically_across_strategies() {
    let dir = tempfile::tempdir().unwrap();
    let src = common::wan_tiny(dir.path(), 2, 2);
    let fp8 = quantized(&src);
    let p = layerwise_engine::families::profile(&fp8).unwrap();
    assert!(
        p.bytes_by_dtype.get("F8_E4M3").is_some_and(|b| *b > 0),
        "{p:?}"
    );
    let model = Model::open(&fp8).unwrap();
    let request = Request {
        seed: 5,
        steps: 2,
        guidance: 3.0,
        frames: 5,
        max_sequence_length: 16,
        ..Request::image(
            layerwise_engine::execution::work::Condition::Prompt {
                prompt: "a red fox".into(),
                negative: None,
            },
            32,
            32,
        )
    };
    let reference = latents(
        &model,
        std::slice::from_ref(&request),
        &opts(Strategy::Resident, 1, 2),
    );
    for (s, dp) in [(Strategy::Offload, 1), (Strategy::OffloadSharded, 2)] {
        assert_eq!(
            latents(&model, std::slice::from_ref(&request), &opts(s, dp, 2)),
            reference,
            "{s}"
        );
    }
}

/// Quantizing a folder that is already fp8 converts nothing: it is refused, naming the
/// folder and why, and no output folder is written (it used to write a copy with 0 weights
/// converted). The same for a DiT and a Wan pipeline.
#[test]
fn quantizing_an_fp8_folder_again_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for src in [
        common::tiny(dir.path(), 2),
        common::wan_tiny(dir.path(), 1, 1),
    ] {
        let fp8 = quantized(&src);
        let again = dir.path().join("again");
        let e = quantize_fp8(&fp8, &again).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("already fp8")
                && msg.contains("F8_E4M3")
                && msg.contains(&fp8.display().to_string()),
            "{msg}"
        );
        assert_eq!(e.field(), Some("input"), "{msg}");
        assert!(!again.exists(), "{} was written", again.display());
    }
}

#[test]
fn an_fp8_linear_outside_the_blocks_is_dequantized_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let fp8 = quantized(&common::tiny(dir.path(), 2));
    let mut t = read_transformer(&fp8);
    let name = "proj_out_1.weight";
    let (_, shape, bytes) = t[name].clone();
    let w: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let s = layerwise_engine::tools::quantize::scale_for(&w);
    let q: Vec<u8> = w
        .iter()
        .map(|v| layerwise_engine::tools::quantize::to_e4m3(v / s).to_bits())
        .collect();
    t.insert(name.into(), (Dtype::F8_E4M3, shape, q));
    t.insert(
        "proj_out_1.weight_scale".into(),
        (Dtype::F32, vec![1], s.to_le_bytes().to_vec()),
    );
    let outside = with_transformer(&fp8, &dir.path().join("outside"), &t);
    let deq = dequantized(&outside, &dir.path().join("outside-deq"));
    let requests = vec![common::request(4, 2, 4.0)];
    let o = opts(Strategy::OffloadSharded, 2, 2);
    let got = latents(&Model::open(&outside).unwrap(), &requests, &o);
    assert_eq!(got, latents(&Model::open(&deq).unwrap(), &requests, &o));
    assert_ne!(got, latents(&Model::open(&fp8).unwrap(), &requests, &o));
}

/// DiT-XL/2 shapes (28 blocks 1152 wide, seeded weights, the SD VAE) at 256 px: how far
/// fp8 weights move the image from f32 ones, and the bytes a step streams. Takes minutes
/// and 4 GB of disk, so it runs on request:
/// `cargo test -p layerwise-engine --test fp8 xl -- --ignored --nocapture`.
#[test]
#[ignore]
fn xl_shaped_fp8_psnr_and_bytes_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("xl");
    let mut o = layerwise_engine::tools::synth::SynthOptions::preset("xl").unwrap();
    o.seed = 3;
    layerwise_engine::tools::synth::synth(&src, &o).unwrap();
    let fp8 = quantized(&src);
    let streamed = |m: &Path| {
        layerwise_engine::families::profile(m)
            .unwrap()
            .block_bytes
            .iter()
            .sum::<u64>()
    };
    // The bf16 twin streams half the f32 bytes.
    let (bf16, q) = (streamed(&src) / 2, streamed(&fp8));
    println!(
        "DiT-XL/2 shapes: bytes streamed per step: bf16 {bf16}, fp8 {q} ({:.4} of bf16)",
        q as f64 / bf16 as f64
    );
    let requests = vec![Request {
        seed: 1,
        steps: 2,
        guidance: 4.0,
        ..Request::image(
            layerwise_engine::execution::work::Condition::Class(207),
            256,
            256,
        )
    }];
    let db = psnr(
        &Model::open(&fp8).unwrap(),
        &Model::open(&src).unwrap(),
        &requests,
    );
    println!("DiT-XL/2 shapes, 256 px, 2 steps: fp8 vs f32 weights: PSNR {db:.1} dB");
    assert!(db.is_finite() && db > 20.0, "PSNR {db}");
}
