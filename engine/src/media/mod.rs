//! What the engine writes for people to look at: PNG images.

pub mod image;
