//! cgroup memory accounting, v1 and v2 alike (through `cgroups-rs`).
//!
//! Two cgroups matter to the agent. The *pods* cgroup (a flag names it; `kubepods` or
//! `kubepods.slice` on most nodes) bounds what engine pods can use: its limit and usage go
//! into the node's status. The *prewarm* cgroup is the agent's own child cgroup whose memory
//! limit is the node's page-cache budget. Page cache is charged to the cgroup of the task
//! that first reads it, so running the prewarm readers there bounds the cache they bring in:
//! at the limit the kernel reclaims the oldest warmed pages of that cgroup, never anyone
//! else's memory.
//!
//! Placement is by process: each prewarm job is a short-lived child process (see
//! [`crate::worker`]) written to the cgroup's `cgroup.procs` before it reads anything. That
//! is the same on v1 and v2 (v2 would refuse single threads of a domain cgroup without
//! threaded mode). The cgroup stays after a job, so its cache stays accounted to it.
//!
//! Paths are relative to the hierarchy's root (`/sys/fs/cgroup/memory` on v1,
//! `/sys/fs/cgroup` on v2), with or without a leading `/`.

use cgroups_rs::memory::{MemController, SetMemory};
use cgroups_rs::{Cgroup, CgroupPid, MaxValue};

use crate::{Error, Result};

/// Limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page).
const UNLIMITED: u64 = 1 << 62;

/// A cgroup's memory numbers in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupMemory {
    /// The hard limit, `None` when there is none.
    pub limit: Option<u64>,
    pub usage: u64,
    /// The highest usage seen (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`; 0 when the
    /// kernel does not report it).
    pub peak: u64,
}

/// Whether this node runs the unified (v2) hierarchy.
pub fn is_v2() -> bool {
    cgroups_rs::hierarchies::is_cgroup2_unified_mode()
}

fn rel(path: &str) -> &str {
    path.trim_start_matches('/')
}

fn load(path: &str) -> Cgroup {
    Cgroup::load_with_specified_controllers(
        cgroups_rs::hierarchies::auto(),
        rel(path),
        vec!["memory".to_string()],
    )
}

fn limit_of(v: i64) -> Option<u64> {
    (v >= 0 && (v as u64) < UNLIMITED).then_some(v as u64)
}

fn memory_of(cg: &Cgroup, path: &str) -> Result<CgroupMemory> {
    let mem: &MemController = cg.controller_of().ok_or_else(|| {
        Error::cgroup(
            path,
            "no memory controller (is it enabled for this cgroup?)",
        )
    })?;
    if cg.v2() {
        // memory_stat() panics on v2 when memory.max and friends are absent (the root).
        let set = mem.get_mem().map_err(|e| Error::cgroup(path, e))?;
        let stat = mem.memory_stat();
        let limit = match set.max {
            Some(MaxValue::Value(v)) => limit_of(v),
            _ => None,
        };
        return Ok(CgroupMemory {
            limit,
            usage: stat.usage_in_bytes,
            peak: stat.max_usage_in_bytes,
        });
    }
    let stat = mem.memory_stat();
    Ok(CgroupMemory {
        limit: limit_of(stat.limit_in_bytes),
        usage: stat.usage_in_bytes,
        peak: stat.max_usage_in_bytes,
    })
}

/// The memory limit and usage of the cgroup at `path` (the pods' cgroup, for the inventory).
pub fn memory(path: &str) -> Result<CgroupMemory> {
    let cg = load(path);
    if !cg.exists() {
        return Err(Error::cgroup(path, "does not exist"));
    }
    memory_of(&cg, path)
}

/// This process's own memory cgroup path (from `/proc/self/cgroup`), relative to the root.
pub fn own_path() -> Result<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| Error::io("/proc/self/cgroup", e))?;
    own_path_in(&text, is_v2())
        .ok_or_else(|| Error::cgroup("/proc/self/cgroup", "no memory cgroup line"))
}

/// The memory cgroup in the text of a `/proc/<pid>/cgroup` file.
pub fn own_path_in(text: &str, v2: bool) -> Option<String> {
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let ours = if v2 {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == "memory")
        };
        ours.then(|| rel(path).to_string())
    })
}

