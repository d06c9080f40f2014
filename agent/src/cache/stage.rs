//! Staging one requested model into the node model cache, as the node loop runs it: the
//! credentials are read from the deployment's Secret on each try (a fixed Secret takes effect
//! at the next one), the fill runs one at a time per node (two fills of one source never write
//! the same partial copy), its progress is reported as a [`StagingStatus`] (bytes, rate, ETA)
//! every second, and a failed try is reported by its [`Fault`] and retried after a backoff
//! that grows with the failures (shorter for faults that may pass by themselves). The copy is
//! then handed to the profiler and warmer like any folder on the node.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crds::{S3Source, StagingState, StagingStatus};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};

use super::fill::{self, Credentials, FillOptions, Progress, Source};
use super::{Cache, Fault, StageError, Staged};

/// How often a fill's progress is reported.
const REPORT_EVERY: Duration = Duration::from_secs(1);
/// The Secret keys the credentials are read from (the AWS tools' names).
pub const ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
pub const SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub const SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";

/// The node's cache with what staging into it needs.
pub struct Stager {
    cache: Cache,
    /// The cache folder's path on the node (what engine pods mount), which `cache` may see
    /// under a prefix.
    host_dir: PathBuf,
    options: FillOptions,
    /// The copies the node's current requests name, never evicted to make room.
    referenced: Mutex<BTreeSet<String>>,
    /// One fill at a time.
    turn: tokio::sync::Mutex<()>,
}

