//! What a container's launch stages on the host: its volumes (hostPath under the node's
//! root, emptyDir, the projected service account), its command line and its preStop sleep.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{
    Container, EnvVarSource, HostPathVolumeSource, Pod, PodSpec, Volume, VolumeMount,
};
use kube::ResourceExt;

use super::host::traversable;
use super::names::SERVICE_ACCOUNT_DIR;
use super::refusal::{refuse_unless, Refusal};
use super::secrets::SecretKey;
use super::security::{security, Security};
use super::state::Config;
use crate::tools;

/// What staging a container reads: the pod, its one container, where it runs, the folder
/// the runner keeps for it, and the ids its processes run as.
pub(super) struct Staging<'a> {
    pub(super) config: &'a Config,
    pub(super) spec: &'a PodSpec,
    pub(super) container: &'a Container,
    pub(super) name: String,
    pub(super) uid: String,
    pub(super) node: &'a str,
    pub(super) ip: IpAddr,
    /// The node's root folder: its host filesystem.
    pub(super) root: &'a Path,
    /// `<work>/<pod>`: its volumes and service-account files.
    pub(super) pod_dir: PathBuf,
    pub(super) sec: Security,
}

impl<'a> Staging<'a> {
    /// Makes the pod's folder and starts its `podman run` options: the host network, no
    /// pulls, the CRI log, and the security settings.
    pub(super) fn new(
        config: &'a Config,
        pod: &Pod,
        spec: &'a PodSpec,
        container: &'a Container,
        node: &'a str,
        ip: IpAddr,
    ) -> Result<(Staging<'a>, Vec<String>), Refusal> {
        let name = pod.name_any();
        let uid = pod.uid().unwrap_or_default();
        let root = &config.node_roots[node];
        let pod_dir = config.work.join(&name);
        std::fs::create_dir_all(&pod_dir).map_err(anyhow::Error::from)?;
        traversable(&pod_dir)?;

        let mut options: Vec<String> = vec![
            "--network=host".into(),
            format!("--hostname={name}"),
            "--pull=never".into(),
            "--log-driver=k8s-file".into(),
        ];
        let sec = security(
            spec.security_context.as_ref(),
            container.security_context.as_ref(),
            &mut options,
        )?;
        let staging = Staging {
            config,
            spec,
            container,
            name,
            uid,
            node,
            ip,
            root,
            pod_dir,
            sec,
        };
        Ok((staging, options))
    }

    /// The container's name in podman: the pod's and the start of its UID.
    pub(super) fn container_name(&self) -> String {
        let uid = &self.uid;
        format!("{}-{}", self.name, &uid[..uid.len().min(8)])
    }

