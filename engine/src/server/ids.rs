//! Job ids, and which replica owns the job an id names.
//!
//! Behind a Service, a client's `GET /v1/jobs/{id}` lands on any replica, but a job lives in
//! the one process that accepted it. With a key (the deployment's Secret, the same in every
//! replica) an id names its owner: the address other replicas reach it at, the owner's
//! incarnation (a random number drawn at start, so a restarted process at the same address
//! knows the id is not its own), and the owner's own number for the job, authenticated with
//! an HMAC-SHA256 tag under the key. A replica that is not the owner forwards the request
//! there ([`super::forward`]) only once the tag checks out, so no id a client makes up can
//! lead a replica to dial an address of the client's choosing.
//!
//! Without a key (a bare `layerwise serve`) every job is local, and its id is still one no
//! client can guess: the job's number in 16 hex digits, then 32 hex digits of an HMAC-SHA256
//! tag over it under a random key the process draws at start. A client that knows its own
//! id learns nothing of its neighbours' (counting down from one's own number yields ids
//! whose tags do not check out), and an id of an earlier process is unknown to a new one.

use std::net::{IpAddr, SocketAddr};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::Error;

/// The fewest bytes a key may have: 128 bits of a random secret (the operator makes 256).
pub const MIN_KEY_BYTES: usize = 16;
/// The first byte of a routed id (its layout's version).
const VERSION: u8 = 1;
/// Bytes of the HMAC-SHA256 tag kept in an id (128 bits, the left half).
const TAG_BYTES: usize = 16;
/// What the tag covers besides the id's own bytes, so a tag made for anything else under the
/// same key never passes for an id's.
const DOMAIN: &[u8] = b"layerwise job id v1\0";

/// Where the job an id names lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// In this process, under this number.
    Here(u64),
    /// In another replica, reachable at this address (vouched for by the key).
    Peer(SocketAddr),
}

/// A deployment's key, shown by nobody's `Debug`.
#[derive(Clone)]
pub struct JobKey(Vec<u8>);

impl JobKey {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<JobKey, Error> {
        let bytes = bytes.into();
        if bytes.len() < MIN_KEY_BYTES {
            return Err(Error::invalid(
                "job-key",
                format!(
                    "{} bytes: a key needs at least {MIN_KEY_BYTES} (the operator's Secret holds 64 hex digits)",
                    bytes.len()
                ),
            ));
        }
        Ok(JobKey(bytes))
    }

    /// A key of 32 random bytes, for ids that never leave this process.
    fn random() -> JobKey {
        JobKey(rand::random::<[u8; 32]>().to_vec())
    }
}

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobKey(<{} bytes, redacted>)", self.0.len())
    }
}

impl std::str::FromStr for JobKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<JobKey, Error> {
        JobKey::new(s.as_bytes())
    }
}

#[derive(Debug, Clone)]
struct Keyed {
    key: JobKey,
    me: SocketAddr,
    incarnation: u32,
}

/// Hex digits of a local id: the number's 16, then the tag's 32 (128 bits).
const LOCAL_ID_DIGITS: usize = 16 + 2 * TAG_BYTES;

/// How this process writes and reads job ids.
#[derive(Debug, Clone)]
pub struct JobIds {
    mode: Mode,
}

#[derive(Debug, Clone)]
enum Mode {
    /// Local ids, tagged under a key drawn at start that never leaves the process.
    Local(JobKey),
    /// Ids that name this process under the deployment's key.
    Keyed(Keyed),
}

impl JobIds {
    /// Ids that stay local (no owner), tagged under a key drawn now.
    pub fn local() -> JobIds {
        JobIds {
            mode: Mode::Local(JobKey::random()),
        }
    }

    /// Ids that name this process (at `me`, as other replicas reach it) under `key`.
    pub fn keyed(key: JobKey, me: SocketAddr) -> JobIds {
        JobIds::with_incarnation(key, me, rand::random())
    }

    /// [`JobIds::keyed`] with a given incarnation (tests make ids of "earlier" processes).
    pub fn with_incarnation(key: JobKey, me: SocketAddr, incarnation: u32) -> JobIds {
        JobIds {
            mode: Mode::Keyed(Keyed {
                key,
                me,
                incarnation,
            }),
        }
    }

    /// The address ids name as this process's, when they name one.
    pub fn me(&self) -> Option<SocketAddr> {
        match &self.mode {
            Mode::Keyed(k) => Some(k.me),
            Mode::Local(_) => None,
        }
    }

    /// The id of this process's job `number`.
    pub fn format(&self, number: u64) -> String {
        let k = match &self.mode {
            Mode::Keyed(k) => k,
            Mode::Local(key) => return local_id(key, number),
        };
        let mut b = body(k.incarnation, number, k.me);
        let tag = tag(&k.key, &b);
        b.extend_from_slice(&tag[..TAG_BYTES]);
        URL_SAFE_NO_PAD.encode(b)
    }