impl Stager {
    pub fn new(cache: Cache, host_dir: PathBuf, options: FillOptions) -> Self {
        Stager {
            cache,
            host_dir,
            options,
            referenced: Mutex::new(BTreeSet::new()),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The cache folder as the agent reads it (for the profiler's roots).
    pub fn dir(&self) -> &Path {
        self.cache.dir()
    }

    /// The sources the node's requests name now: their copies stay.
    pub fn set_referenced(&self, sources: &[&S3Source]) {
        *self.referenced.lock().expect("referenced lock") =
            sources.iter().map(|s| fill::key_of(s)).collect();
    }

    /// The published copy's folder on the node, as pods mount it.
    pub fn host_path(&self, key: &str) -> PathBuf {
        super::ready_path(&self.host_dir, key)
    }

    /// One try: reads the credentials, waits its turn, fills the copy reporting progress to
    /// `report` each second, and returns the copy's folder as the agent reads it.
    pub async fn try_once(
        &self,
        client: &Client,
        namespace: &str,
        spec: &S3Source,
        mut report: impl FnMut(StagingStatus) + Send,
    ) -> Staged<PathBuf> {
        let credentials = match &spec.credentials_secret {
            Some(s) => Some(credentials(client, namespace, &s.name).await?),
            None => None,
        };
        let source = Source {
            spec: spec.clone(),
            credentials,
        };
        let _turn = self.turn.lock().await;
        let referenced = self.referenced.lock().expect("referenced lock").clone();
        let progress = Progress::default();
        let run = fill::fill(&self.cache, &source, &referenced, self.options, &progress);
        tokio::pin!(run);
        let mut meter = Meter::new(Instant::now());
        let mut tick = tokio::time::interval(REPORT_EVERY);
        loop {
            tokio::select! {
                r = &mut run => return r,
                _ = tick.tick() => {
                    let done = progress.done.load(Ordering::Relaxed);
                    let total = progress.total.load(Ordering::Relaxed);
                    report(meter.status(Instant::now(), done, total));
                }
            }
        }
    }
}

/// Reads the credentials from Secret `name` in `namespace`: a missing Secret or key is
/// [`Fault::CredentialsUnavailable`], naming the Secret and the key (never a value).
pub async fn credentials(client: &Client, namespace: &str, name: &str) -> Staged<Credentials> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = format!("Secret {namespace}/{name}");
    let secret = tokio::time::timeout(Duration::from_secs(15), api.get_opt(name))
        .await
        .map_err(|_| {
            StageError::new(
                Fault::StoreUnavailable,
                format!("reading {what}: no answer"),
            )
        })?
        .map_err(|e| {
            StageError::new(
                Fault::CredentialsUnavailable,
                format!("reading {what}: {e}"),
            )
        })?
        .ok_or_else(|| {
            StageError::new(
                Fault::CredentialsUnavailable,
                format!("{what} (the s3 source's credentialsSecret) does not exist"),
            )
        })?;
    from_data(&what, secret.data.unwrap_or_default())
}

/// The credentials in a Secret's data.
fn from_data(
    what: &str,
    data: std::collections::BTreeMap<String, k8s_openapi::ByteString>,
) -> Staged<Credentials> {
    let get = |key: &str| -> Staged<Option<String>> {
        data.get(key)
            .map(|v| {
                String::from_utf8(v.0.clone())
                    .map(|s| s.trim().to_string())
                    .map_err(|_| {
                        StageError::new(
                            Fault::CredentialsUnavailable,
                            format!("{what}: key {key} is not UTF-8 text"),
                        )
                    })
            })
            .transpose()
    };
    let need = |key: &str| -> Staged<String> {
        get(key)?.filter(|v| !v.is_empty()).ok_or_else(|| {
            StageError::new(
                Fault::CredentialsUnavailable,
                format!("{what} has no key {key}"),
            )
        })
    };
    Ok(Credentials {
        access_key_id: need(ACCESS_KEY_ID)?,
        secret_access_key: need(SECRET_ACCESS_KEY)?,
        session_token: get(SESSION_TOKEN)?.filter(|v| !v.is_empty()),
    })
}

/// How long to wait after the `failures`-th failed try with `fault` before the next: a
/// fault that may pass by itself (a moving object, a store away) is retried soon, one that
/// needs a person (credentials, a missing bucket, a full cache) less often; both double per
/// failure up to five minutes.
pub fn retry_after(fault: Fault, failures: u32) -> Duration {
    let base = if fault.transient() { 2 } else { 30 };
    let secs = base * 2u64.saturating_pow(failures.saturating_sub(1).min(16));
    Duration::from_secs(secs.min(300))
}

/// The status of a failed try.
pub fn failed(e: &StageError, failures: u32, bytes: u64, total: u64) -> StagingStatus {
    StagingStatus {
        state: if e.fault.transient() {
            StagingState::Retrying
        } else {
            StagingState::Failed
        },
        bytes,
        total_bytes: total,
        reason: Some(e.fault.reason().into()),
        message: Some(e.msg.clone()),
        failures,
        ..Default::default()
    }
}

/// A download's rate and ETA, from the bytes it has at each report: the rate is an
/// exponentially weighted mean over the reports (about the last ten seconds), so a stall
/// shows within seconds and one slow chunk does not swing the ETA.
pub struct Meter {
    last: Instant,
    last_bytes: Option<u64>,
    rate: f64,
}

impl Meter {
    /// A meter starting at `at`.
    pub fn new(at: Instant) -> Self {
        Meter {
            last: at,
            last_bytes: None,
            rate: 0.0,
        }
    }

    /// The status at `at` with `done` of `total` bytes on disk.
    pub fn status(&mut self, at: Instant, done: u64, total: u64) -> StagingStatus {
        let dt = at.duration_since(self.last).as_secs_f64();
        match self.last_bytes {
            // Until the store is listed nothing is known; the first figure after is what a
            // resumed copy already had (counted at once, before any GET): not a rate.
            None if total == 0 => {}
            None => self.last_bytes = Some(done),
            Some(prev) if dt > 0.0 => {
                let now = done.saturating_sub(prev) as f64 / dt;
                let w = (dt / 10.0).min(1.0);
                self.rate = if self.rate == 0.0 {
                    now
                } else {
                    self.rate * (1.0 - w) + now * w
                };
                self.last_bytes = Some(done);
            }
            Some(_) => {}
        }
        self.last = at;
        let left = total.saturating_sub(done);
        StagingStatus {
            state: if total == 0 {
                StagingState::Listing
            } else if left == 0 {
                StagingState::Verifying
            } else {
                StagingState::Downloading
            },
            bytes: done,
            total_bytes: total,
            bytes_per_second: self.rate as u64,
            eta_seconds: (total > 0 && self.rate >= 1.0)
                .then(|| (left as f64 / self.rate).ceil() as u64),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn the_meter_gives_rate_and_eta_and_does_not_count_resumed_bytes() {
        let t0 = Instant::now();
        let mut m = Meter::new(t0);
        let s = m.status(t0, 0, 0);
        assert_eq!(s.state, StagingState::Listing);
        // Resumed with 500 bytes on disk: not a rate.
        let s = m.status(t0 + Duration::from_secs(1), 500, 1500);
        assert_eq!(
            (s.state, s.bytes_per_second, s.eta_seconds),
            (StagingState::Downloading, 0, None)
        );
        let s = m.status(t0 + Duration::from_secs(2), 600, 1500);
        assert_eq!(s.bytes_per_second, 100);
        assert_eq!(s.eta_seconds, Some(9));
        // A stall pulls the rate down and the ETA up.
        let s = m.status(t0 + Duration::from_secs(3), 600, 1500);
        assert!(s.bytes_per_second < 100, "{s:?}");
        assert!(s.eta_seconds.unwrap() > 9, "{s:?}");
        let s = m.status(t0 + Duration::from_secs(4), 1500, 1500);
        assert_eq!((s.state, s.eta_seconds), (StagingState::Verifying, Some(0)));
    }

    #[test]
    fn backoff_doubles_to_a_cap_and_waits_longer_for_a_person() {
        assert_eq!(retry_after(Fault::ObjectChanged, 1), Duration::from_secs(2));
        assert_eq!(retry_after(Fault::ObjectChanged, 3), Duration::from_secs(8));
        assert_eq!(retry_after(Fault::AccessDenied, 1), Duration::from_secs(30));
        assert_eq!(
            retry_after(Fault::AccessDenied, 4),
            Duration::from_secs(240)
        );
        assert_eq!(retry_after(Fault::CacheFull, 40), Duration::from_secs(300));
    }

    #[test]
    fn credentials_come_from_the_aws_keys_and_name_what_is_missing() {
        let data = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect()
        };
        let c = from_data(
            "Secret ns/s",
            data(&[(ACCESS_KEY_ID, "AKID\n"), (SECRET_ACCESS_KEY, "shh")]),
        )
        .unwrap();
        assert_eq!((c.access_key_id.as_str(), c.session_token), ("AKID", None));
        let e = from_data("Secret ns/s", data(&[(ACCESS_KEY_ID, "AKID")])).unwrap_err();
        assert_eq!(e.fault, Fault::CredentialsUnavailable);
        assert!(
            e.msg.contains("ns/s") && e.msg.contains(SECRET_ACCESS_KEY),
            "{e}"
        );
        assert!(!e.msg.contains("AKID"), "{e}");
    }
}
