//! The command's inputs as the planner takes them: the profile (as the node agent reports
//! it in the DiffusionNode's status), the spec (the file's DiffusionDeployment with the
//! flags over it, read with the CRD's own types and checked against its schema's rules),
//! and the node (what its agent would report). Every bad input is an error naming the flag,
//! the file or the field.

use std::path::Path;

use anyhow::{bail, ensure, Context as _, Result};
use crds::{DiffusionDeploymentSpec, Profile};
use layerwise_core::bytesize::parse_bytes;
use layerwise_core::timing::Rates;
use serde_json::{json, Value};

use super::args::{Link, NodeArgs, WorkloadArgs};
use super::schema;
use crate::planner::NodeReport;

/// The profile of `model`: a pipeline folder profiled from its headers by the engine's
/// family registry, as the node agent profiles it, or a profile JSON file. Either way it
/// passes through the JSON a DiffusionNode carries, as the operator receives it.
pub fn profile(model: &Path) -> Result<Profile> {
    let value = if model.is_dir() {
        let p = layerwise_engine::families::profile(model)
            .with_context(|| format!("profiling the pipeline folder {}", model.display()))?;
        serde_json::to_value(p)?
    } else {
        let text = std::fs::read_to_string(model).with_context(|| {
            format!(
                "--model {}: neither a pipeline folder nor a readable profile JSON file",
                model.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| {
            format!(
                "--model {}: not JSON (a profile is what `layerwise inspect DIR --json` prints)",
                model.display()
            )
        })?
    };
    serde_json::from_value(value).with_context(|| {
        format!(
            "--model {}: not a checkpoint profile (what `layerwise inspect DIR --json` prints)",
            model.display()
        )
    })
}

/// The spec to plan: the DiffusionDeployment in `file` (or one naming only the profile's
/// family), with each flag of `w` and `node`'s rates in place of the file's field, checked
/// against the CRD schema's rules and read with the CRD's types.
pub fn spec(
    file: Option<&Path>,
    w: &WorkloadArgs,
    node: &NodeArgs,
    profile: &Profile,
) -> Result<DiffusionDeploymentSpec> {
    let mut spec = match file {
        Some(f) => deployment_spec(f)?,
        None => json!({
            "model": {
                "family": profile.family,
                "location": { "hostPath": "/models" }
            }
        }),
    };
    let what = file.map_or("the flags".to_string(), |f| f.display().to_string());
    let workload = [
        ("maxWidth", w.max_width.map(Value::from)),
        ("maxHeight", w.max_height.map(Value::from)),
        ("maxFrames", w.max_frames.map(Value::from)),
        ("maxSteps", w.max_steps.map(Value::from)),
        ("maxBatch", w.max_batch.map(Value::from)),
        ("guidance", w.guidance.map(Value::from)),
        ("maxPromptTokens", w.max_prompt_tokens.map(Value::from)),
        ("maxLatencySeconds", w.max_latency_seconds.map(Value::from)),
    ];
    set_all(&mut spec, "workload", &workload);
    let fixed = [
        ("strategy", w.strategy.clone().map(Value::from)),
        ("dp", w.dp.map(Value::from)),
        ("sp", w.sp.map(Value::from)),
        ("slots", w.slots.map(Value::from)),
    ];
    set_all(&mut spec, "", &fixed);
    let rates = [
        ("deviceTflops", node.device_tflops.map(Value::from)),
        (
            "hostToDeviceGBps",
            node.host_to_device_gbps.map(Value::from),
        ),
        ("peerGBps", node.peer_gbps.map(Value::from)),
    ];
    if rates.iter().any(|(_, v)| v.is_some()) {
        set_all(&mut spec, "accelerator", &[]);
        set_all(&mut spec["accelerator"], "rates", &rates);
    }
    let broken = schema::check_spec(&spec);
    if !broken.is_empty() {
        bail!(
            "the DiffusionDeployment of {what} breaks the CRD's rules:\n  {}",
            broken.join("\n  ")
        );
    }
    let spec: DiffusionDeploymentSpec = serde_json::from_value(spec)
        .with_context(|| format!("reading the DiffusionDeployment spec of {what}"))?;
    ensure!(
        spec.model.family == profile.family,
        "the DiffusionDeployment of {what} names family `{}`, but the checkpoint is a `{}` pipeline",
        spec.model.family,
        profile.family
    );
    Ok(spec)
}

/// The spec of the DiffusionDeployment in `file` (YAML or JSON).
fn deployment_spec(file: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("--deployment {}: cannot read it", file.display()))?;
    let mut doc: Value = serde_saphyr::from_str(&text)
        .with_context(|| format!("--deployment {}: not YAML or JSON", file.display()))?;
    let kind = doc["kind"].as_str().unwrap_or_default();
    ensure!(
        kind == "DiffusionDeployment",
        "--deployment {}: holds a {}, not a DiffusionDeployment",
        file.display(),
        if kind.is_empty() {
            "document without `kind`"
        } else {
            kind
        }
    );
    let api = doc["apiVersion"].as_str().unwrap_or_default();
    ensure!(
        api == crate::context::API_VERSION,
        "--deployment {}: apiVersion `{api}`, expected `{}`",
        file.display(),
        crate::context::API_VERSION
    );
    match doc.get_mut("spec").map(Value::take) {
        Some(spec @ Value::Object(_)) => Ok(spec),
        _ => bail!(
            "--deployment {}: the DiffusionDeployment has no spec",
            file.display()
        ),
    }
}

/// Sets each of `fields` that is `Some` in `spec[object]` (`spec` itself where `object` is
/// empty), making the object where it is missing.
fn set_all(spec: &mut Value, object: &str, fields: &[(&str, Option<Value>)]) {
    let target = if object.is_empty() {
        spec
    } else {
        let slot = &mut spec[object];
        if !slot.is_object() {
            *slot = json!({});
        }
        slot
    };
    for (name, value) in fields {
        if let Some(v) = value {
            target[*name] = v.clone();
        }
    }
}

/// The node `args` describe, as its agent would report it: every accelerator for one
/// pod's ranks, the model warm in its page cache.
pub fn node(args: &NodeArgs) -> Result<NodeReport> {
    ensure!(
        !args.gpu.trim().is_empty(),
        "--gpu: name the accelerator product"
    );
    ensure!(args.gpus >= 1, "--gpus {}: at least 1", args.gpus);
    let device_bytes = bytes("--device-memory", &args.device_memory)?;
    let host_bytes = bytes("--host-memory", &args.host_memory)?;
    let fast_peer_link = match args.link {
        Some(link) => link == Link::Nvlink,
        None => linked_by_default(&args.gpu),
    };
    Ok(NodeReport {
        name: args.node_name.clone(),
        devices: args.gpus,
        device_bytes,
        product: args.gpu.clone(),
        fast_peer_link,
        host_bytes,
        warm: true,
    })
}

/// Whether accelerators of `product` share a fast peer link unless `--link` says: where
/// the product's rates gather between peers faster than they copy from the host (the
/// NVLink parts of the table; a PCIe-only part gathers at about its host rate).
pub fn linked_by_default(product: &str) -> bool {
    let (r, _) = Rates::for_product(product);
    r.peer > r.host_to_device
}

/// The bytes of `value` for `flag`, in the project's one grammar
/// ([`layerwise_core::bytesize`]: `80Gi`, `81559Mi`, `48G`, `80GiB`, `48GB`).
pub fn bytes(flag: &str, value: &str) -> Result<u64> {
    match parse_bytes(value) {
        Ok(0) => bail!("{flag} {value:?}: must be more than 0 bytes"),
        Ok(b) => Ok(b),
        Err(e) => bail!("{flag}: {e}"),
    }
}