    /// Who owns the job `id` names. An id this process cannot have made, or whose tag does
    /// not check out, is a 404 naming it; one that names an earlier process at this
    /// process's own address is a 410 saying so.
    pub fn parse(&self, id: &str) -> Result<Owner, Error> {
        let unknown = || Error::NotFound {
            what: format!("job `{id}`"),
        };
        let k = match &self.mode {
            Mode::Keyed(k) => k,
            Mode::Local(key) => return parse_local(key, id).ok_or_else(unknown),
        };
        let raw = URL_SAFE_NO_PAD.decode(id).map_err(|_| unknown())?;
        let (incarnation, number, owner) = read(&raw).ok_or_else(unknown)?;
        let (b, t) = raw.split_at(raw.len() - TAG_BYTES);
        let mut mac = mac(&k.key);
        mac.update(b);
        mac.verify_truncated_left(t).map_err(|_| unknown())?;
        if owner != k.me {
            return Ok(Owner::Peer(owner));
        }
        if incarnation != k.incarnation {
            return Err(Error::ReplicaGone {
                job: id.to_string(),
                owner: format!(
                    "{owner} (an earlier process at this replica's address; it restarted since)"
                ),
            });
        }
        Ok(Owner::Here(number))
    }
}

/// A local id: the number in 16 hex digits, then its tag under `key` in 32.
fn local_id(key: &JobKey, number: u64) -> String {
    let tag = tag(key, &number.to_be_bytes());
    let hex: String = tag[..TAG_BYTES]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{number:016x}{hex}")
}

/// The number of a local id whose tag checks out under `key`.
fn parse_local(key: &JobKey, id: &str) -> Option<Owner> {
    if id.len() != LOCAL_ID_DIGITS || !id.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let number = u64::from_str_radix(&id[..16], 16).ok()?;
    let given: Vec<u8> = (16..id.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&id[i..i + 2], 16))
        .collect::<Result<_, _>>()
        .ok()?;
    let mut mac = mac(key);
    mac.update(&number.to_be_bytes());
    mac.verify_truncated_left(&given).ok()?;
    Some(Owner::Here(number))
}

/// version, incarnation, number, port, then the IP's 4 or 16 bytes.
fn body(incarnation: u32, number: u64, addr: SocketAddr) -> Vec<u8> {
    let mut b = Vec::with_capacity(15 + 16 + TAG_BYTES);
    b.push(VERSION);
    b.extend_from_slice(&incarnation.to_be_bytes());
    b.extend_from_slice(&number.to_be_bytes());
    b.extend_from_slice(&addr.port().to_be_bytes());
    match addr.ip() {
        IpAddr::V4(ip) => b.extend_from_slice(&ip.octets()),
        IpAddr::V6(ip) => b.extend_from_slice(&ip.octets()),
    }
    b
}

/// The parts of a routed id's bytes (tag not checked), or `None` when it has another shape.
fn read(raw: &[u8]) -> Option<(u32, u64, SocketAddr)> {
    let ip_len = raw.len().checked_sub(15 + TAG_BYTES)?;
    if raw[0] != VERSION {
        return None;
    }
    let incarnation = u32::from_be_bytes(raw[1..5].try_into().ok()?);
    let number = u64::from_be_bytes(raw[5..13].try_into().ok()?);
    let port = u16::from_be_bytes(raw[13..15].try_into().ok()?);
    let ip = &raw[15..15 + ip_len];
    let ip = match ip_len {
        4 => IpAddr::from(<[u8; 4]>::try_from(ip).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(ip).ok()?),
        _ => return None,
    };
    Some((incarnation, number, SocketAddr::new(ip, port)))
}

fn mac(key: &JobKey) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC takes keys of any length");
    m.update(DOMAIN);
    m
}

