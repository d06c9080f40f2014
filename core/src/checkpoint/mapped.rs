//! A component's weight files mapped read-only with memmap2, so the weights are shared
//! page cache, never copied whole into anonymous memory, and a tensor's bytes are borrowed
//! from the mapping.

use std::fs::File;
use std::sync::Arc;

use memmap2::Mmap;

use super::component::Component;
use crate::{Error, Result};

/// A component with its files mapped read-only. Cloning shares the mappings.
#[derive(Clone)]
pub struct Mapped {
    pub component: Arc<Component>,
    maps: Arc<Vec<Mmap>>,
}

impl Mapped {
    pub fn map(component: Component) -> Result<Mapped> {
        let mut maps = Vec::with_capacity(component.files.len());
        for h in &component.files {
            let f = File::open(&h.path).map_err(|e| Error::io(&h.path, e))?;
            // SAFETY: the mapping is read-only and the engine never writes through it. A
            // file truncated underneath us would fault; checkpoints are immutable inputs
            // mounted read-only, and the header check at open (`Component::open`) ruled
            // out short files.
            let m = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&h.path, e))?;
            if (m.len() as u64) < h.file_len {
                return Err(Error::checkpoint(
                    &h.path,
                    "file shrank after its header was read",
                ));
            }
            maps.push(m);
        }
        Ok(Mapped {
            component: Arc::new(component),
            maps: Arc::new(maps),
        })
    }

    /// The stored bytes of a tensor, borrowed from the mapping.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let &(f, t) = self.component.index.get(name)?;
        let info = &self.component.files[f].tensors[t];
        Some(self.range(f, info.offset, info.len))
    }

    /// A byte range of file `file` of the component.
    pub fn range(&self, file: usize, offset: u64, len: u64) -> &[u8] {
        &self.maps[file][offset as usize..(offset + len) as usize]
    }

    /// Advises the kernel that the mapping is read in order (bigger read-ahead).
    pub fn advise_sequential(&self) {
        for m in self.maps.iter() {
            let _ = m.advise(memmap2::Advice::Sequential);
        }
    }
}
