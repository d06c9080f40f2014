//! The real `layerwise serve` process over HTTP on 127.0.0.1: a burst of 10× the queue
//! capacity (429s for the excess, memory back to idle after), SIGTERM with work in flight,
//! a rank that fails, loadgen against it, and `--trace` + `trace-svg`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::process::{spawn, Server, BIN, T};
use layerwise_engine::server::shutdown::DrainPlan;
use layerwise_engine::tools::loadgen::http;
use serde_json::{json, Value};

impl Server {
    async fn gauge(&self, name: &str) -> f64 {
        let m = String::from_utf8(self.call("GET", "/metrics", None).await.body).unwrap();
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not in\n{m}"))
            .parse()
            .unwrap()
    }

    async fn wait_gauges(&self, queue: f64, running: f64) {
        let deadline = Instant::now() + T;
        while self.gauge("layerwise_queue_depth").await != queue
            || self.gauge("layerwise_running_requests").await != running
        {
            assert!(
                Instant::now() < deadline,
                "queue/running never reached {queue}/{running}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn rss_anon(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .unwrap()
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    fn exit_status(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_ten_times_the_queue_gets_429s_and_memory_returns_to_idle() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 2);
    let s = spawn(
        &model,
        &["--dp", "1", "--max-queue", "4", "--strategy", "offload"],
    );
    s.wait_ready().await;
    // Warm up so lazily allocated buffers are part of the idle level.
    for seed in 0..3 {
        let r = s
            .call(
                "POST",
                "/v1/images/generations",
                Some(json!({ "class_label": 1, "seed": seed, "steps": 40 })),
            )
            .await;
        assert_eq!(r.status, 200);
    }
    s.wait_gauges(0.0, 0.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = s.rss_anon();
    let burst = 40;
    let tasks: Vec<_> = (0..burst)
        .map(|i| {
            let addr = s.addr;
            tokio::spawn(async move {
                let body = json!({ "class_label": i, "seed": i, "steps": 40, "response_format": "b64_json" }).to_string();
                http(addr, "POST", "/v1/images/generations", Some(body.as_bytes()), T).await.unwrap()
            })
        })
        .collect();
    let mut peak = idle;
    let mut codes = std::collections::BTreeMap::new();
    for t in tasks {
        peak = peak.max(s.rss_anon());
        let r = t.await.unwrap();
        if r.status == 429 {
            assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
        }
        *codes.entry(r.status).or_insert(0) += 1;
    }
    s.wait_gauges(0.0, 0.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = s.rss_anon();
    eprintln!("burst of {burst} with queue 4: {codes:?}; RssAnon idle {:.1} MiB, peak {:.1} MiB, after {:.1} MiB", mib(idle), mib(peak), mib(after));
    let (ok, busy) = (
        codes.get(&200).copied().unwrap_or(0),
        codes.get(&429).copied().unwrap_or(0),
    );
    assert_eq!(ok + busy, burst, "only 200 and 429: {codes:?}");
    assert!(busy >= burst / 2, "the excess is refused: {codes:?}");
    assert!(ok >= 4, "at least the queue's worth completes: {codes:?}");
    assert!(
        after <= idle + (16 << 20),
        "RssAnon {:.1} MiB after the burst vs {:.1} MiB idle",
        mib(after),
        mib(idle)
    );

    // loadgen against the same server.
    let out = Command::new(BIN)
        .args([
            "loadgen",
            "--url",
            &format!("http://{}", s.addr),
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--steps",
            "2",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("outputs/s") && text.contains("4 ok"),
        "{text}"
    );
}

impl Server {
    /// Submits an asynchronous job and returns its id.
    async fn submit(&self, body: Value) -> String {
        let r = self.call("POST", "/v1/jobs", Some(body)).await;
        assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
        r.json().unwrap()["id"].as_str().unwrap().to_string()
    }

    /// Polls job `id` until it has ended; returns its status.
    async fn ended(&self, id: &str) -> Value {
        let deadline = Instant::now() + T;
        loop {
            let r = self.call("GET", &format!("/v1/jobs/{id}"), None).await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let st = r.json().unwrap();
            if ["succeeded", "failed", "cancelled"].contains(&st["state"].as_str().unwrap()) {
                return st;
            }
            assert!(Instant::now() < deadline, "job {id} never ended: {st}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn sigterm(&self) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
        assert_eq!(
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) },
            0
        );
    }
}

/// A drain finishes the work: after SIGTERM readiness fails and new jobs get a retryable
/// 503 with Retry-After, while the running job and the one queued behind it both finish
/// and their results stay readable; once both are read the process exits 0, long before
/// its 60 s grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_running_and_queued_jobs_and_keeps_their_results_readable() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 8);
    let mut s = spawn(
        &model,
        &["--dp", "1", "--max-queue", "8", "--grace-seconds", "60"],
    );
    s.wait_ready().await;
    let job = |steps: usize, seed: u64| json!({ "class_label": 1, "seed": seed, "steps": steps, "size": "128x128" });
    // About 3 s of work on 2 cores: long enough to still run when SIGTERM lands.
    let running = s.submit(job(250, 1)).await;
    s.wait_gauges(0.0, 1.0).await;
    let queued = s.submit(job(5, 2)).await;
    s.wait_gauges(1.0, 1.0).await;
    let t = Instant::now();
    s.sigterm();
    // Out of the Service at once; new work is refused, retryably.
    let deadline = Instant::now() + T;
    while s.call("GET", "/readyz", None).await.status != 503 {
        assert!(Instant::now() < deadline, "still ready after SIGTERM");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = s.call("POST", "/v1/jobs", Some(job(5, 3))).await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.json().unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("shutting down"));
    for id in [&running, &queued] {
        let st = s.ended(id).await;
        assert_eq!(st["state"], "succeeded", "{st}");
        let r = s.call("GET", &format!("/v1/jobs/{id}/result"), None).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("content-type"), Some("image/png"));
    }
    // Every job ended and was read: the process leaves without waiting out the grace.
    let status = s.exit_status(T);
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

/// A grace shorter than a step: once the grace is nearly spent the running job fails with a
/// retryable 503 its client can read, its pass stops at the next block, and the process is
/// gone within the grace: before the listener's own stop, since nothing runs any more and
/// the failure was read. An outside test once measured 26-35 s for a 3 s grace: the step's
/// length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grace_shorter_than_a_step_stops_the_pass_and_exits_within_it() {
    let dir = tempfile::tempdir().unwrap();
    // 160 blocks at 512x512: a step of tens of seconds on 2 busy cores (several on idle
    // ones), each block a fraction of one.
    let model = common::tiny(dir.path(), 160);
    let grace = Duration::from_secs(8);
    let plan = DrainPlan::new(grace);
    let mut s = spawn(
        &model,
        &["--dp", "1", "--grace-seconds", &grace.as_secs().to_string()],
    );
    s.wait_ready().await;
    let id = s
        .submit(json!({ "class_label": 1, "seed": 1, "steps": 10, "size": "512x512" }))
        .await;
    s.wait_gauges(0.0, 1.0).await;
    let t = Instant::now();
    s.sigterm();
    let st = s.ended(&id).await;
    let failed = t.elapsed();
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["error_type"], "unavailable", "{st}");
    assert!(st["error"].as_str().unwrap().contains("grace"), "{st}");
    let status = s.exit_status(Duration::from_secs(60));
    let exited = t.elapsed();
    assert_eq!(status.code(), Some(0), "{status:?}");
    eprintln!(
        "grace {grace:?} ({plan:?}): job failed after {failed:?} at step {} of 10, process gone after {exited:?}",
        st["steps_done"]
    );
    assert!(st["steps_done"].as_u64().unwrap() < 10, "{st}");
    // Gone before the listener's stop: the rank reported its stopped pass in time.
    assert!(
        exited < plan.stop,
        "{exited:?}, the listener stops at {:?}",
        plan.stop
    );
}

/// What the server answers on a raw connection after writing `head` (a status line, or
/// "closed" when it closes without one), and how long that took.
async fn raw(addr: std::net::SocketAddr, head: &str) -> (String, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = Instant::now();
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf))
        .await
        .expect("the server neither answered nor closed within 30 s")
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]);
    let line = text.lines().next().unwrap_or("closed").to_string();
    (line, t.elapsed())
}

