//! Peak anonymous resident memory of this process, sampled from /proc. Weights mapped
//! from the checkpoint are file-backed and do not count; what does count is every copy
//! the process makes, which is what the offload strategies promise to keep small.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Current anonymous RSS in bytes (0 where /proc is unavailable).
pub fn anon_rss() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Samples anonymous RSS every few milliseconds until dropped.
pub struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RssSampler {
    pub fn start() -> Self {
        let peak = Arc::new(AtomicU64::new(anon_rss()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("rss-sampler".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    p.fetch_max(anon_rss(), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
            .ok();
        RssSampler { peak, stop, thread }
    }

    pub fn peak(&self) -> u64 {
        self.peak
            .fetch_max(anon_rss(), Ordering::Relaxed)
            .max(anon_rss())
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