fn tag(key: &JobKey, body: &[u8]) -> [u8; 32] {
    let mut m = mac(key);
    m.update(body);
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> JobKey {
        s.parse().unwrap()
    }

    fn ids(k: &str, me: &str, incarnation: u32) -> JobIds {
        JobIds::with_incarnation(key(k), me.parse().unwrap(), incarnation)
    }

    #[test]
    fn local_ids_cannot_be_guessed_from_ones_own() {
        let l = JobIds::local();
        let id = l.format(0xab);
        assert_eq!(id.len(), 48, "{id}");
        assert!(id.starts_with("00000000000000ab"), "{id}");
        assert_eq!(l.parse(&id).unwrap(), Owner::Here(0xab));
        // The neighbours' numbers with one's own tag, the bare number (what ids were before),
        // and a tag with one digit changed are all unknown jobs.
        let tag = &id[16..];
        let mut flipped = id.clone().into_bytes();
        flipped[47] = if flipped[47] == b'0' { b'1' } else { b'0' };
        let flipped = String::from_utf8(flipped).unwrap();
        let neighbours = [
            format!("{:016x}{tag}", 0xaa),
            format!("{:016x}{tag}", 0xac),
            "00000000000000ab".to_string(),
            flipped,
        ];
        for bad in
            neighbours
                .iter()
                .map(String::as_str)
                .chain(["ab", "", &"z".repeat(48), &id[..47]])
        {
            let e = l.parse(bad).unwrap_err();
            assert_eq!(e.http_status(), 404, "{bad}: {e}");
            assert!(e.to_string().contains(&format!("job `{bad}`")), "{e}");
        }
        // Another process (a restart) draws its own key: the old id is unknown there.
        assert_eq!(JobIds::local().parse(&id).unwrap_err().http_status(), 404);
        // A routed id means nothing to a server without a key: it stays local.
        let routed = ids("0123456789abcdef0123", "10.0.0.1:8080", 1).format(5);
        assert_eq!(l.parse(&routed).unwrap_err().http_status(), 404);
    }

    #[test]
    fn a_routed_id_names_its_owner_to_every_replica_with_the_key() {
        let k = "0123456789abcdef0123456789abcdef";
        let a = ids(k, "10.0.0.1:8080", 7);
        let b = ids(k, "10.0.0.2:8080", 9);
        let v6 = ids(k, "[fd00::1]:8080", 3);
        for number in [0, 1, u64::MAX] {
            let id = a.format(number);
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
                "{id} is not path-safe"
            );
            assert!(id.starts_with('A'), "{id}: no leading `-`");
            assert_eq!(a.parse(&id).unwrap(), Owner::Here(number));
            assert_eq!(
                b.parse(&id).unwrap(),
                Owner::Peer("10.0.0.1:8080".parse().unwrap())
            );
        }
        let id = v6.format(42);
        assert_eq!(v6.parse(&id).unwrap(), Owner::Here(42));
        assert_eq!(
            a.parse(&id).unwrap(),
            Owner::Peer("[fd00::1]:8080".parse().unwrap())
        );
    }

    #[test]
    fn forged_ids_are_unknown_jobs() {
        let k = "0123456789abcdef0123456789abcdef";
        let a = ids(k, "10.0.0.1:8080", 7);
        let b = ids(k, "10.0.0.2:8080", 9);
        let other_key = ids("fedcba9876543210fedcba9876543210", "10.0.0.1:8080", 7);
        let id = a.format(5);
        let raw = URL_SAFE_NO_PAD.decode(&id).unwrap();
        // Every single bit flipped, in the owner's address, the number, the tag...
        for byte in 0..raw.len() {
            let mut r = raw.clone();
            r[byte] ^= 1;
            let forged = URL_SAFE_NO_PAD.encode(&r);
            let e = b.parse(&forged).unwrap_err();
            assert_eq!(e.http_status(), 404, "byte {byte}: {e}");
        }
        // ... a tag made under another key, a short tag, nothing of the right shape.
        assert_eq!(
            b.parse(&other_key.format(5)).unwrap_err().http_status(),
            404
        );
        let short = URL_SAFE_NO_PAD.encode(&raw[..raw.len() - 1]);
        assert_eq!(b.parse(&short).unwrap_err().http_status(), 404);
        for bad in ["", "x", "0000000000000005", "not base64!", &"A".repeat(47)] {
            assert_eq!(b.parse(bad).unwrap_err().http_status(), 404, "{bad}");
        }
    }

    #[test]
    fn an_id_of_an_earlier_process_at_the_same_address_is_gone() {
        let k = "0123456789abcdef0123456789abcdef";
        let before = ids(k, "10.0.0.1:8080", 7);
        let after = ids(k, "10.0.0.1:8080", 8);
        let id = before.format(5);
        let e = after.parse(&id).unwrap_err();
        assert_eq!(e.http_status(), 410, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&id) && msg.contains("no longer running") && msg.contains("restarted"),
            "{msg}"
        );
    }

    #[test]
    fn short_keys_are_refused_and_keys_never_print() {
        let e = "too short".parse::<JobKey>().unwrap_err();
        assert!(e.to_string().contains("job-key"), "{e}");
        let k = key("0123456789abcdef0123456789abcdef");
        assert!(!format!("{k:?}").contains("0123"), "{k:?}");
        let i = JobIds::keyed(k, "10.0.0.1:8080".parse().unwrap());
        assert!(!format!("{i:?}").contains("0123"), "{i:?}");
    }
}
