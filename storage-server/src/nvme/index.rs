//! The NVMe tier's durable block index, so its blocks survive a restart of the storage server.
//!
//! A side file (`<nvme path>.index`) holds a 32-byte header (magic, format version, block size,
//! slot count) and one 32-byte entry per slot: block id (0 = free), published length, crc32c of
//! those 12 bytes. A write updates its slot's entry and syncs it before it is acknowledged; a free
//! clears the entries (and syncs) before the slots can be reused. At start every entry with a
//! good crc comes back as a block of that length; one with a bad crc (a write cut off by a crash,
//! never acknowledged) is dropped with a warning.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
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
    file: File,
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
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening the NVMe block index {}", path.display()))?;
        let index = BlockIndex { file, path: path.to_path_buf() };
        let expected = header(block_size, slots);
        let size = index.file.metadata()?.len();
        if size == 0 {
            index.file.write_all_at(&expected, 0)?;
            index.file.set_len(ENTRY_BYTES * (slots as u64 + 1))?;
            index.file.sync_all().with_context(|| format!("syncing {}", path.display()))?;
            return Ok((index, Vec::new()));
        }
        let mut found = [0u8; ENTRY_BYTES as usize];
        index.file.read_exact_at(&mut found, 0).with_context(|| format!("reading {}", path.display()))?;
        if found != expected {
            bail!(
                "the NVMe block index {} was made for another tier (block size or size differ, or it is not an \
                 index); remove it and the tier's data to start empty",
                path.display()
            );
        }
        let mut bytes = vec![0u8; (ENTRY_BYTES * slots as u64) as usize];
        index.file.read_exact_at(&mut bytes, ENTRY_BYTES).with_context(|| format!("reading {}", path.display()))?;
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
        self.file.write_all_at(&encode(block_id, len), ENTRY_BYTES * (slot as u64 + 1))?;
        self.file.sync_data()
    }

    /// Records that `slots` are free, durably (one sync for all).
    pub fn clear(&self, slots: &[usize]) -> std::io::Result<()> {
        for &slot in slots {
            self.file.write_all_at(&[0u8; ENTRY_BYTES as usize], ENTRY_BYTES * (slot as u64 + 1))?;
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
        index.file.write_all_at(&[0xff], ENTRY_BYTES * 4 + 9).unwrap();
        drop(index);
        assert_eq!(BlockIndex::open(&path, 4096, 8).unwrap().1, expected[1..]);
        // Another geometry is refused.
        let err = format!("{:#}", BlockIndex::open(&path, 8192, 8).err().unwrap());
        assert!(err.contains("made for another tier"), "{err}");
    }
}
