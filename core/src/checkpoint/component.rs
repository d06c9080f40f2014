//! One component folder's weights as its safetensors headers describe them: which files
//! (one file, or the shards a `*.safetensors.index.json` lists, checked against it) and
//! where each tensor lives. Opening reads headers only, never weight bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::files::{read_small, regular_file};
use super::header::{Header, TensorInfo};
use crate::{Error, Result};

/// The weight file names diffusers writes, in the order we look for them.
const WEIGHT_NAMES: [&str; 2] = ["diffusion_pytorch_model", "model"];

/// One component folder's weights: the files' headers and where each tensor lives.
#[derive(Debug, Clone)]
pub struct Component {
    pub dir: PathBuf,
    pub files: Vec<Header>,
    /// Tensor name → (index into `files`, index into that file's tensors).
    pub index: BTreeMap<String, (usize, usize)>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl Component {
    /// Reads the headers of a component folder's safetensors weights.
    pub fn open(dir: &Path) -> Result<Component> {
        let (files, expected) = Self::weight_files(dir)?;
        let headers = files
            .iter()
            .map(|p| Header::read(p))
            .collect::<Result<Vec<_>>>()?;
        let mut index = BTreeMap::new();
        for (fi, h) in headers.iter().enumerate() {
            for (ti, t) in h.tensors.iter().enumerate() {
                if let Some((other, _)) = index.insert(t.name.clone(), (fi, ti)) {
                    return Err(Error::tensor(
                        &h.path,
                        &t.name,
                        format!("also stored in {}", headers[other].path.display()),
                    ));
                }
            }
        }
        if let Some((index_path, map)) = expected {
            for (name, file) in &map {
                match index.get(name) {
                    None => {
                        return Err(Error::tensor(
                            &index_path,
                            name,
                            format!(
                                "listed in the index (in {file}) but not found in any weight file"
                            ),
                        ))
                    }
                    Some(&(fi, _)) if !headers[fi].path.ends_with(file) => {
                        return Err(Error::tensor(
                            &index_path,
                            name,
                            format!(
                                "index says {file} but it is in {}",
                                headers[fi].path.display()
                            ),
                        ))
                    }
                    _ => {}
                }
            }
            if let Some(name) = index.keys().find(|n| !map.contains_key(*n)) {
                let (fi, _) = index[name];
                return Err(Error::tensor(
                    &headers[fi].path,
                    name,
                    "not listed in the shard index",
                ));
            }
        }
        Ok(Component {
            dir: dir.to_path_buf(),
            files: headers,
            index,
        })
    }

    /// The weight files of a folder, and the shard index's map when there is one.
    #[allow(clippy::type_complexity)]
    fn weight_files(
        dir: &Path,
    ) -> Result<(Vec<PathBuf>, Option<(PathBuf, BTreeMap<String, String>)>)> {
        for stem in WEIGHT_NAMES {
            let single = dir.join(format!("{stem}.safetensors"));
            if single.exists() {
                regular_file(&single)?;
                return Ok((vec![single], None));
            }
            let index_path = dir.join(format!("{stem}.safetensors.index.json"));
            if index_path.exists() {
                let text = read_small(&index_path)?;
                let idx: ShardIndex = serde_json::from_slice(&text).map_err(|e| {
                    Error::checkpoint(&index_path, format!("not a shard index: {e}"))
                })?;
                let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
                files.sort();
                files.dedup();
                let mut paths = Vec::with_capacity(files.len());
                for f in files {
                    if f.contains('/') || f.contains("..") {
                        return Err(Error::checkpoint(
                            &index_path,
                            format!("shard `{f}` is not a file name in this folder"),
                        ));
                    }
                    let p = dir.join(&f);
                    if !p.is_file() {
                        return Err(Error::checkpoint(
                            &index_path,
                            format!("shard file `{f}` is missing"),
                        ));
                    }
                    paths.push(p);
                }
                return Ok((paths, Some((index_path, idx.weight_map))));
            }
        }
        Err(Error::checkpoint(
            dir,
            "no diffusion_pytorch_model.safetensors or diffusion_pytorch_model.safetensors.index.json",
        ))
    }

    /// The header entry and file of a tensor.
    pub fn get(&self, name: &str) -> Option<(&Header, &TensorInfo)> {
        self.index.get(name).map(|&(f, t)| {
            let h = &self.files[f];
            (h, &h.tensors[t])
        })
    }

    /// The file a tensor is in (for error messages).
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.get(name)
            .map_or_else(|| self.dir.clone(), |(h, _)| h.path.clone())
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.files.iter().map(Header::tensor_bytes).sum()
    }

    /// Bytes of the named tensors this component has (a name it lacks counts 0): as
    /// stored, or, given `elem`, once loaded at `elem` bytes per element.
    pub fn bytes_of<S: AsRef<str>>(
        &self,
        names: impl IntoIterator<Item = S>,
        elem: Option<u64>,
    ) -> u64 {
        names
            .into_iter()
            .filter_map(|n| self.get(n.as_ref()))
            .map(|(_, t)| elem.map_or(t.len, |e| t.numel() as u64 * e))
            .sum()
    }
}
