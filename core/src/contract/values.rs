//! The value types of the contract's flags whose text is not a plain number: `--slots`,
//! `--resident-blocks` and `--resident-blocks-by-component`. Each parses what the other
//! renders, so a value the operator writes is the value the engine reads.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::memory;
use crate::{Error, Result};

/// `--slots`: a fixed K or as many as the device memory allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotsChoice {
    Fixed(usize),
    Auto,
}

impl Default for SlotsChoice {
    fn default() -> Self {
        SlotsChoice::Fixed(2)
    }
}

impl FromStr for SlotsChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(SlotsChoice::Auto);
        }
        s.parse()
            .map(SlotsChoice::Fixed)
            .map_err(|_| Error::invalid("slots", format!("`{s}`: expected a number ≥ 2 or `auto`")))
    }
}

impl fmt::Display for SlotsChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotsChoice::Fixed(k) => write!(f, "{k}"),
            SlotsChoice::Auto => f.write_str("auto"),
        }
    }
}

/// `--resident-blocks`: how many blocks of each streamed group stay on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidentBlocks {
    Fixed(usize),
    /// As many as fit the device memory budget after the slots, the activations and the
    /// overhead ([`crate::slots::auto_resident_blocks`]).
    Auto,
}

impl Default for ResidentBlocks {
    fn default() -> Self {
        ResidentBlocks::Fixed(0)
    }
}

impl FromStr for ResidentBlocks {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(ResidentBlocks::Auto);
        }
        s.parse().map(ResidentBlocks::Fixed).map_err(|_| {
            Error::invalid(
                "resident-blocks",
                format!("`{s}`: expected a number of blocks or `auto`"),
            )
        })
    }
}

impl fmt::Display for ResidentBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResidentBlocks::Fixed(n) => write!(f, "{n}"),
            ResidentBlocks::Auto => f.write_str("auto"),
        }
    }
}

/// `--resident-blocks-by-component`: blocks kept of each group of the components named
/// (`transformer=20,text_encoder=0`), in place of `--resident-blocks`' one count for
/// every group; read and written by the core's one code
/// ([`memory::parse_component_blocks`]), as the planner writes it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlocksByComponent(pub BTreeMap<String, u64>);

impl FromStr for BlocksByComponent {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(BlocksByComponent(memory::parse_component_blocks(s)?))
    }
}

impl fmt::Display for BlocksByComponent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&memory::format_component_blocks(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse() {
        assert_eq!("auto".parse::<SlotsChoice>().unwrap(), SlotsChoice::Auto);
        assert_eq!("3".parse::<SlotsChoice>().unwrap(), SlotsChoice::Fixed(3));
        for bad in ["x", "-1", "2.5", ""] {
            let e = bad.parse::<SlotsChoice>().unwrap_err().to_string();
            assert!(e.contains("slots") && e.contains("`auto`"), "{e}");
        }
        assert_eq!(SlotsChoice::Auto.to_string(), "auto");
        assert_eq!(SlotsChoice::Fixed(4).to_string(), "4");
    }
}
