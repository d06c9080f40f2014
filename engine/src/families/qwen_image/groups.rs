//! The indices of the Qwen-Image model's streamed groups of blocks, which the checkpoint (that
//! lists the groups) and the runtime (that streams them) agree on.

/// Group indices of a Qwen-Image model's streamed blocks.
pub const TEXT_ENCODER: usize = 0;
pub const TRANSFORMER: usize = 1;