/// The agent's prewarm cgroup: created (or reused) with the cache budget as its limit.
pub struct PrewarmCgroup {
    cg: Cgroup,
    path: String,
}

impl PrewarmCgroup {
    /// Creates the cgroup at `path` (its parent must exist) and sets its memory limit to
    /// `budget` bytes. Fails with a message naming the path when the cgroup file system is
    /// not writable here.
    pub fn create(path: &str, budget: u64) -> Result<PrewarmCgroup> {
        // Inside the cgroup tree, never above it: `../../..` would leave it.
        if std::path::Path::new(path)
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(Error::cgroup(path, "must not contain `..`"));
        }
        let cg = Cgroup::new_with_specified_controllers(
            cgroups_rs::hierarchies::auto(),
            rel(path),
            Some(vec!["memory".to_string()]),
        )
        .map_err(|e| Error::cgroup(path, format!("creating: {e}")))?;
        // cgroups-rs only warns when v1 mkdir fails.
        if !cg.exists() {
            return Err(Error::cgroup(
                path,
                "could not be created (is the cgroup file system writable?)",
            ));
        }
        let mem: &MemController = cg
            .controller_of()
            .ok_or_else(|| Error::cgroup(path, "no memory controller"))?;
        let limit = i64::try_from(budget).unwrap_or(i64::MAX);
        if cg.v2() {
            mem.set_mem(SetMemory {
                max: Some(MaxValue::Value(limit)),
                ..Default::default()
            })
        } else {
            mem.set_limit(limit)
        }
        .map_err(|e| {
            Error::cgroup(
                path,
                format!("setting the memory limit to {budget} bytes: {e}"),
            )
        })?;
        if !cg.v2() {
            // Only v1 can reset the peak; on v2 memory.peak is the cgroup's lifetime high.
            let _ = mem.reset_max_usage();
        }
        Ok(PrewarmCgroup {
            cg,
            path: path.to_string(),
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Moves the whole process `pid` (all its threads) into this cgroup.
    pub fn add_process(&self, pid: u32) -> Result<()> {
        self.cg
            .add_task_by_tgid(CgroupPid::from(pid as u64))
            .map_err(|e| Error::cgroup(&self.path, format!("adding process {pid}: {e}")))
    }

    /// Limit, usage and peak now.
    pub fn memory(&self) -> Result<CgroupMemory> {
        memory_of(&self.cg, &self.path)
    }

    /// The budget (the limit as the kernel holds it, rounded to pages).
    pub fn budget(&self) -> Result<u64> {
        Ok(self.memory()?.limit.unwrap_or(u64::MAX))
    }

    /// Removes the cgroup (it must hold no process). Its cache charges move to the parent.
    pub fn delete(self) -> Result<()> {
        self.cg
            .delete()
            .map_err(|e| Error::cgroup(&self.path, format!("removing: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_path_is_found_on_both_versions() {
        let v1 = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        assert_eq!(own_path_in(v1, false).as_deref(), Some("process_api/abc"));
        let v2 = "0::/kubepods.slice/pod1.slice\n";
        assert_eq!(
            own_path_in(v2, true).as_deref(),
            Some("kubepods.slice/pod1.slice")
        );
        assert_eq!(own_path_in("1:cpu:/\n", false), None);
    }

    #[test]
    fn limits_near_two_to_the_63_are_no_limit() {
        assert_eq!(limit_of(9_223_372_036_854_771_712), None);
        assert_eq!(limit_of(-1), None);
        assert_eq!(limit_of(1 << 30), Some(1 << 30));
    }

    #[test]
    fn a_prewarm_cgroup_cannot_climb_out_of_the_tree() {
        for path in ["../../..", "kubepods/../../etc", ".."] {
            let e = PrewarmCgroup::create(path, 1 << 30)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("must not contain `..`"), "{path}: {e}");
        }
    }

    #[test]
    fn own_cgroup_memory_is_readable() {
        let path = own_path().unwrap();
        let m = memory(&path).unwrap();
        assert!(m.limit.is_none_or(|l| l > 0));
    }
}
