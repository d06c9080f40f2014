//! Byte sizes on the command line: `1073741824`, `512Mi`, `64G`, `100MB`.

/// Parses a byte size with an optional binary (`Ki`, `Mi`, `Gi`, `Ti`) or decimal (`k`/`K`,
/// `M`, `G`, `T`, with or without `B`) suffix.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected a number of bytes like 512Mi or 100MB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" | "TiB" => 1 << 40,
        "k" | "K" | "kB" | "KB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "T" | "TB" => 1_000_000_000_000,
        other => return Err(format!("`{s}`: unknown unit `{other}`")),
    };
    Ok((n * mult as f64).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("100MB"), Ok(100_000_000));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("Mi").is_err());
    }
}
