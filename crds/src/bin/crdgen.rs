//! Writes the CRD YAML of every kind under `crds/` (and the Helm chart's copy), or with
//! `--check` fails when a committed file differs from what the types generate.

use std::path::Path;

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    let check = std::env::args().any(|a| a == "--check");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [root.to_path_buf(), root.join("../charts/layerwise/crds")];
    let mut stale = Vec::new();
    for (file, crd) in crds::all() {
        let text = crds::to_yaml(&crd).with_context(|| format!("serializing {file}"))?;
        for dir in &dirs {
            let path = dir.join(file);
            if check {
                let committed = std::fs::read_to_string(&path).unwrap_or_default();
                if committed != text {
                    stale.push(path.display().to_string());
                }
            } else {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                std::fs::write(&path, &text)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
    }
    if !stale.is_empty() {
        bail!(
            "generated CRDs differ from the committed ones: {}; run `cargo run -p layerwise-crds --bin crdgen`",
            stale.join(", ")
        );
    }
    Ok(())
}
