//! The model sources beside a folder on the nodes: an S3-compatible object store (`s3`), and
//! how a claim's files reach the engine pods (`persistentVolumeClaim.mode`). The location
//! itself ([`crate::ModelLocation`]) holds exactly one source; these are its parts.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// A pipeline folder in an S3-compatible object store: every object under `prefix` is a file
/// of the pipeline, its key less the prefix its path. The node agents copy it into their
/// node model cache (verified, published whole), and the engine pods read that copy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// The store's endpoint URL (`https://s3.eu-west-1.amazonaws.com`,
    /// `http://seaweedfs.storage:8333`). Unset: AWS S3 in `region`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('https://') || self.startsWith('http://')").message("s3.endpoint must be an http:// or https:// URL"))]
    #[schemars(length(max = 1024))]
    pub endpoint: Option<String>,
    /// The bucket.
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9][a-z0-9.-]*[a-z0-9]$')").message("s3.bucket must be a bucket name: lowercase letters, digits, '.' and '-'"))]
    #[schemars(length(min = 3, max = 63))]
    pub bucket: String,
    /// The key prefix of the pipeline folder (`models/wan2.2-t2v/`); a trailing `/` is
    /// implied. Empty: the whole bucket.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[x_kube(validation = Rule::new("!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')").message("s3.prefix must be relative and must not contain '..'"))]
    #[schemars(length(max = 1024))]
    pub prefix: String,
    /// The store's region (`us-east-1` where the store does not care).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// Path-style requests (`<endpoint>/<bucket>/<key>`), which most S3-compatible servers
    /// need; virtual-hosted style (`<bucket>.<endpoint>/<key>`) otherwise.
    #[serde(default)]
    pub path_style: bool,
    /// A Secret in the DiffusionDeployment's namespace holding the credentials, under the
    /// keys `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN` where
    /// they are temporary). Read by the node agents only, never logged nor written to any
    /// status. Unset: anonymous requests (a public bucket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<SecretName>,
}

/// A Secret in the DiffusionDeployment's namespace, by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretName {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

impl S3Source {
    /// A short human form, `s3://<bucket>/<prefix>` and the endpoint: never the credentials.
    pub fn describe(&self) -> String {
        let at = self
            .endpoint
            .as_ref()
            .map(|e| format!(" at {e}"))
            .unwrap_or_default();
        format!("s3://{}/{}{at}", self.bucket, self.prefix)
    }
}

/// How the engine pods read a claim's files.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum ClaimMode {
    /// The pods mount the claim read-only and read the files where they are; the agents
    /// profile and warm the folder where they can read it on the node (a `local` or
    /// `hostPath` volume).
    #[default]
    InPlace,
    /// The agents copy the claim's folder into their node model cache, and the pods read
    /// that copy: for a network volume (NFS, CSI) whose reads over the network would stall
    /// the streams.
    Staged,
}
