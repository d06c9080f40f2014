//! The builtin autoscaler: engine pods' load (queued + running requests, read from their
//! `/metrics`) to a replica count. The formula and the scale-down delay are pure functions;
//! the load comes through [`LoadSource`] so tests can feed it.
//!
//! The same load ranks the pods for a scale-down ([`deletion_cost`]).
//!
//! A pod whose load cannot be read is not idle: what the others report is only a lower
//! bound of the load, so it may scale up but never down (missing data holds the replicas).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use layerwise_core::metric_names as names;
use prometheus_parse::{Scrape, Value};

/// Bounds and target from the spec's `autoscaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: i32,
    pub max: i32,
    /// Requests one replica should carry.
    pub target: u32,
    /// How long load must stay low before replicas are removed.
    pub delay: Duration,
}

/// Replicas for `load` requests: ceil(load / target), clamped to [min, max].
pub fn desired(load: u64, b: &Bounds) -> i32 {
    let want = load.div_ceil(u64::from(b.target.max(1)));
    let want = i32::try_from(want).unwrap_or(i32::MAX);
    want.clamp(b.min.max(0), b.max.max(b.min.max(0)))
}

/// One autoscaler step's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub replicas: i32,
    /// Since when a scale-down has been pending (kept in status between steps).
    pub pending_since: Option<Timestamp>,
}

/// What the autoscaler read of the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// Requests queued and running over the pods that answered.
    pub load: u64,
    /// Whether every running pod answered.
    pub complete: bool,
}

/// Scales up at once; scales down only once the load has wanted fewer replicas for the whole
/// delay, then to what the load wants now. With a pod unread the load is a lower bound: it
/// may scale up, but holds the replicas otherwise and restarts the delay.
pub fn step(
    current: i32,
    observed: Observed,
    b: &Bounds,
    pending_since: Option<Timestamp>,
    now: Timestamp,
) -> Step {
    let want = desired(observed.load, b);
    let current = current.clamp(b.min.max(0), b.max.max(b.min.max(0)));
    if want >= current || !observed.complete {
        return Step {
            replicas: want.max(current),
            pending_since: None,
        };
    }
    let since = pending_since.unwrap_or(now);
    let waited = now.duration_since(since).unsigned_abs();
    if waited >= b.delay {
        Step {
            replicas: want,
            pending_since: None,
        }
    } else {
        Step {
            replicas: current,
            pending_since: Some(since),
        }
    }
}

/// What one engine pod reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PodLoad {
    pub queued: u64,
    pub running: u64,
}

impl PodLoad {
    pub fn total(&self) -> u64 {
        self.queued + self.running
    }
}

/// Where the autoscaler reads a pod's load.
pub trait LoadSource: Send + Sync {
    fn load<'a>(&'a self, pod: &'a Pod) -> BoxFuture<'a, Result<PodLoad, String>>;
}

/// The pods whose load is read: running, and not being deleted.
pub fn running(pods: &[Arc<Pod>]) -> Vec<Arc<Pod>> {
    pods.iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .cloned()
        .collect()
}

/// Reads the load of each of `pods` from `source`, all at once.
pub async fn read(source: &dyn LoadSource, pods: &[Arc<Pod>]) -> Vec<Result<PodLoad, String>> {
    futures::future::join_all(pods.iter().map(|p| source.load(p))).await
}

/// The annotation a ReplicaSet ranks pods by when it removes some (lower goes first).
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// When the operator last wrote [`DELETION_COST`] on the pod (Unix seconds).
pub const DELETION_COST_AT: &str = "layerwise.dev/deletion-cost-at";

/// A pod's `controller.kubernetes.io/pod-deletion-cost` from its load: the requests it has
/// queued or running, so a ReplicaSet scaling down removes the pods with the least work
/// first (an idle pod costs 0). Capped at `i32::MAX`, the annotation's range.
pub fn deletion_cost(load: &PodLoad) -> i32 {
    i32::try_from(load.total()).unwrap_or(i32::MAX)
}

