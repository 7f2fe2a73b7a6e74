//! The NVMe tier's durable block index, so its blocks survive a restart of the storage server.
//!
//! A side file (`<nvme path>.index`) holds a 32-byte header (magic, format version, block size,
//! slot count) and one 32-byte entry per slot: block id (0 = free), published length, crc32c of
//! those 12 bytes. A write updates its slot's entry and syncs it before it is acknowledged; a free
//! clears the entries (and syncs) before the slots can be reused. At start every entry with a
//! good crc comes back as a block of that length; one with a bad crc (damage) is dropped with a
//! warning. Entries are updated in place, so one must never be torn (that would lose the length
//! acknowledged before): an entry never straddles a 512-byte sector, and a disk writes a sector
//! whole or not at all.
//!
//! A new index is written whole (header, zeroed entries), synced, and its directory synced, before
//! anything is recorded in it; a file that a crash left short of that (shorter than a header, a
//! header of zeros, or our header on a file cut short) held nothing and is made again. File I/O
//! goes through a [`Fs`], so the power-loss tests (`index/power_loss.rs`) run it on a simulated
//! disk that keeps only what was synced.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use tern_common::durable::{parent_dir, Fs, FsFile, Open, RealFs};
use tern_proto::BlockId;

const MAGIC: &[u8; 8] = b"TERNNVIX";
const VERSION: u32 = 1;
const ENTRY_BYTES: u64 = 32;

/// A block found in the index at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub slot: usize,
    pub block_id: BlockId,
    pub len: u32,
}

pub struct BlockIndex {
    file: Box<dyn FsFile>,
    path: PathBuf,
}

fn encode(block_id: BlockId, len: u32) -> [u8; ENTRY_BYTES as usize] {
    let mut entry = [0u8; ENTRY_BYTES as usize];
    entry[..8].copy_from_slice(&block_id.get().to_le_bytes());
    entry[8..12].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&entry[..12]);
    entry[12..16].copy_from_slice(&crc.to_le_bytes());
    entry
}

