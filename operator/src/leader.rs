//! Leader election: of the operator's replicas, only the one that holds a
//! `coordination.k8s.io/v1` Lease runs the controller; the others stand by and take over
//! when its lease lapses. The Lease protocol (acquire when free or expired, renew `grace`
//! before expiry, conflicts by server-side apply) is kube-lease-manager's.
//!
//! What this module adds is the leader's side of safety. A holder that cannot renew must
//! stop acting before a standby may take the lease, and the crate keeps retrying a failed
//! renewal without saying so. So while it leads, a replica also watches the Lease itself
//! ([`lapse`]) and steps down, stopping the controller at once, when the Lease names
//! someone else or its last renewal is about to expire (`grace / 2` before a standby would
//! see it expired). A lost apiserver means no renewal seen, so the leader stops in time.
//! A replica that stepped down stands by again with a fresh manager.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError, LeaseParams};
use tracing::{info, warn};

use crate::autoscaler::LoadSource;
use crate::context::{Election, Settings, MANAGER};
use crate::controller;
use crate::error::{Error, Result};
use crate::telemetry::Telemetry;

/// Pause after a failed attempt to reach the Lease.
const RETRY: Duration = Duration::from_secs(1);
/// How long a controller told to stop (shutdown) may take to finish its reconciles.
const STOP_GRACE: Duration = Duration::from_secs(10);

impl Election {
    fn check(&self) -> Result<()> {
        if self.grace_seconds == 0 || self.grace_seconds >= self.lease_seconds {
            return Err(Error::Settings(format!(
                "leader election: the renew grace ({} s) must be at least 1 s and less than the lease ({} s)",
                self.grace_seconds, self.lease_seconds
            )));
        }
        Ok(())
    }

    fn error(&self, source: LeaseManagerError) -> Error {
        Error::Lease {
            lease: format!("{}/{}", self.namespace, self.lease),
            source,
        }
    }
}

