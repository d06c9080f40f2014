//! Model families: what a family's checkpoint must contain (names, shapes), how each
//! component splits into prologue, blocks and epilogue, what its activations cost, and
//! (with the `runtime` feature) its math. Metadata is always built, without tensor math,
//! so the node agent can profile checkpoints.

pub mod autoencoder_kl;
pub mod dit;

/// One tensor a family expects, by full name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}
