//! The `layerwise-operator` under test: started with leader election and metrics on a
//! loopback port, its metrics read in windows, restarted and stopped.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerwise_e2e::tools::kubeconfig;
use layerwise_engine::tools::loadgen::http;
use serde_json::json;
use tokio::process::{Child, Command};

use super::args::Args;
use super::common::{NS, WAIT};
use super::cpu::process_cpu;

/// What the operator's /metrics say, the parts this benchmark reads.
#[derive(Default, Clone)]
pub(super) struct Metrics {
    pub(super) reconciles: f64,
    /// "verb resource" to requests.
    pub(super) requests: BTreeMap<String, f64>,
}

/// The difference between two readings.
pub(super) struct Window {
    pub(super) reconciles: f64,
    pub(super) requests: BTreeMap<String, f64>,
}

impl Window {
    pub(super) fn between(a: &Metrics, b: &Metrics) -> Window {
        let requests = b
            .requests
            .iter()
            .map(|(k, v)| (k.clone(), v - a.requests.get(k).copied().unwrap_or(0.0)))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        Window {
            reconciles: b.reconciles - a.reconciles,
            requests,
        }
    }

    /// Requests other than watches (each watch is one long-lived request).
    pub(super) fn calls(&self) -> f64 {
        self.requests
            .iter()
            .filter(|(k, _)| !k.starts_with("watch "))
            .map(|(_, v)| v)
            .sum()
    }

    pub(super) fn print(&self, what: &str) {
        let per = self.calls() / self.reconciles.max(1.0);
        println!(
            "requests {what}: {:.0} reconciles, {:.0} API requests (watches aside), {per:.2} per reconcile",
            self.reconciles,
            self.calls()
        );
        let mut top: Vec<(&String, &f64)> = self.requests.iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(a.1));
        let top: Vec<String> = top.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        println!("  by verb and resource: {}", top.join(", "));
    }

    pub(super) fn json(&self) -> serde_json::Value {
        json!({
            "reconciles": self.reconciles,
            "requests": self.calls(),
            "requests_per_reconcile": self.calls() / self.reconciles.max(1.0),
            "by_verb_and_resource": self.requests,
        })
    }
}

/// A running `layerwise-operator`.
pub(super) struct Operator {
    pub(super) child: Child,
    pub(super) addr: SocketAddr,
    pub(super) started: Instant,
}

impl Operator {
    pub(super) async fn start(a: &Args, pod: &str) -> Result<Operator> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = std::fs::File::create(std::env::temp_dir().join(format!("{pod}.log")))?;
        let child = Command::new(&a.operator)
            .env("KUBECONFIG", kubeconfig())
            .env("LAYERWISE_LISTEN", addr.to_string())
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", NS)
            .env("LAYERWISE_LEADER_ELECT", "true")
            .env("LAYERWISE_MODEL_ROOTS", "/models")
            .env("LAYERWISE_RESYNC_SECONDS", a.resync_seconds.to_string())
            .env(
                "LAYERWISE_LOG",
                std::env::var("LAYERWISE_FLEET_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", a.operator.display()))?;
        Ok(Operator {
            child,
            addr,
            started: Instant::now(),
        })
    }

    /// Waits until it leads with its stores synced; returns how long that took.
    pub(super) async fn wait_leading(&mut self) -> Result<Duration> {
        loop {
            if let Ok(r) = http(self.addr, "GET", "/readyz", None, Duration::from_secs(2)).await {
                if r.status == 200 && String::from_utf8_lossy(&r.body).starts_with("leading") {
                    return Ok(self.started.elapsed());
                }
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("the operator exited: {status}");
            }
            ensure!(self.started.elapsed() < WAIT, "the operator did not lead");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until it has reconciled `count` times (a new operator's first pass over every
    /// deployment); returns how long after `since` that was, and its metrics then.
    pub(super) async fn wait_reconciled(
        &self,
        count: usize,
        since: Instant,
    ) -> Result<(Duration, Metrics)> {
        loop {
            let m = self.metrics().await?;
            if m.reconciles >= count as f64 {
                return Ok((since.elapsed(), m));
            }
            ensure!(
                since.elapsed() < WAIT,
                "the new operator did not reconcile every deployment"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub(super) async fn metrics(&self) -> Result<Metrics> {
        let r = http(self.addr, "GET", "/metrics", None, Duration::from_secs(10)).await?;
        ensure!(r.status == 200, "/metrics: HTTP {}", r.status);
        let mut m = Metrics::default();
        for line in String::from_utf8_lossy(&r.body).lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if series == "layerwise_operator_reconciles_total" {
                m.reconciles = value;
            } else if let Some(labels) =
                series.strip_prefix("layerwise_operator_api_requests_total{")
            {
                let label = |name: &str| {
                    labels
                        .split(',')
                        .find_map(|l| l.strip_prefix(&format!("{name}=\"")))
                        .map(|v| v.trim_end_matches(['"', '}']).to_string())
                        .unwrap_or_default()
                };
                m.requests
                    .insert(format!("{} {}", label("verb"), label("resource")), value);
            }
        }
        Ok(m)
    }

    /// VmRSS and VmHWM in bytes.
    pub(super) fn memory(&self) -> Result<(u64, u64)> {
        let pid = self.child.id().context("the operator has exited")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .unwrap_or(0)
        };
        Ok((field("VmRSS:"), field("VmHWM:")))
    }

    /// CPU time the operator has used (user + system), seconds.
    pub(super) fn cpu_seconds(&self) -> Result<f64> {
        let pid = self.child.id().context("the operator has exited")?;
        Ok(process_cpu(&pid.to_string())
            .context("reading the operator's /proc stat")?
            .1)
    }

    /// SIGTERM, then waits for it to exit.
    pub(super) async fn stop(&mut self) -> Result<()> {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .context("the operator did not stop within 30 s of SIGTERM")??;
        ensure!(status.success(), "the operator exited with {status}");
        Ok(())
    }
}
