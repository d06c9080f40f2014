//! What every part of the benchmark names: its namespace, its fake agents' field manager,
//! how many requests it keeps in flight and how long it waits for anything.

use std::time::Duration;

pub(super) const NS: &str = "fleet-bench";
pub(super) const AGENT: &str = "fleet-bench-agent";
pub(super) const GIB: u64 = 1 << 30;
/// Requests in flight while the fleet and the deployments are created.
pub(super) const PARALLEL: usize = 32;
pub(super) const WAIT: Duration = Duration::from_secs(600);
