//! The loopback rule, checked: every socket of a process the test cluster started must be
//! bound to and connected with 127.0.0.0/8 (or ::1), and every address the cluster hands
//! out (node and pod IPs) must be loopback.
//!
//! Sockets are read from `/proc/<pid>/fd` (socket inodes) joined with `/proc/net/{tcp,tcp6,
//! udp,udp6}`, which is what `ss -p` does, without needing `ss` or its output format.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// One socket of a watched process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Socket {
    pub proto: &'static str,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Kernel TCP state number (0x0A = LISTEN, 0x01 = ESTABLISHED); 0x07 for unconnected UDP.
    pub state: u8,
}

impl Socket {
    /// Whether the socket keeps to loopback: bound to a loopback address (a wildcard bind
    /// would accept from any interface) and, if connected, connected to loopback.
    pub fn is_loopback_only(&self) -> bool {
        is_loopback(self.local.ip()) && (self.remote.port() == 0 || is_loopback(self.remote.ip()))
    }
}

/// 127.0.0.0/8, ::1, or an IPv4-mapped 127.x address.
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The socket inodes process `pid` holds open.
fn socket_inodes(pid: u32) -> Result<HashSet<u64>> {
    let dir = format!("/proc/{pid}/fd");
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue; // closed while we looked
        };
        let target = target.to_string_lossy();
        if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
        {
            inodes.insert(inode.parse()?);
        }
    }
    Ok(inodes)
}

/// Every TCP/UDP socket (v4 and v6) that process `pid` holds.
pub fn sockets_of(pid: u32) -> Result<Vec<Socket>> {
    let inodes = socket_inodes(pid)?;
    let mut found = Vec::new();
    for proto in ["tcp", "tcp6", "udp", "udp6"] {
        let table = Path::new("/proc/net").join(proto);
        let text = std::fs::read_to_string(&table)
            .with_context(|| format!("reading {}", table.display()))?;
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || !inodes.contains(&f[9].parse::<u64>().unwrap_or(0)) {
                continue;
            }
            found.push(Socket {
                proto,
                local: parse_addr(f[1]).with_context(|| format!("{proto}: {line}"))?,
                remote: parse_addr(f[2]).with_context(|| format!("{proto}: {line}"))?,
                state: u8::from_str_radix(f[3], 16)?,
            });
        }
    }
    Ok(found)
}

/// Parses `/proc/net/tcp*`'s `HEXADDR:HEXPORT`: the address is in host byte order by
/// 32-bit word (little-endian here), the port big-endian.
pub fn parse_addr(field: &str) -> Result<SocketAddr> {
    let Some((addr, port)) = field.split_once(':') else {
        bail!("no ':' in address {field:?}");
    };
    let port = u16::from_str_radix(port, 16)?;
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(u32::from_str_radix(addr, 16)?.to_le_bytes())),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                let word = u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16)?;
                chunk.copy_from_slice(&word.to_le_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        n => bail!("address {addr:?} has {n} hex digits"),
    };
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_addresses() {
        assert_eq!(
            parse_addr("0100007F:1F90").unwrap(),
            "127.0.0.1:8080".parse().unwrap()
        );
        assert_eq!(
            parse_addr("00000000:0050").unwrap(),
            "0.0.0.0:80".parse().unwrap()
        );
        assert_eq!(
            parse_addr("00000000000000000000000001000000:0016").unwrap(),
            "[::1]:22".parse().unwrap()
        );
        assert_eq!(
            parse_addr("0000000000000000FFFF00000100007F:0016").unwrap(),
            "[::ffff:127.0.0.1]:22".parse().unwrap()
        );
    }

    #[test]
    fn wildcard_and_private_are_not_loopback() {
        let sock = |local: &str, remote: &str| Socket {
            proto: "tcp",
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
            state: 1,
        };
        assert!(sock("127.0.0.1:1", "0.0.0.0:0").is_loopback_only());
        assert!(sock("127.0.0.1:1", "127.0.0.5:80").is_loopback_only());
        assert!(!sock("0.0.0.0:1", "0.0.0.0:0").is_loopback_only());
        assert!(!sock("[::]:1", "[::]:0").is_loopback_only());
        assert!(!sock("127.0.0.1:1", "10.1.2.3:443").is_loopback_only());
    }

    #[test]
    fn sees_a_socket_of_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mine = sockets_of(std::process::id()).unwrap();
        assert!(
            mine.iter()
                .any(|s| s.local.port() == port && s.state == 0x0A),
            "{mine:?}"
        );
    }
}
