//! Reading and checking one safetensors file's header without touching its data.
//!
//! Only the 8-byte length and the JSON header are read (two `pread`s), so a 100 GB file
//! costs the same as a 1 MB one. Every check that can be made from the header and the
//! file's length is made here, and each failure names the file and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::Deserialize;

use crate::{Error, Result};

/// The largest header read. safetensors itself allows 100 MB, but a header is about 150
/// bytes a tensor (a 14 B model's, 0.2 MB) and parsing one costs about 20 times its size in
/// memory, so a larger length field is refused as corrupt rather than read.
const MAX_HEADER: u64 = 16 << 20;

/// One tensor as the header describes it, with its absolute byte range in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    pub len: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parsed header of one safetensors file.
#[derive(Debug, Clone)]
pub struct Header {
    pub path: PathBuf,
    pub file_len: u64,
    /// Where the data section starts (8 + header length).
    pub data_start: u64,
    /// Tensors sorted by offset.
    pub tensors: Vec<TensorInfo>,
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// Bytes per element of a dtype, or an error for sub-byte formats we cannot slice.
pub fn dtype_size(dtype: Dtype) -> Option<usize> {
    let bits = dtype.bitsize();
    bits.is_multiple_of(8).then_some(bits / 8)
}

impl Header {
    /// Reads and validates the header of `path`.
    pub fn read(path: &Path) -> Result<Header> {
        // A FIFO would block the open itself; a device never ends.
        super::files::regular_file(path)?;
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let bad = |msg: String| Error::checkpoint(path, msg);
        if file_len < 8 {
            return Err(bad(format!(
                "file is {file_len} bytes, too short for a safetensors header (truncated?)"
            )));
        }
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0)
            .map_err(|e| Error::io(path, e))?;
        let header_len = u64::from_le_bytes(len_bytes);
        // The length field is the file's first 8 bytes, whatever the file is: never print
        // it, or an error would show the start of any file a path leads to.
        if header_len > MAX_HEADER {
            return Err(bad(format!(
                "the header length field is over the {MAX_HEADER}-byte limit: not a safetensors file?"
            )));
        }
        if 8 + header_len > file_len {
            return Err(bad(format!(
                "the header length field is past the end of the file ({} bytes after it): truncated, or not a safetensors file?",
                file_len - 8
            )));
        }
        let mut json = vec![0u8; header_len as usize];
        file.read_exact_at(&mut json, 8)
            .map_err(|e| Error::io(path, e))?;
        Self::parse(path, &json, file_len)
    }

    /// Validates a header given its JSON bytes and the length of the file it came from.
    pub fn parse(path: &Path, json: &[u8], file_len: u64) -> Result<Header> {
        let bad = |msg: String| Error::checkpoint(path, msg);
        let raw: HashMap<String, serde_json::Value> = serde_json::from_slice(json)
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let data_start = 8 + json.len() as u64;
        let data_len = file_len - data_start;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, value) in raw {
            if name == "__metadata__" {
                continue;
            }
            let info: RawInfo = serde_json::from_value(value)
                .map_err(|e| Error::tensor(path, &name, format!("malformed header entry: {e}")))?;
            let (start, end) = info.data_offsets;
            let Some(size) = dtype_size(info.dtype) else {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!("dtype {:?} is not byte-addressable", info.dtype),
                ));
            };
            let numel = info
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
                .and_then(|n| n.checked_mul(size as u64))
                .ok_or_else(|| {
                    Error::tensor(path, &name, format!("shape {:?} overflows", info.shape))
                })?;
            if end < start {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!("data_offsets [{start}, {end}] run backwards"),
                ));
            }
            if end - start != numel {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!(
                        "data_offsets [{start}, {end}] hold {} bytes but {:?} {:?} needs {numel}",
                        end - start,
                        info.dtype,
                        info.shape
                    ),
                ));
            }
            if end > data_len {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!(
                        "data ends at byte {end} of the data section but the file holds only {data_len} (truncated or offsets past the end)"
                    ),
                ));
            }
            tensors.push(TensorInfo {
                name,
                dtype: info.dtype,
                shape: info.shape,
                offset: data_start + start,
                len: end - start,
            });
        }
        tensors.sort_by(|a, b| {
            (a.offset, a.len)
                .cmp(&(b.offset, b.len))
                .then_with(|| a.name.cmp(&b.name))
        });
        for pair in tensors.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.offset < a.offset + a.len {
                return Err(Error::tensor(
                    path,
                    &b.name,
                    format!("bytes overlap tensor `{}`", a.name),
                ));
            }
        }
        Ok(Header {
            path: path.to_path_buf(),
            file_len,
            data_start,
            tensors,
        })
    }

    /// Sum of the tensors' bytes.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// Serialises a header for `tensors` (name, dtype, shape) laid out back to back in the
/// given order, padded so the data section starts 8-byte aligned. Returns the header
/// bytes (length prefix included) and each tensor's offset within the data section.
pub fn encode_header(tensors: &[(String, Dtype, Vec<usize>)]) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut map = serde_json::Map::new();
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut at = 0u64;
    for (name, dtype, shape) in tensors {
        let size = dtype_size(*dtype)
            .ok_or_else(|| Error::invalid("dtype", format!("{dtype:?} is not byte-addressable")))?;
        let len = shape.iter().product::<usize>() as u64 * size as u64;
        map.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [at, at + len] }),
        );
        offsets.push(at);
        at += len;
    }
    let mut json = serde_json::to_vec(&map).expect("a JSON map serialises");
    while !(8 + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok((out, offsets))
}