    /// The container's environment from the spec: literal values (listen addresses on the
    /// pod IP), the Secrets' keys read for it, and the downward API's fields.
    pub(super) fn environment(
        &self,
        secrets: &BTreeMap<SecretKey, String>,
    ) -> Result<Vec<(String, String)>, Refusal> {
        let mut env: Vec<(String, String)> = Vec::new();
        for e in self.container.env.iter().flatten() {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => listen_on(self.ip, v),
                (None, Some(from)) if from.secret_key_ref.is_some() => {
                    let r = from.secret_key_ref.as_ref().expect("matched");
                    secrets
                        .get(&(r.name.clone(), r.key.clone()))
                        .cloned()
                        .ok_or_else(|| Refusal::config(format!("env {} not read", e.name)))?
                }
                (None, Some(from)) => self.field(&e.name, from)?,
                (None, None) => String::new(),
            };
            env.push((e.name.clone(), value));
        }
        Ok(env)
    }

    /// The downward API's value for env `var`, which `from` takes from a field of the pod.
    pub(super) fn field(&self, var: &str, from: &EnvVarSource) -> Result<String, Refusal> {
        let field = from
            .field_ref
            .as_ref()
            .map(|f| f.field_path.as_str())
            .ok_or_else(|| {
                Refusal::config(format!(
                    "env {var} comes from a source the node runner lacks"
                ))
            })?;
        Ok(match field {
            "spec.nodeName" => self.node.to_string(),
            "metadata.name" => self.name.clone(),
            "metadata.namespace" => self.config.namespace.clone(),
            "metadata.uid" => self.uid.clone(),
            "status.podIP" => self.ip.to_string(),
            "spec.serviceAccountName" => self.spec.service_account_name.clone().unwrap_or_default(),
            other => {
                return Err(Refusal::config(format!(
                    "env {var} from unknown field {other}"
                )))
            }
        })
    }

    /// Stages every volume the container mounts and adds its `--mount`, then the service
    /// account's default mount when no projected volume took its place; where credentials
    /// are mounted, `KUBECONFIG` goes into `env`.
    pub(super) fn mount_volumes(
        &self,
        options: &mut Vec<String>,
        env: &mut Vec<(String, String)>,
    ) -> Result<(), Refusal> {
        let mut token_mounted = false;
        for m in self.container.volume_mounts.iter().flatten() {
            let volume = self
                .spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .ok_or_else(|| Refusal::config(format!("mount of unknown volume {}", m.name)))?;
            let dir = if let Some(h) = &volume.host_path {
                self.host_path(h)?
            } else if holds_token(volume) {
                token_mounted = true;
                let dir = self.pod_dir.join("volumes").join(&volume.name);
                service_account_files(self.config, self.spec, self.node, &dir, &self.sec)?;
                env.push((
                    "KUBECONFIG".into(),
                    format!("{}/kubeconfig", m.mount_path.trim_end_matches('/')),
                ));
                dir
            } else if volume.empty_dir.is_some() {
                self.empty_dir(&volume.name)?
            } else {
                return Err(Refusal::config(format!(
                    "volume {} is of a kind the node runner does not mount",
                    volume.name
                )));
            };
            options.push(bind_mount(dir, m)?);
        }
        if !token_mounted && self.spec.automount_service_account_token != Some(false) {
            // No projected volume (no ServiceAccount admission): the default path.
            let dir = self.pod_dir.join("volumes").join("serviceaccount");
            service_account_files(self.config, self.spec, self.node, &dir, &self.sec)?;
            options.push(format!(
                "--mount=type=bind,source={},destination={SERVICE_ACCOUNT_DIR},ro",
                dir.display()
            ));
            env.push((
                "KUBECONFIG".into(),
                format!("{SERVICE_ACCOUNT_DIR}/kubeconfig"),
            ));
        }
        Ok(())
    }

    /// A `hostPath` volume's folder under the node's root, checked (or made) as its `type`
    /// says.
    pub(super) fn host_path(&self, h: &HostPathVolumeSource) -> Result<PathBuf, Refusal> {
        let node = self.node;
        let dir = self.root.join(h.path.trim_start_matches('/'));
        match h.type_.as_deref().unwrap_or("") {
            "DirectoryOrCreate" => std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?,
            "Directory" => refuse_unless!(
                dir.is_dir(),
                "hostPath {} is not a directory on {node}",
                h.path
            ),
            "File" => {
                refuse_unless!(dir.is_file(), "hostPath {} is not a file on {node}", h.path)
            }
            "" => {}
            other => {
                return Err(Refusal::config(format!(
                    "hostPath type {other} is not supported by the node runner"
                )))
            }
        }
        Ok(dir)
    }

    /// A fresh `emptyDir` folder, open to every user as a kubelet makes it.
    pub(super) fn empty_dir(&self, volume: &str) -> Result<PathBuf, Refusal> {
        let dir = self.pod_dir.join("volumes").join(volume);
        std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
            .map_err(anyhow::Error::from)?;
        Ok(dir)
    }
}

/// Whether `volume` is the projected one that carries the service account's token.
pub(super) fn holds_token(volume: &Volume) -> bool {
    volume
        .projected
        .as_ref()
        .and_then(|p| p.sources.as_ref())
        .is_some_and(|s| s.iter().any(|s| s.service_account_token.is_some()))
}

