//! The node model cache filled from a real S3-compatible server (SeaweedFS, on loopback)
//! holding a synthetic checkpoint: the copy is published whole and profiles like the
//! original; a second fill finds it; an interrupted fill resumes from its journal; and each
//! fault is refused by its name, with nothing half-published and the node's other models
//! untouched.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::files;
use layerwise_agent::cache::fill::{fill, Credentials, FillOptions, Progress, Source};
use layerwise_agent::cache::{Cache, Fault, StageError};
use layerwise_e2e::s3::{S3Server, ACCESS_KEY, SECRET_KEY};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;

fn creds() -> Credentials {
    Credentials {
        access_key_id: ACCESS_KEY.into(),
        secret_access_key: SECRET_KEY.into(),
        session_token: None,
    }
}

fn source(s: &S3Server, bucket: &str, prefix: &str) -> Source {
    Source {
        spec: crds::S3Source {
            endpoint: Some(s.endpoint.clone()),
            bucket: bucket.into(),
            prefix: prefix.into(),
            region: Some("us-east-1".into()),
            path_style: true,
            credentials_secret: Some(crds::SecretName {
                name: "keys".into(),
            }),
        },
        credentials: Some(creds()),
    }
}

fn client(s: &S3Server, bucket: &str) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(&s.endpoint)
            .with_allow_http(true)
            .with_bucket_name(bucket)
            .with_region("us-east-1")
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()
            .unwrap(),
    )
}

/// Uploads the pipeline folder `dir` under `prefix`.
async fn upload(store: &dyn ObjectStore, dir: &Path, prefix: &str) {
    for rel in files(dir) {
        let key = ObjectPath::from(format!("{prefix}/{}", rel.display()));
        let bytes = std::fs::read(dir.join(&rel)).unwrap();
        store.put(&key, bytes.into()).await.unwrap();
    }
}

/// A tiny DiT pipeline with real weights (so its files have real sizes).
fn pipeline(dir: &Path, layers: usize) -> PathBuf {
    use layerwise_engine::tools::synth::{synth, SynthOptions};
    let out = dir.join(format!("tiny-{layers}"));
    let mut o = SynthOptions::preset("tiny").unwrap();
    o.set_layers(layers);
    o.seed = 11;
    synth(&out, &o).unwrap();
    out
}

/// The fault a fill of `src` into `cache` fails with.
async fn fail(cache: &Cache, src: &Source) -> StageError {
    fill(
        cache,
        src,
        &BTreeSet::new(),
        small_chunks(),
        &Progress::default(),
    )
    .await
    .unwrap_err()
}

/// Runs `fill` until `progress` passes `bytes`, then drops it mid-download (what an agent
/// restarted then leaves on disk: synced chunks, their journal, no published copy).
async fn interrupt_after(
    fill: impl std::future::Future<Output = Result<PathBuf, StageError>>,
    progress: &Progress,
    bytes: u64,
    s: &S3Server,
) {
    let stopped = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::pin!(fill);
        loop {
            tokio::select! {
                r = &mut fill => panic!("the fill finished before it was interrupted: {r:?}"),
                _ = tokio::time::sleep(Duration::from_millis(5)) => {
                    if progress.done.load(Ordering::Relaxed) > bytes { break; }
                }
            }
        }
    })
    .await;
    assert!(stopped.is_ok(), "the fill never got far: {}", s.log());
}

/// A file of the interrupted copy at `partial` and an offset in one of its chunks the
/// journal records as done (the journal's layout: per file, an identity line, then the
/// indices of the chunks on disk).
fn journalled_byte(partial: &Path, chunk: u64) -> (String, u64) {
    for e in std::fs::read_dir(partial.join(".layerwise-journal")).unwrap() {
        let e = e.unwrap();
        let text = std::fs::read_to_string(e.path()).unwrap();
        let rel = e
            .file_name()
            .to_string_lossy()
            .replace("%2F", "/")
            .replace("%25", "%");
        let size = std::fs::metadata(partial.join(&rel)).unwrap().len();
        if let Some(i) = text
            .lines()
            .skip(1)
            .filter_map(|l| l.parse::<u64>().ok())
            .next()
        {
            // The chunk's last byte: inside a tensor's data once past the header.
            return (rel, ((i + 1) * chunk).min(size) - 1);
        }
    }
    panic!("no chunk journalled under {}", partial.display());
}

