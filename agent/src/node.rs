//! The node loop: the one task that owns every model's status on this node and writes the
//! node's `DiffusionNode` status (server-side apply, field manager [`MANAGER`]).
//!
//! It watches only its own `DiffusionNode` (field selector `metadata.name`) and acts when the
//! spec changes, not on its own status writes; model tasks report to it through a channel;
//! a tick re-reads the inventory, re-measures residency, notices files that changed since
//! they were warmed, and writes the status when something changed.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crds::{
    AcceleratorInventory, DiffusionNode, DiffusionNodeSpec, DiffusionNodeStatus, ModelRequest,
    ModelState, NodeModelStatus,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::http::AppState;
use crate::inventory::{self, Inventory};
use crate::metrics::Metrics;
use crate::models::{self, Settings, Update};
use crate::pagecache::{self, Identity, Residency};
use crate::{Error, Result};

/// The field manager of everything the agent writes.
pub const MANAGER: &str = "layerwise-agent";
/// Timeout of every API call.
const API_TIMEOUT: Duration = Duration::from_secs(15);
/// How often residency of models being warmed is measured.
const WARMING_RESIDENCY_EVERY: Duration = Duration::from_secs(3);

/// What the node loop needs.
pub struct Context {
    pub client: Client,
    /// This node's name (the downward API's `spec.nodeName`).
    pub node: String,
    pub settings: Arc<Settings>,
    pub metrics: Arc<Metrics>,
    pub http: Arc<AppState>,
    /// The pods' cgroup path, for the inventory.
    pub pods_cgroup: Option<String>,
    /// How often the inventory and residency are read again.
    pub reinventory: Duration,
    /// The node model cache, where the agent has one: models whose source is `s3` are
    /// staged into it.
    pub stager: Option<Arc<crate::cache::stage::Stager>>,
}

/// One requested model as the loop tracks it.
struct Entry {
    request: ModelRequest,
    status: NodeModelStatus,
    /// Number of the task working on it (reports from older tasks are ignored).
    task: u64,
    handle: Option<JoinHandle<()>>,
    files: Vec<(PathBuf, Identity)>,
    /// Bytes the current warm has read so far (for the counter's increments).
    progress: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Aborting the task drops the worker's future, which kills the worker process.
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// The status the agent writes, from the inventory and its models.
pub fn status(inv: &Inventory, models: Vec<NodeModelStatus>, at: Time) -> DiffusionNodeStatus {
    DiffusionNodeStatus {
        accelerators: inv.accelerators(),
        host_memory_bytes: inv.host.total,
        cgroup_memory_limit_bytes: inv.pods_cgroup.and_then(|c| c.limit),
        model_count: models.len() as u32,
        models,
        updated_at: Some(at),
    }
}

struct Loop {
    ctx: Context,
    api: Api<DiffusionNode>,
    entries: BTreeMap<String, Entry>,
    next_task: u64,
    tx: mpsc::Sender<Update>,
    inventory: Inventory,
    dirty: bool,
}

/// Runs the node loop until `shutdown` resolves.
pub async fn run(ctx: Context, shutdown: impl Future<Output = ()>) -> Result<()> {
    let api: Api<DiffusionNode> = Api::all(ctx.client.clone());
    let (tx, mut rx) = mpsc::channel(256);
    let inventory = read_inventory(&ctx).await;
    if let Some(note) = &inventory.accelerator_note {
        if inventory.labelled.is_empty() {
            info!(%note, "no accelerators reported");
        } else {
            warn!(%note, accelerators = ?inventory.labelled, "NVML unavailable (no driver library or device injected into the agent's container): accelerators from the Node's GPU Feature Discovery labels, the fast peer link from {}", inventory::FAST_PEER_LINK_LABEL);
        }
    }
    let mut l = Loop {
        api: api.clone(),
        entries: BTreeMap::new(),
        next_task: 0,
        tx,
        inventory,
        dirty: true,
        ctx,
    };
    let mut exists = false;
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", l.ctx.node));
    let mut watch = std::pin::pin!(watcher(api, cfg).default_backoff().applied_objects());
    let mut shutdown = std::pin::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_spec: Option<DiffusionNodeSpec> = None;
    let (mut last_inventory, mut last_residency) = (Instant::now(), Instant::now());
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            ev = watch.next() => match ev {
                Some(Ok(dn)) => {
                    if last_spec.as_ref() != Some(&dn.spec) {
                        l.reconcile(&dn.spec.models);
                        last_spec = Some(dn.spec);
                    }
                }
                Some(Err(e)) => warn!(error = %e, "watching DiffusionNode"),
                None => break,
            },
            Some(u) = rx.recv() => l.update(u),
            _ = tick.tick() => {
                l.ctx.http.tick();
                if last_inventory.elapsed() >= l.ctx.reinventory {
                    last_inventory = Instant::now();
                    last_residency = Instant::now();
                    l.inventory = read_inventory(&l.ctx).await;
                    l.refresh(false).await;
                    l.dirty = true;
                } else if last_residency.elapsed() >= WARMING_RESIDENCY_EVERY {
                    last_residency = Instant::now();
                    l.refresh(true).await;
                }
                if !exists {
                    // Retried each tick: the CRD may not be served yet when the agent starts.
                    match l.ensure_exists().await {
                        Ok(()) => exists = true,
                        Err(e) => {
                            l.ctx.metrics.error(&e);
                            warn!(error = %e, "creating this node's DiffusionNode");
                        }
                    }
                }
                if exists && l.dirty {
                    match l.write_status().await {
                        Ok(()) => l.dirty = false,
                        Err(e) => {
                            l.ctx.metrics.error(&e);
                            warn!(error = %e, "writing status");
                        }
                    }
                }
            }
        }
    }
    info!("shutting down: stopping prewarm workers");
    l.entries.clear();
    Ok(())
}