/// Reads the engine's queue depth and running requests (`metric_names::QUEUE_DEPTH` and
/// `RUNNING_REQUESTS`) from a Prometheus text page, summing the series of each name; a
/// negative or non-finite value counts as 0.
pub fn parse_metrics(text: &str) -> Result<PodLoad, String> {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .map_err(|e| format!("unreadable metrics page: {e}"))?;
    let mut load = PodLoad::default();
    for sample in &scrape.samples {
        let (Value::Gauge(v) | Value::Untyped(v) | Value::Counter(v)) = sample.value else {
            continue;
        };
        let v = if v.is_finite() && v > 0.0 {
            v.round() as u64
        } else {
            0
        };
        if sample.metric == names::QUEUE_DEPTH.full {
            load.queued += v;
        } else if sample.metric == names::RUNNING_REQUESTS.full {
            load.running += v;
        }
    }
    Ok(load)
}

/// The most of a `/metrics` page read: an engine's is a few KiB.
const MAX_PAGE: usize = 4 << 20;

/// Reads `/metrics` from the pod's IP over HTTP/1 (connections pooled across scrapes), with
/// a timeout over the whole exchange.
#[derive(Clone)]
pub struct HttpLoad {
    port: u16,
    timeout: Duration,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl HttpLoad {
    pub fn new(port: u16, timeout: Duration) -> HttpLoad {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        HttpLoad {
            port,
            timeout,
            client,
        }
    }

    async fn fetch(&self, url: &str) -> Result<PodLoad, String> {
        let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let res = self
            .client
            .get(uri)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !res.status().is_success() {
            return Err(format!("{url} answered {}", res.status()));
        }
        let body = Limited::new(res.into_body(), MAX_PAGE)
            .collect()
            .await
            .map_err(|e| format!("reading {url}: {e}"))?
            .to_bytes();
        let text = std::str::from_utf8(&body).map_err(|e| format!("{url}: {e}"))?;
        parse_metrics(text).map_err(|e| format!("{url}: {e}"))
    }
}

impl LoadSource for HttpLoad {
    fn load<'a>(&'a self, pod: &'a Pod) -> BoxFuture<'a, Result<PodLoad, String>> {
        Box::pin(async move {
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .ok_or("pod has no IP yet")?;
            let ip: std::net::IpAddr = ip.parse().map_err(|e| format!("pod IP {ip}: {e}"))?;
            let url = format!(
                "http://{}/metrics",
                std::net::SocketAddr::new(ip, self.port)
            );
            tokio::time::timeout(self.timeout, self.fetch(&url))
                .await
                .map_err(|_| format!("{url} timed out"))?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(load: u64) -> Observed {
        Observed {
            load,
            complete: true,
        }
    }

    fn b(min: i32, max: i32, target: u32, delay_s: u64) -> Bounds {
        Bounds {
            min,
            max,
            target,
            delay: Duration::from_secs(delay_s),
        }
    }

    #[test]
    fn desired_is_ceil_of_load_over_target_clamped() {
        let bounds = b(1, 10, 4, 0);
        assert_eq!(desired(0, &bounds), 1);
        assert_eq!(desired(4, &bounds), 1);
        assert_eq!(desired(5, &bounds), 2);
        assert_eq!(desired(17, &bounds), 5);
        assert_eq!(desired(1000, &bounds), 10);
        assert_eq!(desired(0, &b(0, 3, 1, 0)), 0, "scale to zero when min is 0");
        assert_eq!(desired(u64::MAX, &b(0, 3, 1, 0)), 3);
    }

    #[test]
    fn scales_up_at_once_and_down_after_the_delay() {
        let bounds = b(1, 8, 2, 60);
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let up = step(1, all(9), &bounds, None, t0);
        assert_eq!(
            up,
            Step {
                replicas: 5,
                pending_since: None
            }
        );
        // Load drops: nothing changes yet, the wait starts.
        let s1 = step(5, all(1), &bounds, None, t0);
        assert_eq!(
            s1,
            Step {
                replicas: 5,
                pending_since: Some(t0)
            }
        );
        let t1 = t0 + Duration::from_secs(59);
        assert_eq!(step(5, all(1), &bounds, s1.pending_since, t1).replicas, 5);
        let t2 = t0 + Duration::from_secs(60);
        assert_eq!(
            step(5, all(1), &bounds, s1.pending_since, t2),
            Step {
                replicas: 1,
                pending_since: None
            }
        );
        // A load spike while waiting cancels the wait.
        assert_eq!(
            step(5, all(10), &bounds, s1.pending_since, t1),
            Step {
                replicas: 5,
                pending_since: None
            }
        );
    }

    #[test]
    fn a_pod_that_cannot_be_read_holds_the_replicas() {
        let bounds = b(1, 8, 2, 60);
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let partial = |load| Observed {
            load,
            complete: false,
        };
        // Idle as far as the readable pods say: no scale-down, no wait started.
        assert_eq!(
            step(5, partial(0), &bounds, None, t0),
            Step {
                replicas: 5,
                pending_since: None
            }
        );
        // A wait under way restarts; the delay runs again once every pod answers.
        let t1 = t0 + Duration::from_secs(120);
        assert_eq!(
            step(5, partial(1), &bounds, Some(t0), t1),
            Step {
                replicas: 5,
                pending_since: None
            }
        );
        assert_eq!(step(5, all(1), &bounds, None, t1).replicas, 5);
        // What the readable pods report already wants more: scale up.
        assert_eq!(step(2, partial(9), &bounds, None, t0).replicas, 5);
    }

    #[test]
    fn out_of_bounds_current_is_brought_into_bounds() {
        assert_eq!(
            step(20, all(100), &b(1, 4, 1, 60), None, Timestamp::UNIX_EPOCH).replicas,
            4
        );
        assert_eq!(
            step(0, all(0), &b(2, 4, 1, 60), None, Timestamp::UNIX_EPOCH).replicas,
            2
        );
    }

    #[test]
    fn the_deletion_cost_is_the_work_a_pod_holds() {
        let load = |queued, running| PodLoad { queued, running };
        assert_eq!(deletion_cost(&load(0, 0)), 0);
        assert_eq!(deletion_cost(&load(3, 1)), 4);
        assert_eq!(deletion_cost(&load(u64::MAX / 2, 7)), i32::MAX);
    }

    #[test]
    fn parses_prometheus_text() {
        let text =
            "# HELP layerwise_queue_depth Requests waiting\n# TYPE layerwise_queue_depth gauge\n\
            layerwise_queue_depth 3\nlayerwise_running_requests{rank=\"0\"} 1\n\
            layerwise_running_requests{rank=\"1\"} 1 1700000000000\nother_metric 9\n";
        assert_eq!(
            parse_metrics(text).unwrap(),
            PodLoad {
                queued: 3,
                running: 2
            }
        );
        assert_eq!(parse_metrics("garbage\n").unwrap(), PodLoad::default());
    }

    /// A pod at 127.0.0.1 whose engine serves `page` at /metrics on the returned port.
    async fn engine_pod(page: String) -> (Pod, u16) {
        use k8s_openapi::api::core::v1::PodStatus;
        let app =
            axum::Router::new().route("/metrics", axum::routing::get(move || async move { page }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let pod = Pod {
            status: Some(PodStatus {
                pod_ip: Some("127.0.0.1".into()),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        (pod, port)
    }

    #[tokio::test]
    async fn reads_the_engines_own_metrics_page_over_http() {
        // The page the engine's server renders, with its own names.
        let metrics = layerwise_engine::server::metrics::Metrics::new(2);
        metrics.queue_depth.set(5);
        metrics.running.set(2);
        metrics.finished("succeeded");
        let (pod, port) = engine_pod(metrics.render()).await;
        let source = HttpLoad::new(port, Duration::from_secs(5));
        let want = PodLoad {
            queued: 5,
            running: 2,
        };
        assert_eq!(source.load(&pod).await.unwrap(), want);
        // Again, over the pooled connection.
        assert_eq!(source.load(&pod).await.unwrap(), want);

        // Nothing listening: an error that names the URL.
        let closed = HttpLoad::new(1, Duration::from_secs(5));
        let err = closed.load(&pod).await.unwrap_err();
        assert!(err.contains("http://127.0.0.1:1/metrics"), "{err}");
        // No IP yet.
        let err = source.load(&Pod::default()).await.unwrap_err();
        assert!(err.contains("no IP"), "{err}");
    }
}