fn small_chunks() -> FillOptions {
    FillOptions {
        chunk_bytes: 4096,
        parallel: 4,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_in_s3_is_staged_whole_found_again_and_resumed() {
    let s = S3Server::start().unwrap();
    s.create_bucket("models").unwrap();
    let d = tempfile::tempdir().unwrap();
    let original = pipeline(d.path(), 2);
    let store = client(&s, "models");
    upload(store.as_ref(), &original, "org/tiny").await;
    let cache = Cache::open(&d.path().join("cache"), 1 << 30).unwrap();
    let src = source(&s, "models", "org/tiny/");
    let none = BTreeSet::new();

    // Interrupted after some chunks (an agent restarted mid-download): nothing published.
    let progress = Progress::default();
    let first = fill(
        &cache,
        &src,
        &none,
        FillOptions {
            parallel: 1,
            ..small_chunks()
        },
        &progress,
    );
    interrupt_after(first, &progress, 64 << 10, &s).await;
    let before = progress.done.load(Ordering::Relaxed);
    assert!(
        cache.lookup(&src.key()).is_none(),
        "a half-downloaded copy is visible"
    );

    // The next fill resumes: what the journal holds is counted at once, not fetched again.
    let progress = Progress::default();
    let dir = fill(&cache, &src, &none, small_chunks(), &progress)
        .await
        .unwrap();
    let total = progress.total.load(Ordering::Relaxed);
    assert_eq!(progress.done.load(Ordering::Relaxed), total);
    assert!(before > 0 && before < total, "{before} of {total}");
    for rel in files(&original) {
        assert_eq!(
            std::fs::read(dir.join(&rel)).unwrap(),
            std::fs::read(original.join(&rel)).unwrap(),
            "{}",
            rel.display()
        );
    }
    let profile = layerwise_engine::families::profile(&dir).unwrap();
    assert_eq!(profile.family, "dit");
    // Found again: no store needed.
    drop(s);
    let again = fill(&cache, &src, &none, small_chunks(), &Progress::default())
        .await
        .unwrap();
    assert_eq!(again, dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_are_refused_by_name_with_nothing_half_published() {
    let s = S3Server::start().unwrap();
    s.create_bucket("models").unwrap();
    let d = tempfile::tempdir().unwrap();
    let original = pipeline(d.path(), 2);
    let store = client(&s, "models");
    upload(store.as_ref(), &original, "good").await;
    let cache = Cache::open(&d.path().join("cache"), 1 << 30).unwrap();
    let none = BTreeSet::new();
    let opts = small_chunks();

    // A model already staged stays untouched by every failure below.
    let good = source(&s, "models", "good");
    let kept = fill(&cache, &good, &none, opts, &Progress::default())
        .await
        .unwrap();

    // Wrong credentials (into another cache: this one already holds the copy).
    let other = Cache::open(&d.path().join("other"), 1 << 30).unwrap();
    let mut wrong = source(&s, "models", "good");
    wrong.credentials = Some(Credentials {
        secret_access_key: "not-the-secret".into(),
        ..creds()
    });
    let e = fail(&other, &wrong).await;
    assert_eq!(e.fault, Fault::AccessDenied, "{e}");
    assert!(
        !e.msg.contains("not-the-secret") && !e.msg.contains(SECRET_KEY),
        "{e}"
    );
    // Nor do they get the copy this cache already holds for the same source.
    let e = fail(&cache, &wrong).await;
    assert_eq!(e.fault, Fault::AccessDenied, "the cached copy: {e}");
    wrong.credentials = None;
    let e = fail(&other, &wrong).await;
    assert_eq!(e.fault, Fault::AccessDenied, "anonymous: {e}");
    let e = fail(&cache, &wrong).await;
    assert_eq!(
        e.fault,
        Fault::AccessDenied,
        "anonymous, the cached copy: {e}"
    );

    let e = fail(&cache, &source(&s, "absent", "x")).await;
    assert_eq!(e.fault, Fault::NoSuchBucket, "{e}");

    let e = fail(&cache, &source(&s, "models", "nothing-here")).await;
    assert_eq!(e.fault, Fault::ObjectNotFound, "{e}");
    assert!(e.msg.contains("s3://models/nothing-here"), "{e}");

    // A weights file truncated in the store: its header no longer fits the file.
    let weights = original.join("transformer/diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    upload(store.as_ref(), &original, "truncated").await;
    store
        .put(
            &ObjectPath::from("truncated/transformer/diffusion_pytorch_model.safetensors"),
            bytes[..bytes.len() / 2].to_vec().into(),
        )
        .await
        .unwrap();
    let truncated = source(&s, "models", "truncated");
    let e = fail(&cache, &truncated).await;
    assert_eq!(e.fault, Fault::IntegrityMismatch, "{e}");
    assert!(e.msg.contains("diffusion_pytorch_model.safetensors"), "{e}");
    assert!(cache.lookup(&truncated.key()).is_none());

    // Bytes corrupted after they were written and journalled (a bad disk, a torn page): the
    // resumed fill finds the file's MD5 off the store's ETag, publishes nothing, and discards
    // the bad file, so the next fill fetches it whole and succeeds.
    upload(store.as_ref(), &original, "rot").await;
    let rot = source(&s, "models", "rot");
    let progress = Progress::default();
    let run = fill(
        &cache,
        &rot,
        &none,
        FillOptions {
            parallel: 1,
            ..opts
        },
        &progress,
    );
    interrupt_after(run, &progress, 32 << 10, &s).await;
    let partial = d.path().join("cache/partial").join(rot.key());
    let (rel, offset) = journalled_byte(&partial, opts.chunk_bytes);
    let victim = partial.join(&rel);
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[offset as usize] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    let e = fail(&cache, &rot).await;
    assert_eq!(e.fault, Fault::IntegrityMismatch, "{e}");
    assert!(e.msg.contains("MD5") && e.msg.contains(&rel), "{e}");
    assert!(cache.lookup(&rot.key()).is_none());
    assert!(
        !victim.exists(),
        "the corrupt file is kept for the next fill"
    );
    let healed = fill(&cache, &rot, &none, opts, &Progress::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(healed.join(&rel)).unwrap(),
        std::fs::read(original.join(&rel)).unwrap()
    );

    // An object replaced while it downloads: the ranged GETs carry the listed ETag.
    let big = vec![7u8; 4 << 20];
    store
        .put(&ObjectPath::from("moving/blob.bin"), big.clone().into())
        .await
        .unwrap();
    let moving = source(&s, "models", "moving");
    let progress = Progress::default();
    let slow = FillOptions {
        chunk_bytes: 1024,
        parallel: 1,
    };
    let run = fill(&cache, &moving, &none, slow, &progress);
    tokio::pin!(run);
    let e = loop {
        tokio::select! {
            r = &mut run => break r.unwrap_err(),
            _ = tokio::time::sleep(Duration::from_millis(5)) => {
                if progress.done.load(Ordering::Relaxed) > 0 {
                    let mut other = big.clone();
                    other[0] = 8;
                    store.put(&ObjectPath::from("moving/blob.bin"), other.into()).await.unwrap();
                    break run.await.unwrap_err();
                }
            }
        }
    };
    assert_eq!(e.fault, Fault::ObjectChanged, "{e}");
    assert!(e.fault.transient());
    assert!(cache.lookup(&moving.key()).is_none());

    // A cache too small for the model: refused before a byte is fetched.
    let tight = Cache::open(&d.path().join("tight"), 1024).unwrap();
    let progress = Progress::default();
    let e = fill(&tight, &good, &none, opts, &progress)
        .await
        .unwrap_err();
    assert_eq!(e.fault, Fault::CacheFull, "{e}");
    assert_eq!(progress.done.load(Ordering::Relaxed), 0);

    assert!(kept.join("model_index.json").is_file());
    assert_eq!(cache.lookup(&good.key()), Some(kept));
}
