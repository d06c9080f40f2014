//! The bound Qwen-Image's pipeline puts on a prompt, which the checkpoint's limits and the
//! runtime's request check both read.

/// The most prompt tokens QwenImagePipeline reads (`max_sequence_length` may not exceed it).
pub const MAX_SEQUENCE_LENGTH: usize = 1024;
