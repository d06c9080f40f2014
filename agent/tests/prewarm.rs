//! Prewarm against the real page cache and a real memory cgroup: a file evicted with
//! `posix_fadvise(DONTNEED)` goes from about 0% to 100% resident (mincore), and files larger
//! than the prewarm cgroup's budget keep the cgroup within it and are reported as too big.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};
use layerwise_agent::cgroup::{self, PrewarmCgroup};
use layerwise_agent::pagecache;

const AGENT: &str = env!("CARGO_BIN_EXE_layerwise-agent");
const MIB: u64 = 1 << 20;

fn write_synced(path: &Path, bytes: u64) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let block: Vec<u8> = (0..MIB).map(|i| (i * 31 % 251) as u8).collect();
    for _ in 0..bytes / MIB {
        f.write_all(&block)?;
    }
    // Only clean pages can be dropped.
    f.sync_all()?;
    Ok(())
}

fn agent(args: &[&str]) -> Result<String> {
    let out = Command::new(AGENT)
        .args(args)
        .output()
        .context("running the agent")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "layerwise-agent {args:?} failed: {text}"
    );
    Ok(text)
}

#[test]
fn evicted_file_is_warmed_from_near_zero_to_full_residency() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("weights.safetensors");
    write_synced(&path, 64 * MIB)?;
    pagecache::evict(&path)?;
    let before = pagecache::residency(&path)?;
    ensure!(
        before.percent() < 5.0,
        "evicted file still {:.1}% resident",
        before.percent()
    );
    let out = agent(&["prewarm", "--memory-floor", "0", path.to_str().unwrap()])?;
    let after = pagecache::residency(&path)?;
    println!(
        "residency {:.1}% -> {:.1}%\n{out}",
        before.percent(),
        after.percent()
    );
    // Every byte was read, but the kernel may reclaim a page or two before mincore looks
    // (the other test in this binary is squeezing a cgroup at the same time).
    ensure!(after.percent() >= 99.9, "after prewarm: {after:?}");
    ensure!(out.contains("state: Warm"), "{out}");
    Ok(())
}

/// A fresh child of this process's memory cgroup, or why there cannot be one here.
fn test_cgroup(budget: u64) -> Result<Result<(PrewarmCgroup, String), String>> {
    let own = match cgroup::own_path() {
        Ok(p) => p,
        Err(e) => return Ok(Err(format!("no memory cgroup: {e}"))),
    };
    let path = format!(
        "{}/layerwise-prewarm-test-{}",
        own.trim_end_matches('/'),
        std::process::id()
    );
    match PrewarmCgroup::create(&path, budget) {
        Ok(cg) => Ok(Ok((cg, path))),
        Err(e) => Ok(Err(format!(
            "the cgroup file system is not writable here ({e})"
        ))),
    }
}

#[test]
fn files_over_the_budget_stay_within_the_prewarm_cgroup_and_are_reported() -> Result<()> {
    let budget = 32 * MIB;
    let (cg, path) = match test_cgroup(budget)? {
        Ok(x) => x,
        Err(why) => {
            println!("SKIPPED: {why}");
            return Ok(());
        }
    };
    // The agent reuses the cgroup (create is idempotent) and sets the same limit.
    let result = (|| -> Result<()> {
        let dir = tempfile::tempdir()?;
        let files: Vec<PathBuf> = (0..3)
            .map(|i| dir.path().join(format!("shard-{i}.safetensors")))
            .collect();
        for f in &files {
            write_synced(f, 32 * MIB)?;
            pagecache::evict(f)?;
        }
        let out = agent(&[
            "prewarm",
            "--memory-floor",
            "0",
            "--prewarm-cgroup",
            &path,
            "--cache-budget",
            &budget.to_string(),
            dir.path().to_str().unwrap(),
        ])?;
        let mem = cg.memory()?;
        let after = pagecache::residency_of(&files)?;
        println!("{out}cgroup {path}: {mem:?}; residency {after:?}");
        ensure!(mem.limit == Some(budget), "limit {:?}", mem.limit);
        ensure!(
            mem.peak > 0 && mem.usage > 0,
            "nothing was charged to the prewarm cgroup: {mem:?}"
        );
        ensure!(
            mem.peak <= budget,
            "peak {} over the budget {budget}",
            mem.peak
        );
        ensure!(
            after.resident <= budget + MIB,
            "more resident than the budget: {after:?}"
        );
        ensure!(out.contains("budget too small"), "{out}");
        ensure!(!out.contains("state: Warm\n"), "{out}");
        Ok(())
    })();
    // The worker has exited: the cgroup is empty and can go (its charges move to the parent).
    cg.delete()?;
    result
}