async fn read_inventory(ctx: &Context) -> Inventory {
    let path = ctx.pods_cgroup.clone();
    let mut inv = tokio::task::spawn_blocking(move || Inventory::read(path.as_deref()))
        .await
        .expect("inventory task panicked");
    if inv.devices.is_empty() {
        match node_labels(ctx).await {
            Ok(Some(acc)) => inv.labelled = vec![acc],
            Ok(None) => {}
            Err(e) => {
                ctx.metrics.error(&e);
                warn!(error = %e, "reading accelerators from the Node's labels");
            }
        }
    }
    let m = &ctx.metrics;
    m.host_available_bytes.set(inv.host.available as i64);
    for d in &inv.devices {
        let l = crate::metrics::DeviceLabels {
            device: d.index.to_string(),
            product: d.product.clone(),
        };
        m.device_free_bytes
            .get_or_create(&l)
            .set(d.memory_free as i64);
    }
    if let Some(c) = inv.pods_cgroup {
        m.pods_cgroup_usage_bytes.set(c.usage as i64);
    }
    if let Some(note) = &inv.pods_cgroup_note {
        warn!(%note, "pods cgroup");
    }
    if let Some(cg) = &ctx.settings.cgroup {
        if let Ok(mem) = cg.memory() {
            m.prewarm_cgroup_usage_bytes.set(mem.usage as i64);
        }
    }
    inv
}

/// The accelerators this node's GPU Feature Discovery labels describe (see
/// [`inventory::from_gfd_labels`]).
async fn node_labels(ctx: &Context) -> Result<Option<AcceleratorInventory>> {
    let api: Api<Node> = Api::all(ctx.client.clone());
    let node = timeout(api.get(&ctx.node), &format!("reading Node {}", ctx.node)).await?;
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(inventory::NVIDIA_RESOURCE))
        .and_then(|q| q.0.parse().ok());
    inventory::from_gfd_labels(node.labels(), allocatable).map_err(|msg| Error::Invalid {
        field: format!("Node {}", ctx.node),
        msg,
    })
}

