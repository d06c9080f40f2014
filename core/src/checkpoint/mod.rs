//! Checkpoints in the diffusers folder layout: `model_index.json`, and one folder per
//! component (`transformer/`, `vae/`, `scheduler/`), each with a `config.json` and its
//! weights as one safetensors file or several listed by a `*.safetensors.index.json`.
//!
//! Opening a component reads headers only; [`Mapped`] maps the files with memmap2 so the
//! weights are shared page cache, never copied whole into anonymous memory.

pub mod check;
pub mod fp8;
pub mod header;
pub mod profile;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::Deserialize;

pub use header::{Header, TensorInfo};
pub use profile::{ActivationCost, ComponentProfile, Profile, RequestShape};

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

/// A component with its files mapped read-only. Cloning shares the mappings.
#[derive(Clone)]
pub struct Mapped {
    pub component: Arc<Component>,
    maps: Arc<Vec<Mmap>>,
}

impl Mapped {
    pub fn map(component: Component) -> Result<Mapped> {
        let mut maps = Vec::with_capacity(component.files.len());
        for h in &component.files {
            let f = File::open(&h.path).map_err(|e| Error::io(&h.path, e))?;
            // SAFETY: the mapping is read-only and the engine never writes through it. A
            // file truncated underneath us would fault; checkpoints are immutable inputs
            // mounted read-only, and the header check above ruled out short files at open.
            let m = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&h.path, e))?;
            if (m.len() as u64) < h.file_len {
                return Err(Error::checkpoint(
                    &h.path,
                    "file shrank after its header was read",
                ));
            }
            maps.push(m);
        }
        Ok(Mapped {
            component: Arc::new(component),
            maps: Arc::new(maps),
        })
    }

    /// The stored bytes of a tensor, borrowed from the mapping.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let &(f, t) = self.component.index.get(name)?;
        let info = &self.component.files[f].tensors[t];
        Some(self.range(f, info.offset, info.len))
    }

    /// A byte range of file `file` of the component.
    pub fn range(&self, file: usize, offset: u64, len: u64) -> &[u8] {
        &self.maps[file][offset as usize..(offset + len) as usize]
    }

    /// Advises the kernel that the mapping is read in order (bigger read-ahead).
    pub fn advise_sequential(&self) {
        for m in self.maps.iter() {
            let _ = m.advise(memmap2::Advice::Sequential);
        }
    }
}

/// The paths of a diffusers model folder.
#[derive(Debug, Clone)]
pub struct ModelFolder {
    pub root: PathBuf,
    /// The pipeline class `model_index.json` names (`_class_name`), if it names one.
    pub class_name: Option<String>,
    /// Class names by label, as diffusers' `DiTPipeline` keeps them (`id2label`: each
    /// value one or more comma-separated names); empty when the folder has none.
    pub id2label: std::collections::BTreeMap<u32, String>,
}

impl ModelFolder {
    /// Checks that `root` looks like a diffusers pipeline folder.
    pub fn new(root: &Path) -> Result<ModelFolder> {
        let index = root.join("model_index.json");
        if !index.is_file() {
            return Err(Error::checkpoint(
                root,
                "no model_index.json: not a diffusers model folder",
            ));
        }
        let text = read_small(&index)?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| Error::checkpoint(&index, format!("not valid JSON: {e}")))?;
        for part in ["transformer", "vae"] {
            if v.get(part).is_none() {
                return Err(Error::config(
                    &index,
                    part,
                    "missing; this pipeline needs a transformer and a vae",
                ));
            }
        }
        let class_name = match v.get("_class_name") {
            None => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(Error::config(
                    &index,
                    "_class_name",
                    format!("{other} is not a pipeline class name"),
                ))
            }
        };
        let mut id2label = std::collections::BTreeMap::new();
        if let Some(map) = v.get("id2label").filter(|m| !m.is_null()) {
            let bad = |msg: String| Error::config(&index, "id2label", msg);
            let map = map
                .as_object()
                .ok_or_else(|| bad(format!("{map}: expected an object of label: names")))?;
            for (k, name) in map {
                let label = k
                    .parse::<u32>()
                    .map_err(|_| bad(format!("key `{k}` is not a class label")))?;
                let name = name
                    .as_str()
                    .ok_or_else(|| bad(format!("label {k}: {name} is not a string")))?;
                id2label.insert(label, name.to_string());
            }
        }
        Ok(ModelFolder {
            root: root.to_path_buf(),
            class_name,
            id2label,
        })
    }
    pub fn transformer(&self) -> PathBuf {
        self.root.join("transformer")
    }
    pub fn vae(&self) -> PathBuf {
        self.root.join("vae")
    }
    pub fn scheduler_config(&self) -> PathBuf {
        self.root.join("scheduler").join("scheduler_config.json")
    }
}

