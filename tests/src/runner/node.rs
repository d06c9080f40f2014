//! The runner's handle: starts the watch task, answers the test's questions about what
//! runs and what ended, and removes every container at shutdown.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::host::{podman, remove_orphans, traversable};
use super::names::NAMESPACE_LABEL;
use super::state::{Config, Exit, Running, State};
use super::watch::watch_pods;

/// The runner: a task watching pods, one supervisor task per pod.
pub struct NodeRunner {
    pub(super) state: Arc<Mutex<State>>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) task: JoinHandle<()>,
    pub(super) namespace: String,
}

impl NodeRunner {
    /// Starts watching `config.namespace` with `client` (which must be allowed to patch pod
    /// status, delete pods and create events there). Removes first the containers of runners
    /// whose test process is gone.
    pub fn start(client: Client, config: Config) -> Result<NodeRunner> {
        std::fs::create_dir_all(&config.work)
            .with_context(|| format!("creating {}", config.work.display()))?;
        traversable(&config.work)?;
        remove_orphans()?;
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stop_rx) = watch::channel(false);
        let namespace = config.namespace.clone();
        let task = tokio::spawn(watch_pods(client, Arc::new(config), state.clone(), stop_rx));
        Ok(NodeRunner {
            state,
            stop,
            task,
            namespace,
        })
    }

    /// The containers running now.
    pub fn running(&self) -> Vec<Running> {
        let s = self.state.lock().expect("runner state");
        s.running.values().cloned().collect()
    }

    /// Every container that has ended so far.
    pub fn exits(&self) -> Vec<Exit> {
        self.state.lock().expect("runner state").exits.clone()
    }

    /// Pods the runner could not run, each with the kubelet's reason and why.
    pub fn failures(&self) -> Vec<String> {
        self.state.lock().expect("runner state").failures.clone()
    }

    /// Stops watching, stops what still runs, and removes every container it started (after
    /// the test has deleted what it wanted stopped cleanly).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        let label = format!("label={NAMESPACE_LABEL}={}", self.namespace);
        if let Ok(out) = podman(&["ps", "-aq", "--filter", &label]).await {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = podman(&["rm", "-f", "-t", "0", id]).await;
            }
        }
    }
}