impl Loop {
    /// Creates this node's `DiffusionNode` when it is missing. Server-side apply of an empty
    /// `spec.models`: the schema requires `spec`, and owning the empty list (never its items)
    /// keeps the object valid when the last requester withdraws, while the operator's
    /// requests stay untouched.
    async fn ensure_exists(&self) -> Result<()> {
        let obj = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "metadata": { "name": self.ctx.node }, "spec": { "models": [] } });
        let (pp, patch) = (PatchParams::apply(MANAGER), Patch::Apply(&obj));
        timeout(
            self.api.patch(&self.ctx.node, &pp, &patch),
            &format!("creating DiffusionNode {}", self.ctx.node),
        )
        .await?;
        Ok(())
    }

    async fn write_status(&mut self) -> Result<()> {
        let models = self.entries.values().map(|e| e.status.clone()).collect();
        let st = status(&self.inventory, models, now());
        let patch = json!({ "apiVersion": "layerwise.dev/v1alpha1", "kind": "DiffusionNode", "status": st });
        let (pp, patch) = (PatchParams::apply(MANAGER).force(), Patch::Apply(&patch));
        match timeout(
            self.api.patch_status(&self.ctx.node, &pp, &patch),
            &format!("writing the status of DiffusionNode {}", self.ctx.node),
        )
        .await
        {
            Err(Error::Kube {
                source: kube::Error::Api(s),
                ..
            }) if s.code == 404 => {
                // Deleted under us: make it again, write on the next tick.
                self.ensure_exists().await.and(Err(Error::Invalid {
                    field: "DiffusionNode".into(),
                    msg: format!("{} was missing; recreated", self.ctx.node),
                }))
            }
            r => r.map(|_| ()),
        }
    }

    /// Follows a new spec: starts new models, restarts moved ones, drops removed ones.
    fn reconcile(&mut self, requests: &[ModelRequest]) {
        let wanted: BTreeMap<&str, &ModelRequest> =
            requests.iter().map(|r| (r.id.as_str(), r)).collect();
        let gone: Vec<String> = self
            .entries
            .keys()
            .filter(|id| !wanted.contains_key(id.as_str()))
            .cloned()
            .collect();
        if let Some(stager) = &self.ctx.stager {
            stager.set_referenced(&crate::staged::sources(requests));
        }
        for id in gone {
            info!(model = %id, "removed from the spec; stopping");
            self.entries.remove(&id);
            self.ctx.metrics.remove_model(&id);
            self.dirty = true;
        }
        for (id, r) in wanted {
            if self.entries.get(id).is_some_and(|e| e.request == *r) {
                continue;
            }
            info!(model = %id, location = %r.location.describe(), "preparing");
            self.start(r.clone());
        }
    }

    fn start(&mut self, request: ModelRequest) {
        self.next_task += 1;
        let task = self.next_task;
        let id = request.id.clone();
        let mut entry = Entry {
            status: NodeModelStatus {
                id: id.clone(),
                state: ModelState::Pending,
                updated_at: Some(now()),
                ..Default::default()
            },
            request,
            task,
            handle: None,
            files: Vec::new(),
            progress: 0,
        };
        // The model families whose checkpoints this agent's reader understands: the
        // engine's registry.
        let families = layerwise_engine::families::names();
        let dir = if families.contains(&entry.request.family.as_str()) {
            models::resolve(
                &id,
                &entry.request.location,
                self.ctx.settings.model_root.as_deref(),
                &self.ctx.settings.model_roots,
            )
        } else {
            Err(Error::Model {
                id: id.clone(),
                msg: format!(
                    "family `{}`: this agent profiles {}",
                    entry.request.family,
                    families.join(", ")
                ),
            })
        };
        match (dir, &self.ctx.stager) {
            (_, Some(stager)) if entry.request.location.s3.is_some() => {
                entry.handle = Some(tokio::spawn(crate::staged::prepare(
                    entry.request.clone(),
                    task,
                    stager.clone(),
                    self.ctx.client.clone(),
                    self.ctx.settings.clone(),
                    self.tx.clone(),
                )));
            }
            (Ok(dir), _) => {
                entry.handle = Some(tokio::spawn(models::prepare(
                    id.clone(),
                    task,
                    dir,
                    entry.request.family.clone(),
                    self.ctx.settings.clone(),
                    self.tx.clone(),
                )));
            }
            (Err(e), _) => fail(&mut entry.status, &e, &self.ctx.metrics),
        }
        self.entries.insert(id, entry);
        self.dirty = true;
    }

    /// Applies a model task's report.
    fn update(&mut self, u: Update) {
        let (id, task) = match &u {
            Update::State { id, task, .. }
            | Update::Profiled { id, task, .. }
            | Update::Progress { id, task, .. }
            | Update::Staging { id, task, .. }
            | Update::Warmed { id, task, .. }
            | Update::Failed { id, task, .. } => (id.clone(), *task),
        };
        let m = self.ctx.metrics.clone();
        let Some(e) = self.entries.get_mut(&id).filter(|e| e.task == task) else {
            return;
        };
        let labels = Metrics::model(&id);
        let st = &mut e.status;
        match u {
            Update::State { state, .. } => {
                st.state = state;
                if state == ModelState::Warming {
                    e.progress = 0;
                }
            }
            Update::Profiled {
                profile,
                files,
                residency,
                ..
            } => {
                st.profile = Some(*profile);
                st.profiled_at = Some(now());
                set_residency(st, residency, &m);
                e.files = files;
            }
            Update::Progress { bytes, .. } => {
                m.bytes_warmed
                    .get_or_create(&labels)
                    .inc_by(bytes.saturating_sub(e.progress));
                e.progress = e.progress.max(bytes);
                return;
            }
            Update::Staging { status, .. } => {
                m.staging(&id, &status);
                if status.state != crds::StagingState::Staged {
                    st.state = ModelState::Staging;
                }
                st.staging = Some(status);
            }
            Update::Warmed {
                outcome, residency, ..
            } => {
                m.bytes_warmed
                    .get_or_create(&labels)
                    .inc_by(outcome.bytes_read.saturating_sub(e.progress));
                m.warm_throughput
                    .get_or_create(&labels)
                    .set(outcome.throughput());
                if !outcome.changed.is_empty() {
                    for (p, id) in e.files.iter_mut() {
                        if let Ok(now) = Identity::of(p) {
                            *id = now;
                        }
                    }
                }
                info!(model = %id, bytes = outcome.bytes_read, seconds = outcome.seconds, resident = residency.resident, total = residency.total, "warmed");
                set_residency(st, residency, &m);
                let (state, error) = models::verdict(
                    residency,
                    self.ctx.settings.budget,
                    outcome.stopped.as_deref(),
                );
                st.state = state;
                st.error = error;
                if state == ModelState::Warm {
                    st.warmed_at = Some(now());
                }
                e.handle = None;
            }
            Update::Failed { error, .. } => {
                fail(st, &error, &m);
                e.handle = None;
            }
        }
        st.updated_at = Some(now());
        self.dirty = true;
    }

    /// Re-measures residency (of models being warmed only, with `warming_only`), and warms
    /// again models whose files changed since they were warmed.
    async fn refresh(&mut self, warming_only: bool) {
        let jobs: Vec<RefreshJob> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.files.is_empty() && e.status.state != ModelState::Failed)
            .filter(|(_, e)| {
                !warming_only || e.status.state == ModelState::Warming && e.handle.is_some()
            })
            .map(|(id, e)| (id.clone(), e.files.clone(), e.handle.is_none()))
            .collect();
        if jobs.is_empty() {
            return;
        }
        let measured = tokio::task::spawn_blocking(move || {
            jobs.into_iter()
                .map(|(id, files, idle)| {
                    let paths: Vec<PathBuf> = files.iter().map(|(p, _)| p.clone()).collect();
                    let changed = if idle {
                        models::changed(&files)
                    } else {
                        Vec::new()
                    };
                    (id, pagecache::residency_of(&paths), changed)
                })
                .collect::<Vec<_>>()
        })
        .await
        .expect("residency task panicked");
        let m = self.ctx.metrics.clone();
        let mut restart = Vec::new();
        for (id, residency, changed) in measured {
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            match residency {
                Ok(r) => {
                    if r.resident != e.status.resident_bytes || r.total != e.status.total_bytes {
                        set_residency(&mut e.status, r, &m);
                        self.dirty = true;
                    }
                }
                Err(err) => m.error(&err),
            }
            if !changed.is_empty() {
                info!(model = %id, files = ?changed, "files changed since warmed; preparing again");
                restart.push(e.request.clone());
            }
        }
        for r in restart {
            self.start(r);
        }
    }
}

