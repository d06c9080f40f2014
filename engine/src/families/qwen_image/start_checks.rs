//! What a Qwen-Image folder must hold, beyond its weights, for the requests it accepts to
//! run: a scheduler whose sigmas stay finite for every step count and image size a request
//! may ask for, and a tokenizer that tokenizes the pipeline's template with rows left after
//! its drop. Checked once when the runtime opens (for `serve` and `inspect` alike), so a
//! corrupt config is refused at start naming its file rather than failing every request as
//! though the client had sent a bad `steps` or `prompt`; what still fails later is reported
//! as the file's fault (a 5xx), never the client's.

use std::path::Path;

use crate::components::qwen2_5_vl::QwenTokenizer;
use crate::samplers::flow::{FlowMatchEuler, FlowMatchEulerConfig};
use crate::{Error, Result};

/// A prompt of every script a request may use: a vocabulary missing one of their bytes
/// fails here, at start, rather than on the first request that uses it.
const PROBE_TEXT: &str = "A red fox, 3 cats & a dog: \"quoted\" (text)\n\ttabbed — é ü ß 中文 日本語 한국어 😀 ∑ ½";

/// The schedule of `steps` steps for an image of `tokens` packed tokens. A failure past
/// `native_tokens` (the shift grows with the image until its exponential overflows) is the
/// size's: a 422 naming `size`. One at or below it, which [`scheduler`] rules out at start,
/// is the config's: a 5xx naming `path`.
pub fn schedule(
    cfg: &FlowMatchEulerConfig,
    path: &Path,
    steps: usize,
    tokens: usize,
    native_tokens: usize,
) -> Result<FlowMatchEuler> {
    cfg.check_steps(steps)?;
    FlowMatchEuler::for_image(cfg, steps, tokens).map_err(|e| {
        if tokens > native_tokens {
            return Error::invalid(
                "size",
                format!(
                    "an image of {tokens} tokens is past what the scheduler's shift reaches \
                     (mu {:.1} at that length; its sigmas are not finite): ask for a smaller size",
                    cfg.mu(tokens)
                ),
            );
        }
        let field = if cfg.use_dynamic_shifting {
            "max_shift"
        } else {
            "shift"
        };
        Error::config(
            path,
            field,
            format!(
                "the schedule of {steps} steps for an image of {tokens} tokens fails ({e}): \
                 the scheduler config is corrupt"
            ),
        )
    })
}

/// Refuses a scheduler config that cannot run the pipeline's `default_steps`, or whose
/// schedule fails at either end of the step counts for an image of one token or of
/// `native_tokens` (the shift is monotone in both, so the ends bound every request between).
pub fn scheduler(
    cfg: &FlowMatchEulerConfig,
    path: &Path,
    default_steps: usize,
    native_tokens: usize,
) -> Result<()> {
    if cfg.check_steps(default_steps).is_err() {
        return Err(Error::config(
            path,
            "num_train_timesteps",
            format!(
                "{}: the pipeline's default of {default_steps} steps does not run on it",
                cfg.num_train_timesteps
            ),
        ));
    }
    let fewest = (1..=2).find(|&s| cfg.check_steps(s).is_ok()).unwrap_or(2);
    for steps in [fewest, default_steps, cfg.num_train_timesteps] {
        for tokens in [1, native_tokens.max(1)] {
            schedule(cfg, path, steps, tokens, native_tokens)?;
        }
    }
    Ok(())
}

/// Refuses a tokenizer that fails on ordinary text or leaves no rows of an empty prompt
/// after the template's drop (each error names its file): every request would fail on it.
pub fn tokenizer(t: &QwenTokenizer) -> Result<()> {
    for text in ["", PROBE_TEXT] {
        t.ids(text, "prompt")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_failing_later_blames_the_size_past_native_and_the_file_below() {
        let path = Path::new("scheduler/scheduler_config.json");
        let mut cfg = FlowMatchEulerConfig::qwen_image();
        cfg.max_shift = Some(1000.0);
        // Past the native 4096 tokens the overflow is the size's: a 422 naming `size`.
        let e = schedule(&cfg, path, 20, 5000, 4096).err().unwrap();
        assert_eq!((e.http_status(), e.field()), (422, Some("size")), "{e}");
        // At or below it, the config's: a 5xx naming the file and the field.
        let e = schedule(&cfg, path, 20, 5000, 8192).err().unwrap();
        assert_eq!(e.http_status(), 500, "{e}");
        assert!(e.to_string().contains("scheduler_config.json"), "{e}");
        assert_eq!(e.field(), Some("max_shift"), "{e}");
        // A step count out of range stays the client's.
        let e = schedule(&cfg, path, 0, 16, 4096).err().unwrap();
        assert_eq!((e.http_status(), e.field()), (422, Some("steps")), "{e}");
        // The published config opens; this one does not.
        let good = FlowMatchEulerConfig::qwen_image();
        scheduler(&good, path, 50, 4096).unwrap();
        assert!(scheduler(&cfg, path, 50, 4096).is_err());
    }
}
