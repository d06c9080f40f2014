//! Measured peaks by phase, as a run reports them: for each of text encoding, one
//! denoising pass and the decode, the largest peak any of its runs held above its start.

use std::collections::BTreeMap;

use serde::Serialize;

/// The phases whose memory a run measures and the memory model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// A pass over a text encoder's blocks (or a pathway that reads only the prompt).
    TextEncoder,
    /// One pass over a transformer's blocks: a denoising step's (or a guided step's half).
    Transformer,
    /// Latents to pixels.
    Decode,
}

impl PhaseKind {
    pub const ALL: [PhaseKind; 3] = [
        PhaseKind::TextEncoder,
        PhaseKind::Transformer,
        PhaseKind::Decode,
    ];

    /// The name `--stats`, `bench` and the metrics' labels use.
    pub fn name(self) -> &'static str {
        match self {
            PhaseKind::TextEncoder => "text_encoder",
            PhaseKind::Transformer => "transformer",
            PhaseKind::Decode => "decode",
        }
    }
}

/// Per phase, the largest measured peak above the phase's start, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct PhasePeaks(pub BTreeMap<PhaseKind, u64>);

impl PhasePeaks {
    /// Records one run of `kind` that held `bytes` at its peak.
    pub fn record(&mut self, kind: PhaseKind, bytes: u64) {
        let e = self.0.entry(kind).or_insert(0);
        *e = (*e).max(bytes);
    }

    /// Takes in another's peaks (another rank's, a decode thread's).
    pub fn merge(&mut self, other: &PhasePeaks) {
        for (k, v) in &other.0 {
            self.record(*k, *v);
        }
    }

    pub fn get(&self, kind: PhaseKind) -> Option<u64> {
        self.0.get(&kind).copied()
    }
}
