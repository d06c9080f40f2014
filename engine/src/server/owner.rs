//! Who a job belongs to: the credential that created it. Job ids cannot be guessed, but a
//! list of every caller's jobs would hand them out, and with an id anyone could download or
//! delete the job. So, as OpenAI scopes its lists to the API key, a job belongs to the
//! bearer token of the `Authorization` header that created it, kept only as a SHA-256 hash
//! ([`Credential`]); listing, reading, downloading, cancelling and deleting see only the
//! caller's own jobs, and another caller's job answers 404, as if it did not exist.
//!
//! A request without the header is anonymous: its jobs belong to no credential and are
//! reached by id alone (the id is the capability), and listing them is off unless the
//! operator turns it on (`--anonymous-list`), since any anonymous caller would see every
//! other's. The server checks no token against anything: it does not authenticate, it only
//! keeps callers apart. A gateway in front that authenticates passes the token on.

use std::fmt;

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::Error;

/// What the hash covers before the token, so it is nobody else's hash of the same bytes.
const DOMAIN: &[u8] = b"layerwise job owner v1\0";

/// A bearer token's SHA-256 hash (under [`DOMAIN`]); the token itself is never kept.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Credential([u8; 32]);

impl Credential {
    /// The credential of `token`.
    pub fn of(token: &str) -> Credential {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        h.update(token.as_bytes());
        Credential(h.finalize().into())
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Enough to tell two apart in a log, nothing to replay.
        write!(f, "Credential({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// The caller of a request: the credential its `Authorization: Bearer` header gives, or
/// none (anonymous). A handler that takes it refuses a malformed header with a 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller(pub Option<Credential>);

impl Caller {
    /// The caller `headers` name: none without an `Authorization` header; a 401 for one
    /// that is not `Bearer <token>`.
    pub fn of(headers: &HeaderMap) -> Result<Caller, Error> {
        let Some(value) = headers.get(AUTHORIZATION) else {
            return Ok(Caller(None));
        };
        let bad = |why: &str| {
            Error::Unauthorized {
            msg: format!("the Authorization header {why}; send `Authorization: Bearer <token>`, or none to be anonymous"),
        }
        };
        let text = value.to_str().map_err(|_| bad("is not visible ASCII"))?;
        let (scheme, token) = text
            .trim()
            .split_once(' ')
            .ok_or_else(|| bad("has no token"))?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(bad(&format!("uses the `{scheme}` scheme")));
        }
        let token = token.trim();
        if token.is_empty() {
            return Err(bad("has an empty token"));
        }
        Ok(Caller(Some(Credential::of(token))))
    }

    /// Whether a job created by `owner` is this caller's.
    pub fn owns(&self, owner: Option<Credential>) -> bool {
        self.0 == owner
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Caller::of(&parts.headers)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn caller(value: Option<&str>) -> Result<Caller, Error> {
        let mut h = HeaderMap::new();
        if let Some(v) = value {
            h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        Caller::of(&h)
    }

    #[test]
    fn a_bearer_token_is_its_hash_and_anything_else_is_refused() {
        assert_eq!(caller(None).unwrap(), Caller(None));
        let a = caller(Some("Bearer sk-a")).unwrap();
        assert_eq!(a, caller(Some("bearer  sk-a ")).unwrap());
        assert_ne!(a, caller(Some("Bearer sk-b")).unwrap());
        assert!(a.owns(Some(Credential::of("sk-a"))));
        assert!(!a.owns(None));
        assert!(!Caller(None).owns(Some(Credential::of("sk-a"))));
        for v in ["Basic dXNlcjpwYXNz", "Bearer", "Bearer   ", "sk-a"] {
            let e = caller(Some(v)).unwrap_err();
            assert_eq!(e.http_status(), 401, "{v}: {e}");
        }
        assert!(!format!("{:?}", Credential::of("sk-a")).contains("sk-a"));
    }
}
