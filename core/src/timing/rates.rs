//! The node's side of the model: what its devices sustain ([`Rates`]), per accelerator
//! product (`PRODUCT_RATES`, matched on the name NVML or GPU feature discovery reports),
//! with an A100's figures for a product the table lacks, and where a node's rates came from
//! ([`RatesFrom`]), so a plan can say when it was timed with a fallback.

use std::fmt;

/// What a node's devices sustain: the inputs the model turns bytes and FLOPs into time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Sustained dense FLOP/s of one device in the compute dtype.
    pub device_flops: f64,
    /// Host-to-device bytes/s of one device's copy queue.
    pub host_to_device: f64,
    /// All-gather bytes/s each rank receives over the peer link.
    pub peer: f64,
    /// The share of a copy's time that runs beside compute: 1 where copies have engines
    /// of their own (a GPU's copy engines and links); less where they take the cores that
    /// compute (the CPU backend, whose share `bench` measures). The rest of each streamed
    /// block's copy time lengthens its compute.
    pub overlap: f64,
}

/// The product whose figures stand in for one the table lacks.
pub const FALLBACK_PRODUCT: &str = "A100";

impl Rates {
    /// What the planner assumes of a product it has no figures for: an A100's.
    pub const DEFAULT: Rates = Rates {
        device_flops: 1.9e14,
        host_to_device: 25e9,
        peer: 230e9,
        overlap: 1.0,
    };
}

/// Where a node's rates came from: the product table (the entry of the product the node
/// reports, or the fallback's where the table has none), with or without figures the
/// spec set in their place; or given some other way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RatesFrom {
    Product {
        /// The product name the node reports (NVML's, or GPU feature discovery's label).
        reported: String,
        /// The table entry whose figures were used: [`FALLBACK_PRODUCT`] for a fallback.
        figures: &'static str,
        /// Whether the table has no entry for `reported`.
        fallback: bool,
        /// Whether figures the spec sets (`spec.accelerator.rates`) replace any of them.
        overridden: bool,
    },
    /// Rates given another way (a test's, a calibration's), in words.
    Given(String),
}

impl RatesFrom {
    /// The rates of accelerators reporting `product`, and where they come from.
    pub fn product(product: &str) -> (Rates, RatesFrom) {
        let (rates, entry) = Rates::for_product(product);
        (
            rates,
            RatesFrom::Product {
                reported: product.to_string(),
                figures: entry.unwrap_or(FALLBACK_PRODUCT),
                fallback: entry.is_none(),
                overridden: false,
            },
        )
    }

    /// These with figures the spec sets in place of some of them.
    pub fn overridden(self) -> RatesFrom {
        match self {
            RatesFrom::Product {
                reported,
                figures,
                fallback,
                ..
            } => RatesFrom::Product {
                reported,
                figures,
                fallback,
                overridden: true,
            },
            given => given,
        }
    }

    /// Whether the figures are the fallback's, for a product the table lacks.
    pub fn fallback(&self) -> bool {
        matches!(self, RatesFrom::Product { fallback: true, .. })
    }
}

/// Serialized as its words (what `layerwise-operator plan --json` shows as `ratesFrom`).
impl serde::Serialize for RatesFrom {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl From<&str> for RatesFrom {
    fn from(words: &str) -> Self {
        RatesFrom::Given(words.to_string())
    }
}

impl fmt::Display for RatesFrom {
    /// In the words of the plan's timing reason: "the H100 defaults", "spec.accelerator.rates
    /// over the A100 defaults, a fallback for \"NVIDIA X\" (not in the product table)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RatesFrom::Given(words) => f.write_str(words),
            RatesFrom::Product {
                reported,
                figures,
                fallback,
                overridden,
            } => {
                if *overridden {
                    f.write_str("spec.accelerator.rates over ")?;
                }
                write!(f, "the {figures} defaults")?;
                if *fallback {
                    write!(
                        f,
                        ", a fallback for an unknown product ({reported:?}, not in the product table)"
                    )?;
                }
                Ok(())
            }
        }
    }
}