/// The `--mount` option binding `dir` (or its `subPath`, made if missing) where `m` says.
pub(super) fn bind_mount(mut dir: PathBuf, m: &VolumeMount) -> Result<String, Refusal> {
    if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
        dir = dir.join(sub);
        std::fs::create_dir_all(&dir).map_err(anyhow::Error::from)?;
    }
    let dir = dir.to_str().context("a volume path is not UTF-8")?;
    refuse_unless!(
        !dir.contains([':', ',']) && !m.mount_path.contains([':', ',']),
        "mount {} at {}: paths with ':' or ',' are not supported",
        m.name,
        m.mount_path
    );
    let ro = if m.read_only == Some(true) { ",ro" } else { "" };
    Ok(format!(
        "--mount=type=bind,source={dir},destination={}{ro}",
        m.mount_path
    ))
}

/// `v` with a listen address on every interface (`0.0.0.0:<port>`) moved to the pod's IP,
/// the pod's network namespace here.
pub(super) fn listen_on(ip: IpAddr, v: &str) -> String {
    match v.strip_prefix("0.0.0.0:") {
        Some(port) => format!("{ip}:{port}"),
        None => v.to_string(),
    }
}

/// The container's entrypoint (`command[0]`), and `command[1..]` then `args` as its
/// arguments, with listen addresses on the pod IP.
pub(super) fn command_line(container: &Container, ip: IpAddr) -> (Option<String>, Vec<String>) {
    let mut command = container.command.clone().unwrap_or_default().into_iter();
    let entry = command.next();
    let args = command
        .chain(container.args.iter().flatten().cloned())
        .map(|a| listen_on(ip, &a))
        .collect();
    (entry, args)
}

/// The length of the container's `preStop` sleep (the one hook action the runner does).
pub(super) fn pre_stop(container: &Container) -> Result<Duration, Refusal> {
    let hook = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref());
    let Some(h) = hook else {
        return Ok(Duration::ZERO);
    };
    let s = h.sleep.as_ref().ok_or_else(|| {
        Refusal::config("preStop: only the sleep action is supported by the node runner")
    })?;
    Ok(Duration::from_secs(s.seconds.max(0) as u64))
}

/// Writes the service account's credentials into `dir`: a kubeconfig impersonating it on
/// `node` (what its pod-bound token would be), the cluster's CA and the namespace. The
/// kubeconfig is the container user's, mode 0600, as a kubelet makes the token file.
pub(super) fn service_account_files(
    config: &Config,
    spec: &PodSpec,
    node: &str,
    dir: &Path,
    sec: &Security,
) -> Result<(), Refusal> {
    use base64::Engine as _;
    std::fs::create_dir_all(dir).map_err(anyhow::Error::from)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(anyhow::Error::from)?;
    let sa = spec.service_account_name.as_deref().unwrap_or("default");
    let user = format!("system:serviceaccount:{}:{sa}", config.namespace);
    let kc = tools::impersonating_kubeconfig_on_node(&user, node)?;
    let ca = kc
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.certificate_authority_data.clone())
        .unwrap_or_default();
    let ca = base64::engine::general_purpose::STANDARD
        .decode(ca.trim())
        .map_err(|e| Refusal::config(format!("the cluster's CA: {e}")))?;
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_json::to_vec(&kc).map_err(anyhow::Error::from)?)
        .map_err(anyhow::Error::from)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(anyhow::Error::from)?;
    let owner = sec.user.map(|u| u as u32);
    let group = sec.group.map(|g| g as u32).or(owner);
    std::os::unix::fs::chown(&path, owner, group)
        .with_context(|| format!("chown {}", path.display()))?;
    std::fs::write(dir.join("ca.crt"), ca).map_err(anyhow::Error::from)?;
    std::fs::write(dir.join("namespace"), &config.namespace).map_err(anyhow::Error::from)?;
    Ok(())
}
