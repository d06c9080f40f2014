//! Where a Qwen2.5-VL checkpoint keeps the language model's tensors (either spelling
//! transformers reads), and which of the folder's tensors the text encoder never loads.

use crate::checkpoint::Component;
use crate::{Error, Result};

/// The classes whose folder holds a Qwen2.5-VL language model this encoder runs.
pub(super) const CLASSES: [&str; 2] = ["Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"];

/// Where a checkpoint keeps the language model's tensors. transformers 5.24 (like the
/// published Qwen-Image folder, written by 4.5x) saves them as `model.…`, with the vision
/// tower as `visual.…`; checkpoints written from the module paths have them as
/// `model.language_model.…` (and `model.visual.…`). transformers reads both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorPrefix {
    /// `model.`: what `save_pretrained` writes and the published checkpoint holds.
    Model,
    /// `model.language_model.`: the module path.
    LanguageModel,
}

impl TensorPrefix {
    /// Both spellings, the saved one first.
    pub const ALL: [TensorPrefix; 2] = [TensorPrefix::Model, TensorPrefix::LanguageModel];

    /// The prefix itself, with its trailing dot.
    pub fn as_str(self) -> &'static str {
        match self {
            TensorPrefix::Model => "model.",
            TensorPrefix::LanguageModel => "model.language_model.",
        }
    }

    /// The token embedding table, `[vocab_size, hidden_size]`.
    pub fn embedding(self) -> String {
        format!("{}embed_tokens.weight", self.as_str())
    }

    /// The final RMS norm's weight, `[hidden_size]`.
    pub fn final_norm(self) -> String {
        format!("{}norm.weight", self.as_str())
    }

    /// Where layer `i`'s tensors live: `{prefix}layers.{i}.…`.
    pub fn layers(self) -> String {
        format!("{}layers.", self.as_str())
    }

    /// The spelling `c` uses, found by its embedding table; an error naming the table when
    /// neither (or, ambiguously, both) is there.
    pub fn detect(c: &Component) -> Result<TensorPrefix> {
        let found: Vec<TensorPrefix> = Self::ALL
            .into_iter()
            .filter(|p| c.get(&p.embedding()).is_some())
            .collect();
        match found.as_slice() {
            [one] => Ok(*one),
            [] => Err(Error::tensor(
                c.path_of(&TensorPrefix::Model.embedding()),
                TensorPrefix::Model.embedding(),
                format!(
                    "missing (nor is it stored as {}): the folder holds no Qwen2.5-VL language model",
                    TensorPrefix::LanguageModel.embedding()
                ),
            )),
            _ => Err(Error::tensor(
                c.path_of(&TensorPrefix::LanguageModel.embedding()),
                TensorPrefix::LanguageModel.embedding(),
                format!(
                    "stored beside {}: one language model under two prefixes",
                    TensorPrefix::Model.embedding()
                ),
            )),
        }
    }
}

/// Whether a tensor of the folder belongs to what the text encoder never loads: the vision
/// tower (under either spelling) and the language-model head.
pub fn is_unused(name: &str) -> bool {
    name == "lm_head.weight" || name.starts_with("visual.") || name.starts_with("model.visual.")
}
