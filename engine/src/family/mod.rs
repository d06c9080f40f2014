//! Model families: what a family's checkpoint must contain (names, shapes), how its
//! transformer splits into prologue, blocks and epilogue, and what its activations cost.
//! This part is pure metadata (no tensor math) so the node agent can use it to profile.

pub mod dit;
pub mod vae;

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