/// A model to re-measure: id, its files as warmed, and whether no task is working on it.
type RefreshJob = (String, Vec<(PathBuf, Identity)>, bool);

fn set_residency(st: &mut NodeModelStatus, r: Residency, m: &Metrics) {
    st.resident_bytes = r.resident;
    st.total_bytes = r.total;
    m.resident_bytes
        .get_or_create(&Metrics::model(&st.id))
        .set(r.resident as i64);
    m.model_bytes
        .get_or_create(&Metrics::model(&st.id))
        .set(r.total as i64);
}

fn fail(st: &mut NodeModelStatus, e: &Error, m: &Metrics) {
    warn!(model = %st.id, error = %e, "model failed");
    m.error(e);
    st.state = ModelState::Failed;
    st.error = Some(e.to_string());
    st.updated_at = Some(now());
}

async fn timeout<T>(call: impl Future<Output = kube::Result<T>>, action: &str) -> Result<T> {
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(r) => r.map_err(Error::kube(action)),
        Err(_) => Err(Error::Invalid {
            field: "api call".into(),
            msg: format!("{action}: no answer within {}s", API_TIMEOUT.as_secs()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Device;

    #[test]
    fn status_counts_models_and_takes_the_cgroup_limit() {
        let inv = Inventory {
            devices: vec![Device {
                index: 0,
                product: "NVIDIA-L4".into(),
                memory_total: 24 << 30,
                memory_free: 20 << 30,
                fast_peer_link: false,
            }],
            host: crate::meminfo::MemInfo {
                total: 64 << 30,
                available: 60 << 30,
            },
            pods_cgroup: Some(crate::cgroup::CgroupMemory {
                limit: Some(32 << 30),
                usage: 1,
                peak: 1,
            }),
            ..Default::default()
        };
        let m = NodeModelStatus {
            id: "ns/a".into(),
            ..Default::default()
        };
        let s = status(&inv, vec![m], now());
        assert_eq!(s.model_count, 1);
        assert_eq!(s.accelerators[0].count, 1);
        assert_eq!(s.usable_host_bytes(), 32 << 30);
    }
}
