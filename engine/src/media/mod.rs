//! What the engine writes for people to look at: PNG images, and video clips as H.264 in
//! MP4, animated GIF or animated WebP.

pub mod image;
pub mod video;