/// Slow and idle clients cannot hold the server: a body that never arrives is a 408 at the
/// body deadline; idle connections beyond the connection cap are closed at the header
/// deadline, so `/healthz` is still answered; and SIGTERM with a client holding a
/// half-sent request ends the process within the grace period and the drain margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_clients_cannot_hold_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 2);
    let mut s = spawn(
        &model,
        &[
            "--dp",
            "1",
            "--header-timeout-seconds",
            "1",
            "--body-timeout-seconds",
            "1",
            "--max-connections",
            "4",
            "--grace-seconds",
            "1",
        ],
    );
    s.wait_ready().await;

    // A Content-Length that lies: 408 at the body deadline, as JSON.
    let (line, took) = raw(
        s.addr,
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"class_label\":",
    )
    .await;
    assert!(line.contains(" 408 "), "{line}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Twice the connection cap of idle connections (nothing sent): each closes at the
    // header deadline, so a real request is served within a few seconds.
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(tokio::net::TcpStream::connect(s.addr).await.unwrap());
    }
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(20), s.call("GET", "/healthz", None))
        .await
        .expect("/healthz was not answered while idle connections held every slot");
    assert_eq!(r.status, 200);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    drop(idle);

    // SIGTERM while a client holds a half-sent request.
    use tokio::io::AsyncWriteExt;
    let mut slow = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let t = Instant::now();
    s.sigterm();
    let status = s.exit_status(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    drop(slow);
}

