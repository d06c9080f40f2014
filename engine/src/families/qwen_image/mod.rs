//! Qwen-Image (text to image): a double-stream MMDiT transformer over packed 2 × 2 latents.

pub mod transformer;
