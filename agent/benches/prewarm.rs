//! Prewarm throughput against a plain sequential read of the same cold file, and the
//! bandwidth cap holding. Prints figures; asserts nothing.
//!
//! `cargo bench -p layerwise-agent --bench prewarm`
//! Environment: `LAYERWISE_BENCH_DIR` (where the test file goes; default the system temp
//! folder), `LAYERWISE_BENCH_BYTES` (file size, default 1Gi), `LAYERWISE_BENCH_ROUNDS` (3).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use layerwise_agent::pagecache;
use layerwise_agent::prewarm::{self, Options};
use layerwise_core::bytesize::parse_bytes;

fn make_file(path: &Path, bytes: u64) {
    if std::fs::metadata(path)
        .map(|m| m.len() == bytes)
        .unwrap_or(false)
    {
        return;
    }
    let mut f = File::create(path).unwrap();
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in block.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n]).unwrap();
        left -= n as u64;
    }
    // Dirty pages cannot be dropped: write them out so DONTNEED leaves the file cold.
    f.sync_all().unwrap();
}

fn cold(path: &Path) {
    pagecache::evict(path).unwrap();
    let r = pagecache::residency(path).unwrap();
    assert!(
        r.resident < r.total / 50,
        "could not evict {}: {r:?}",
        path.display()
    );
}

/// `dd if=path of=/dev/null bs=1M`, returning bytes/s.
fn sequential(path: &Path) -> f64 {
    cold(path);
    let t = Instant::now();
    let mut f = File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    total as f64 / t.elapsed().as_secs_f64()
}

fn warm(path: &Path, opts: &Options) -> (f64, f64) {
    cold(path);
    let out = prewarm::run(
        &[path.to_path_buf()],
        opts,
        &AtomicBool::new(false),
        &|_| {},
    )
    .unwrap();
    let r = pagecache::residency(path).unwrap();
    (out.throughput(), r.percent())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let dir = std::env::var_os("LAYERWISE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let bytes = std::env::var("LAYERWISE_BENCH_BYTES")
        .ok()
        .map(|s| parse_bytes(&s).unwrap())
        .unwrap_or(1 << 30);
    let rounds: usize = std::env::var("LAYERWISE_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let path = dir.join(format!("layerwise-prewarm-bench-{bytes}.bin"));
    make_file(&path, bytes);
    println!(
        "file {} ({} MB), {rounds} rounds, median",
        path.display(),
        bytes / 1_000_000
    );

    let configs: Vec<(String, Options)> = [1usize, 2, 4, 8]
        .iter()
        .map(|&t| {
            (
                format!("prewarm {t} thread(s)"),
                Options {
                    threads: t,
                    ..Options::default()
                },
            )
        })
        .collect();
    let mut seq = Vec::new();
    let mut results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        seq.push(sequential(&path));
        for (i, (_, o)) in configs.iter().enumerate() {
            results[i].push(warm(&path, o));
        }
    }
    let seq = median(seq);
    println!("{:<26} {:>8.0} MB/s", "sequential read (1 MiB)", seq / 1e6);
    for ((name, _), r) in configs.iter().zip(results) {
        let tp = median(r.iter().map(|x| x.0).collect());
        let res = r.iter().map(|x| x.1).fold(f64::MAX, f64::min);
        println!(
            "{name:<26} {:>8.0} MB/s  {:>5.1}% of sequential, residency after >= {res:.1}%",
            tp / 1e6,
            tp * 100.0 / seq
        );
    }

    // The cap: 300 MB at 100 MB/s should take about 3 s (less the one-chunk burst).
    let cap_bytes = 300_000_000u64;
    let cap_path = dir.join("layerwise-prewarm-bench-cap.bin");
    make_file(&cap_path, cap_bytes);
    for rate in [100_000_000u64, 50_000_000] {
        cold(&cap_path);
        let opts = Options {
            rate_bytes_per_s: Some(rate),
            ..Options::default()
        };
        let out = prewarm::run(
            std::slice::from_ref(&cap_path),
            &opts,
            &AtomicBool::new(false),
            &|_| {},
        )
        .unwrap();
        let expect = (cap_bytes - opts.chunk_bytes) as f64 / rate as f64;
        println!(
            "cap {:>4} MB/s on {} MB: {:.2}s (expected ~{expect:.2}s), {:.1} MB/s effective",
            rate / 1_000_000,
            cap_bytes / 1_000_000,
            out.seconds,
            out.throughput() / 1e6
        );
    }
    if std::env::var_os("LAYERWISE_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&cap_path);
    }
}
