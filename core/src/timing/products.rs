//! The product table: per accelerator product the field's users report running on, the
//! figures its vendor publishes ([`Published`], each row citing the document) and the
//! sustained rates the step-time model times it with ([`Rates`]), and how a reported
//! product name selects its row ([`Product::find`]).
//!
//! Sustained, not data-sheet: the rates follow one convention, which the tests hold every
//! row to, so a row added later cannot drift from it:
//! - compute: about 60 % of the dense (not 2:4-sparse) BF16 tensor peak, what large
//!   GEMMs and fused attention reach in a diffusion transformer's blocks;
//! - host to device: about 78 % of the host link's published bytes per direction (a
//!   pinned copy on PCIe Gen4 ×16 reaches ~25 GB/s, Gen5 ~50 GB/s; NVLink-C2C ~350 GB/s);
//! - peer: an all-gather receives about 78 % of NVLink's bytes per direction (half the
//!   bidirectional figure NVIDIA quotes); a part without NVLink gathers over PCIe at no
//!   more than its host rate (a GeForce card, whose driver disables peer-to-peer, through
//!   host memory at about half of it).
//!
//! A node's measured rates (`engine/gpu-check`, `layerwise bench`) replace these through
//! `spec.accelerator.rates`.

use super::rates::Rates;

/// The link between the host's memory and the device, as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostLink {
    PcieGen4,
    PcieGen5,
    /// NVLink-C2C to a Grace CPU (GB200, GB300).
    NvlinkC2c,
}

impl HostLink {
    /// Published bytes/s per direction (×16 for PCIe).
    pub const fn bytes_per_second(self) -> f64 {
        match self {
            HostLink::PcieGen4 => 32e9,
            HostLink::PcieGen5 => 64e9,
            HostLink::NvlinkC2c => 450e9,
        }
    }
}

/// What the vendor publishes of one product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Published {
    /// Dense BF16 tensor TFLOP/s (the data sheets' sparse figure halved where only that
    /// is given).
    pub bf16_dense_tflops: f64,
    /// Device memory bandwidth, GB/s.
    pub memory_gbps: f64,
    pub host_link: HostLink,
    /// NVLink bandwidth per GPU, GB/s in both directions together as NVIDIA quotes it;
    /// `None` where the devices have none (peers reach each other over PCIe).
    pub nvlink_gbps: Option<f64>,
}

/// One row of the product table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Product {
    /// How plans and docs name it.
    pub label: &'static str,
    /// Each way of naming it: words (upper case, space-separated) that must all be among
    /// the reported name's words. Rows are tried in table order, the more specific first.
    pub names: &'static [&'static str],
    pub published: Published,
    /// Sustained figures, by the module's convention.
    pub rates: Rates,
    /// The vendor document the published figures come from, and how a figure it does not
    /// state was derived.
    pub source: &'static str,
}

impl Product {
    /// The first row naming the product NVML or GPU feature discovery reports (`NVIDIA H20`,
    /// `NVIDIA-GeForce-RTX-4090`, `NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition`), by whole
    /// words, so `H20` is not an `H200` nor `A10` an `A100`.
    pub fn find(reported: &str) -> Option<&'static Product> {
        let have = words(reported);
        PRODUCT_RATES.iter().find(|p| {
            p.names
                .iter()
                .any(|n| n.split(' ').all(|w| have.iter().any(|h| h == w)))
        })
    }
}

impl Rates {
    /// The figures of the first [`PRODUCT_RATES`] entry that `product` names, with that
    /// entry's label; [`Self::DEFAULT`] and `None` otherwise.
    pub fn for_product(product: &str) -> (Rates, Option<&'static str>) {
        Product::find(product).map_or((Rates::DEFAULT, None), |p| (p.rates, Some(p.label)))
    }
}

/// The name's words, upper case: split on anything but letters and digits, so NVML's
/// `NVIDIA GeForce RTX 4090` and GPU feature discovery's `NVIDIA-GeForce-RTX-4090` read
/// alike.
fn words(name: &str) -> Vec<String> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_uppercase)
        .collect()
}

