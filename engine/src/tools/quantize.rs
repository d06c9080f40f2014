//! `layerwise quantize --fp8 IN OUT`: writes a copy of a pipeline folder whose transformers'
//! streamed linear weights are stored `F8_E4M3` with one F32 scale per tensor
//! (`<prefix>.weight_scale`, see [`crate::checkpoint::fp8`]): half the bytes of bf16 per
//! streamed block. The scale is the tensor's absmax / 448 (1 for an all-zero tensor); each
//! element is `w / scale` rounded to the nearest E4M3 value, ties to even, saturating at
//! ±448. Everything else (norms, biases, the prologue and epilogue, which stay resident
//! and gain nothing from fp8, the text encoder, the VAE, configs) is copied as it is.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::checkpoint::fp8::{is_linear, E4M3_MAX, SCALE_SUFFIXES};
use crate::checkpoint::header::encode_header;
use crate::checkpoint::{Component, Mapped};
use crate::families::Checkpoint;
use crate::{Error, Result};

/// What a quantization wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Tensors now stored fp8.
    pub tensors: usize,
    /// Weight bytes of the folder before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// The E4M3 value nearest `x` (ties to even), saturating at ±448; NaN stays NaN.
pub fn to_e4m3(x: f32) -> float8::F8E4M3 {
    float8::F8E4M3::from_f32(x)
}

/// The per-tensor scale of `values`: absmax / 448, or 1 when they are all zero.
pub fn scale_for(values: &[f32]) -> f32 {
    let absmax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    if absmax == 0.0 {
        1.0
    } else {
        absmax / E4M3_MAX
    }
}

fn to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Writes `input` with its transformers' streamed linear weights in fp8 to `output`
/// (a folder that must not exist yet).
pub fn quantize_fp8(input: &Path, output: &Path) -> Result<QuantizeReport> {
    let ck = Checkpoint::open(input)?;
    if output.exists() {
        return Err(Error::invalid(
            "output",
            format!("{} exists; quantize writes a new folder", output.display()),
        ));
    }
    let groups = ck.groups();
    let mut report = QuantizeReport::default();
    // The weight files rewritten, and their shard indexes: everything else is copied.
    let mut rewritten: Vec<PathBuf> = Vec::new();
    let mut jobs = Vec::new();
    let mut kept: BTreeMap<String, usize> = BTreeMap::new();
    for (name, c) in ck.components() {
        report.bytes_before += c.tensor_bytes();
        let mine: Vec<_> = groups.iter().filter(|(n, _)| *n == name).collect();
        if !name.starts_with("transformer") || mine.is_empty() {
            report.bytes_after += c.tensor_bytes();
            continue;
        }
        // Its streamed linear weights: those in a dtype quantize reads are converted, the
        // rest (already fp8, or another dtype) counted for the refusal below.
        let mut names = BTreeSet::new();
        for t in c.files.iter().flat_map(|h| h.tensors.iter()) {
            let streamed = mine
                .iter()
                .any(|(_, g)| g.block_of(&t.name).is_some_and(|b| b < g.count));
            if !streamed || !is_linear(&t.name, &t.shape) {
                continue;
            }
            if matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                names.insert(t.name.clone());
            } else {
                *kept.entry(format!("{:?}", t.dtype)).or_default() += 1;
            }
        }
        rewritten.extend(c.files.iter().map(|h| h.path.clone()));
        rewritten.extend(shard_indexes(&c.dir)?);
        jobs.push((name, c.clone(), names));
    }
    if jobs.iter().all(|(_, _, names)| names.is_empty()) {
        return Err(nothing_to_convert(&ck.root, &kept));
    }
    copy_tree(input, output, &rewritten)?;
    for (name, c, names) in jobs {
        let dir = output.join(name);
        report.tensors += names.len();
        report.bytes_after += write_component(&c, &dir, &names)?;
    }
    // What was written opens and checks like any checkpoint.
    Checkpoint::open(output)?;
    Ok(report)
}

/// Why a folder has no streamed linear weight to convert, from the count of those it keeps
/// by dtype: already fp8, or none in a dtype quantize reads.
fn nothing_to_convert(root: &Path, kept: &BTreeMap<String, usize>) -> Error {
    let why = if let Some(fp8) = kept.get(&format!("{:?}", Dtype::F8_E4M3)) {
        format!(
            "its transformers' streamed linear weights are already fp8 ({fp8} stored F8_E4M3); there is nothing to convert"
        )
    } else if !kept.is_empty() {
        format!(
            "its transformers' streamed linear weights are {}; quantize converts F32, F16 or BF16",
            kept.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    } else {
        "it has no streamed linear weight in a transformer to convert".into()
    };
    Error::invalid("input", format!("{}: {why}", root.display()))
}

/// The shard index files of a component folder.
fn shard_indexes(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".safetensors.index.json"))
        .collect())
}

