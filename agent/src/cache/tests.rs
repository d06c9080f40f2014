//! The cache's rules without a store: what room-making evicts and refuses, that a copy is
//! invisible until published whole, and that the resume journal keeps only what matches.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use super::journal::Journal;
use super::*;

fn entry(key: &str, bytes: u64, age_s: u64) -> Entry {
    Entry {
        key: key.into(),
        bytes,
        last_used: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 - age_s),
    }
}

#[test]
fn room_is_made_from_the_least_recently_used_unreferenced_copies() {
    let entries = [
        entry("old", 40, 300),
        entry("older-but-in-use", 40, 900),
        entry("recent", 40, 10),
        entry("middle", 40, 100),
    ];
    let referenced = BTreeSet::from(["older-but-in-use".to_string()]);
    // 160 held, cap 200: 60 more needs 20 freed, so the oldest unreferenced copy goes.
    let evict = plan_room(&entries, &referenced, "new", 160, 60, 200, u64::MAX).unwrap();
    assert_eq!(evict, ["old"]);
    // 100 more: two go, oldest first, never the referenced one.
    let evict = plan_room(&entries, &referenced, "new", 160, 100, 200, u64::MAX).unwrap();
    assert_eq!(evict, ["old", "middle"]);
    // Room already: nothing goes.
    assert!(
        plan_room(&entries, &referenced, "new", 160, 40, 200, u64::MAX)
            .unwrap()
            .is_empty()
    );
    // The disk, not the cap, is short: evicting frees disk too.
    let evict = plan_room(&entries, &referenced, "new", 160, 30, 1000, 0).unwrap();
    assert_eq!(evict, ["old"]);
}

#[test]
fn a_model_that_cannot_fit_is_refused_by_name_evicting_nothing() {
    let entries = [entry("a", 40, 300), entry("in-use", 100, 900)];
    let referenced = BTreeSet::from(["in-use".to_string()]);
    let e = plan_room(&entries, &referenced, "new", 140, 150, 200, u64::MAX).unwrap_err();
    assert_eq!(e.fault, Fault::CacheFull);
    assert_eq!(e.fault.reason(), "CacheFull");
    assert!(
        e.msg.contains("150 more bytes")
            && e.msg.contains("cap of 200")
            && e.msg.contains("40 bytes of unused"),
        "{}",
        e.msg
    );
    // The disk cannot hold it even with every unused copy gone.
    let e = plan_room(&entries, &referenced, "new", 140, 50, 10_000, 5).unwrap_err();
    assert!(e.msg.contains("5 bytes free"), "{}", e.msg);
}

fn manifest(files: &[(&str, u64)]) -> Manifest {
    Manifest {
        source: "s3://models/dit/".into(),
        files: files
            .iter()
            .map(|(p, s)| FileEntry {
                path: p.to_string(),
                size: *s,
                etag: None,
            })
            .collect(),
    }
}

#[test]
fn a_copy_is_invisible_until_published_whole_and_gone_once_evicted() {
    let d = tempfile::tempdir().unwrap();
    let cache = Cache::open(d.path(), 1 << 20).unwrap();
    let partial = cache.partial_dir("m");
    std::fs::create_dir_all(partial.join("vae")).unwrap();
    std::fs::write(partial.join("vae/config.json"), b"{}").unwrap();
    assert_eq!(cache.lookup("m"), None);
    assert!(cache.entries().unwrap().is_empty());
    let (mut j, _) = Journal::open(&partial, "vae/config.json", None, 2, 1).unwrap();
    j.done(0).unwrap();
    let dir = cache
        .publish("m", &manifest(&[("vae/config.json", 2)]))
        .unwrap();
    let manifest_time = || {
        std::fs::metadata(dir.join(MANIFEST))
            .unwrap()
            .modified()
            .unwrap()
    };
    let before = manifest_time();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(cache.lookup("m").as_deref(), Some(dir.as_path()));
    // A use is marked outside the copy: no file of the model changes (the node loop would
    // take a changed file for a changed model and prepare it again).
    assert_eq!(manifest_time(), before);
    let used = cache.entries().unwrap()[0].last_used;
    assert!(used > before, "{used:?} {before:?}");
    assert!(dir.join("vae/config.json").is_file());
    assert!(!partial.exists());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains("journal")), "{names:?}");
    assert_eq!(cache.entries().unwrap()[0].bytes, 2);
    cache.evict("m").unwrap();
    assert_eq!(cache.lookup("m"), None);
    assert!(!dir.exists());
}

#[test]
fn the_journal_resumes_only_the_same_object() {
    let d = tempfile::tempdir().unwrap();
    let (mut j, done) =
        Journal::open(d.path(), "t/w.safetensors", Some("\"e1\""), 100, 10).unwrap();
    assert!(done.is_empty());
    j.done(3).unwrap();
    j.done(7).unwrap();
    drop(j);
    let (_, done) = Journal::open(d.path(), "t/w.safetensors", Some("\"e1\""), 100, 10).unwrap();
    assert_eq!(done, BTreeSet::from([3, 7]));
    // The object changed in the store: nothing of the old one is kept.
    let (_, done) = Journal::open(d.path(), "t/w.safetensors", Some("\"e2\""), 100, 10).unwrap();
    assert!(done.is_empty());
    let (_, done) = Journal::open(d.path(), "t/w.safetensors", Some("\"e2\""), 100, 10).unwrap();
    assert!(done.is_empty());
}