/// A client that goes away during a synchronous request: its job is cancelled and the rank
/// is free at its next step boundary, not after the request's thousand steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_request_frees_the_rank() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 2);
    let s = spawn(&model, &["--dp", "1", "--max-steps", "1000"]);
    s.wait_ready().await;
    let body = json!({ "class_label": 1, "steps": 1000, "size": "128x128" }).to_string();
    let mut c = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    s.wait_gauges(0.0, 1.0).await;
    let t = Instant::now();
    drop(c);
    s.wait_gauges(0.0, 0.0).await;
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let m = String::from_utf8(s.call("GET", "/metrics", None).await.body).unwrap();
    assert!(
        m.contains("layerwise_requests_finished_total{outcome=\"cancelled\"} 1"),
        "{m}"
    );
}

#[test]
fn a_budget_too_small_fails_the_pod_at_start_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 2);
    let out = Command::new(BIN)
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--dp",
            "2",
            "--device-memory-mib",
            "0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The memory model's need is checked before any rank starts: the error names the
    // budget and what the need is made of.
    assert!(
        err.contains("device-memory")
            && err.contains("but the budget is 0 bytes")
            && err.contains("slots"),
        "{err}"
    );
}

#[test]
fn a_two_rank_trace_shows_copy_gather_and_compute_overlapping() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny(dir.path(), 4);
    let trace = dir.path().join("trace.json");
    let out = Command::new(BIN)
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args([
            "--dp",
            "2",
            "--n",
            "2",
            "--steps",
            "2",
            "--strategy",
            "offload-sharded",
            "--out",
        ])
        .arg(dir.path().join("x.png"))
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let spans: Vec<(u64, String, f64, f64)> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["args"]["rank"].as_u64().unwrap(),
                e["cat"].as_str().unwrap().to_string(),
                e["ts"].as_f64().unwrap(),
                e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    for rank in 0..2 {
        for cat in ["copy", "gather", "compute"] {
            // 4 blocks × 2 steps, every one copied, gathered and computed.
            assert_eq!(
                spans.iter().filter(|s| s.0 == rank && s.1 == cat).count(),
                8,
                "rank {rank} {cat}"
            );
        }
    }
    let overlaps = |a: &str, b: &str| {
        spans.iter().any(|x| {
            x.1 == a
                && spans
                    .iter()
                    .any(|y| y.1 == b && y.0 == x.0 && x.2 < y.3 && y.2 < x.3)
        })
    };
    assert!(
        overlaps("compute", "copy") || overlaps("compute", "gather"),
        "transfers overlap compute"
    );
    let out = Command::new(BIN)
        .arg("trace-svg")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success());
    let svg = std::fs::read_to_string(trace.with_extension("svg")).unwrap();
    assert!(svg.contains("rank 1 gather") && svg.contains("rank 0 compute"));
}