/// The largest config, index or tokenizer file read (UMT5's `tokenizer.json` is 16 MiB).
pub const MAX_SMALL_FILE: u64 = 64 << 20;

/// The folders this process may read model files from, once [`confine`] set them.
static ROOTS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

/// Confines every model file this process reads to `roots` for the rest of its life: a file
/// whose path, its symlinks followed, lies outside all of them is refused by
/// [`regular_file`], which every reader of a model folder goes through. A process serving
/// models for others calls it once at start (the engine's `--model-roots`, the agent's
/// profiler); unconfined, files may lead anywhere (a Hugging Face cache's snapshot links).
/// The roots must exist; confining again to other roots is an error.
pub fn confine(roots: &[PathBuf]) -> Result<()> {
    let mut real = roots
        .iter()
        .map(|r| r.canonicalize().map_err(|e| Error::io(r, e)))
        .collect::<Result<Vec<_>>>()?;
    real.sort();
    real.dedup();
    let set = ROOTS.get_or_init(|| real.clone());
    if *set != real {
        return Err(Error::Invalid {
            field: "model roots".into(),
            msg: format!("already confined to {set:?}, not {real:?}"),
        });
    }
    Ok(())
}

/// Refuses `path` when the process is confined and the file it leads to lies outside every
/// root. The error names the file and the roots, never where the link points.
fn within_roots(path: &Path) -> Result<()> {
    let Some(roots) = ROOTS.get() else {
        return Ok(());
    };
    let real = path.canonicalize().map_err(|e| Error::io(path, e))?;
    if roots.iter().any(|r| real.starts_with(r)) {
        return Ok(());
    }
    let names: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    Err(Error::checkpoint(
        path,
        format!(
            "leads outside the model roots ({}) through a symlink; a model's files must stay inside them",
            names.join(", ")
        ),
    ))
}

/// Checks that `path` (its symlinks followed) is a regular file, as every file of a model
/// folder must be: a FIFO would block the reader forever and a device (`/dev/zero`) never
/// ends; and that it lies inside the model roots when the process is [`confine`]d. Returns
/// its length.
pub fn regular_file(path: &Path) -> Result<u64> {
    within_roots(path)?;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        return Err(Error::checkpoint(
            path,
            format!("{what}; a model folder holds files"),
        ));
    }
    Ok(meta.len())
}

/// Reads a config, index or tokenizer file whole: a regular file of at most
/// [`MAX_SMALL_FILE`] bytes (checked again while reading, should it grow).
pub fn read_small(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let len = regular_file(path)?;
    let too_big = || {
        Error::checkpoint(
            path,
            format!("over {MAX_SMALL_FILE} bytes: too large for a config, index or tokenizer file"),
        )
    };
    if len > MAX_SMALL_FILE {
        return Err(too_big());
    }
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_SMALL_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Most blocks of one streamed group a config may name (`num_layers`): the deepest published
/// DiTs and text encoders have well under 200. A config past it describes no real model, and
/// checking it against the weights would first build that many blocks' names.
pub const MAX_CONFIG_LAYERS: usize = 1024;
/// Most residual blocks per VAE level (`layers_per_block`, `num_res_blocks`; real VAEs: 2–3).
pub const MAX_CONFIG_BLOCKS_PER_LEVEL: usize = 64;
/// Most resolution levels of a VAE (`block_out_channels`, `dim_mult`; real VAEs: 4): each
/// doubles the upscale, which past this would overflow.
pub const MAX_CONFIG_LEVELS: usize = 8;
/// Largest latent side a config may name as the native size (`sample_size`; DiT-XL/2 at 512
/// px has 64).
pub const MAX_CONFIG_LATENT_SIDE: usize = 4096;

/// Refuses the first of `(field, value, bound)` whose value is over its bound, naming the
/// file, the field and the bound: a config value no real model has is refused before any
/// work is sized by it.
pub fn at_most(path: &Path, fields: &[(&str, usize, usize)]) -> Result<()> {
    match fields.iter().find(|(_, v, max)| v > max) {
        None => Ok(()),
        Some((field, v, max)) => Err(Error::config(
            path,
            *field,
            format!("{v} is over the bound of {max} this engine takes (no published model comes near it)"),
        )),
    }
}

/// [`at_most`] for a stack's `num_layers`, the bound every family's config shares.
pub fn layers_at_most(path: &Path, num_layers: usize) -> Result<()> {
    at_most(path, &[("num_layers", num_layers, MAX_CONFIG_LAYERS)])
}

/// Reads and parses a JSON config file, naming the file on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = read_small(path)?;
    serde_json::from_slice(&text).map_err(|e| {
        let field = e.to_string();
        Error::config(
            path,
            field.split('`').nth(1).unwrap_or("(document)"),
            e.to_string(),
        )
    })
}