/// Runs the operator until `shutdown` resolves: with `settings.election`, stands by until
/// this replica holds the lease and runs the controller while it does; without, always
/// runs it. Returns an error only when election cannot work at all (bad settings, or the
/// Lease forbidden to this account).
pub async fn run(
    client: Client,
    settings: Settings,
    load: Arc<dyn LoadSource>,
    telemetry: Arc<Telemetry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let shutdown = shutdown.boxed().shared();
    let Some(election) = settings.election.clone() else {
        telemetry.lead(true);
        controller::lead(client, settings, load, telemetry.clone(), shutdown).await;
        telemetry.lead(false);
        return Ok(());
    };
    election.check()?;
    loop {
        let manager = tokio::select! {
            m = acquire(&client, &election) => m?,
            () = shutdown.clone() => return Ok(()),
        };
        info!(identity = %election.identity, lease = %election.lease, "holding the lease: leading");
        telemetry.lead(true);
        let ending = {
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let stop = async move {
                let _ = stop_rx.await;
            };
            let mut controller = pin!(controller::lead(
                client.clone(),
                settings.clone(),
                load.clone(),
                telemetry.clone(),
                stop,
            ));
            let held = hold(&manager);
            let lapsed = lapse(client.clone(), election.clone());
            let ending = tokio::select! {
                () = &mut controller => Ending::Lost("the controller stopped".into()),
                why = held => Ending::Lost(why),
                why = lapsed => Ending::Lost(why),
                () = shutdown.clone() => Ending::Shutdown,
            };
            // On shutdown the controller finishes its reconciles; a replica that lost the
            // lease drops them at once.
            if ending == Ending::Shutdown {
                let _ = stop_tx.send(());
                if tokio::time::timeout(STOP_GRACE, &mut controller)
                    .await
                    .is_err()
                {
                    warn!("the controller did not stop within {STOP_GRACE:?}; dropping it");
                }
            }
            ending
        };
        telemetry.lead(false);
        match ending {
            Ending::Shutdown => {
                // Hand the lease over now rather than when it lapses.
                match tokio::time::timeout(Duration::from_secs(5), manager.release()).await {
                    Ok(Ok(())) => info!("released the lease"),
                    Ok(Err(err)) => warn!(error = %err, "releasing the lease"),
                    Err(_) => warn!("releasing the lease timed out"),
                }
                return Ok(());
            }
            // Never released here: the Lease may already name another holder.
            Ending::Lost(why) => warn!("stepped down: {why}; standing by"),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Ending {
    Shutdown,
    Lost(String),
}

/// A new lease manager, once it holds the lease. Errors other than a forbidden Lease are
/// retried.
async fn acquire(client: &Client, election: &Election) -> Result<LeaseManager> {
    loop {
        let params = LeaseParams::new(
            election.identity.clone(),
            election.lease_seconds,
            election.grace_seconds,
        )
        .with_field_manager(format!("{MANAGER}/{}", election.identity));
        let built = LeaseManagerBuilder::new(client.clone(), &election.lease)
            .with_namespace(&election.namespace)
            .with_parameters(params)
            .build()
            .await;
        let manager = match built {
            Ok(m) => m,
            Err(err) => {
                fatal_or_wait(election, err).await?;
                continue;
            }
        };
        info!(identity = %election.identity, lease = %election.lease, "standing by for the lease");
        loop {
            match manager.changed().await {
                Ok(true) => return Ok(manager),
                Ok(false) => {}
                Err(err) => fatal_or_wait(election, err).await?,
            }
        }
    }
}

/// A Lease this account may not use is fatal (the chart's Role is missing); anything else
/// is logged and retried after a pause.
async fn fatal_or_wait(election: &Election, err: LeaseManagerError) -> Result<()> {
    if let LeaseManagerError::KubeError(kube::Error::Api(status)) = &err {
        if status.code == 403 {
            return Err(election.error(err));
        }
    }
    warn!(lease = %election.lease, error = %err, "leader election; retrying");
    tokio::time::sleep(RETRY).await;
    Ok(())
}

/// Keeps renewing the lease; returns why it is no longer held.
async fn hold(manager: &LeaseManager) -> String {
    loop {
        match manager.changed().await {
            Ok(false) => return "the lease names another holder".into(),
            Ok(true) => {}
            Err(err) => {
                warn!(error = %err, "renewing the lease failed; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Returns why this replica can no longer vouch for its lease: the Lease names someone
/// else, or its last renewal is so old that it lapses within `grace / 2`.
async fn lapse(client: Client, e: Election) -> String {
    let api: Api<Lease> = Api::namespaced(client, &e.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", e.lease));
    let mut leases = pin!(watcher(api, config).default_backoff().applied_objects());
    let lasts = Duration::from_secs(e.lease_seconds);
    let margin = Duration::from_millis(e.grace_seconds * 500);
    // Leadership was just taken: the lease was renewed about now.
    let mut renewed = SystemTime::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            event = leases.next() => match event {
                Some(Ok(lease)) => {
                    let spec = lease.spec.unwrap_or_default();
                    let holder = spec.holder_identity.unwrap_or_default();
                    if holder != e.identity {
                        let holder = if holder.is_empty() { "nobody" } else { &holder };
                        return format!("the Lease names {holder} as its holder");
                    }
                    if let Some(t) = spec.renew_time {
                        renewed = renewed.max(SystemTime::from(t.0));
                    }
                }
                Some(Err(err)) => warn!(error = %err, "watching the lease"),
                None => return "the watch of the Lease ended".into(),
            },
            _ = tick.tick() => {
                let age = SystemTime::now().duration_since(renewed).unwrap_or_default();
                if age + margin >= lasts {
                    return format!(
                        "the lease was last renewed {:.1} s ago and lasts {} s",
                        age.as_secs_f64(),
                        e.lease_seconds
                    );
                }
            }
        }
    }
}