/// Sustained rates of a GPU (its copies have engines of their own).
const fn gpu(tflops: f64, host_to_device_gbps: f64, peer_gbps: f64) -> Rates {
    Rates {
        device_flops: tflops * 1e12,
        host_to_device: host_to_device_gbps * 1e9,
        peer: peer_gbps * 1e9,
        overlap: 1.0,
    }
}

const fn published(
    bf16_dense_tflops: f64,
    memory_gbps: f64,
    host_link: HostLink,
    nvlink_gbps: Option<f64>,
) -> Published {
    Published {
        bf16_dense_tflops,
        memory_gbps,
        host_link,
        nvlink_gbps,
    }
}

use HostLink::{NvlinkC2c, PcieGen4, PcieGen5};

/// The table, the more specific names first.
pub const PRODUCT_RATES: &[Product] = &[
    Product {
        label: "GB300",
        names: &["GB300"],
        published: published(2500.0, 8000.0, NvlinkC2c, Some(1800.0)),
        rates: gpu(1500.0, 350.0, 700.0),
        source: "NVIDIA GB300 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity over 72 GPUs (2.5 PFLOPS dense each), HBM3e 576 TB/s (8 TB/s each), NVLink 1.8 TB/s per GPU, NVLink-C2C 900 GB/s to Grace",
    },
    Product {
        label: "GB200",
        names: &["GB200"],
        published: published(2500.0, 8000.0, NvlinkC2c, Some(1800.0)),
        rates: gpu(1500.0, 350.0, 700.0),
        source: "NVIDIA GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity over 72 GPUs (2.5 PFLOPS dense each), HBM3e 576 TB/s (8 TB/s each), NVLink 1.8 TB/s per GPU, NVLink-C2C 900 GB/s to Grace",
    },
    Product {
        label: "B300",
        names: &["B300"],
        published: published(2250.0, 8000.0, PcieGen5, Some(1800.0)),
        rates: gpu(1300.0, 50.0, 700.0),
        source: "NVIDIA HGX B300 datasheet: FP16/BF16 36 PFLOPS with sparsity over 8 GPUs (2.25 PFLOPS dense each), up to 8 TB/s HBM3e each, NVLink 1.8 TB/s per GPU; the GPU's PCIe is Gen6 (to the ConnectX-8 switch) but the hosts' is Gen5, which bounds a host copy",
    },
    Product {
        label: "B200",
        names: &["B200"],
        published: published(2250.0, 8000.0, PcieGen5, Some(1800.0)),
        rates: gpu(1300.0, 50.0, 700.0),
        source: "NVIDIA DGX B200 / HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity over 8 GPUs (2.25 PFLOPS dense each), HBM3e 64 TB/s over 8 (8 TB/s each), NVLink 1.8 TB/s per GPU, PCIe Gen5 host",
    },
    Product {
        label: "H200 NVL",
        names: &["H200 NVL"],
        published: published(835.0, 4800.0, PcieGen5, Some(900.0)),
        rates: gpu(500.0, 50.0, 350.0),
        source: "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL): BF16 1,671 TFLOPS with sparsity (835 dense), 4.8 TB/s, 2- or 4-way NVLink bridge 900 GB/s, PCIe Gen5 128 GB/s",
    },
    Product {
        label: "H200",
        names: &["H200"],
        published: published(989.0, 4800.0, PcieGen5, Some(900.0)),
        rates: gpu(600.0, 50.0, 350.0),
        source: "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 TFLOPS with sparsity (989 dense), 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s",
    },
    Product {
        label: "H100 PCIe",
        names: &["H100 PCIE"],
        published: published(756.0, 2000.0, PcieGen5, None),
        rates: gpu(450.0, 50.0, 40.0),
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe): BF16 1,513 TFLOPS with sparsity (756 dense), 2 TB/s, PCIe Gen5 128 GB/s; its NVLink bridge (600 GB/s) is optional, so peers are counted over PCIe: a bridged pair sets spec.accelerator.rates.peerGBps",
    },
    Product {
        label: "H100 NVL",
        names: &["H100 NVL"],
        published: published(835.0, 3900.0, PcieGen5, Some(600.0)),
        rates: gpu(500.0, 50.0, 230.0),
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL): BF16 1,671 TFLOPS with sparsity (835 dense), 3.9 TB/s, NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s",
    },
    Product {
        label: "H100",
        names: &["H100"],
        published: published(989.0, 3350.0, PcieGen5, Some(900.0)),
        rates: gpu(600.0, 50.0, 350.0),
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with sparsity (989 dense), 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s",
    },
    Product {
        label: "H20",
        names: &["H20"],
        published: published(148.0, 4000.0, PcieGen5, Some(900.0)),
        rates: gpu(89.0, 50.0, 350.0),
        source: "NVIDIA H20 product brief (China market; not in NVIDIA's public datasheet library, figures as OEMs reproduce it): FP16/BF16 148 TFLOPS, FP8 296, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s, PCIe Gen5 x16 128 GB/s; the brief gives no sparse figure, and FP8 at twice BF16 is Hopper's dense ratio, so 148 is read as dense",
    },
    Product {
        label: "A100 PCIe",
        names: &["A100 PCIE"],
        published: published(312.0, 1935.0, PcieGen4, None),
        rates: gpu(190.0, 25.0, 20.0),
        source: "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe): BF16 312 TFLOPS dense (624 with sparsity), 1,935 GB/s, PCIe Gen4 64 GB/s; its NVLink bridge (600 GB/s) is optional, so peers are counted over PCIe",
    },
    Product {
        label: "A100",
        names: &["A100"],
        published: published(312.0, 2039.0, PcieGen4, Some(600.0)),
        rates: gpu(190.0, 25.0, 230.0),
        source: "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS dense (624 with sparsity), 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s",
    },
    Product {
        label: "A10",
        names: &["A10"],
        published: published(125.0, 600.0, PcieGen4, None),
        rates: gpu(75.0, 25.0, 20.0),
        source: "NVIDIA A10 Tensor Core GPU datasheet: BF16 125 TFLOPS dense (250 with sparsity), 600 GB/s GDDR6, PCIe Gen4 64 GB/s, no NVLink",
    },
    Product {
        label: "L40S",
        names: &["L40S"],
        published: published(362.0, 864.0, PcieGen4, None),
        rates: gpu(220.0, 25.0, 20.0),
        source: "NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), 864 GB/s GDDR6, PCIe Gen4 x16 64 GB/s, no NVLink",
    },
    Product {
        label: "L40",
        names: &["L40"],
        published: published(181.0, 864.0, PcieGen4, None),
        rates: gpu(110.0, 25.0, 20.0),
        source: "NVIDIA L40 datasheet: BF16 181.05 TFLOPS dense (362.1 with sparsity), 864 GB/s GDDR6, PCIe Gen4 x16 64 GB/s, no NVLink",
    },
    Product {
        label: "L20",
        names: &["L20"],
        published: published(119.5, 864.0, PcieGen4, None),
        rates: gpu(72.0, 25.0, 20.0),
        source: "NVIDIA L20 product brief (China market): FP16/BF16 tensor 119.5 TFLOPS dense (239 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 64 GB/s, no NVLink",
    },
    Product {
        label: "L4",
        names: &["L4"],
        published: published(121.0, 300.0, PcieGen4, None),
        rates: gpu(70.0, 25.0, 20.0),
        source: "NVIDIA L4 datasheet: BF16 121 TFLOPS dense (242 with sparsity), 300 GB/s GDDR6, PCIe Gen4 x16 64 GB/s, no NVLink",
    },
    Product {
        label: "RTX PRO 6000 Blackwell Max-Q",
        names: &["RTX PRO 6000 BLACKWELL MAX Q"],
        published: published(439.0, 1792.0, PcieGen5, None),
        rates: gpu(260.0, 50.0, 40.0),
        source: "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition datasheet: 3,511 AI TOPS (FP4 with sparsity), 96 GB GDDR7 at 1,792 GB/s, PCIe Gen5 x16, no NVLink; BF16 is not stated: derived as 1/8 of the sparse FP4 figure (Blackwell's tensor cores run FP4:FP8:BF16 at 4:2:1, sparsity doubles)",
    },
    Product {
        label: "RTX PRO 6000 Blackwell Server Edition",
        names: &["RTX PRO 6000 BLACKWELL SERVER"],
        published: published(500.0, 1597.0, PcieGen5, None),
        rates: gpu(300.0, 50.0, 40.0),
        source: "NVIDIA RTX PRO 6000 Blackwell Server Edition datasheet: 4 PFLOPS FP4 with sparsity, 96 GB GDDR7 at 1.6 TB/s, PCIe Gen5 x16, no NVLink; BF16 is not stated: derived as 1/8 of the sparse FP4 figure (FP4:FP8:BF16 at 4:2:1, sparsity doubles), which the RTX Blackwell architecture whitepaper's 503.8 dense FP16 TFLOPS (FP32 accumulate) confirms",
    },
    Product {
        label: "RTX PRO 6000 Blackwell",
        names: &["RTX PRO 6000 BLACKWELL"],
        published: published(500.0, 1792.0, PcieGen5, None),
        rates: gpu(300.0, 50.0, 40.0),
        source: "NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet: 4,000 AI TOPS (FP4 with sparsity), 96 GB GDDR7 at 1,792 GB/s, PCIe Gen5 x16, no NVLink; BF16 derived as for the Server Edition",
    },
    Product {
        label: "RTX 4090",
        names: &["RTX 4090"],
        published: published(165.2, 1008.0, PcieGen4, None),
        rates: gpu(99.0, 25.0, 10.0),
        source: "NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090): BF16 tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 with sparsity), 1,008 GB/s GDDR6X, PCIe Gen4 x16, no NVLink; the GeForce driver disables peer-to-peer, so NCCL gathers through host memory at about half the host rate",
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::{RatesFrom, FALLBACK_PRODUCT};

    fn label(reported: &str) -> Option<&'static str> {
        Product::find(reported).map(|p| p.label)
    }

    #[test]
    fn nvml_and_feature_discovery_names_select_their_rows() {
        for (reported, want) in [
            // NVML's names.
            ("NVIDIA H100 80GB HBM3", "H100"),
            ("NVIDIA H100 PCIe", "H100 PCIe"),
            ("NVIDIA H100 NVL", "H100 NVL"),
            ("NVIDIA H200", "H200"),
            ("NVIDIA H200 NVL", "H200 NVL"),
            ("NVIDIA H20", "H20"),
            ("NVIDIA A100-SXM4-80GB", "A100"),
            ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
            ("NVIDIA A100-PCIE-40GB", "A100 PCIe"),
            ("NVIDIA A10", "A10"),
            ("NVIDIA L40S", "L40S"),
            ("NVIDIA L40", "L40"),
            ("NVIDIA L20", "L20"),
            ("NVIDIA L4", "L4"),
            ("NVIDIA B200", "B200"),
            ("NVIDIA B300 SXM6 AC", "B300"),
            ("NVIDIA GB200", "GB200"),
            ("NVIDIA GB300", "GB300"),
            ("NVIDIA GeForce RTX 4090", "RTX 4090"),
            (
                "NVIDIA RTX PRO 6000 Blackwell Server Edition",
                "RTX PRO 6000 Blackwell Server Edition",
            ),
            (
                "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                "RTX PRO 6000 Blackwell",
            ),
            (
                "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                "RTX PRO 6000 Blackwell Max-Q",
            ),
            // GPU feature discovery's `nvidia.com/gpu.product` labels.
            ("NVIDIA-H20", "H20"),
            ("NVIDIA-H100-80GB-HBM3", "H100"),
            ("NVIDIA-GeForce-RTX-4090", "RTX 4090"),
            (
                "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
                "RTX PRO 6000 Blackwell Server Edition",
            ),
            ("NVIDIA-L20", "L20"),
            ("NVIDIA-B300-SXM6-AC", "B300"),
            ("nvidia-l40s", "L40S"),
        ] {
            assert_eq!(label(reported), Some(want), "{reported}");
        }
    }

    #[test]
    fn names_match_whole_words_only() {
        // Neither a longer nor a shorter model number selects a row by its prefix.
        for reported in [
            "NVIDIA A10G",
            "NVIDIA H800",
            "NVIDIA RTX 6000 Ada Generation",
            "NVIDIA GeForce RTX 5090",
            "Tesla V100-SXM2-16GB",
            "AMD Instinct MI300X",
            "",
        ] {
            assert_eq!(label(reported), None, "{reported}");
        }
    }

    #[test]
    fn every_row_is_reachable_by_its_names() {
        // A row shadowed by an earlier, less specific one would never be used.
        for p in PRODUCT_RATES {
            for n in p.names {
                assert_eq!(label(n), Some(p.label), "{n}");
            }
        }
        let mut labels: Vec<&str> = PRODUCT_RATES.iter().map(|p| p.label).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), PRODUCT_RATES.len());
    }

    #[test]
    fn sustained_rates_follow_the_published_figures() {
        for p in PRODUCT_RATES {
            let (r, pb) = (p.rates, p.published);
            let compute = r.device_flops / (pb.bf16_dense_tflops * 1e12);
            assert!(
                (0.55..=0.65).contains(&compute),
                "{}: {compute:.3} of the dense peak",
                p.label
            );
            let host = r.host_to_device / pb.host_link.bytes_per_second();
            assert!(
                (0.7..=0.85).contains(&host),
                "{}: {host:.3} of the host link",
                p.label
            );
            match pb.nvlink_gbps {
                Some(nvlink) => {
                    let peer = r.peer / (nvlink * 1e9 / 2.0);
                    assert!(
                        (0.7..=0.85).contains(&peer),
                        "{}: {peer:.3} of NVLink per direction",
                        p.label
                    );
                }
                None => assert!(
                    r.peer > 0.0 && r.peer <= r.host_to_device,
                    "{}: a PCIe peer gathers no faster than the host link",
                    p.label
                ),
            }
            assert!(pb.memory_gbps > 0.0 && r.overlap == 1.0, "{}", p.label);
            assert!(p.source.starts_with("NVIDIA "), "{}: {}", p.label, p.source);
        }
    }

    #[test]
    fn the_parts_users_report_running_on_have_rows() {
        for reported in [
            "NVIDIA B300 SXM6 AC",
            "NVIDIA H20",
            "NVIDIA L20",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            "NVIDIA GeForce RTX 4090",
        ] {
            let (rates, from) = RatesFrom::product(reported);
            assert!(!from.fallback(), "{reported}: {from}");
            assert_ne!(rates, Rates::DEFAULT, "{reported}");
        }
        // Each differs from the A100 it used to fall back to, in the direction its data
        // sheet says.
        let flops = |n: &str| Rates::for_product(n).0.device_flops;
        assert!(flops("NVIDIA B300") > 5.0 * Rates::DEFAULT.device_flops);
        assert!(flops("NVIDIA H20") < 0.5 * Rates::DEFAULT.device_flops);
        assert!(flops("NVIDIA GeForce RTX 4090") < Rates::DEFAULT.device_flops);
    }

    #[test]
    fn a_product_without_a_row_falls_back_and_says_so() {
        let (rates, from) = RatesFrom::product("NVIDIA H800");
        assert_eq!(rates, Rates::DEFAULT);
        assert_eq!(rates, Product::find(FALLBACK_PRODUCT).unwrap().rates);
        assert!(from.fallback());
        assert_eq!(
            from.to_string(),
            "the A100 defaults, a fallback for an unknown product (\"NVIDIA H800\", not in the product table)"
        );
        assert_eq!(
            from.overridden().to_string(),
            "spec.accelerator.rates over the A100 defaults, a fallback for an unknown product (\"NVIDIA H800\", not in the product table)"
        );
        let (_, known) = RatesFrom::product("NVIDIA H20");
        assert_eq!(known.to_string(), "the H20 defaults");
        assert_eq!(
            serde_json::to_value(&known).unwrap(),
            serde_json::json!("the H20 defaults")
        );
        assert!(!known.fallback());
    }
}
