//! The indices of the Cosmos3 model's streamed groups of blocks, which the checkpoint (that
//! lists the groups) and the runtime (that streams them) agree on.

/// Group indices of a Cosmos3 model's streamed blocks.
pub const UNDERSTANDING: usize = 0;
pub const GENERATION: usize = 1;
