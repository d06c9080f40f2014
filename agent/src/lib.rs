//! The layerwise node agent: one per accelerator node (a DaemonSet), the only writer of its
//! node's `DiffusionNode` status. It reports what the node has (accelerators, host memory,
//! the pods' cgroup limit), profiles the checkpoints the operator asks for from their headers,
//! and warms their files into the page cache without ever pushing the node into pressure:
//! the readers run in a child cgroup whose memory limit is the node's cache budget, at a
//! bandwidth cap, and stop when available memory falls below a floor.
//!
//! Pure decisions (token bucket, residency math, meminfo parsing, status assembly) sit in
//! small modules with unit tests; side effects (files, cgroups, NVML, Kubernetes) at the edges.

pub mod bucket;
pub mod cache;
pub mod cgroup;
pub mod error;
pub mod http;
pub mod inventory;
pub mod meminfo;
pub mod metrics;
pub mod models;
pub mod node;
pub mod pagecache;
pub mod prewarm;
pub mod profiler;
pub mod staged;
pub mod worker;

pub use error::{Error, Result};
