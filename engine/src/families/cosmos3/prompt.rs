//! Cosmos3's prompt, as diffusers' `Cosmos3OmniPipeline.tokenize_prompt` forms it: no
//! text encoder runs; the transformer's understanding pathway reads token ids. A prompt
//! gains the pipeline's metadata sentences (the clip's duration and frame rate, its
//! resolution; the negative prompt their inverses), goes through the tokenizer's own chat
//! template (a system message, the user's text, the assistant's opening), is tokenized
//! without added special tokens, and ends with the end token and `<|vision_start|>`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::components::chat_template::ChatTemplate;
use crate::components::qwen2_5_vl::prompt::token_name;
use crate::components::qwen2_5_vl::synth::VISION_START;
use crate::{Error, Result};

pub use super::template::{with_templates, Target};
use super::template::{SYSTEM_IMAGE, SYSTEM_VIDEO};

/// The text tokenizer of a Cosmos3 folder with its chat template.
pub struct Cosmos3Tokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The chat template, parsed once at load and rendered within its bounds.
    template: ChatTemplate,
    special: Value,
    eos: u32,
    vision_start: u32,
    system_prompt: bool,
    dir: PathBuf,
}

impl Cosmos3Tokenizer {
    /// Loads `dir/tokenizer.json`, `dir/tokenizer_config.json` and the chat template
    /// (`chat_template.jinja`, else the config's `chat_template`).
    pub fn load(dir: &Path, system_prompt: bool) -> Result<Self> {
        let json = dir.join("tokenizer.json");
        let bytes = crate::checkpoint::read_small(&json)?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::checkpoint(&json, format!("not a tokenizer.json: {e}")))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = crate::checkpoint::read_json(&config_path)?;
        let file = dir.join("chat_template.jinja");
        let (template, template_path) = if file.is_file() {
            let text = String::from_utf8(crate::checkpoint::read_small(&file)?)
                .map_err(|_| Error::checkpoint(&file, "not UTF-8 text"))?;
            (text, file)
        } else {
            match config.get("chat_template") {
                Some(Value::String(s)) => (s.clone(), config_path.clone()),
                _ => {
                    return Err(Error::config(
                        &config_path,
                        "chat_template",
                        "missing (nor is there a chat_template.jinja): the pipeline tokenizes prompts through the chat template",
                    ))
                }
            }
        };
        let id = |name: &str, field: &str| {
            tokenizer.token_to_id(name).ok_or_else(|| {
                Error::config(
                    &config_path,
                    field,
                    format!("`{name}` is not in the tokenizer's vocabulary"),
                )
            })
        };
        let eos_name = token_name(config.get("eos_token")).ok_or_else(|| {
            Error::config(
                &config_path,
                "eos_token",
                "missing: the prompt ends with it",
            )
        })?;
        let eos = id(&eos_name, "eos_token")?;
        let vision_start = id(VISION_START, VISION_START)?;
        let mut special = serde_json::Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(v) = token_name(config.get(key)) {
                special.insert(key.into(), Value::String(v));
            }
        }
        let t = Cosmos3Tokenizer {
            tokenizer,
            template: ChatTemplate::parse(template, &template_path)?,
            special: Value::Object(special),
            eos,
            vision_start,
            system_prompt,
            dir: dir.to_path_buf(),
        };
        // A template that does not render, or not within its bounds of size and time, is the
        // folder's fault: say so at open, for both system messages.
        for image in [false, true] {
            let (ctx, bytes) = t.context("", image);
            t.template.render_at_start(ctx, bytes)?;
        }
        Ok(t)
    }

    /// The chat template's context for a system message (when the pipeline adds one) and
    /// `text`, with the bytes of text its messages hold.
    fn context(&self, text: &str, image: bool) -> (Value, usize) {
        let mut messages = Vec::new();
        let mut bytes = text.len();
        if self.system_prompt {
            let system = if image { SYSTEM_IMAGE } else { SYSTEM_VIDEO };
            bytes += system.len();
            messages.push(serde_json::json!({"role": "system", "content": system}));
        }
        messages.push(serde_json::json!({"role": "user", "content": text}));
        let mut ctx = self.special.as_object().cloned().unwrap_or_default();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        ctx.insert("add_vision_id".into(), Value::Bool(false));
        (Value::Object(ctx), bytes)
    }

    /// The chat template over a system message (when the pipeline adds one) and `text`.
    fn render(&self, text: &str, image: bool) -> Result<String> {
        let (ctx, bytes) = self.context(text, image);
        self.template.render(&ctx, bytes)
    }

    /// A tokenizer failure: the tokenizer file's fault (a byte-level vocabulary encodes any
    /// text), naming it.
    fn failed(&self, e: impl std::fmt::Display) -> Error {
        Error::checkpoint(
            self.dir.join("tokenizer.json"),
            format!("the tokenizer failed on the prompt: {e}"),
        )
    }

    /// The ids the understanding pathway reads for `text` (already with its templates).
    pub fn ids(&self, text: &str, image: bool) -> Result<Vec<u32>> {
        let rendered = self.render(text, image)?;
        let enc = self
            .tokenizer
            .encode(rendered.as_str(), false)
            .map_err(|e| self.failed(e))?;
        let mut ids = enc.get_ids().to_vec();
        ids.extend([self.eos, self.vision_start]);
        Ok(ids)
    }

    /// The conditional and unconditional ids of a request, as `tokenize_prompt` returns them.
    pub fn request(
        &self,
        prompt: &str,
        negative: &str,
        t: &Target,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let image = t.frames == 1;
        Ok((
            self.ids(&with_templates(prompt, t, false), image)?,
            self.ids(&with_templates(negative, t, true), image)?,
        ))
    }

    /// Tokens the templates add around a prompt, at most, for the widest outputs
    /// ([`super::template::widest_targets`]): what the activation model reserves beside the prompt's own tokens
    /// ([`layerwise_core::checkpoint::ActivationCost::template_tokens`]). The largest over
    /// an image and clips at both ends of the frame rate, prompt and negative prompt.
    pub fn template_tokens(&self) -> Result<usize> {
        // A one-letter prompt, less its own token: the sentences join a prompt after ". ",
        // which an empty one goes without.
        let own = self.token_count("x")?;
        let mut most = 0;
        for t in super::template::widest_targets() {
            for negative in [false, true] {
                let ids = self.ids(&with_templates("x", &t, negative), t.frames == 1)?;
                most = most.max(ids.len().saturating_sub(own));
            }
        }
        Ok(most)
    }

    /// Tokens `text` itself takes (no template), for the prompt-length bound.
    pub fn token_count(&self, text: &str) -> Result<usize> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| self.failed(e))?;
        Ok(enc.len())
    }
}