/// Copies the folder `from` to `to`, leaving out the files in `skip`.
fn copy_tree(from: &Path, to: &Path, skip: &[PathBuf]) -> Result<()> {
    std::fs::create_dir_all(to).map_err(|e| Error::io(to, e))?;
    for entry in std::fs::read_dir(from).map_err(|e| Error::io(from, e))? {
        let entry = entry.map_err(|e| Error::io(from, e))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if skip.iter().any(|s| s == &src) {
            continue;
        }
        if src.is_dir() {
            copy_tree(&src, &dst, skip)?;
        } else {
            std::fs::copy(&src, &dst).map_err(|e| Error::io(&src, e))?;
        }
    }
    Ok(())
}

/// Rewrites each weight file of `c` into `dir` (same file names), the tensors `names` in
/// fp8 with their scales after them; rewrites the shard index if there is one. Returns
/// the tensor bytes written.
fn write_component(c: &Component, dir: &Path, names: &BTreeSet<String>) -> Result<u64> {
    let mapped = Mapped::map(c.clone())?;
    let mut written = 0u64;
    let mut weight_map = serde_json::Map::new();
    for (fi, h) in c.files.iter().enumerate() {
        let file_name = h.path.file_name().expect("a weight file has a name");
        let path = dir.join(file_name);
        let mut entries: Vec<(String, Dtype, Vec<usize>)> = Vec::new();
        for t in &h.tensors {
            if names.contains(&t.name) {
                entries.push((t.name.clone(), Dtype::F8_E4M3, t.shape.clone()));
                let prefix = t.name.strip_suffix("weight").expect("a linear weight");
                entries.push((format!("{prefix}{}", SCALE_SUFFIXES[0]), Dtype::F32, vec![]));
            } else {
                entries.push((t.name.clone(), t.dtype, t.shape.clone()));
            }
        }
        for (n, _, _) in &entries {
            weight_map.insert(
                n.clone(),
                serde_json::Value::String(file_name.to_string_lossy().into_owned()),
            );
        }
        let (header, _) = encode_header(&entries)?;
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = BufWriter::new(file);
        let io = |e| Error::io(&path, e);
        out.write_all(&header).map_err(io)?;
        for t in &h.tensors {
            let bytes = mapped.range(fi, t.offset, t.len);
            if !names.contains(&t.name) {
                out.write_all(bytes).map_err(io)?;
                written += t.len;
                continue;
            }
            let values = to_f32(bytes, t.dtype).expect("a float tensor");
            if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
                return Err(Error::tensor(
                    &h.path,
                    &t.name,
                    format!("holds {bad}: only finite weights can be scaled to fp8"),
                ));
            }
            let scale = scale_for(&values);
            let q: Vec<u8> = values
                .iter()
                .map(|v| to_e4m3(v / scale).to_bits())
                .collect();
            out.write_all(&q).map_err(io)?;
            out.write_all(&scale.to_le_bytes()).map_err(io)?;
            written += q.len() as u64 + 4;
        }
        out.flush().map_err(io)?;
    }
    for index in shard_indexes(&c.dir)? {
        let json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let path = dir.join(index.file_name().expect("a file"));
        std::fs::write(&path, serde_json::to_vec_pretty(&json).expect("JSON"))
            .map_err(|e| Error::io(&path, e))?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value.
    fn grid() -> Vec<f32> {
        (0u8..=255)
            .map(|b| float8::F8E4M3::from_bits(b).to_f32())
            .filter(|v| v.is_finite())
            .collect()
    }

    /// The reference: nearest finite value, ties to an even code, saturating.
    fn reference(x: f32) -> f32 {
        if x.abs() >= E4M3_MAX {
            return E4M3_MAX.copysign(x);
        }
        let mut best: Option<(f64, u8)> = None;
        for b in 0u8..=255 {
            let v = float8::F8E4M3::from_bits(b).to_f32();
            if !v.is_finite() {
                continue;
            }
            let d = (v as f64 - x as f64).abs();
            best = match best {
                Some((bd, bb)) if bd < d || (bd == d && bb % 2 == 0) => Some((bd, bb)),
                _ => Some((d, b)),
            };
        }
        float8::F8E4M3::from_bits(best.unwrap().1).to_f32()
    }

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        let mut g = grid();
        g.sort_by(f32::total_cmp);
        g.dedup();
        // Each value, each midpoint (a tie) and points either side of it.
        let mut xs = g.clone();
        for w in g.windows(2) {
            let m = (w[0] + w[1]) / 2.0;
            xs.extend([m, m * (1.0 + 1e-6), m * (1.0 - 1e-6)]);
        }
        xs.extend([449.0, 460.0, 464.0, 1e6, -1e6, -470.0]);
        for x in xs {
            let got = to_e4m3(x).to_f32();
            let want = reference(x);
            assert!(
                got == want || (got == 0.0 && want == 0.0),
                "{x}: {got} != {want}"
            );
        }
    }

    #[test]
    fn scale_maps_absmax_to_448() {
        assert_eq!(scale_for(&[0.0, 0.0]), 1.0);
        let s = scale_for(&[1.0, -8.96, 3.0]);
        assert_eq!(s, 8.96 / 448.0);
        assert_eq!(to_e4m3(-8.96 / s).to_f32(), -448.0);
    }
}
