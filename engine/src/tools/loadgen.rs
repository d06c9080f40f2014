//! `layerwise loadgen`: a closed-loop load generator for the server (C clients, N
//! requests, bounded in count and time, loopback only), and the small HTTP/1.1 client it
//! and the tests use.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{Error, Result};

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::invalid(
                "response",
                format!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)),
            )
        })
    }
}

/// One HTTP/1.1 exchange (`Connection: close`) with a loopback server, within `timeout`.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse> {
    if !addr.ip().is_loopback() {
        return Err(Error::invalid(
            "url",
            format!("{addr}: only loopback addresses are allowed"),
        ));
    }
    let io = |e: std::io::Error| Error::internal(format!("{method} {path} to {addr}"), e);
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
        let body = body.unwrap_or_default();
        let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
        s.write_all(head.as_bytes()).await.map_err(io)?;
        s.write_all(body).await.map_err(io)?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.map_err(io)?;
        parse_response(&buf)
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| {
        Error::unavailable(format!(
            "{method} {path} to {addr}: no answer within {timeout:?}"
        ))
    })?
}

fn parse_response(buf: &[u8]) -> Result<HttpResponse> {
    let bad = |what: &str| Error::bug(format!("malformed response: {what}"));
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| bad("headers are not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = buf[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let nl = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or_else(|| bad("chunk size"))?;
            let size = usize::from_str_radix(
                std::str::from_utf8(&rest[..nl])
                    .map_err(|_| bad("chunk size"))?
                    .trim(),
                16,
            )
            .map_err(|_| bad("chunk size"))?;
            if size == 0 {
                break;
            }
            let data = rest
                .get(nl + 2..nl + 2 + size)
                .ok_or_else(|| bad("short chunk"))?;
            out.extend_from_slice(data);
            rest = rest.get(nl + 4 + size..).unwrap_or_default();
        }
        body = out;
    }
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// Resolves an `http://host:port` URL to a loopback socket address.
pub async fn loopback(url: &str) -> Result<SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| Error::invalid("url", format!("`{url}`: expected http://HOST:PORT")))?;
    let hostport = rest.split('/').next().unwrap_or_default();
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| Error::invalid("url", format!("`{url}`: {e}")))?
        .collect();
    addrs
        .into_iter()
        .find(|a| a.ip().is_loopback())
        .ok_or_else(|| {
            Error::invalid(
                "url",
                format!("`{url}`: not a loopback address; loadgen only talks to this machine"),
            )
        })
}

/// `layerwise loadgen` options.
#[derive(Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// The server, e.g. http://127.0.0.1:8080 (loopback only).
    #[arg(long, env = "LAYERWISE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Requests in flight at once.
    #[arg(long, env = "LAYERWISE_CONCURRENCY", default_value_t = 4)]
    pub concurrency: usize,
    /// Requests in all (at most 10000).
    #[arg(long, env = "LAYERWISE_REQUESTS", default_value_t = 32)]
    pub requests: usize,
    /// Stop sending after this many seconds.
    #[arg(long, env = "LAYERWISE_DURATION_SECONDS", default_value_t = 300)]
    pub duration_seconds: u64,
    /// Denoising steps per request.
    #[arg(long, env = "LAYERWISE_STEPS", default_value_t = 10)]
    pub steps: usize,
    /// Image size `WxH` (default: the model's native size).
    #[arg(long, env = "LAYERWISE_SIZE")]
    pub size: Option<String>,
    /// Classifier-free guidance scale.
    #[arg(long, env = "LAYERWISE_GUIDANCE", default_value_t = 4.0)]
    pub guidance: f32,
}

/// What a load run measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    pub status_counts: std::collections::BTreeMap<u16, usize>,
    pub wall_seconds: f64,
    pub outputs_per_second: f64,
    pub latency_p50: f64,
    pub latency_p90: f64,
    pub latency_p99: f64,
    pub latency_max: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs the load: `concurrency` clients send requests until `requests` have been sent or
/// the duration is over.
pub async fn run(a: &LoadgenArgs) -> Result<LoadReport> {
    let addr = loopback(&a.url).await?;
    let total = a.requests.min(10_000);
    let deadline = Instant::now() + Duration::from_secs(a.duration_seconds);
    // Text families get a prompt, class-conditional ones a class label.
    let models = http(addr, "GET", "/v1/models", None, Duration::from_secs(30))
        .await?
        .json()?;
    let text = models["data"][0]["conditioning"] == "text";
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency.max(1) {
        let (next, a) = (next.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= total || Instant::now() >= deadline {
                    return out;
                }
                let mut body = serde_json::json!({ "seed": i, "steps": a.steps, "guidance": a.guidance, "response_format": "url" });
                if text {
                    body["prompt"] = format!("a photograph, take {i}").into();
                } else {
                    body["class_label"] = (i % 1000).into();
                }
                if let Some(s) = &a.size {
                    body["size"] = s.clone().into();
                }
                let t = Instant::now();
                let left = deadline.saturating_duration_since(t).max(Duration::from_secs(1));
                let r = http(addr, "POST", "/v1/images/generations", Some(body.to_string().as_bytes()), left).await;
                out.push((r.map(|r| r.status).unwrap_or(0), t.elapsed().as_secs_f64()));
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(
            t.await
                .map_err(|e| Error::internal("a load generator task failed", e))?,
        );
    }
    let wall = start.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = results
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, l)| *l)
        .collect();
    lat.sort_by(|x, y| x.total_cmp(y));
    let mut status_counts = std::collections::BTreeMap::new();
    for (s, _) in &results {
        *status_counts.entry(*s).or_insert(0) += 1;
    }
    Ok(LoadReport {
        requests: results.len(),
        ok: lat.len(),
        errors: results.len() - lat.len(),
        status_counts,
        wall_seconds: wall,
        outputs_per_second: lat.len() as f64 / wall.max(1e-9),
        latency_p50: percentile(&lat, 0.5),
        latency_p90: percentile(&lat, 0.9),
        latency_p99: percentile(&lat, 0.99),
        latency_max: lat.last().copied().unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let r = parse_response(
            b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!(
            (r.status, r.header("Retry-After"), r.body.as_slice()),
            (429, Some("3"), &b"{}"[..])
        );
        let r = parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!(r.body, b"abcde");
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.5), 2.0);
    }

    #[tokio::test]
    async fn refuses_other_hosts() {
        let e = http(
            "10.0.0.1:80".parse().unwrap(),
            "GET",
            "/",
            None,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("loopback"), "{e}");
    }
}
