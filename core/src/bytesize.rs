//! The one grammar of a byte size, wherever one is read: a node's memory as Kubernetes
//! reports it, a flag of the agent or of `layerwise-operator plan`. It takes what
//! Kubernetes writes (quantities: `17179869184`, `16Gi`, `16G`, `1.5Ti`, `16e9`, `1500m`)
//! and what a person types (`16GiB`, `16GB`, `100MB`, `4096B`, `16 GiB`), so a size means
//! the same to every crate: before this there were two parsers, and `16GB` was a size to
//! the agent and not to the CRDs. Binary units (`Ki`, `KiB`, ...) are powers of 1024,
//! decimal ones (`k`, `K`, `kB`, `KB`, `M`, `MB`, ...) powers of 1000, as Kubernetes and
//! the SI have them. A fraction of a byte is rounded down.

use std::fmt;

/// A text that is not a byte size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteSizeError {
    /// The text as given.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl fmt::Display for ByteSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}`: {}; write bytes (4096), a Kubernetes quantity (16Gi, 16G, 1.5Ti) or a size with its unit (16GiB, 16GB, 100MB)",
            self.text, self.why
        )
    }
}

impl std::error::Error for ByteSizeError {}

/// The scale of a unit, or `None` when it is none of the grammar's.
fn scale(unit: &str) -> Option<f64> {
    const KI: f64 = 1024.0;
    Some(match unit {
        "" | "B" => 1.0,
        "Ki" | "KiB" => KI,
        "Mi" | "MiB" => KI.powi(2),
        "Gi" | "GiB" => KI.powi(3),
        "Ti" | "TiB" => KI.powi(4),
        "Pi" | "PiB" => KI.powi(5),
        "Ei" | "EiB" => KI.powi(6),
        "k" | "K" | "kB" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "P" | "PB" => 1e15,
        "E" | "EB" => 1e18,
        // Kubernetes' milli (a quantity may say `1500m` bytes).
        "m" => 1e-3,
        _ => return None,
    })
}

/// The bytes `text` names (see the module's grammar).
pub fn parse_bytes(text: &str) -> Result<u64, ByteSizeError> {
    let fail = |why| ByteSizeError {
        text: text.to_string(),
        why,
    };
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim_start();
    if number.is_empty() {
        return Err(fail("no number"));
    }
    if number.starts_with('-') {
        return Err(fail("a negative size"));
    }
    // Kubernetes' exponent form (`16e9`, `1E3`): a decimal exponent, no unit after it.
    let scale = match scale(unit) {
        Some(s) => s,
        None => match unit.strip_prefix(['e', 'E']).map(str::parse::<i32>) {
            Some(Ok(e)) => 10f64.powi(e),
            _ => return Err(fail("an unknown unit")),
        },
    };
    // Exact for whole numbers with a whole scale (the usual case), beyond f64's 53 bits.
    if let (Ok(n), true) = (number.parse::<u64>(), scale >= 1.0 && scale.fract() == 0.0) {
        return n.checked_mul(scale as u64).ok_or_else(|| fail("too large"));
    }
    let v = number.parse::<f64>().map_err(|_| fail("not a number"))? * scale;
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(fail("too large"));
    }
    Ok(v.floor() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_quantities_and_typed_units_are_one_grammar() {
        for (text, want) in [
            ("17179869184", 17_179_869_184),
            ("4096B", 4096),
            ("16Gi", 16 << 30),
            ("16GiB", 16 << 30),
            ("16 GiB", 16 << 30),
            ("16384Mi", 16 << 30),
            ("1.5Ti", 3 << 39),
            ("1.5Gi", 3 << 29),
            ("129000Ki", 129_000 * 1024),
            ("16G", 16_000_000_000),
            ("16e9", 16_000_000_000),
            ("1500m", 1),
            ("8K", 8_000),
            ("8kB", 8_000),
            ("2Ei", 2 << 60),
            // The two old parsers' disagreements: the agent took these and the CRDs did
            // not (16GB, 100MB); the CRDs took these and the agent did not (16e9, 1Pi).
            ("16GB", 16_000_000_000),
            ("100MB", 100_000_000),
            ("1Pi", 1 << 50),
        ] {
            assert_eq!(parse_bytes(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn anything_else_is_named() {
        for (text, why) in [
            ("", "no number"),
            ("Gi", "no number"),
            ("-1Gi", "a negative size"),
            ("12 parsecs", "an unknown unit"),
            ("16gb", "an unknown unit"),
            ("1.2.3G", "not a number"),
            ("20000000Ei", "too large"),
        ] {
            let e = parse_bytes(text).unwrap_err();
            assert_eq!(e.why, why, "{text}");
            assert!(e.to_string().starts_with(&format!("`{text}`")), "{e}");
        }
    }
}
