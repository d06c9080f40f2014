//! The request bounds an engine pod enforces: the one definition the server's flags read and
//! the operator writes (from a DiffusionDeployment's `workload`), so the two cannot drift. The
//! planner sizes activations for a request at exactly these bounds
//! ([`crate::checkpoint::ActivationCost::checked_bytes`]), and the server refuses anything
//! beyond them with a 422 naming the field.

use crate::checkpoint::ActivationCost;

/// Environment variable of `layerwise serve --max-width`.
pub const ENV_MAX_WIDTH: &str = "LAYERWISE_MAX_WIDTH";
/// Environment variable of `layerwise serve --max-height`.
pub const ENV_MAX_HEIGHT: &str = "LAYERWISE_MAX_HEIGHT";
/// Environment variable of `layerwise serve --max-frames`.
pub const ENV_MAX_FRAMES: &str = "LAYERWISE_MAX_FRAMES";
/// Environment variable of `layerwise serve --max-steps`.
pub const ENV_MAX_STEPS: &str = "LAYERWISE_MAX_STEPS";
/// Environment variable of `layerwise serve --max-n`.
pub const ENV_MAX_N: &str = "LAYERWISE_MAX_N";
/// Environment variable of `layerwise serve --guidance-allowed`.
pub const ENV_GUIDANCE_ALLOWED: &str = "LAYERWISE_GUIDANCE_ALLOWED";
/// Environment variable of the engine's `--device-memory-mib`.
pub const ENV_DEVICE_MEMORY_MIB: &str = "LAYERWISE_DEVICE_MEMORY_MIB";
/// Environment variable of the engine's `--device-overhead-mib`.
pub const ENV_DEVICE_OVERHEAD_MIB: &str = "LAYERWISE_DEVICE_OVERHEAD_MIB";
/// Environment variable of the engine's `--resident-components`.
pub const ENV_RESIDENT_COMPONENTS: &str = "LAYERWISE_RESIDENT_COMPONENTS";
/// Environment variable of the engine's `--resident-blocks`.
pub const ENV_RESIDENT_BLOCKS: &str = "LAYERWISE_RESIDENT_BLOCKS";

/// What one request may ask for, beyond what the model itself can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBounds {
    /// Largest output width in pixels.
    pub max_width: u64,
    /// Largest output height in pixels.
    pub max_height: u64,
    /// Most frames of one clip (1: images only).
    pub max_frames: u64,
    /// Most denoising steps.
    pub max_steps: u64,
    /// Most outputs per request.
    pub max_n: u64,
    /// Whether requests may use classifier-free guidance (a scale above 1, which doubles the
    /// transformer's batch). Without it requests run unguided, as the plan sized them.
    pub guidance: bool,
}

impl RequestBounds {
    /// Device bytes the largest request within these bounds needs for activations: the
    /// one formula ([`ActivationCost::checked_bytes`]) the planner reserves and the engine
    /// keeps free. `None` when no device could hold such a request.
    pub fn activation_bytes(&self, cost: &ActivationCost) -> Option<u64> {
        cost.checked_bytes(
            self.max_width,
            self.max_height,
            self.max_frames,
            self.max_n,
            self.guidance,
        )
    }

    /// The environment that makes `layerwise serve` enforce these bounds.
    pub fn env(&self) -> [(&'static str, String); 6] {
        [
            (ENV_MAX_WIDTH, self.max_width.to_string()),
            (ENV_MAX_HEIGHT, self.max_height.to_string()),
            (ENV_MAX_FRAMES, self.max_frames.to_string()),
            (ENV_MAX_STEPS, self.max_steps.to_string()),
            (ENV_MAX_N, self.max_n.to_string()),
            (ENV_GUIDANCE_ALLOWED, self.guidance.to_string()),
        ]
    }
}
