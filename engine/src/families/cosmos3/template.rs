//! The text Cosmos3's pipeline puts around a prompt before tokenizing it: its system
//! messages and metadata sentences (the clip's duration and frame rate, its resolution).
//! Apart from the tokenizer ([`super::prompt`]) so a build without the runtime can still
//! bound the tokens they add, for the activation model's
//! [`crate::checkpoint::ActivationCost::template_tokens`].

pub const SYSTEM_IMAGE: &str =
    "You are a helpful assistant who will generate images from a give prompt.";
pub const SYSTEM_VIDEO: &str =
    "You are a helpful assistant who will generate videos from a give prompt.";

/// What a prompt is for: the metadata sentences and the system message depend on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    pub frames: usize,
    pub width: usize,
    pub height: usize,
    pub fps: f64,
}

/// `base.rstrip(".") + ". " + addition`, or `addition` alone after an empty base.
fn append(base: &str, addition: &str) -> String {
    let base = base.trim_end_matches('.');
    if base.is_empty() {
        addition.to_string()
    } else {
        format!("{base}. {addition}")
    }
}

/// The prompt (or, `negative`, the negative prompt) with the pipeline's metadata sentences.
pub fn with_templates(text: &str, t: &Target, negative: bool) -> String {
    let not = if negative { "not " } else { "" };
    let mut text = text.to_string();
    if t.frames != 1 {
        let duration = t.frames as f64 / t.fps;
        text = append(
            &text,
            &format!(
                "The video is {not}{duration:.1} seconds long and is {not}of {:.0} FPS.",
                t.fps
            ),
        );
    }
    let kind = if t.frames == 1 { "image" } else { "video" };
    append(
        &text,
        &format!(
            "This {kind} is {not}of {}x{} resolution.",
            t.height, t.width
        ),
    )
}

/// The widest output the template bound covers: under 100,000 pixels a side, frames,
/// seconds and frames a second (the metadata sentences' numbers are widest there).
pub fn widest_targets() -> [Target; 3] {
    let wide = |frames, fps| Target {
        frames,
        width: 99_999,
        height: 99_999,
        fps,
    };
    [wide(1, 1.0), wide(99_999, 1.0), wide(99_999, 999.0)]
}

/// Chat-template markers a message list adds around its texts, at most: three roles'
/// openings (a start token, the role and a newline), two closings, the end token and
/// `<|vision_start|>`, as bytes of a byte-level tokenizer (a special token is one).
const CHAT_MARKER_BYTES: usize = 48;

/// Tokens the templates add to a prompt, bounded without the tokenizer: the bytes of the
/// longest system message and metadata sentences and the chat markers, which a
/// byte-level tokenizer (Qwen's) takes at most one token each. What a build without the
/// runtime reserves; the engine counts them exactly with its tokenizer.
pub fn byte_bound(system_prompt: bool) -> usize {
    let system = if system_prompt {
        SYSTEM_IMAGE.len().max(SYSTEM_VIDEO.len())
    } else {
        0
    };
    let sentences = widest_targets()
        .iter()
        .flat_map(|t| [false, true].map(|n| with_templates("x", t, n).len() - 1))
        .max()
        .unwrap_or(0);
    system + sentences + CHAT_MARKER_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_read_as_the_pipeline_writes_them() {
        let video = Target {
            frames: 121,
            width: 1280,
            height: 720,
            fps: 24.0,
        };
        assert_eq!(
            with_templates("A fox.", &video, false),
            "A fox. The video is 5.0 seconds long and is of 24 FPS. This video is of 720x1280 resolution."
        );
        assert_eq!(
            with_templates("", &video, true),
            "The video is not 5.0 seconds long and is not of 24 FPS. This video is not of 720x1280 resolution."
        );
        let image = Target { frames: 1, ..video };
        assert_eq!(
            with_templates("A fox", &image, false),
            "A fox. This image is of 720x1280 resolution."
        );
    }
}
