//! `layerwise soak`: a bounded soak of a running server. For a set time, C clients send a
//! mix of valid jobs (polled to the end), invalid requests (malformed, unknown fields,
//! out of bounds, oversized) and jobs cancelled at once, at a load above what the server
//! can take. It counts what was accepted, refused and failed after acceptance, and samples
//! the server process's resident memory and open descriptors before, at the peak and after
//! the server is idle again. Loopback only.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};

use super::loadgen::{http, loopback};
use crate::metric_names as names;
use crate::{Error, Result};

/// `layerwise soak` options.
#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// The server, e.g. http://127.0.0.1:8080 (loopback only).
    #[arg(long, env = "LAYERWISE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// The server's process id (its memory and descriptors are read from /proc).
    #[arg(long)]
    pub pid: u32,
    /// Seconds of load (at most 3600).
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Clients sending at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Denoising steps of the valid jobs.
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// Size of the valid jobs, `WxH` (default: the model's native size).
    #[arg(long)]
    pub size: Option<String>,
}

/// Resident memory and open descriptors of a process at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcessSample {
    pub rss_bytes: u64,
    pub open_fds: u64,
}

impl ProcessSample {
    /// Reads `/proc/PID`.
    pub fn of(pid: u32) -> Result<ProcessSample> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| Error::io(format!("/proc/{pid}/status"), e))?;
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .ok_or_else(|| Error::bug(format!("/proc/{pid}/status has no VmRSS")))?;
        let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map_err(|e| Error::io(format!("/proc/{pid}/fd"), e))?
            .count() as u64;
        Ok(ProcessSample {
            rss_bytes: rss_kib * 1024,
            open_fds,
        })
    }
}

/// What a soak measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SoakReport {
    pub seconds: f64,
    pub requests: u64,
    /// Valid and to-be-cancelled jobs the server took (202).
    pub accepted: u64,
    pub succeeded: u64,
    pub cancelled: u64,
    /// Refused before queueing: 429 (queue full) or 503.
    pub refused: u64,
    /// Invalid requests answered with a 4xx, as they should be.
    pub invalid_refused: u64,
    /// Accepted jobs that then failed: the figure that must be 0.
    pub failed_after_accept: u64,
    /// 5xx answers and transport errors to requests that were not accepted jobs.
    pub server_errors: u64,
    pub before: ProcessSample,
    pub peak: ProcessSample,
    pub after: ProcessSample,
    /// A few of the failures, to say what went wrong.
    pub failures: Vec<String>,
}

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    accepted: AtomicU64,
    succeeded: AtomicU64,
    cancelled: AtomicU64,
    refused: AtomicU64,
    invalid_refused: AtomicU64,
    failed_after_accept: AtomicU64,
    server_errors: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl Counts {
    fn fail(&self, counter: &AtomicU64, what: String) {
        counter.fetch_add(1, Ordering::Relaxed);
        let mut f = self.failures.lock().expect("failures lock");
        if f.len() < 10 {
            f.push(what);
        }
    }
}

const TIMEOUT: Duration = Duration::from_secs(300);

/// The body of a valid job for the served model (a class, or a prompt for text families).
fn valid_body(text: bool, i: usize, a: &SoakArgs) -> Value {
    let mut body = if text {
        json!({ "prompt": format!("soak {i}") })
    } else {
        json!({ "class_label": i % 10 })
    };
    body["seed"] = json!(i);
    body["steps"] = json!(a.steps);
    if let Some(s) = &a.size {
        body["size"] = json!(s);
    }
    body
}

