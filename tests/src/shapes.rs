//! The fake fleet's shapes, parsed from the same file `tests/cluster/up` reads, so the tests
//! can check the cluster against what was asked for.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// One line of the shapes file: `count` nodes named `<prefix>-<i>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub prefix: String,
    pub count: u32,
    /// Extended resource name, e.g. `nvidia.com/gpu` or `huawei.com/Ascend910`.
    pub resource: String,
    pub devices: u32,
    /// Per-device memory in MiB, as GPU Feature Discovery puts in `nvidia.com/gpu.memory`.
    pub device_memory_mib: u64,
    pub product: String,
    pub cpu: String,
    pub memory: String,
}

impl Shape {
    /// The node names this shape expands to.
    pub fn node_names(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.count).map(move |i| format!("{}-{i}", self.prefix))
    }
}

/// The shapes file in force: `LAYERWISE_CLUSTER_SHAPES`, else the default next to `up`.
pub fn shapes_file() -> PathBuf {
    std::env::var_os("LAYERWISE_CLUSTER_SHAPES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/shapes"))
}

/// Reads the shapes file in force.
pub fn load() -> Result<Vec<Shape>> {
    let path = shapes_file();
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading shapes file {}", path.display()))?;
    parse(&text).with_context(|| format!("parsing shapes file {}", path.display()))
}

/// Parses the whitespace-separated shapes format (comments start with `#`).
pub fn parse(text: &str) -> Result<Vec<Shape>> {
    let mut shapes = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let [prefix, count, resource, devices, mem, product, cpu, memory] = f[..] else {
            bail!("line {}: expected 8 columns, found {}", n + 1, f.len());
        };
        let num = |what: &str, v: &str| -> Result<u64> {
            v.parse()
                .with_context(|| format!("line {}: {what} {v:?} is not a number", n + 1))
        };
        shapes.push(Shape {
            prefix: prefix.to_owned(),
            count: u32::try_from(num("count", count)?)?,
            resource: resource.to_owned(),
            devices: u32::try_from(num("devices", devices)?)?,
            device_memory_mib: num("device_memory_mib", mem)?,
            product: product.to_owned(),
            cpu: cpu.to_owned(),
            memory: memory.to_owned(),
        });
    }
    Ok(shapes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_file_mixes_shapes() {
        let shapes = load().unwrap();
        assert!(shapes.len() >= 2, "{shapes:?}");
        let mems: std::collections::BTreeSet<_> =
            shapes.iter().map(|s| s.device_memory_mib).collect();
        assert!(mems.len() >= 2, "default fleet should mix device sizes");
    }

    #[test]
    fn rejects_short_lines() {
        let err = parse("# c\nx 1 nvidia.com/gpu 8\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }

    #[test]
    fn names_nodes_by_prefix() {
        let s = &parse("a 2 nvidia.com/gpu 8 81920 P 8 1Gi").unwrap()[0];
        assert_eq!(s.node_names().collect::<Vec<_>>(), ["a-0", "a-1"]);
    }
}
