//! What the operator last applied of each object it owns ([`Applied`]), so an unchanged
//! object is not applied again.

use std::collections::HashMap;

use serde::Serialize;

use super::triggers::hash_of;

/// and the version the apiserver answered with (a Deployment's `generation`, which any
/// change to its spec moves; a Service's `resourceVersion`, which any change moves). While
/// the stored object is still at that version and the desired object hashes the same, an
/// apply would change nothing, so it is not sent: a steady reconcile writes nothing.
/// Anything else that changes the object moves its version, and the next reconcile applies
/// again. Kept in memory: a new leader applies everything once.
#[derive(Default)]
pub struct Applied(std::sync::Mutex<HashMap<AppliedKey, (u64, String)>>);

/// The owning deployment's uid and the kind applied.
type AppliedKey = (String, &'static str);

impl Applied {
    /// Whether `desired` (of `kind`, owned by the deployment `uid`) is what was applied last
    /// and the stored object is still at the version that apply made.
    pub fn unchanged(
        &self,
        uid: &str,
        kind: &'static str,
        desired: &impl Serialize,
        stored: Option<&str>,
    ) -> bool {
        let map = self.0.lock().expect("not poisoned");
        map.get(&(uid.to_string(), kind))
            .is_some_and(|(hash, version)| {
                *hash == hash_of(desired) && Some(version.as_str()) == stored
            })
    }

    /// The version the last apply of `kind` for `uid` made, if this process made one.
    pub fn version(&self, uid: &str, kind: &'static str) -> Option<String> {
        let map = self.0.lock().expect("not poisoned");
        map.get(&(uid.to_string(), kind)).map(|(_, v)| v.clone())
    }

    /// Records that `desired` was applied and the apiserver answered with `version`.
    pub fn record(&self, uid: &str, kind: &'static str, desired: &impl Serialize, version: String) {
        let mut map = self.0.lock().expect("not poisoned");
        map.insert((uid.to_string(), kind), (hash_of(desired), version));
    }

    /// Forgets a deployment that is gone.
    pub fn forget(&self, uid: &str) {
        self.0
            .lock()
            .expect("not poisoned")
            .retain(|(u, _), _| u != uid);
    }
}
