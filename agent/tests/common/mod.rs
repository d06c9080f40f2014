//! What the agent's integration tests share: the agent process they run (killed when
//! dropped), a plain HTTP GET of its endpoints, the `DiffusionNode` requests they write as
//! the operator would and the model statuses they read back, and a folder's files.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::Result;
use crds::{DiffusionNode, NodeModelStatus};
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};

pub const AGENT: &str = env!("CARGO_BIN_EXE_layerwise-agent");

/// The agent process, killed and reaped when the test ends, however it ends.
pub struct Agent(pub Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` from the agent listening on `port`: the whole response, head and body.
pub fn http_get(port: u16, path: &str) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Every file under `dir`, relative, sorted.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// Sets `node`'s model requests to `models` (server-side apply as `requester`, the
/// operator's role).
pub async fn request(
    api: &Api<DiffusionNode>,
    node: &str,
    requester: &str,
    models: Vec<Value>,
) -> Result<()> {
    let obj = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode",
        "metadata": { "name": node }, "spec": { "models": models } });
    api.patch(
        node,
        &PatchParams::apply(requester).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    Ok(())
}

/// What `node`'s agent reports of the model requested as `id`.
pub async fn model(
    api: &Api<DiffusionNode>,
    node: &str,
    id: &str,
) -> Result<Option<NodeModelStatus>> {
    Ok(api
        .get(node)
        .await?
        .status
        .and_then(|s| s.model(id).cloned()))
}
