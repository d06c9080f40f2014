//! What a job makes, an image or a clip at its frame rate: the modality the API, the
//! scheduler and the metrics label their counts with. A leaf, so the scheduler and the
//! metrics both read it without reading each other.

/// What a job makes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// PNG images.
    Image,
    /// H.264 clips in MP4, shown `fps` frames a second.
    Video { fps: f64 },
}

impl Kind {
    pub const IMAGE: &'static str = "image";
    pub const VIDEO: &'static str = "video";

    /// The modality label of the API and the metrics.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Image => Kind::IMAGE,
            Kind::Video { .. } => Kind::VIDEO,
        }
    }
}
