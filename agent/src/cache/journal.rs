//! The resume journal of a copy being downloaded: per file, the object's identity (ETag and
//! size) and the chunk size it was cut into, then the index of each chunk whose bytes are on
//! disk and synced. A restarted agent reads it and fetches only the missing chunks; a journal
//! whose object no longer matches (a new ETag or size) is dropped with its file.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// The folder of the journals, inside the copy's `partial/<key>/`.
const DIR: &str = ".layerwise-journal";

/// One file's journal, open for appending.
pub struct Journal {
    file: File,
}

/// The journal path of the file `rel` of the copy at `partial`.
fn path_of(partial: &Path, rel: &str) -> PathBuf {
    partial
        .join(DIR)
        .join(rel.replace('%', "%25").replace('/', "%2F"))
}

/// The identity line a journal starts with.
fn identity(etag: Option<&str>, size: u64, chunk: u64) -> String {
    format!("{}\t{size}\t{chunk}", etag.unwrap_or("-"))
}

impl Journal {
    /// Opens the journal of `rel` for an object of `etag` and `size` cut into `chunk`-byte
    /// chunks, and returns the chunks already done. A journal of another identity (the object
    /// changed, or the chunk size) is started afresh, and `done` is empty.
    pub fn open(
        partial: &Path,
        rel: &str,
        etag: Option<&str>,
        size: u64,
        chunk: u64,
    ) -> io::Result<(Journal, BTreeSet<u64>)> {
        let path = path_of(partial, rel);
        std::fs::create_dir_all(path.parent().expect("a journal has a folder"))?;
        let want = identity(etag, size, chunk);
        let mut done = BTreeSet::new();
        let mut same = false;
        if let Ok(f) = File::open(&path) {
            let mut lines = BufReader::new(f).lines();
            if lines.next().transpose()?.as_deref() == Some(want.as_str()) {
                same = true;
                // A torn last line (a crash mid-append) is not a number: skipped.
                done.extend(
                    lines
                        .map_while(Result::ok)
                        .filter_map(|l| l.parse::<u64>().ok()),
                );
            }
        }
        let file = if same {
            OpenOptions::new().append(true).open(&path)?
        } else {
            let mut f = File::create(&path)?;
            writeln!(f, "{want}")?;
            f.sync_data()?;
            f
        };
        Ok((Journal { file }, done))
    }

    /// Records chunk `index` as done: called once its bytes are synced.
    pub fn done(&mut self, index: u64) -> io::Result<()> {
        writeln!(self.file, "{index}")?;
        self.file.sync_data()
    }
}

/// Drops the journal of the file `rel` of the copy at `partial` (its bytes are discarded, so
/// the next fill fetches the whole file again).
pub fn forget(partial: &Path, rel: &str) -> io::Result<()> {
    match std::fs::remove_file(path_of(partial, rel)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Drops every journal of the copy at `partial` (it is complete).
pub fn remove(partial: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(partial.join(DIR)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether `name` is the journals' folder (not a file of the model).
pub fn is_journal(name: &str) -> bool {
    name == DIR
}
