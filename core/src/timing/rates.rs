//! The node's side of the model: what its devices sustain ([`Rates`]), per accelerator
//! product ([`PRODUCT_RATES`]), with an A100's figures for a product without any.

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

/// Figures for one accelerator product: the substring of the product name the node agent
/// reports that selects them, and the rates. Sustained, not data-sheet: about 60 % of the
/// dense bf16 peak, and what a pinned host-to-device copy and an NCCL all-gather reach in
/// practice (PCIe Gen4 x16 ~25 GB/s, Gen5 ~50 GB/s; a PCIe-only part gathers at about
/// its host rate).
pub const PRODUCT_RATES: &[(&str, Rates)] = &[
    (
        "B200",
        Rates {
            device_flops: 1.3e15,
            host_to_device: 50e9,
            peer: 700e9,
            overlap: 1.0,
        },
    ),
    (
        "H200",
        Rates {
            device_flops: 6.0e14,
            host_to_device: 50e9,
            peer: 350e9,
            overlap: 1.0,
        },
    ),
    (
        "H100",
        Rates {
            device_flops: 6.0e14,
            host_to_device: 50e9,
            peer: 350e9,
            overlap: 1.0,
        },
    ),
    (
        "A100",
        Rates {
            device_flops: 1.9e14,
            host_to_device: 25e9,
            peer: 230e9,
            overlap: 1.0,
        },
    ),
    (
        "L40S",
        Rates {
            device_flops: 2.2e14,
            host_to_device: 25e9,
            peer: 20e9,
            overlap: 1.0,
        },
    ),
    (
        "L4",
        Rates {
            device_flops: 7.0e13,
            host_to_device: 25e9,
            peer: 20e9,
            overlap: 1.0,
        },
    ),
];

impl Rates {
    /// What the planner assumes of a product it has no figures for: an A100's.
    pub const DEFAULT: Rates = Rates {
        device_flops: 1.9e14,
        host_to_device: 25e9,
        peer: 230e9,
        overlap: 1.0,
    };

    /// The figures of the first [`PRODUCT_RATES`] entry whose name `product` contains
    /// (case-insensitive), with that name; [`Self::DEFAULT`] and `None` otherwise.
    pub fn for_product(product: &str) -> (Rates, Option<&'static str>) {
        let p = product.to_ascii_uppercase();
        PRODUCT_RATES
            .iter()
            .find(|(name, _)| p.contains(name))
            .map_or((Rates::DEFAULT, None), |(name, r)| (*r, Some(*name)))
    }
}
