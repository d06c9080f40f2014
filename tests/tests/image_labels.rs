//! What a platform team's reviewer reads off an image before running it agrees with the
//! repository: every image states the workspace's licence (the one `LICENSE` holds and
//! `Cargo.toml` names) and the chart's version, and the CUDA engine image states the NVIDIA
//! driver it needs, the same series the README tells an operator to install.

use anyhow::{ensure, Context, Result};
use layerwise_e2e::images;
use layerwise_e2e::tools::repo;

/// The labels of image `name` (short name), as podman reads them.
fn labels(name: &str) -> Result<serde_json::Value> {
    let tag = images::tag(name)?;
    let text = images::podman_ok(&["image", "inspect", "--format", "{{json .Labels}}", &tag])?;
    serde_json::from_str(text.trim()).with_context(|| format!("labels of {tag}: {text}"))
}

#[test]
fn images_state_the_licence_the_version_and_the_driver_they_need() -> Result<()> {
    let names: Vec<&str> = images::NAMES
        .into_iter()
        .filter(|n| *n != "engine-cuda" || images::cuda_enabled())
        .collect();
    images::ensure(&names)?;
    let cargo = std::fs::read_to_string(repo().join("Cargo.toml"))?;
    let licence = cargo
        .lines()
        .find_map(|l| l.trim().strip_prefix("license = "))
        .map(|v| v.trim_matches('"').to_string())
        .context("Cargo.toml names no licence")?;
    let text = std::fs::read_to_string(repo().join("LICENSE")).context("the LICENSE file")?;
    ensure!(
        licence == "Apache-2.0" && text.contains("Apache License") && text.contains("Version 2.0"),
        "Cargo.toml says {licence}; LICENSE begins {:?}",
        text.lines().take(3).collect::<Vec<_>>()
    );
    ensure!(repo().join("NOTICE").is_file(), "no NOTICE beside LICENSE");
    let version = images::app_version()?;
    for name in &names {
        let l = labels(name)?;
        ensure!(
            l["org.opencontainers.image.licenses"] == licence.as_str(),
            "layerwise-{name}: licence label {}",
            l["org.opencontainers.image.licenses"]
        );
        ensure!(
            l["org.opencontainers.image.version"] == version.as_str(),
            "layerwise-{name}: version label {}, the chart's appVersion is {version}",
            l["org.opencontainers.image.version"]
        );
    }
    if names.contains(&"engine-cuda") {
        let l = labels("engine-cuda")?;
        let min = l["dev.layerwise.nvidia.driver.min"]
            .as_str()
            .context("layerwise-engine-cuda has no dev.layerwise.nvidia.driver.min label")?;
        let readme = std::fs::read_to_string(repo().join("README.md"))?;
        ensure!(
            readme.contains(&format!("NVIDIA driver of the {min} series or newer")),
            "the image needs driver {min}, which README.md does not say"
        );
        let description = l["org.opencontainers.image.description"]
            .as_str()
            .unwrap_or_default();
        ensure!(
            description.contains(&format!("driver {min} or newer")),
            "layerwise-engine-cuda's description does not say driver {min}: {description}"
        );
    }
    Ok(())
}