fn header(block_size: u32, slots: usize) -> [u8; ENTRY_BYTES as usize] {
    let mut header = [0u8; ENTRY_BYTES as usize];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&block_size.to_le_bytes());
    header[16..24].copy_from_slice(&(slots as u64).to_le_bytes());
    let crc = crc32c::crc32c(&header[..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header
}

impl BlockIndex {
    /// The index file beside the tier at `nvme`.
    pub fn path_for(nvme: &Path) -> PathBuf {
        let mut name = nvme.as_os_str().to_owned();
        name.push(".index");
        PathBuf::from(name)
    }

    /// Opens (or creates) the index at `path` for a tier of `slots` blocks of `block_size`, and
    /// returns the blocks it lists. An index made for another block size or slot count is refused:
    /// its slots would not be the tier's.
    pub fn open(path: &Path, block_size: u32, slots: usize) -> anyhow::Result<(BlockIndex, Vec<Entry>)> {
        BlockIndex::open_in(Arc::new(RealFs), path, block_size, slots)
    }

    /// [`BlockIndex::open`] on the filesystem `fs`.
    pub fn open_in(
        fs: Arc<dyn Fs>,
        path: &Path,
        block_size: u32,
        slots: usize,
    ) -> anyhow::Result<(BlockIndex, Vec<Entry>)> {
        let opening = || format!("opening the NVMe block index {}", path.display());
        let file = fs.open(path, Open::Create).with_context(opening)?;
        let index = BlockIndex { file, path: path.to_path_buf() };
        let expected = header(block_size, slots);
        let whole = ENTRY_BYTES * (slots as u64 + 1);
        let size = index.file.size().with_context(opening)?;
        let mut found = [0u8; ENTRY_BYTES as usize];
        if size >= ENTRY_BYTES {
            index.file.read_at(&mut found, 0).with_context(|| format!("reading {}", path.display()))?;
        }
        if size < ENTRY_BYTES || found == [0; ENTRY_BYTES as usize] || (found == expected && size < whole) {
            // New, or a crash came before its first sync (the header or size did not reach the
            // disk): nothing was ever recorded in it.
            if size > 0 {
                tracing::warn!("{}: an index left unfinished by a crash; made again", path.display());
            }
            index.file.set_len(0)?;
            index.file.write_at(&expected, 0)?;
            index.file.set_len(whole)?;
            index.file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
            // Its name too: records synced into a file whose name a crash takes away are lost.
            let dir = parent_dir(path);
            fs.sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))?;
            return Ok((index, Vec::new()));
        }
        if found != expected {
            bail!(
                "the NVMe block index {} was made for another tier (block size or size differ, or it is not an \
                 index); remove it and the tier's data to start empty",
                path.display()
            );
        }
        let mut bytes = vec![0u8; (ENTRY_BYTES * slots as u64) as usize];
        index.file.read_at(&mut bytes, ENTRY_BYTES).with_context(|| format!("reading {}", path.display()))?;
        let mut entries = Vec::new();
        for (slot, entry) in bytes.chunks_exact(ENTRY_BYTES as usize).enumerate() {
            let block_id = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
            if block_id == 0 && entry.iter().all(|&b| b == 0) {
                continue;
            }
            let len = u32::from_le_bytes(entry[8..12].try_into().expect("4 bytes"));
            let crc = u32::from_le_bytes(entry[12..16].try_into().expect("4 bytes"));
            if crc != crc32c::crc32c(&entry[..12]) || block_id == 0 || len > block_size {
                tracing::warn!(
                    "{}: slot {slot}'s entry is damaged (a write cut off by a crash?); the slot is taken as free",
                    path.display()
                );
                continue;
            }
            entries.push(Entry { slot, block_id: BlockId::from(block_id), len });
        }
        Ok((index, entries))
    }

    /// Records that `slot` holds `block_id` with `len` bytes, durably.
    pub fn record(&self, slot: usize, block_id: BlockId, len: u32) -> std::io::Result<()> {
        self.file.write_at(&encode(block_id, len), ENTRY_BYTES * (slot as u64 + 1))?;
        self.file.sync_data()
    }

    /// Records that `slots` are free, durably (one sync for all).
    pub fn clear(&self, slots: &[usize]) -> std::io::Result<()> {
        for &slot in slots {
            self.file.write_at(&[0u8; ENTRY_BYTES as usize], ENTRY_BYTES * (slot as u64 + 1))?;
        }
        if slots.is_empty() {
            return Ok(());
        }
        self.file.sync_data()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod power_loss;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_reopening_and_damage_is_dropped() {
        let temp = tempfile::tempdir().unwrap();
        let path = temp.path().join("t.index");
        let (index, entries) = BlockIndex::open(&path, 4096, 8).unwrap();
        assert!(entries.is_empty());
        index.record(3, BlockId::from(77), 100).unwrap();
        index.record(5, BlockId::from(78), 4096).unwrap();
        index.record(6, BlockId::from(79), 1).unwrap();
        index.clear(&[6]).unwrap();
        drop(index);
        let (index, entries) = BlockIndex::open(&path, 4096, 8).unwrap();
        let expected = [
            Entry { slot: 3, block_id: BlockId::from(77), len: 100 },
            Entry { slot: 5, block_id: BlockId::from(78), len: 4096 },
        ];
        assert_eq!(entries, expected);
        // A torn entry (its crc does not match: slot 3's length) is dropped.
        index.file.write_at(&[0xff], ENTRY_BYTES * 4 + 9).unwrap();
        drop(index);
        assert_eq!(BlockIndex::open(&path, 4096, 8).unwrap().1, expected[1..]);
        // Another geometry is refused.
        let err = format!("{:#}", BlockIndex::open(&path, 8192, 8).err().unwrap());
        assert!(err.contains("made for another tier"), "{err}");
    }
}