/// Polls a job to its end; returns its state.
async fn finish(addr: SocketAddr, id: &str) -> Result<String> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let r = http(addr, "GET", &format!("/v1/jobs/{id}"), None, TIMEOUT).await?;
        let v = r.json()?;
        match v["state"].as_str() {
            Some(s @ ("succeeded" | "failed" | "cancelled")) => {
                if s == "failed" {
                    return Ok(format!("failed: {}", v["error"]));
                }
                return Ok(s.to_string());
            }
            _ if Instant::now() > deadline => {
                return Err(Error::unavailable(format!("job {id} never ended")))
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Sends request `i` of the mix: 6 and 7 of every 10 invalid, 8 and 9 jobs cancelled at once,
/// the rest valid jobs followed to their end.
async fn one(addr: SocketAddr, text: bool, i: usize, a: &SoakArgs, c: &Counts) {
    c.requests.fetch_add(1, Ordering::Relaxed);
    match i % 10 {
        6 | 7 => invalid(addr, text, i, a, c).await,
        kind => job(addr, text, i, a, c, kind >= 8).await,
    }
}

/// An invalid request, one of four kinds by `i`: each must be a 4xx, never a 5xx or a
/// dropped connection.
async fn invalid(addr: SocketAddr, text: bool, i: usize, a: &SoakArgs, c: &Counts) {
    let bodies: [Vec<u8>; 4] = [
        b"{not json".to_vec(),
        json!({ "colour": "red" }).to_string().into_bytes(),
        {
            let mut b = valid_body(text, i, a);
            b["steps"] = json!(1_000_000);
            b.to_string().into_bytes()
        },
        vec![b' '; 70 << 10],
    ];
    let body = &bodies[(i / 10) % bodies.len()];
    match http(addr, "POST", "/v1/jobs", Some(body), TIMEOUT).await {
        Ok(r) if (400..500).contains(&r.status) => {
            c.invalid_refused.fetch_add(1, Ordering::Relaxed);
        }
        Ok(r) => c.fail(
            &c.server_errors,
            format!("invalid request answered {}", r.status),
        ),
        Err(e) => c.fail(&c.server_errors, format!("invalid request: {e}")),
    }
}

/// A valid job, cancelled at once where `cancel`, followed to its end.
async fn job(addr: SocketAddr, text: bool, i: usize, a: &SoakArgs, c: &Counts, cancel: bool) {
    let body = valid_body(text, i, a).to_string();
    let r = match http(addr, "POST", "/v1/jobs", Some(body.as_bytes()), TIMEOUT).await {
        Ok(r) => r,
        Err(e) => return c.fail(&c.server_errors, format!("submit: {e}")),
    };
    match r.status {
        202 => {}
        429 | 503 => {
            c.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        s => return c.fail(&c.server_errors, format!("submit answered {s}")),
    }
    c.accepted.fetch_add(1, Ordering::Relaxed);
    let id = match r
        .json()
        .ok()
        .and_then(|v| v["id"].as_str().map(String::from))
    {
        Some(id) => id,
        None => return c.fail(&c.failed_after_accept, "202 without an id".into()),
    };
    if cancel {
        let _ = http(addr, "DELETE", &format!("/v1/jobs/{id}"), None, TIMEOUT).await;
    }
    match finish(addr, &id).await {
        Ok(s) if s == "succeeded" => {
            c.succeeded.fetch_add(1, Ordering::Relaxed);
        }
        Ok(s) if s == "cancelled" => {
            c.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        Ok(s) => c.fail(&c.failed_after_accept, format!("job {id}: {s}")),
        Err(e) => c.fail(&c.failed_after_accept, format!("job {id}: {e}")),
    }
}

/// A gauge of the server's `/metrics`.
async fn gauge(addr: SocketAddr, name: &str) -> Result<f64> {
    let r = http(addr, "GET", "/metrics", None, TIMEOUT).await?;
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::bug(format!("no {name} in /metrics")))
}

/// Waits until nothing is queued or running, then a moment for memory to be handed back.
async fn idle(addr: SocketAddr) -> Result<()> {
    let idle_by = Instant::now() + TIMEOUT;
    while gauge(addr, names::QUEUE_DEPTH.full).await? != 0.0
        || gauge(addr, names::RUNNING_REQUESTS.full).await? != 0.0
    {
        if Instant::now() > idle_by {
            return Err(Error::unavailable("the server never became idle"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

/// Runs the soak and waits for the server to be idle again.
pub async fn run(a: &SoakArgs) -> Result<SoakReport> {
    let addr = loopback(&a.url).await?;
    let models = http(addr, "GET", "/v1/models", None, TIMEOUT)
        .await?
        .json()?;
    let text = models["data"][0]["conditioning"] == "text";
    // Warm up first (lazy allocations, thread stacks, allocator arenas), so "before" is
    // the idle level of a server that has served, which "after" should return to.
    let warm = Counts::default();
    for i in 0..4 {
        one(addr, text, i, a, &warm).await;
    }
    idle(addr).await?;
    let before = ProcessSample::of(a.pid)?;
    let peak = Arc::new(Mutex::new(before));
    let counts = Arc::new(Counts::default());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(a.seconds.min(3600));
    let sampler = {
        let (peak, pid) = (peak.clone(), a.pid);
        tokio::spawn(async move {
            loop {
                if let Ok(s) = ProcessSample::of(pid) {
                    let mut p = peak.lock().expect("peak lock");
                    p.rss_bytes = p.rss_bytes.max(s.rss_bytes);
                    p.open_fds = p.open_fds.max(s.open_fds);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let clients: Vec<_> = (0..a.concurrency.max(1))
        .map(|_| {
            let (a, counts, next) = (a.clone(), counts.clone(), next.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    one(addr, text, i, &a, &counts).await;
                }
            })
        })
        .collect();
    for c in clients {
        c.await
            .map_err(|e| Error::internal("a soak client task failed", e))?;
    }
    let seconds = started.elapsed().as_secs_f64();
    idle(addr).await?;
    sampler.abort();
    let after = ProcessSample::of(a.pid)?;
    let c = &counts;
    let n = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let peak = *peak.lock().expect("peak lock");
    let failures = c.failures.lock().expect("failures lock").clone();
    Ok(SoakReport {
        seconds,
        requests: n(&c.requests),
        accepted: n(&c.accepted),
        succeeded: n(&c.succeeded),
        cancelled: n(&c.cancelled),
        refused: n(&c.refused),
        invalid_refused: n(&c.invalid_refused),
        failed_after_accept: n(&c.failed_after_accept),
        server_errors: n(&c.server_errors),
        before,
        peak,
        after,
        failures,
    })
}
