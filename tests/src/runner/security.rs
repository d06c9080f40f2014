//! The container's security settings, its own over the pod's, as `podman run` options;
//! what this kubelet does not do is refused.

use anyhow::Result;
use k8s_openapi::api::core::v1::{PodSecurityContext, SecurityContext};

use super::refusal::{refuse_unless, Refusal};

/// The security settings of the container: its own over the pod's.
pub(super) struct Security {
    pub(super) user: Option<i64>,
    pub(super) group: Option<i64>,
    pub(super) non_root: bool,
}

/// Translates the pod's and container's security contexts into `podman run` options,
/// refusing what this kubelet does not do.
pub(super) fn security(
    pod_sc: Option<&PodSecurityContext>,
    sc: Option<&SecurityContext>,
    options: &mut Vec<String>,
) -> Result<Security, Refusal> {
    let pod_sc = pod_sc.cloned().unwrap_or_default();
    let sc = sc.cloned().unwrap_or_default();
    refuse_unless!(
        sc.privileged != Some(true),
        "privileged containers are not allowed on this node"
    );
    refuse_unless!(
        pod_sc.fs_group.is_none() && pod_sc.fs_group_change_policy.is_none(),
        "securityContext.fsGroup is not supported by the node runner"
    );
    refuse_unless!(
        sc.se_linux_options.is_none() && pod_sc.se_linux_options.is_none(),
        "securityContext.seLinuxOptions: this node has no SELinux"
    );
    refuse_unless!(
        pod_sc.sysctls.as_ref().is_none_or(Vec::is_empty),
        "securityContext.sysctls are not supported by the node runner"
    );
    refuse_unless!(
        sc.proc_mount.as_deref().unwrap_or("Default") == "Default",
        "securityContext.procMount {:?} is not supported",
        sc.proc_mount
    );
    let user = sc.run_as_user.or(pod_sc.run_as_user);
    let group = sc.run_as_group.or(pod_sc.run_as_group);
    match (user, group) {
        (Some(u), Some(g)) => options.push(format!("--user={u}:{g}")),
        (Some(u), None) => options.push(format!("--user={u}")),
        (None, Some(_)) => {
            return Err(Refusal::config(
                "runAsGroup without runAsUser is not supported by the node runner",
            ))
        }
        (None, None) => {}
    }
    for g in pod_sc.supplemental_groups.iter().flatten() {
        options.push(format!("--group-add={g}"));
    }
    if sc.read_only_root_filesystem == Some(true) {
        // A kubelet mounts nothing writable in the root's place.
        options.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    if let Some(caps) = &sc.capabilities {
        for c in caps.drop.iter().flatten() {
            options.push(format!("--cap-drop={c}"));
        }
        for c in caps.add.iter().flatten() {
            options.push(format!("--cap-add={c}"));
        }
    }
    if sc.allow_privilege_escalation == Some(false) {
        options.push("--security-opt=no-new-privileges".into());
    }
    let seccomp = sc
        .seccomp_profile
        .as_ref()
        .or(pod_sc.seccomp_profile.as_ref());
    match seccomp.map(|p| p.type_.as_str()) {
        // The runtime's default profile, which podman applies unless told otherwise.
        Some("RuntimeDefault") => {}
        // A kubelet without --seccomp-default runs containers unconfined.
        None | Some("Unconfined") => options.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => {
            return Err(Refusal::config(format!(
                "seccompProfile {other} is not supported by the node runner"
            )))
        }
    }
    let apparmor = sc
        .app_armor_profile
        .as_ref()
        .or(pod_sc.app_armor_profile.as_ref());
    refuse_unless!(
        apparmor.is_none_or(|p| p.type_ != "Localhost"),
        "appArmorProfile Localhost is not supported by the node runner"
    );
    Ok(Security {
        user,
        group,
        non_root: sc.run_as_non_root.or(pod_sc.run_as_non_root) == Some(true),
    })
}
