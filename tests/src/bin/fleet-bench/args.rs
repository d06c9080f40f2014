//! The command line.

use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};

pub(super) struct Args {
    pub(super) operator: PathBuf,
    pub(super) nodes: usize,
    pub(super) deployments: usize,
    pub(super) resync_seconds: u64,
    pub(super) steady_seconds: u64,
    pub(super) json: Option<PathBuf>,
}

pub(super) fn args() -> Result<Args> {
    let mut a = Args {
        operator: PathBuf::new(),
        nodes: 1000,
        deployments: 100,
        resync_seconds: 15,
        steady_seconds: 45,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--operator" => a.operator = value()?.into(),
            "--nodes" => a.nodes = value()?.parse()?,
            "--deployments" => a.deployments = value()?.parse()?,
            "--resync-seconds" => a.resync_seconds = value()?.parse()?,
            "--steady-seconds" => a.steady_seconds = value()?.parse()?,
            "--json" => a.json = Some(value()?.into()),
            other => bail!("unknown argument {other}; see the module documentation"),
        }
    }
    ensure!(
        a.operator.is_file(),
        "--operator must name the layerwise-operator binary"
    );
    ensure!(a.nodes <= 256 * 4, "at most 1024 nodes (their podCIDRs)");
    Ok(a)
}
