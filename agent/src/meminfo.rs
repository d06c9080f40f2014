//! `/proc/meminfo`: physical memory and what is available without swapping, which the
//! prewarm floor watches.

use std::path::Path;

use crate::{Error, Result};

/// The two numbers the agent needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// Parses the text of `/proc/meminfo` (values in kB).
pub fn parse(text: &str) -> Option<MemInfo> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some(kb * 1024)
        })
    };
    Some(MemInfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

/// Reads `/proc/meminfo` (or `path`, for tests).
pub fn read_from(path: &Path) -> Result<MemInfo> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse(&text).ok_or_else(|| Error::Invalid {
        field: path.display().to_string(),
        msg: "no MemTotal or MemAvailable line".into(),
    })
}

/// The node's memory now.
pub fn read() -> Result<MemInfo> {
    read_from(Path::new("/proc/meminfo"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_text() {
        let text = "MemTotal:       24576000 kB\nMemFree:         8000000 kB\nMemAvailable:   20000000 kB\nBuffers: 1 kB\n";
        assert_eq!(
            parse(text),
            Some(MemInfo {
                total: 24_576_000 * 1024,
                available: 20_000_000 * 1024
            })
        );
    }

    #[test]
    fn missing_fields_are_none() {
        assert_eq!(parse("MemTotal: 1 kB\n"), None);
        assert_eq!(parse("MemTotalX: 1 kB\nMemAvailable: 1 kB\n"), None);
    }

    #[test]
    fn this_machine_has_memory() {
        let m = read().unwrap();
        assert!(m.total > 0 && m.available <= m.total);
    }
}
