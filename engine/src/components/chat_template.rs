//! A checkpoint's chat template (Jinja, rendered with minijinja), within bounds. The
//! template is the checkpoint's code and runs on every request, so a corrupt or hostile one
//! must not run without end: each render has a fuel of [`RENDER_FUEL`] instructions and may
//! write at most [`MAX_OVERHEAD`] bytes beyond the text it is given, and the render at
//! start must finish within [`START_RENDER_TIMEOUT`]. A template past any of these is
//! refused when the folder opens, naming its file; one that still fails on a request is a
//! 5xx naming it too (never the prompt's fault).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Error, Result};

/// Instructions one render may run. Chat templates loop over a conversation's messages,
/// a few hundred instructions for the pipelines' two or three; this leaves a wide margin
/// and stops a loop that never ends within milliseconds.
pub const RENDER_FUEL: u64 = 100_000;

/// Bytes a render may write beyond the messages' own text: the template's role markers and
/// fixed strings (a few hundred bytes in Qwen's templates).
pub const MAX_OVERHEAD: usize = 64 << 10;

/// How long the render at start may take before the template is refused.
pub const START_RENDER_TIMEOUT: Duration = Duration::from_secs(2);

/// A parsed chat template and the file it came from.
#[derive(Clone)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    path: PathBuf,
}

/// A writer that refuses to hold more than `max` bytes, so an unbounded template fails
/// rather than filling memory.
struct Bounded {
    out: Vec<u8>,
    max: usize,
    over: bool,
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("the rendered text is over its bound"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Parses `source`, read from `path` (a `chat_template.jinja`, or the
    /// `tokenizer_config.json` whose `chat_template` it is).
    pub fn parse(source: String, path: &Path) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source)
            .map_err(|e| fault(path, format!("does not parse: {e}")))?;
        Ok(ChatTemplate {
            env,
            path: path.to_path_buf(),
        })
    }

    /// The file the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renders `ctx`, whose messages hold `text_bytes` bytes of text, within the bounds.
    pub fn render(&self, ctx: &serde_json::Value, text_bytes: usize) -> Result<String> {
        let max = text_bytes.saturating_add(MAX_OVERHEAD);
        let mut out = Bounded {
            out: Vec::new(),
            max,
            over: false,
        };
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| fault(&self.path, e.to_string()))?;
        let result = template.render_captured_to(minijinja::Value::from_serialize(ctx), &mut out);
        if out.over {
            return Err(fault(
                &self.path,
                format!(
                    "renders over {max} bytes for {text_bytes} bytes of messages: a chat template adds at most {MAX_OVERHEAD}"
                ),
            ));
        }
        if let Err(e) = result {
            let why = if e.kind() == minijinja::ErrorKind::OutOfFuel {
                format!("runs past {RENDER_FUEL} instructions: a chat template is a few hundred")
            } else {
                format!("does not render: {e}")
            };
            return Err(fault(&self.path, why));
        }
        String::from_utf8(out.out).map_err(|_| fault(&self.path, "renders text that is not UTF-8"))
    }

    /// [`Self::render`] of `ctx` at start, refused past [`START_RENDER_TIMEOUT`]. The render
    /// runs on a thread of its own, so a template that outlasts the bound is reported while
    /// it runs on (to its fuel's end) rather than holding the start forever.
    pub fn render_at_start(&self, ctx: serde_json::Value, text_bytes: usize) -> Result<String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = self.clone();
        std::thread::Builder::new()
            .name("chat-template-check".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let _ = tx.send((t.render(&ctx, text_bytes), started.elapsed()));
            })
            .map_err(|e| Error::bug(format!("cannot start the chat template's check: {e}")))?;
        match rx.recv_timeout(START_RENDER_TIMEOUT) {
            Ok((rendered, _)) => rendered,
            Err(_) => Err(fault(
                &self.path,
                format!(
                    "takes over {:.0} s to render one prompt: a chat template renders in microseconds",
                    START_RENDER_TIMEOUT.as_secs_f64()
                ),
            )),
        }
    }
}

/// The template's fault, naming its file.
fn fault(path: &Path, msg: impl Into<String>) -> Error {
    Error::checkpoint(path, format!("the chat template {}", msg.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str) -> Result<String> {
        let t = ChatTemplate::parse(source.into(), Path::new("t/chat_template.jinja"))?;
        t.render_at_start(serde_json::json!({"text": "a fox"}), 5)
    }

    #[test]
    fn bounded_templates_render_and_unbounded_ones_are_refused_naming_the_file() {
        assert_eq!(render("<{{ text }}>").unwrap(), "<a fox>");
        for (source, why) in [
            ("{{ 'x' * 1000000 }}", "renders over"),
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                "instructions",
            ),
            ("{{ text.nope() }}", "does not render"),
            ("{% if %}", "does not parse"),
        ] {
            let e = render(source).unwrap_err().to_string();
            assert!(
                e.contains("chat_template.jinja") && e.contains(why),
                "{source}: {e}"
            );
        }
    }
}
