//! Lost blocks made visible: how many blocks of a file are lost (every copy's server dead,
//! restarted without it, or forgotten), and how many files have one, for List, Stat and Status.

use super::State;
use crate::namespace::FileMeta;

impl State {
    /// Blocks of `file` every copy of which is lost.
    pub(super) fn lost_blocks(&self, file: &FileMeta) -> u64 {
        file.copies().filter(|copies| !copies.iter().any(|block| self.servers.block_readable(block))).count() as u64
    }

    /// Files with a lost block: a pass over every block, only when some block may be lost.
    pub(super) fn lost_files(&self) -> u64 {
        if self.servers.all_blocks_readable() {
            return 0;
        }
        self.namespace.file_metas().filter(|file| self.lost_blocks(file) > 0).count() as u64
    }
}
