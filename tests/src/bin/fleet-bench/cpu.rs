//! CPU time: the operator's process, the control plane's (etcd, kube-apiserver, the
//! controller manager, the scheduler, kwok) and the machine's, between two readings.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// CPU seconds by part of the machine (see [`control_plane_cpu`]).
pub(super) type Cpu = BTreeMap<&'static str, f64>;

/// What the control plane costs with nothing to do but keep the fleet: kwok's lease
/// renewals and node heartbeats for every node.
pub(super) async fn print_idle_cpu() {
    let idle = Duration::from_secs(10);
    let (c0, t) = (control_plane_cpu(), Instant::now());
    tokio::time::sleep(idle).await;
    println!(
        "cpu before the deployments: {}",
        cpu_between(&c0, &control_plane_cpu(), t.elapsed().as_secs_f64())
    );
}

/// A process's command name (`comm`, at most 15 characters) and the CPU time it has used
/// (user + system), seconds; `pid` is a /proc entry ("self" for this process).
pub(super) fn process_cpu(pid: &str) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    // Fields after the command (which may hold spaces) start at the state, field 3; utime
    // and stime are fields 14 and 15, so 11 and 12 counted from the state.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((comm, (ticks(11) + ticks(12)) as f64 / hz))
}

/// CPU seconds used so far by each part of the machine's control plane (the processes of
/// these names) and by this benchmark (its fake agents and watches).
pub(super) fn control_plane_cpu() -> Cpu {
    const PARTS: [(&str, &str); 5] = [
        ("etcd", "etcd"),
        ("kube-apiserver", "apiserver"),
        ("kube-controller", "controller-manager"),
        ("kube-scheduler", "scheduler"),
        ("kwok", "kwok"),
    ];
    let mut out: Cpu = PARTS.iter().map(|(_, n)| (*n, 0.0)).collect();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some((comm, secs)) = process_cpu(pid) {
            if let Some((_, part)) = PARTS.iter().find(|(c, _)| *c == comm) {
                *out.entry(part).or_default() += secs;
            }
        }
    }
    out.insert("benchmark", process_cpu("self").map_or(0.0, |(_, s)| s));
    out
}

/// What each part used between two samples of [`control_plane_cpu`], as a line.
pub(super) fn cpu_between(a: &Cpu, b: &Cpu, wall: f64) -> String {
    let mut total = 0.0;
    let parts: Vec<String> = b
        .iter()
        .map(|(k, v)| {
            let used = v - a.get(k).copied().unwrap_or(0.0);
            total += used;
            format!("{k} {used:.1} s")
        })
        .collect();
    format!(
        "{} in {wall:.1} s ({:.2} cores)",
        parts.join(", "),
        total / wall.max(1e-9)
    )
}
